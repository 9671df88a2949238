package feedserver

import (
	"net"
	"os"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	"golang.org/x/sys/unix"

	"github.com/gpubridge/gpubridge/lib/testenv"
)

// spinPair is a connected Unix stream pair: a reader over one end with the
// given spin, and the other end's descriptor for the test to write.
func spinPair(t *testing.T, spin time.Duration) (*reader, int) {
	t.Helper()
	fds, err := unix.Socketpair(unix.AF_UNIX, unix.SOCK_STREAM|unix.SOCK_CLOEXEC, 0)
	require.NoError(t, err)
	f := os.NewFile(uintptr(fds[0]), "feed")
	c, err := net.FileConn(f)
	require.NoError(t, err)
	f.Close()
	t.Cleanup(func() { c.Close(); unix.Close(fds[1]) })
	s := &Server{o: ServerOptions{Spin: spin}}
	return &reader{conn: c.(*net.UnixConn), s: s, oob: make([]byte, unix.CmsgSpace(4*maxPendingFDs))}, fds[1]
}

func TestSpinningRead(t *testing.T) {
	t.Run("bytes that come during the spin", func(t *testing.T) {
		r, peer := spinPair(t, testenv.Scale(5*time.Second))
		go func() {
			time.Sleep(2 * time.Millisecond)
			_, _ = unix.Write(peer, []byte("hello"))
		}()
		p := make([]byte, 64)
		n, _, _, err, ok := r.spinRecv(p, r.oob)
		require.True(t, ok, "the spin ends with the bytes, not with its time")
		require.NoError(t, err)
		assert.Equal(t, "hello", string(p[:n]))
	})
	t.Run("nothing within the spin", func(t *testing.T) {
		r, _ := spinPair(t, time.Millisecond)
		_, _, _, _, ok := r.spinRecv(make([]byte, 64), r.oob)
		assert.False(t, ok, "an empty socket leaves the answer to the blocking read")
	})
	t.Run("a descriptor with its message", func(t *testing.T) {
		r, peer := spinPair(t, testenv.Scale(5*time.Second))
		memfd, err := unix.MemfdCreate("spin-test", unix.MFD_CLOEXEC)
		require.NoError(t, err)
		defer unix.Close(memfd)
		require.NoError(t, unix.Sendmsg(peer, []byte("R"), unix.UnixRights(memfd), nil, 0))
		p := make([]byte, 64)
		n, oobn, _, err, ok := r.spinRecv(p, r.oob)
		require.True(t, ok)
		require.NoError(t, err)
		assert.Equal(t, 1, n)
		require.NoError(t, r.takeFDs(r.oob[:oobn]))
		require.Len(t, r.s.fds, 1, "the descriptor came through the spinning read")
		unix.Close(r.s.fds[0])
	})
	t.Run("the end of the stream", func(t *testing.T) {
		r, peer := spinPair(t, testenv.Scale(5*time.Second))
		require.NoError(t, unix.Shutdown(peer, unix.SHUT_WR))
		n, _, _, err, ok := r.spinRecv(make([]byte, 64), r.oob)
		require.True(t, ok)
		require.NoError(t, err)
		assert.Zero(t, n, "0 bytes: the caller's EOF")
	})
	t.Run("recv falls back to the blocking read", func(t *testing.T) {
		r, peer := spinPair(t, 100*time.Microsecond)
		go func() {
			time.Sleep(20 * time.Millisecond)
			_, _ = unix.Write(peer, []byte("late"))
		}()
		p := make([]byte, 64)
		n, _, _, err := r.recv(p, r.oob)
		require.NoError(t, err)
		assert.Equal(t, "late", string(p[:n]))
	})
}
