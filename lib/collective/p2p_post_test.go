package collective

import (
	"bytes"
	"context"
	"fmt"
	"sync"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/gpubridge/gpubridge/lib/testenv"
	"github.com/gpubridge/gpubridge/lib/wire"
)

// waitReversed waits for ps from goroutines started last first, each a
// little after the one before, so that a Wait that took its place in the
// (peer, tag) order only when it ran would reverse the messages; it
// returns each one's length and error.
func waitReversed(ctx context.Context, ps []Pending) ([]int, []error) {
	ns, errs := make([]int, len(ps)), make([]error, len(ps))
	var wg sync.WaitGroup
	for i := len(ps) - 1; i >= 0; i-- {
		wg.Go(func() { ns[i], errs[i] = ps[i].Wait(ctx) })
		time.Sleep(200 * time.Microsecond)
	}
	wg.Wait()
	return ns, errs
}

// TestP2PPostOrder: both members post n Sends and n Recvs on one tag to
// and from each other, then wait for them in reverse order from
// goroutines of their own: message i of each direction is matched with
// Recv i (the order of posting), intact, small, chunked and striped.
func TestP2PPostOrder(t *testing.T) {
	for _, c := range []struct {
		name    string
		striped bool
		size    func(i int) int
	}{
		{"small", false, func(i int) int { return 10 + i }},
		{"chunked", false, func(i int) int { return 3*testChunk + i }},
		{"striped", true, func(i int) int { return 3*testChunk + i }},
		{"mixed", true, func(i int) int { return []int{5, testChunk - 1, 4*testChunk + 3, 2 * testChunk}[i%4] }},
	} {
		t.Run(c.name, func(t *testing.T) {
			stripedP2P = c.striped
			defer func() { stripedP2P = false }()
			cl := newCluster(t, 2, 1, Options{ChunkBytes: testChunk})
			ctx := context.Background()
			const n = 12
			requireNoErrors(t, cl.each(func(m int, cm *Comm) error {
				peer := 1 - m
				var ps []Pending
				bufs := make([][]byte, n)
				for i := range n {
					bufs[i] = make([]byte, 5*testChunk)
					// Recvs and Sends interleaved: both directions at once.
					ps = append(ps, cm.PostRecv(peer, 5, bufs[i]))
					ps = append(ps, cm.PostSend(peer, 5, msg(uint32(m), i, c.size(i))))
				}
				ns, errs := waitReversed(ctx, ps)
				for k, err := range errs {
					if err != nil {
						return err
					}
					if k%2 == 1 {
						continue
					}
					i := k / 2
					if want := msg(uint32(peer), i, c.size(i)); !bytes.Equal(bufs[i][:ns[k]], want) {
						return fmt.Errorf("member %d: Recv %d got %d bytes, not message %d of %d bytes", m, i, ns[k], i, len(want))
					}
				}
				return nil
			}))
			for _, cm := range cl.comms {
				assert.Zero(t, cm.unexpected.Load())
			}
		})
	}
}

// TestP2PPostSendGivesUp: a posted Send whose deadline passes while an
// earlier one holds the tag fails saying so and leaves the queue: the
// next Send takes its place in the order, and the messages are numbered
// without a gap.
func TestP2PPostSendGivesUp(t *testing.T) {
	cl := newCluster(t, 2, 1, Options{ChunkBytes: testChunk})
	ctx := context.Background()
	first := cl.comms[0].PostSend(1, 3, []byte("first"))
	late := cl.comms[0].PostSend(1, 3, []byte("late"))
	short, cancel := context.WithTimeout(ctx, 30*time.Millisecond)
	defer cancel()
	_, err := late.Wait(short)
	require.ErrorIs(t, err, context.DeadlineExceeded)
	require.ErrorContains(t, err, "an earlier message on this tag was still being sent")
	third := cl.comms[0].PostSend(1, 3, []byte("third"))
	_, err = first.Wait(ctx)
	require.NoError(t, err)
	_, err = third.Wait(ctx)
	require.NoError(t, err)
	buf := make([]byte, 16)
	for _, want := range []string{"first", "third"} {
		n, err := cl.comms[1].Recv(ctx, 0, 3, buf)
		require.NoError(t, err)
		assert.Equal(t, want, string(buf[:n]))
	}
	require.NoError(t, cl.comms[1].state())
}

