package store

import (
	"bytes"
	"context"
	"encoding/binary"
	"errors"
	"io"
	"log/slog"
	"net"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
	"go.uber.org/goleak"

	"github.com/gpubridge/gpubridge/lib/testenv"
)

func TestMain(m *testing.M) { goleak.VerifyTestMain(m) }

// syncBuffer is a goroutine-safe log sink.
type syncBuffer struct {
	mu sync.Mutex
	b  bytes.Buffer
}

func (s *syncBuffer) Write(p []byte) (int, error) {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.b.Write(p)
}

func (s *syncBuffer) String() string {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.b.String()
}

type testServer struct {
	srv  *Server
	addr string
	logs *syncBuffer
}

// startServer runs a Server on a loopback port until the test ends; tweak,
// if given, adjusts the server before it serves.
func startServer(t *testing.T, opts ServerOptions, tweak ...func(*Server)) *testServer {
	t.Helper()
	logs := &syncBuffer{}
	if opts.Logger == nil {
		opts.Logger = slog.New(slog.NewTextHandler(logs, &slog.HandlerOptions{Level: slog.LevelDebug}))
	}
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	require.NoError(t, err)
	srv := NewServer(opts)
	for _, f := range tweak {
		f(srv)
	}
	done := make(chan error, 1)
	go func() { done <- srv.Serve(ln) }()
	t.Cleanup(func() {
		ctx, cancel := context.WithTimeout(context.Background(), testenv.Scale(10*time.Second))
		defer cancel()
		require.NoError(t, srv.Shutdown(ctx))
		require.NoError(t, <-done)
	})
	return &testServer{srv: srv, addr: ln.Addr().String(), logs: logs}
}

// waitLog waits until the server log contains substr.
func (ts *testServer) waitLog(t *testing.T, substr string) {
	t.Helper()
	require.Eventually(t, func() bool { return strings.Contains(ts.logs.String(), substr) },
		testenv.Scale(10*time.Second), 5*time.Millisecond, "log line %q not found in:\n%s", substr, ts.logs.String())
}

func dialT(t *testing.T, addr string, opts ...Option) *Client {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), testenv.Scale(20*time.Second))
	defer cancel()
	c, err := Dial(ctx, addr, append([]Option{WithConnectTimeout(testenv.Scale(20 * time.Second))}, opts...)...)
	require.NoError(t, err)
	t.Cleanup(func() { _ = c.Close() })
	return c
}

func tctx(t *testing.T) context.Context {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), testenv.Scale(60*time.Second))
	t.Cleanup(cancel)
	return ctx
}

// raw is a hand-driven protocol connection for server tests.
type raw struct {
	t  *testing.T
	nc net.Conn
}

func rawDial(t *testing.T, addr string, handshake bool) *raw {
	t.Helper()
	return rawDialWith(t, &net.Dialer{}, addr, handshake)
}

// deafDial is rawDial for a client that will not read: its receive buffer
// is small, so the kernel does not take megabytes of replies off the
// server's hands (loopback buffers can grow to tens of MiB).
func deafDial(t *testing.T, addr string) *raw {
	t.Helper()
	d := &net.Dialer{Control: func(_, _ string, c syscall.RawConn) error {
		var serr error
		err := c.Control(func(fd uintptr) {
			serr = syscall.SetsockoptInt(int(fd), syscall.SOL_SOCKET, syscall.SO_RCVBUF, 4096)
		})
		return errors.Join(err, serr)
	}}
	return rawDialWith(t, d, addr, true)
}

func rawDialWith(t *testing.T, d *net.Dialer, addr string, handshake bool) *raw {
	t.Helper()
	d.Timeout = testenv.Scale(10 * time.Second)
	nc, err := d.Dial("tcp", addr)
	require.NoError(t, err)
	t.Cleanup(func() { _ = nc.Close() })
	r := &raw{t: t, nc: nc}
	if handshake {
		var e enc
		e.byte1(cmdValidate)
		e.u32(validationMagic)
		e.byte1(cmdPing)
		e.u32(0x1234)
		r.send(e.b)
		require.Equal(t, uint32(0x1234), r.u32())
	}
	return r
}

func (r *raw) send(b []byte) {
	r.t.Helper()
	_ = r.nc.SetWriteDeadline(time.Now().Add(testenv.Scale(10 * time.Second)))
	_, err := r.nc.Write(b)
	require.NoError(r.t, err)
}

func (r *raw) req(q *request) {
	r.t.Helper()
	var e enc
	encodeRequest(&e, q)
	r.send(e.b)
}

func (r *raw) read(n int) []byte {
	r.t.Helper()
	_ = r.nc.SetReadDeadline(time.Now().Add(testenv.Scale(10 * time.Second)))
	b := make([]byte, n)
	_, err := io.ReadFull(r.nc, b)
	require.NoError(r.t, err)
	return b
}

func (r *raw) u8() byte     { return r.read(1)[0] }
func (r *raw) u32() uint32  { return binary.LittleEndian.Uint32(r.read(4)) }
func (r *raw) i64() int64   { return int64(binary.LittleEndian.Uint64(r.read(8))) }
func (r *raw) blob() []byte { return r.read(int(r.i64())) }

// nothingWithin asserts that no byte arrives within d.
func (r *raw) nothingWithin(d time.Duration) {
	r.t.Helper()
	_ = r.nc.SetReadDeadline(time.Now().Add(d))
	var b [1]byte
	n, err := r.nc.Read(b[:])
	require.Zero(r.t, n, "unexpected byte %#x", b[0])
	var ne net.Error
	require.ErrorAs(r.t, err, &ne)
	require.True(r.t, ne.Timeout())
}

// closedByPeer asserts that the server closes the connection.
func (r *raw) closedByPeer() {
	r.t.Helper()
	_ = r.nc.SetReadDeadline(time.Now().Add(testenv.Scale(10 * time.Second)))
	_, err := io.Copy(io.Discard, r.nc)
	// EOF (nil from Copy) or a reset both mean closed; a timeout does not.
	var ne net.Error
	if errors.As(err, &ne) {
		require.False(r.t, ne.Timeout(), "connection not closed: %v", err)
	}
}
