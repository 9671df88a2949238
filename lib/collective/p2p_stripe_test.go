package collective

import (
	"bytes"
	"context"
	"fmt"
	"math/rand/v2"
	"sync"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/gpubridge/gpubridge/lib/reduce"
	"github.com/gpubridge/gpubridge/lib/testenv"
	"github.com/gpubridge/gpubridge/lib/transport"
	"github.com/gpubridge/gpubridge/lib/wire"
)

// The point-to-point tests again, with every message of testStripeMin
// bytes or more striped over testP2PStreams point-to-point streams.
func TestP2PStripedAll(t *testing.T) {
	stripedP2P = true
	defer func() { stripedP2P = false }()
	t.Run("Basic", TestP2PBasic)
	t.Run("ManyTags", TestP2PManyTags)
	t.Run("OutOfOrder", TestP2POutOfOrder)
	t.Run("SameTagOrder", TestP2PSameTagOrder)
	t.Run("ConcurrentSenders", TestP2PConcurrentSenders)
	t.Run("TooLong", TestP2PTooLong)
	t.Run("UnexpectedLimit", TestP2PUnexpectedLimit)
	t.Run("RecvTimeout", TestRecvTimeout)
}

func TestStripeAnnounce(t *testing.T) {
	total, unit, frames, err := parseStripeAnnounce(stripeAnnounce(10<<20+1, 1<<20))
	require.NoError(t, err)
	assert.Equal(t, []int{10<<20 + 1, 1 << 20, 11}, []int{total, unit, frames})
	for _, c := range []struct {
		p    []byte
		want string
	}{
		{stripeAnnounce(1, 1)[:11], "an announcement of 11 bytes, want 12"},
		{stripeAnnounce(5, 0), "frames of 0 bytes"},
		{stripeAnnounce(5, wire.MaxPayload+1), "frames of 67108865 bytes"},
		{stripeAnnounce(0, 7), "a message of 0 bytes"},
		{stripeAnnounce(maxStripeFrames*64+1, 64), "in frames of 64 bytes (1 byte to 1048576 frames allowed)"},
	} {
		_, _, _, err := parseStripeAnnounce(c.p)
		assert.ErrorContains(t, err, c.want)
	}
}

func FuzzStripeAnnounce(f *testing.F) {
	f.Add(stripeAnnounce(64<<20, 4<<20))
	f.Add(stripeAnnounce(1, 1))
	f.Add([]byte{1, 2, 3})
	f.Fuzz(func(t *testing.T, p []byte) {
		total, unit, frames, err := parseStripeAnnounce(p)
		if err != nil {
			return
		}
		require.Equal(t, p, stripeAnnounce(total, unit))
		require.LessOrEqual(t, frames, maxStripeFrames)
		require.Equal(t, (total+unit-1)/unit, frames)
	})
}

// Sizes around the stripe threshold and the frame boundaries, received
// into posted and queued Recvs, into buffers larger and smaller.
func TestP2PStripedSizes(t *testing.T) {
	stripedP2P = true
	defer func() { stripedP2P = false }()
	cl := newCluster(t, 2, 2, Options{ChunkBytes: 4 * testChunk})
	for _, c := range cl.comms {
		c.stripeUnit = testChunk
	}
	ctx := context.Background()
	u := 4 * testChunk // frames of ChunkBytes once the message is 3 of them
	sizes := []int{testStripeMin - 1, testStripeMin, testStripeMin + 1, 3*testChunk - 1, 3 * testChunk, 3*u - 1, 3 * u, 3*u + 1, 7*u + 5, 40 * u}
	for _, size := range sizes {
		for _, queued := range []bool{false, true} {
			for _, short := range []bool{false, true} {
				src := randBytes(rand.New(rand.NewPCG(uint64(size), 3)), size)
				bufLen := size + 7
				if short {
					bufLen = size / 2
				}
				buf := make([]byte, bufLen)
				var n int
				var err error
				if queued {
					require.NoError(t, cl.comms[0].Send(ctx, 1, 9, src))
					n, err = cl.comms[1].Recv(ctx, 0, 9, buf)
				} else {
					errs := cl.each(func(m int, c *Comm) error {
						if m == 0 {
							return c.Send(ctx, 1, 9, src)
						}
						n, err = c.Recv(ctx, 0, 9, buf)
						return nil
					})
					requireNoErrors(t, errs)
				}
				what := fmt.Sprintf("size %d, queued %v, short %v", size, queued, short)
				require.Equal(t, size, n, what)
				if short {
					require.ErrorIs(t, err, ErrTooLong, what)
					require.Equal(t, src[:bufLen], buf, what)
				} else {
					require.NoError(t, err, what)
					require.Equal(t, src, buf[:n], what)
				}
			}
		}
	}
	assert.Zero(t, cl.comms[1].unexpected.Load())
	requireNoErrors(t, cl.each(func(m int, c *Comm) error { return c.Barrier(ctx) }))
}

