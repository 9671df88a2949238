package netif

import (
	"context"
	"net"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	"go.uber.org/goleak"

	"github.com/gpubridge/gpubridge/lib/testenv"
)

func TestMain(m *testing.M) { goleak.VerifyTestMain(m) }

func TestLoopback(t *testing.T) {
	h, err := Open()
	require.NoError(t, err)
	defer h.Close()

	lo := net.IPv4(127, 0, 0, 1)
	rt, err := h.RouteTo(lo)
	require.NoError(t, err)
	assert.Equal(t, "lo", rt.Interface)
	assert.True(t, rt.Src.Equal(lo), "source %v", rt.Src)
	assert.Nil(t, rt.Gateway)

	l, err := h.Link("lo")
	require.NoError(t, err)
	ip, err := h.LinkIP(l)
	require.NoError(t, err)
	assert.True(t, ip.Equal(lo), "lo's address %v", ip)
	assert.Equal(t, "lo", h.InterfaceOf(lo))
	assert.Equal(t, "lo", h.InterfaceOf(net.IPv4(127, 0, 0, 2)), "a loopback address no interface lists")
	assert.Empty(t, h.InterfaceOf(net.IPv4zero))
	assert.Empty(t, h.InterfaceOf(net.IPv4(192, 0, 2, 1)), "TEST-NET-1: nobody's")
	assert.Contains(t, h.LinkNames(), "lo")

	_, err = h.Link("nosuchif0")
	assert.Error(t, err)
	links, err := h.Links()
	require.NoError(t, err)
	assert.NotEmpty(t, links)
}

func TestResolve(t *testing.T) {
	ctx, cancel := context.WithTimeout(context.Background(), testenv.Scale(10*time.Second))
	defer cancel()
	tests := []struct {
		host, want string
	}{
		{"10.1.2.3", "10.1.2.3"},
		{"::1", "::1"},
		{"localhost", "127.0.0.1"}, // IPv4 first, though /etc/hosts may list ::1 too
	}
	for _, tt := range tests {
		ip, err := Resolve(ctx, tt.host)
		require.NoError(t, err, tt.host)
		assert.Equal(t, tt.want, ip.String(), tt.host)
	}
	_, err := Resolve(ctx, "no-such-host.invalid")
	assert.Error(t, err)
}