// TestP2PPostClaimsArriving: a Recv posted while its message is arriving
// into the queue takes it over (what arrived is copied, the rest lands in
// its buffer) and gets it whole; one that then gives up hands it back to
// the head of the queue, for the next Recv. Chunked and striped.
func TestP2PPostClaimsArriving(t *testing.T) {
	for _, striped := range []bool{false, true} {
		for _, giveUp := range []bool{false, true} {
			t.Run(fmt.Sprintf("striped=%v/give_up=%v", striped, giveUp), func(t *testing.T) {
				stripedP2P = striped
				defer func() { stripedP2P = false }()
				cl := newCluster(t, 2, 1, Options{ChunkBytes: testChunk})
				recv, pr := cl.comms[1], cl.comms[1].peers[0]
				ctx := context.Background()
				whole := msg(4, 0, 5*testChunk+3)
				// Member 0's frames are written by hand to stop mid-message.
				var rest func()
				if striped {
					w := &stripeWriter{t: t, mesh: cl.meshes[0], tag: 4, seq: 1, whole: whole, unit: testChunk}
					w.announce()
					w.frame(3)
					w.frame(0)
					rest = func() {
						for _, i := range []int{1, 2, 4, 5} {
							w.frame(i)
						}
					}
				} else {
					frame := func(i, frames int) {
						h := wire.Header{Kind: wire.KindP2P, Seq: 1, Step: 4, Chunk: uint32(i)}
						if i == frames-1 {
							h.Flags = wire.FlagLast
						}
						lo := i * testChunk
						require.NoError(t, cl.meshes[0].Control(1).Send(ctx, h, whole[lo:min(lo+testChunk, len(whole))]))
					}
					frame(0, 6)
					frame(1, 6)
					rest = func() {
						for i := 2; i < 6; i++ {
							frame(i, 6)
						}
					}
				}
				require.Eventually(t, func() bool {
					pr.mu.Lock()
					defer pr.mu.Unlock()
					return len(pr.unexpected[4]) == 1 && recv.unexpected.Load() > 0
				}, testenv.Scale(10*time.Second), time.Millisecond)
				buf := make([]byte, 8*testChunk)
				p := recv.PostRecv(0, 4, buf)
				assert.Zero(t, recv.unexpected.Load(), "claimed: no longer queued")
				if giveUp {
					cctx, cancel := context.WithCancel(ctx)
					cancel()
					_, err := p.Wait(cctx)
					require.ErrorIs(t, err, context.Canceled)
					rest()
					n, err := recv.Recv(ctx, 0, 4, buf)
					require.NoError(t, err)
					assert.Equal(t, whole, buf[:n])
				} else {
					rest()
					n, err := p.Wait(ctx)
					require.NoError(t, err)
					assert.Equal(t, whole, buf[:n])
				}
				assert.Zero(t, recv.unexpected.Load())
				require.NoError(t, recv.state())
			})
		}
	}
}

// TestP2PPostPeerGone: Sends and Recvs posted and waiting when the peer
// closes all fail with the same cause; none hangs.
func TestP2PPostPeerGone(t *testing.T) {
	cl := newCluster(t, 2, 1, Options{ChunkBytes: testChunk})
	ctx := context.Background()
	c := cl.comms[1]
	var ps []Pending
	for range 4 {
		ps = append(ps, c.PostRecv(0, 8, make([]byte, 16)))
	}
	results := make(chan error, len(ps))
	for _, p := range ps {
		go func() {
			_, err := p.Wait(ctx)
			results <- err
		}()
	}
	require.NoError(t, cl.comms[0].Close())
	const cause = "member 0: closed its end of the bridge"
	for range ps {
		err := <-results
		require.ErrorIs(t, err, ErrBroken)
		require.ErrorContains(t, err, cause)
	}
	_, err := c.PostSend(0, 8, []byte("x")).Wait(ctx)
	require.ErrorContains(t, err, cause)
}