// Both members send to each other at once on several tags, striped and
// not on the same tags, while collectives run on the data streams: every
// message arrives intact and in order per tag, nothing deadlocks.
func TestP2PStripedBothWays(t *testing.T) {
	stripedP2P = true
	defer func() { stripedP2P = false }()
	cl := newCluster(t, 2, 2, Options{ChunkBytes: testChunk})
	ctx := context.Background()
	const tags, perTag = 4, 12
	size := func(tag, i int) int { return []int{10, 3 * testChunk, testChunk - 1, 9*testChunk + 3}[(tag+i)%4] }
	requireNoErrors(t, cl.each(func(m int, c *Comm) error {
		peer := 1 - m
		var wg sync.WaitGroup
		errs := make(chan error, 2*tags+1)
		for tag := range tags {
			wg.Go(func() {
				for i := range perTag {
					if err := c.Send(ctx, peer, uint32(tag), msg(uint32(tag+10*m), i, size(tag, i))); err != nil {
						errs <- err
						return
					}
				}
			})
			wg.Go(func() {
				buf := make([]byte, 10*testChunk)
				for i := range perTag {
					n, err := c.Recv(ctx, peer, uint32(tag), buf)
					if err != nil {
						errs <- err
						return
					}
					if want := msg(uint32(tag+10*peer), i, size(tag, i)); !bytes.Equal(buf[:n], want) {
						errs <- fmt.Errorf("member %d tag %d message %d: wrong bytes (%d, want %d)", m, tag, i, n, len(want))
						return
					}
				}
			})
		}
		wg.Go(func() {
			buf := make([]byte, 8*testChunk)
			for range 5 {
				if err := c.AllReduce(ctx, buf, reduce.Float32, reduce.Sum, nil); err != nil {
					errs <- err
					return
				}
			}
		})
		wg.Wait()
		close(errs)
		return <-errs
	}))
}

// stripeWriter writes a striped message's frames by hand, as member 0.
type stripeWriter struct {
	t     *testing.T
	mesh  transport.Mesh
	tag   uint32
	seq   uint64
	whole []byte
	unit  int
}

func (w *stripeWriter) announce() {
	h := wire.Header{Kind: wire.KindP2P, Seq: w.seq, Step: w.tag, Flags: wire.FlagStripe}
	require.NoError(w.t, w.mesh.Control(1).Send(context.Background(), h, stripeAnnounce(len(w.whole), w.unit)))
}

func (w *stripeWriter) frame(i int) {
	h := wire.Header{Kind: wire.KindP2P, Seq: w.seq, Step: w.tag, Chunk: uint32(i)}
	p := w.whole[i*w.unit : min((i+1)*w.unit, len(w.whole))]
	require.NoError(w.t, w.mesh.P2PStream(1, i%w.mesh.P2PStreams()).Send(context.Background(), h, p))
}

