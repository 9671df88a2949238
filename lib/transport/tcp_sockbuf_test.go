package transport

import (
	"net"
	"testing"

	"github.com/stretchr/testify/require"
	"golang.org/x/sys/unix"
)

// sockBufOf reads SO_SNDBUF and SO_RCVBUF of c (the kernel reports twice
// what was set, for its bookkeeping).
func sockBufOf(t *testing.T, c *net.TCPConn) (snd, rcv int) {
	t.Helper()
	rc, err := c.SyscallConn()
	require.NoError(t, err)
	var gerr error
	require.NoError(t, rc.Control(func(fd uintptr) {
		if snd, gerr = unix.GetsockoptInt(int(fd), unix.SOL_SOCKET, unix.SO_SNDBUF); gerr != nil {
			return
		}
		rcv, gerr = unix.GetsockoptInt(int(fd), unix.SOL_SOCKET, unix.SO_RCVBUF)
	}))
	require.NoError(t, gerr)
	return snd, rcv
}

// Config.SockBuf sets both socket buffers of every data connection, dialed
// and accepted alike; out of range it is refused before anything is set
// up.
func TestTCPSockBuf(t *testing.T) {
	const small = 256 << 10
	got := map[int][2]int{}
	for _, sb := range []int{small, 0} {
		b := newBridge(t, TCP, 2, 2, false)
		for i := range b.cfgs {
			b.cfgs[i].SockBuf = sb
		}
		ms := b.mustEstablish(t)
		var first [2]int
		for m, mesh := range ms {
			for st := range 2 {
				c := mesh.Stream(1-m, st).(*tcpStream).conn
				snd, rcv := sockBufOf(t, c)
				if m == 0 && st == 0 {
					first = [2]int{snd, rcv}
				}
				require.Equal(t, first, [2]int{snd, rcv}, "SockBuf %d: member %d stream %d differs from the others", sb, m, st)
			}
		}
		got[sb] = first
	}
	// The kernel doubles what it is given, and may cap it (rmem_max,
	// wmem_max) when the FORCE options are not allowed.
	require.LessOrEqual(t, got[small][0], 2*small)
	require.LessOrEqual(t, got[small][1], 2*small)
	require.GreaterOrEqual(t, got[0][0], got[small][0], "the default (4 MiB) is no smaller")
	require.GreaterOrEqual(t, got[0][1], got[small][1], "the default (4 MiB) is no smaller")
	if unix.Geteuid() == 0 {
		require.Equal(t, [2]int{2 * small, 2 * small}, got[small])
		require.Equal(t, [2]int{2 * sockBuf, 2 * sockBuf}, got[0])
	}

	for _, sb := range []int{1 << 10, MaxSockBuf + 1} {
		b := newBridge(t, TCP, 2, 1, false)
		b.cfgs[0].SockBuf = sb
		_, errs := b.establish(t, 0)
		require.ErrorContains(t, errs[0], "socket buffers of")
	}
}
