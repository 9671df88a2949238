package transport

import (
	"context"
	"errors"
	"fmt"
	"sync"
	"testing"
	"time"

	"github.com/gpubridge/gpubridge/lib/testenv"
	"github.com/gpubridge/gpubridge/lib/wire"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

// callsEnded sends one frame from meshes[1] to meshes[0] on every stream
// (data, point-to-point, control), each under a context that then ends, as
// a collective's or a barrier's does when the call returns, and waits until
// the transport has seen every one end. It returns the number of streams.
func callsEnded(t *testing.T, meshes []Mesh) int {
	t.Helper()
	n := meshes[1].Streams() + meshes[1].P2PStreams() + 1
	ctx, cancel := context.WithTimeout(context.Background(), testenv.Scale(10*time.Second))
	defer cancel()
	var wg sync.WaitGroup
	errc := make(chan error, 2*n)
	for s := range n {
		wg.Go(func() {
			if err := streamOf(meshes[0], 1, s).Recv(ctx, func(wire.Header, []byte) error { return nil }); err != nil {
				errc <- fmt.Errorf("recv on stream %d: %w", s, err)
			}
		})
		wg.Go(func() {
			cctx, ccancel := context.WithCancel(ctx)
			defer ccancel()
			if err := streamOf(meshes[1], 0, s).Send(cctx, wire.Header{Kind: wire.KindData}, []byte("call")); err != nil {
				errc <- fmt.Errorf("send on stream %d: %w", s, err)
			}
		})
	}
	wg.Wait()
	close(errc)
	for err := range errc {
		require.NoError(t, err)
	}
	if tm, ok := meshes[1].(*tcpMesh); ok {
		// The cancellation hooks run on goroutines of their own: wait for
		// every one, so that the close below comes after them, as it
		// does in a member that leaves after its last call.
		require.Eventually(t, func() bool {
			fired := true
			tm.each(func(s *tcpStream) {
				s.wg.mu.Lock()
				fired = fired && s.wg.fired
				s.wg.mu.Unlock()
			})
			return fired
		}, testenv.Scale(10*time.Second), time.Millisecond, "the ended contexts' hooks did not run")
	}
	return n
}

// readAll starts a Recv on every stream of meshes[0] from member 1 and
// returns their errors, by stream, once all have returned.
func readAll(t *testing.T, meshes []Mesh, n int) func() []error {
	ctx, cancel := context.WithTimeout(context.Background(), testenv.Scale(10*time.Second))
	errs := make([]error, n)
	var wg sync.WaitGroup
	for s := range n {
		wg.Go(func() {
			errs[s] = streamOf(meshes[0], 1, s).Recv(ctx, func(wire.Header, []byte) error {
				return errors.New("a frame came before the close")
			})
		})
	}
	return func() []error {
		t.Helper()
		wg.Wait()
		cancel()
		return errs
	}
}

// A member that closes its mesh in order after its last call ended (its
// streams' contexts done) tells the peer so on every stream: the peer's
// readers, the point-to-point and control streams' included, see
// ErrPeerClosed, not a bare end of the connection that says the member may
// have died. (Over TCP the ended contexts used to leave a deadline in the
// past on the connections, so that Close's KindClose frames failed at once
// and the peer read EOF: the "bridge member lost" warning at every
// bench's end.)
func TestCloseAfterCallsEnded(t *testing.T) {
	for _, tr := range transports {
		t.Run(string(tr), func(t *testing.T) {
			meshes := newBridge(t, tr, 2, 2, false).set(func(c *Config) { c.P2PStreams = 2 }).mustEstablish(t)
			n := callsEnded(t, meshes)
			wait := readAll(t, meshes, n)
			time.Sleep(20 * time.Millisecond) // the readers are waiting
			require.NoError(t, meshes[1].Close())
			for s, err := range wait() {
				var pe *PeerError
				require.ErrorAs(t, err, &pe, "stream %d", s)
				assert.Equal(t, meshes[0].Peer(1), pe.Peer, "stream %d", s)
				assert.ErrorIs(t, err, ErrPeerClosed, "stream %d", s)
				assert.NotErrorIs(t, err, ErrConnClosed, "stream %d", s)
			}
		})
	}
}

// The same for Abort: a member that fails after its last call ended still
// tells the peer why on every stream.
func TestAbortAfterCallsEnded(t *testing.T) {
	for _, tr := range transports {
		t.Run(string(tr), func(t *testing.T) {
			meshes := newBridge(t, tr, 2, 2, false).set(func(c *Config) { c.P2PStreams = 2 }).mustEstablish(t)
			n := callsEnded(t, meshes)
			wait := readAll(t, meshes, n)
			time.Sleep(20 * time.Millisecond)
			meshes[1].Abort(errors.New("reduce failed: out of memory"))
			for s, err := range wait() {
				var pe *PeerError
				require.ErrorAs(t, err, &pe, "stream %d", s)
				assert.Contains(t, err.Error(), "failed: reduce failed: out of memory", "stream %d", s)
			}
		})
	}
}

// A frame a peer published just before it closed is read, not lost, even
// when the reader looked at the ring just before the frame and at the
// peer's state just after the close (a rank's last send of a job: its
// receiver used to fail with "closed its end of the bridge" instead).
func TestSHMFrameBeforeCloseIsRead(t *testing.T) {
	meshes := newBridge(t, SHM, 2, 2, false).mustEstablish(t)
	reader := meshes[0].(*shmMesh)
	var once sync.Once
	sendErr := make(chan error, 1)
	reader.beforePeerCheck = func() {
		once.Do(func() {
			ctx, cancel := context.WithTimeout(context.Background(), testenv.Scale(10*time.Second))
			defer cancel()
			sendErr <- streamOf(meshes[1], 0, 0).Send(ctx, wire.Header{Kind: wire.KindData}, []byte("last"))
			_ = meshes[1].Close()
		})
	}
	ctx, cancel := context.WithTimeout(WithSpin(context.Background(), 0), testenv.Scale(10*time.Second))
	defer cancel()
	var got []byte
	err := streamOf(meshes[0], 1, 0).Recv(ctx, func(_ wire.Header, p []byte) error {
		got = append([]byte(nil), p...)
		return nil
	})
	require.NoError(t, <-sendErr)
	require.NoError(t, err)
	assert.Equal(t, "last", string(got))
	// The next receive finds the close.
	err = streamOf(meshes[0], 1, 0).Recv(ctx, func(wire.Header, []byte) error { return nil })
	assert.ErrorIs(t, err, ErrPeerClosed)
}