// A Recv that gives up while its striped message is arriving hands it on
// intact, frames arrived and to come, to the next Recv or the queue; one
// whose buffer overflowed drops it, and the next message is fine.
func TestP2PStripedRecvCancel(t *testing.T) {
	for _, c := range []struct {
		name     string
		handoff  bool
		overflow bool
	}{{"queued", false, false}, {"posted_next", true, false}, {"overflowed", false, true}} {
		t.Run(c.name, func(t *testing.T) {
			stripedP2P = true
			defer func() { stripedP2P = false }()
			cl := newCluster(t, 2, 1, Options{ChunkBytes: testChunk})
			recv := cl.comms[1]
			ctx := context.Background()
			w := &stripeWriter{t: t, mesh: cl.meshes[0], tag: 4, seq: 1, whole: msg(4, 0, 5*testChunk+3), unit: testChunk}
			bufLen := 8 * testChunk
			if c.overflow {
				bufLen = 2 * testChunk
			}
			cctx, cancel := context.WithCancel(ctx)
			first := make(chan error, 1)
			go func() {
				_, err := recv.Recv(cctx, 0, 4, make([]byte, bufLen))
				first <- err
			}()
			pr := recv.peers[0]
			require.Eventually(t, func() bool {
				pr.mu.Lock()
				defer pr.mu.Unlock()
				return len(pr.posted[4]) == 1
			}, testenv.Scale(10*time.Second), time.Millisecond)
			w.announce()
			w.frame(4)
			w.frame(1)
			require.Eventually(t, func() bool {
				pr.mu.Lock()
				defer pr.mu.Unlock()
				sm := pr.striped[stripeKey{4, 1}]
				return sm != nil && sm.got == 2*testChunk
			}, testenv.Scale(10*time.Second), time.Millisecond)
			second := make(chan []byte, 1)
			if c.handoff {
				go func() {
					buf := make([]byte, 8*testChunk)
					n, err := recv.Recv(ctx, 0, 4, buf)
					assert.NoError(t, err)
					second <- buf[:n]
				}()
				require.Eventually(t, func() bool {
					pr.mu.Lock()
					defer pr.mu.Unlock()
					return len(pr.posted[4]) == 1
				}, testenv.Scale(10*time.Second), time.Millisecond)
			}
			cancel()
			require.ErrorIs(t, <-first, context.Canceled)
			for _, i := range []int{0, 2, 3, 5} {
				w.frame(i)
			}
			if c.overflow {
				next := msg(4, 1, 3*testChunk)
				ts, turn := cl.comms[0].peers[1].postSend(4)
				ts.next = 1 // message 1 was written by hand
				cl.comms[0].peers[1].leaveSend(ts, turn)
				require.NoError(t, cl.comms[0].Send(ctx, 1, 4, next))
				buf := make([]byte, 8*testChunk)
				n, err := recv.Recv(ctx, 0, 4, buf)
				require.NoError(t, err)
				assert.Equal(t, next, buf[:n], "the overflowed message was dropped")
				assert.Zero(t, recv.unexpected.Load())
				require.NoError(t, recv.state())
				return
			}
			if !c.handoff {
				buf := make([]byte, 8*testChunk)
				n, err := recv.Recv(ctx, 0, 4, buf)
				require.NoError(t, err)
				second <- buf[:n]
			}
			assert.Equal(t, w.whole, <-second)
			assert.Zero(t, recv.unexpected.Load())
			require.NoError(t, recv.state())
		})
	}
}

// A peer that closes while its striped message is arriving: the Recv fails
// naming it; a message the peer sent whole before closing is delivered.
func TestP2PStripedPeerClosed(t *testing.T) {
	stripedP2P = true
	defer func() { stripedP2P = false }()
	cl := newCluster(t, 2, 1, Options{ChunkBytes: testChunk})
	ctx := context.Background()
	whole := msg(6, 0, 6*testChunk)
	require.NoError(t, cl.comms[0].Send(ctx, 1, 5, whole))
	w := &stripeWriter{t: t, mesh: cl.meshes[0], tag: 6, seq: 1, whole: whole, unit: testChunk}
	w.announce()
	w.frame(0)
	w.frame(2)
	require.NoError(t, cl.comms[0].Close())
	buf := make([]byte, 8*testChunk)
	n, err := cl.comms[1].Recv(ctx, 0, 5, buf)
	require.NoError(t, err)
	assert.Equal(t, whole, buf[:n])
	_, err = cl.comms[1].Recv(ctx, 0, 6, buf)
	require.ErrorIs(t, err, ErrBroken)
	require.ErrorIs(t, err, transport.ErrPeerClosed)
}

// The unexpected-queue limit counts a striped message's announced length
// when it is announced.
func TestP2PStripedUnexpectedLimit(t *testing.T) {
	stripedP2P = true
	defer func() { stripedP2P = false }()
	cl := newClusterLimit(t, 2, 1, Options{ChunkBytes: testChunk}, 16*testChunk)
	ctx := context.Background()
	require.NoError(t, cl.comms[0].Send(ctx, 1, 1, msg(1, 0, 10*testChunk)))
	require.Eventually(t, func() bool { return cl.comms[1].unexpected.Load() == 10*testChunk }, testenv.Scale(10*time.Second), time.Millisecond)
	w := &stripeWriter{t: t, mesh: cl.meshes[0], tag: 2, seq: 1, whole: msg(2, 0, 7*testChunk), unit: testChunk}
	w.announce() // 17 KiB announced, nothing of it sent
	_, err := cl.comms[1].Recv(ctx, 0, 99, nil)
	require.ErrorIs(t, err, ErrBroken)
	require.ErrorContains(t, err, "member 0: 17408 bytes of messages wait for a matching Recv, over the limit of 16 KiB (message 1 on tag 2)")
}

