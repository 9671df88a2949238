package collective

import (
	"bytes"
	"context"
	"encoding/binary"
	"fmt"
	"math/rand/v2"
	"sync"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/gpubridge/gpubridge/lib/testenv"
	"github.com/gpubridge/gpubridge/lib/wire"
)

// msg builds a recognisable message: its (tag, index) and size bytes of
// filler derived from them.
func msg(tag uint32, i, size int) []byte {
	b := make([]byte, max(size, 8))
	binary.LittleEndian.PutUint32(b, tag)
	binary.LittleEndian.PutUint32(b[4:], uint32(i))
	for k := 8; k < len(b); k++ {
		b[k] = byte(int(tag)*31 + i*7 + k)
	}
	return b
}

func TestP2PBasic(t *testing.T) {
	cl := newCluster(t, 2, 1, Options{ChunkBytes: testChunk})
	ctx := context.Background()
	for _, size := range []int{0, 1, testChunk - 1, testChunk, testChunk + 1, 10*testChunk + 3} {
		src := randBytes(rand.New(rand.NewPCG(uint64(size), 0)), size)
		errs := cl.each(func(m int, c *Comm) error {
			if m == 0 {
				return c.Send(ctx, 1, 42, src)
			}
			buf := make([]byte, size+5)
			n, err := c.Recv(ctx, 0, 42, buf)
			if err != nil {
				return err
			}
			if n != size || !bytes.Equal(buf[:n], src) {
				return fmt.Errorf("size %d: got %d bytes", size, n)
			}
			return nil
		})
		requireNoErrors(t, errs)
	}
}

// TestP2PManyTags: many tags in flight at once, sent in one order and
// received in another, from many goroutines; each arrives exactly once.
func TestP2PManyTags(t *testing.T) {
	cl := newCluster(t, 2, 2, Options{ChunkBytes: testChunk})
	ctx := context.Background()
	const tags, perTag = 64, 4
	requireNoErrors(t, cl.each(func(m int, c *Comm) error {
		var wg sync.WaitGroup
		errs := make(chan error, tags)
		rng := rand.New(rand.NewPCG(uint64(m), 9))
		order := rng.Perm(tags)
		for _, tag := range order {
			wg.Go(func() {
				for i := range perTag {
					size := (tag*37 + i*1000) % (5 * testChunk)
					if m == 0 {
						if err := c.Send(ctx, 1, uint32(tag), msg(uint32(tag), i, size)); err != nil {
							errs <- err
							return
						}
						continue
					}
					buf := make([]byte, 5*testChunk)
					n, err := c.Recv(ctx, 0, uint32(tag), buf)
					if err != nil {
						errs <- err
						return
					}
					if want := msg(uint32(tag), i, size); !bytes.Equal(buf[:n], want) {
						errs <- fmt.Errorf("tag %d message %d: wrong bytes (%d, want %d)", tag, i, n, len(want))
						return
					}
				}
			})
		}
		wg.Wait()
		close(errs)
		return <-errs
	}))
}

// TestP2POutOfOrder: a Recv for tag B completes while the message of tag A,
// sent first, waits unposted; then A is received.
func TestP2POutOfOrder(t *testing.T) {
	cl := newCluster(t, 2, 1, Options{ChunkBytes: testChunk})
	ctx := context.Background()
	a, b := msg(1, 0, 20*testChunk), msg(2, 0, 100)
	require.NoError(t, cl.comms[0].Send(ctx, 1, 1, a))
	require.NoError(t, cl.comms[0].Send(ctx, 1, 2, b))
	buf := make([]byte, 30*testChunk)
	n, err := cl.comms[1].Recv(ctx, 0, 2, buf)
	require.NoError(t, err)
	require.Equal(t, b, buf[:n])
	n, err = cl.comms[1].Recv(ctx, 0, 1, buf)
	require.NoError(t, err)
	require.Equal(t, a, buf[:n])
	assert.Zero(t, cl.comms[1].unexpected.Load())
}

// TestP2PSameTagOrder: messages on one tag arrive in the order sent, posted
// before or after their arrival.
func TestP2PSameTagOrder(t *testing.T) {
	cl := newCluster(t, 3, 1, Options{ChunkBytes: testChunk})
	ctx := context.Background()
	const n = 200
	requireNoErrors(t, cl.each(func(m int, c *Comm) error {
		switch m {
		case 0, 2:
			for i := range n {
				if err := c.Send(ctx, 1, 7, msg(uint32(m), i, i*50)); err != nil {
					return err
				}
			}
			return nil
		}
		var wg sync.WaitGroup
		errs := make([]error, 3)
		for _, src := range []int{0, 2} {
			wg.Go(func() {
				buf := make([]byte, n*50)
				for i := range n {
					if i%17 == 0 {
						time.Sleep(time.Millisecond) // let some queue up
					}
					k, err := c.Recv(ctx, src, 7, buf)
					if err != nil {
						errs[src] = err
						return
					}
					if !bytes.Equal(buf[:k], msg(uint32(src), i, i*50)) {
						errs[src] = fmt.Errorf("from %d: message %d out of order", src, i)
						return
					}
				}
			})
		}
		wg.Wait()
		return errors2(errs)
	}))
}

