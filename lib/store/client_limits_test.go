package store

import (
	"context"
	"errors"
	"strings"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/gpubridge/gpubridge/lib/testenv"
)

// TestClientRefusesOverLimitRequests is issue 9's "a probe too large for
// the store fails with connection reset by peer": the client checks the
// protocol's limits before sending and names them.
func TestClientRefusesOverLimitRequests(t *testing.T) {
	ts := startServer(t, ServerOptions{})
	ctx := tctx(t)
	c := dialT(t, ts.addr)
	over := make([]byte, DefaultMaxValueLen+1)
	longKey := strings.Repeat("k", DefaultMaxKeyLen)
	manyKeys := make([]string, DefaultMaxKeysPerRequest+1)
	tests := []struct {
		name string
		call func() error
		want string
	}{
		{"set value", func() error { return c.Set(ctx, "probe", over) },
			`store set: the value of key "probe" is 8388609 bytes, over the store's 8 MiB limit`},
		{"append value", func() error { return c.Append(ctx, "a", over) }, "over the store's 8 MiB limit"},
		{"compare_set desired", func() error { _, err := c.CompareSet(ctx, "cs", nil, over); return err },
			`store compare_set: the value of key "cs" is 8388609 bytes`},
		{"multi_set value", func() error {
			return c.MultiSet(ctx, []string{"m1", "m2"}, [][]byte{[]byte("ok"), over})
		}, `the value of key "m2"`},
		{"set key", func() error { return c.Set(ctx, longKey, nil) }, "bytes with its prefixes, over the store's 8 KiB limit"},
		{"get key", func() error { _, err := c.Get(ctx, longKey); return err }, "store get: the key"},
		{"wait key", func() error { return c.Wait(ctx, []string{"x", longKey}, time.Second) }, "over the store's 8 KiB limit"},
		{"multi_get count", func() error { _, err := c.MultiGet(ctx, manyKeys); return err },
			"131073 keys in one request, over the store's limit of 131072"},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			err := tt.call()
			var le *LimitError
			require.ErrorAs(t, err, &le)
			assert.Contains(t, err.Error(), tt.want)
			// Nothing was sent: the connection is fine.
			require.NoError(t, c.Ping(ctx))
		})
	}
	assert.NotContains(t, ts.logs.String(), "closing connection")

	// A larger limit for a server configured for it.
	ts2 := startServer(t, ServerOptions{MaxValueLen: 16 << 20})
	c2 := dialT(t, ts2.addr, WithMaxValueLen(16<<20))
	require.NoError(t, c2.Set(ctx, "probe", over))
	v, err := c2.Get(ctx, "probe")
	require.NoError(t, err)
	assert.Len(t, v, len(over))
}

func TestCheckAddr(t *testing.T) {
	tests := []struct {
		addr, want string
	}{
		{"127.0.0.1:29500", ""},
		{"[::1]:1", ""},
		{"node-7.cluster:65535", ""},
		{"127.0.0.1:", "the port is missing"},
		{"127.0.0.1:0", "port 0 is no server's port"},
		{":29500", "the host is missing"},
		{"127.0.0.1:65536", `port "65536" is not a number from 1 to 65535`},
		{"127.0.0.1:http", `port "http" is not a number`},
		{"127.0.0.1", "want HOST:PORT"},
		{"", "want HOST:PORT"},
	}
	for _, tt := range tests {
		t.Run(tt.addr, func(t *testing.T) {
			err := CheckAddr(tt.addr)
			if tt.want == "" {
				require.NoError(t, err)
				return
			}
			var ae *AddrError
			require.ErrorAs(t, err, &ae)
			assert.Equal(t, tt.addr, ae.Addr)
			assert.Contains(t, err.Error(), tt.want)
		})
	}

	// Dial fails at once on such an address rather than retrying until the
	// connect timeout.
	start := time.Now()
	_, err := Dial(context.Background(), "127.0.0.1:", WithConnectTimeout(testenv.Scale(30*time.Second)))
	var ae *AddrError
	require.ErrorAs(t, err, &ae)
	assert.False(t, errors.Is(err, ErrTimeout))
	assert.Less(t, time.Since(start), testenv.Scale(5*time.Second))

	for _, tt := range []struct {
		flag, host, port, want, err string
	}{
		{"h:1", "", "", "h:1", ""},
		{"", "10.0.0.1", "29500", "10.0.0.1:29500", ""},
		{"", "::1", "29500", "[::1]:29500", ""},
		{"", "10.0.0.1", "", "", "--store is required (or GPUBRIDGE_STORE, or MASTER_ADDR and MASTER_PORT; MASTER_PORT not set)"},
		{"", "", "", "", "MASTER_ADDR and MASTER_PORT not set)"},
		{"", "10.0.0.1", "0", "", "port 0"},
		{"10.0.0.1:", "", "", "", "the port is missing"},
	} {
		env := map[string]string{"MASTER_ADDR": tt.host, "MASTER_PORT": tt.port}
		got, err := ResolveAddr(tt.flag, func(k string) string { return env[k] })
		if tt.err != "" {
			require.ErrorAs(t, err, &ae, "%+v", tt)
			assert.Contains(t, err.Error(), tt.err)
			continue
		}
		require.NoError(t, err)
		assert.Equal(t, tt.want, got)
	}
}