// Frames of a striped message that break the protocol break the
// communicator, naming what was wrong.
func TestP2PStripedProtocolError(t *testing.T) {
	for _, c := range []struct {
		name  string
		write func(w *stripeWriter)
		want  string
	}{
		{"twice", func(w *stripeWriter) { w.announce(); w.frame(0); w.frame(0) }, "sent frame 0 of striped message 1 on tag 3 twice"},
		{"past the end", func(w *stripeWriter) {
			w.announce()
			h := wire.Header{Kind: wire.KindP2P, Seq: 1, Step: 3, Chunk: 9}
			require.NoError(w.t, w.mesh.P2PStream(1, 0).Send(context.Background(), h, nil))
		}, "sent frame 9 of striped message 1 on tag 3, which has 3"},
		{"length", func(w *stripeWriter) {
			w.announce()
			h := wire.Header{Kind: wire.KindP2P, Seq: 1, Step: 3, Chunk: 1}
			require.NoError(w.t, w.mesh.P2PStream(1, 1).Send(context.Background(), h, make([]byte, 5)))
		}, "sent frame 1 of striped message 1 on tag 3 with 5 bytes, want 1024"},
		{"bad announcement", func(w *stripeWriter) {
			h := wire.Header{Kind: wire.KindP2P, Seq: 1, Step: 3, Flags: wire.FlagStripe}
			require.NoError(w.t, w.mesh.Control(1).Send(context.Background(), h, []byte{1}))
		}, "announced striped message 1 on tag 3 with an announcement of 1 bytes, want 12: protocol error"},
		{"flags", func(w *stripeWriter) {
			h := wire.Header{Kind: wire.KindP2P, Seq: 1, Step: 3, Flags: wire.FlagLast}
			require.NoError(w.t, w.mesh.P2PStream(1, 2).Send(context.Background(), h, nil))
		}, "sent a p2p frame (flags 0x03) on point-to-point stream 2: protocol error"},
	} {
		t.Run(c.name, func(t *testing.T) {
			stripedP2P = true
			defer func() { stripedP2P = false }()
			cl := newCluster(t, 2, 1, Options{ChunkBytes: testChunk})
			c.write(&stripeWriter{t: t, mesh: cl.meshes[0], tag: 3, seq: 1, whole: msg(3, 0, 3*testChunk), unit: testChunk})
			_, err := cl.comms[1].Recv(context.Background(), 0, 77, nil)
			require.ErrorIs(t, err, ErrBroken)
			require.ErrorContains(t, err, "member 0 "+c.want)
		})
	}
}

// Striped messages over real TCP and shared memory meshes, both ways at
// once.
func TestP2PStripedRealMeshes(t *testing.T) {
	for _, kind := range []transport.Kind{transport.TCP, transport.SHM} {
		t.Run(string(kind), func(t *testing.T) {
			meshes := realMeshesRing(t, kind, 2, 1, 256<<10, 2)
			cl := newClusterMesh(t, meshes, Options{ChunkBytes: 64 << 10, Timeout: testenv.Scale(30 * time.Second)}, DefaultMaxUnexpected)
			for _, c := range cl.comms {
				c.stripeMin, c.stripeUnit = 64<<10, 64<<10
			}
			ctx := context.Background()
			sizes := []int{64<<10 - 1, 64 << 10, 200<<10 + 3, 1 << 20}
			requireNoErrors(t, cl.each(func(m int, c *Comm) error {
				peer := 1 - m
				errs := make([]error, 2)
				var wg sync.WaitGroup
				wg.Go(func() {
					for i, size := range sizes {
						if err := c.Send(ctx, peer, 1, msg(uint32(m), i, size)); err != nil {
							errs[0] = err
							return
						}
					}
				})
				wg.Go(func() {
					buf := make([]byte, 1<<20)
					for i, size := range sizes {
						n, err := c.Recv(ctx, peer, 1, buf)
						if err != nil {
							errs[1] = err
							return
						}
						if !bytes.Equal(buf[:n], msg(uint32(peer), i, size)) {
							errs[1] = fmt.Errorf("message %d: wrong bytes", i)
							return
						}
					}
				})
				wg.Wait()
				return errors2(errs)
			}))
		})
	}
}