func errors2(errs []error) error {
	for _, err := range errs {
		if err != nil {
			return err
		}
	}
	return nil
}

// TestP2PConcurrentSenders: goroutines sending at once to one peer, on
// shared and separate tags: every message arrives once, intact, and each
// sender's messages on a tag stay in order.
func TestP2PConcurrentSenders(t *testing.T) {
	cl := newCluster(t, 2, 1, Options{ChunkBytes: testChunk})
	ctx := context.Background()
	const senders, each = 8, 30
	requireNoErrors(t, cl.each(func(m int, c *Comm) error {
		if m == 0 {
			var wg sync.WaitGroup
			errs := make([]error, senders)
			for s := range senders {
				wg.Go(func() {
					for i := range each {
						tag := uint32(s % 3) // senders share tags
						b := msg(uint32(s), i, 3*testChunk+s)
						if err := c.Send(ctx, 1, tag, b); err != nil {
							errs[s] = err
							return
						}
					}
				})
			}
			wg.Wait()
			return errors2(errs)
		}
		next := make([]int, senders)
		buf := make([]byte, 4*testChunk)
		for range senders * each {
			tag := uint32(rand.IntN(3))
			for {
				// Only receive on a tag that still has messages coming.
				left := 0
				for s := range senders {
					if uint32(s%3) == tag {
						left += each - next[s]
					}
				}
				if left > 0 {
					break
				}
				tag = (tag + 1) % 3
			}
			n, err := c.Recv(ctx, 0, tag, buf)
			if err != nil {
				return err
			}
			s := int(binary.LittleEndian.Uint32(buf))
			i := int(binary.LittleEndian.Uint32(buf[4:]))
			if s >= senders || uint32(s%3) != tag || i != next[s] || !bytes.Equal(buf[:n], msg(uint32(s), i, 3*testChunk+s)) {
				return fmt.Errorf("tag %d: got sender %d message %d, want message %d", tag, s, i, next[min(s, senders-1)])
			}
			next[s]++
		}
		return nil
	}))
}

// TestP2PTooLong: a message longer than the buffer is an error and is
// consumed; the next one on the tag is fine. Both posted and queued.
func TestP2PTooLong(t *testing.T) {
	cl := newCluster(t, 2, 1, Options{ChunkBytes: testChunk})
	ctx := context.Background()
	for _, posted := range []bool{false, true} {
		long, short := msg(3, 0, 3*testChunk), msg(3, 1, 10)
		var n int
		var err error
		buf := make([]byte, testChunk)
		if posted {
			done := make(chan struct{})
			go func() {
				defer close(done)
				n, err = cl.comms[1].Recv(ctx, 0, 3, buf)
			}()
			time.Sleep(10 * time.Millisecond)
			require.NoError(t, cl.comms[0].Send(ctx, 1, 3, long))
			<-done
		} else {
			require.NoError(t, cl.comms[0].Send(ctx, 1, 3, long))
			time.Sleep(10 * time.Millisecond)
			n, err = cl.comms[1].Recv(ctx, 0, 3, buf)
		}
		require.ErrorIs(t, err, ErrTooLong)
		require.ErrorContains(t, err, fmt.Sprintf("a message of %d bytes for a %d-byte buffer", len(long), len(buf)))
		assert.Equal(t, len(long), n)
		assert.Equal(t, long[:len(buf)], buf)
		require.NoError(t, cl.comms[0].Send(ctx, 1, 3, short))
		n, err = cl.comms[1].Recv(ctx, 0, 3, buf)
		require.NoError(t, err)
		assert.Equal(t, short, buf[:n])
	}
	// Not broken.
	requireNoErrors(t, cl.each(func(m int, c *Comm) error { return c.Barrier(ctx) }))
}

// TestP2PUnexpectedLimit: messages nobody receives are queued up to the
// limit; past it the communicator breaks with an error saying why.
func TestP2PUnexpectedLimit(t *testing.T) {
	cl := newClusterLimit(t, 2, 1, Options{ChunkBytes: testChunk}, 16*testChunk)
	ctx := context.Background()
	for i := range 15 {
		require.NoError(t, cl.comms[0].Send(ctx, 1, uint32(i), msg(uint32(i), 0, testChunk)))
	}
	time.Sleep(20 * time.Millisecond)
	require.NoError(t, cl.comms[1].state(), "under the limit")
	for i := 15; i < 20; i++ {
		_ = cl.comms[0].Send(ctx, 1, uint32(i), msg(uint32(i), 0, testChunk))
	}
	_, err := cl.comms[1].Recv(ctx, 0, 99, nil)
	require.ErrorIs(t, err, ErrBroken)
	require.ErrorContains(t, err, "wait for a matching Recv, over the limit of 16 KiB")
	// The sender learns it too.
	require.Eventually(t, func() bool { return cl.comms[0].state() != nil }, testenv.Scale(10*time.Second), time.Millisecond)
}

// TestRecvTimeout: a Recv with nothing to receive times out without
// breaking anything.
func TestRecvTimeout(t *testing.T) {
	cl := newCluster(t, 2, 1, Options{Timeout: 100 * time.Millisecond})
	_, err := cl.comms[1].Recv(context.Background(), 0, 5, make([]byte, 8))
	require.ErrorIs(t, err, context.DeadlineExceeded)
	require.ErrorContains(t, err, "recv (tag 5 from member 0, 8 B buffer): timed out after 100ms waiting for member 0 (no message with this tag arrived)")
	require.NoError(t, cl.comms[0].Send(context.Background(), 1, 5, []byte("late")))
	buf := make([]byte, 8)
	n, err := cl.comms[1].Recv(context.Background(), 0, 5, buf)
	require.NoError(t, err)
	assert.Equal(t, "late", string(buf[:n]))
}

// TestRecvCancelMidMessage: a Recv that gives up while its message is
// arriving hands the message on intact, to the queue or to a later Recv.
func TestRecvCancelMidMessage(t *testing.T) {
	for _, handoff := range []bool{false, true} {
		t.Run(fmt.Sprintf("posted_next=%v", handoff), func(t *testing.T) {
			cl := newCluster(t, 2, 1, Options{ChunkBytes: testChunk})
			recv := cl.comms[1]
			// Member 0's frames are written by hand to stop mid-message.
			ctl := cl.meshes[0].Control(1)
			ctx := context.Background()
			whole := msg(4, 0, 2*testChunk)
			frame := func(i int, last bool) {
				h := wire.Header{Kind: wire.KindP2P, Seq: 1, Step: 4, Chunk: uint32(i)}
				if last {
					h.Flags = wire.FlagLast
				}
				require.NoError(t, ctl.Send(ctx, h, whole[i*testChunk:(i+1)*testChunk]))
			}
			cctx, cancel := context.WithCancel(ctx)
			first := make(chan error, 1)
			go func() {
				_, err := recv.Recv(cctx, 0, 4, make([]byte, 4*testChunk))
				first <- err
			}()
			waitState := func(want int) {
				require.Eventually(t, func() bool {
					pr := recv.peers[0]
					pr.mu.Lock()
					defer pr.mu.Unlock()
					in := pr.inflight[4]
					if want == posted {
						return len(pr.posted[4]) > 0
					}
					return in != nil && in.req != nil && in.req.state == want
				}, testenv.Scale(10*time.Second), time.Millisecond)
			}
			waitState(posted)
			frame(0, false)
			waitState(filling)
			second := make(chan []byte, 1)
			if handoff {
				go func() {
					buf := make([]byte, 4*testChunk)
					n, err := recv.Recv(ctx, 0, 4, buf)
					assert.NoError(t, err)
					second <- buf[:n]
				}()
				require.Eventually(t, func() bool {
					pr := recv.peers[0]
					pr.mu.Lock()
					defer pr.mu.Unlock()
					return len(pr.posted[4]) == 1
				}, testenv.Scale(10*time.Second), time.Millisecond)
			}
			cancel()
			require.ErrorIs(t, <-first, context.Canceled)
			frame(1, true)
			if !handoff {
				buf := make([]byte, 4*testChunk)
				n, err := recv.Recv(ctx, 0, 4, buf)
				require.NoError(t, err)
				second <- buf[:n]
			}
			assert.Equal(t, whole, <-second)
			require.NoError(t, recv.state())
		})
	}
}

// TestP2PProtocolError: a frame out of sequence breaks the communicator.
func TestP2PProtocolError(t *testing.T) {
	cl := newCluster(t, 2, 1, Options{})
	h := wire.Header{Kind: wire.KindP2P, Seq: 2, Step: 1, Flags: wire.FlagLast}
	require.NoError(t, cl.meshes[0].Control(1).Send(context.Background(), h, nil))
	_, err := cl.comms[1].Recv(context.Background(), 0, 1, nil)
	require.ErrorIs(t, err, ErrBroken)
	require.ErrorContains(t, err, "member 0 sent frame 0 of message 2 on tag 1, this member expected frame 0 of message 1: protocol error")
}
