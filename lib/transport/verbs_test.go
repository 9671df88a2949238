package transport

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"math/rand/v2"
	"net"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/gpubridge/gpubridge/lib/ibverbs"
	"github.com/gpubridge/gpubridge/lib/rendezvous"
	"github.com/gpubridge/gpubridge/lib/testenv"
	"github.com/gpubridge/gpubridge/lib/wire"
)

// The verbs transport's logic over the in-memory fake device
// (verbs_fake_test.go): credits, chunking, ordering, held frames,
// registrations, and the failures a real device cannot be made to show on
// demand. verbs_rxe_test.go runs the transport on a real device.

// verbsMeshes establishes the members of b and returns their meshes.
func verbsMeshes(t *testing.T, b *bridge, ringBytes int, mod []func(i int, c *Config)) []*verbsMesh {
	t.Helper()
	b.set(func(c *Config) { c.RingBytes = ringBytes })
	for i := range b.cfgs {
		for _, m := range mod {
			m(i, &b.cfgs[i])
		}
	}
	meshes, errs := b.establish(t)
	out := make([]*verbsMesh, len(meshes))
	for i, err := range errs {
		require.NoError(t, err, "member %d", i)
		out[i] = meshes[i].(*verbsMesh)
	}
	return out
}

// fakeBridge establishes n members over one fake fabric.
func fakeBridge(t *testing.T, n, streams, ringBytes int, crc bool, mod ...func(i int, c *Config)) (*fakeFabric, []*fakeDev, []*verbsMesh) {
	t.Helper()
	f := newFakeFabric()
	devs := make([]*fakeDev, n)
	for i := range devs {
		devs[i] = f.dev(fmt.Sprintf("fake%d", i))
	}
	b := newBridge(t, Verbs, n, streams, crc).set(func(c *Config) { c.verbsOpen = f.opener(devs) })
	return f, devs, verbsMeshes(t, b, ringBytes, mod)
}

// frame is a test frame: header fields and a payload made from them.
func testPayload(seq uint64, n int) []byte {
	r := rand.New(rand.NewPCG(seq, uint64(n)))
	b := make([]byte, n)
	for i := range b {
		b[i] = byte(r.Uint32())
	}
	return b
}

// Frames of every size from 0 to several ring halves go both ways on every
// stream of every pair at once; each arrives whole, in order, with its
// header; the credit protocol never lets an immediate value find no
// posted receive.
func TestVerbsFramesInOrder(t *testing.T) {
	for _, n := range []int{2, 3} {
		t.Run(fmt.Sprintf("%d members", n), func(t *testing.T) {
			f, _, ms := fakeBridge(t, n, 2, 64<<10, true)
			sizes := []int{0, 1, 63, 64, 65, 4000, 32 << 10, 34<<10 - 64, 34 << 10, 100 << 10, 300 << 10}
			const rounds = 3
			ctx, cancel := context.WithTimeout(context.Background(), testenv.Scale(60*time.Second))
			defer cancel()
			var wg sync.WaitGroup
			errc := make(chan error, 2*n*n*4)
			for a := range n {
				for b := range n {
					if a == b {
						continue
					}
					for st := range ms[a].Streams() + 1 {
						out := ms[a].links[b][st]
						in := ms[b].links[a][st]
						wg.Go(func() {
							for r := range rounds {
								for i, sz := range sizes {
									seq := uint64(r*100 + i)
									h := wire.Header{Kind: wire.KindData, Seq: seq, Step: uint32(st), Chunk: uint32(a)}
									if err := out.Send(ctx, h, testPayload(seq, sz)); err != nil {
										errc <- err
										return
									}
								}
							}
						})
						wg.Go(func() {
							for r := range rounds {
								for i, sz := range sizes {
									seq := uint64(r*100 + i)
									err := in.Recv(ctx, func(h wire.Header, p []byte) error {
										if h.Seq != seq || h.Step != uint32(st) || h.Chunk != uint32(a) || !bytes.Equal(p, testPayload(seq, sz)) {
											return fmt.Errorf("stream %d %d->%d: frame %d (%d bytes) arrived as seq %d, %d bytes", st, a, b, seq, sz, h.Seq, len(p))
										}
										return nil
									})
									if err != nil {
										errc <- err
										return
									}
								}
							}
						})
					}
				}
			}
			wg.Wait()
			close(errc)
			for err := range errc {
				require.NoError(t, err)
			}
			f.mu.Lock()
			defer f.mu.Unlock()
			assert.Zero(t, f.rnr, "immediate values without a posted receive")
			assert.Zero(t, f.psnMismatch, "queue pairs whose sequence numbers disagree")
		})
	}
}

// Point-to-point streams (Config.P2PStreams) are queue pairs of their own
// with data-sized rings after the data streams' in the registration:
// frames, split ones too, go on every data, point-to-point and control
// stream of 3 members at once, each in order, none on another's ring;
// Describe says so; every member made and connected the queue pairs.
func TestVerbsP2PStreams(t *testing.T) {
	const ring = 64 << 10
	f, devs, ms := fakeBridge(t, 3, 2, ring, true, func(_ int, c *Config) { c.P2PStreams = 3 })
	meshes := make([]Mesh, len(ms))
	for i, m := range ms {
		meshes[i] = m
		assert.Equal(t, 2, m.Streams())
		assert.Equal(t, 3, m.P2PStreams())
		assert.Contains(t, m.Describe(), "verbs, 2 streams per peer and 3 for point-to-point, crc32c, ")
		// Rings: per peer 2 + 3 of the data size and the control one.
		assert.Len(t, m.mrs[0].(*fakeMR).b, 2*(5*(ring+4096)+verbsCtlRing+4096))
		assert.Equal(t, 2*(2+3+1), devs[i].qps, "queue pairs of member %d", i)
	}
	exchange(t, meshes, []int{0, 1, 4093, ring/2 + 100, 100 << 10, 13})
	f.mu.Lock()
	defer f.mu.Unlock()
	assert.Zero(t, f.rnr, "immediate values without a posted receive")
	assert.Zero(t, f.psnMismatch, "queue pairs whose sequence numbers disagree")
}

// Members that disagree on the point-to-point streams fail the set-up
// with the same error, before any queue pair is connected.
func TestVerbsP2PStreamsMismatch(t *testing.T) {
	f := newFakeFabric()
	devs := []*fakeDev{f.dev("fake0"), f.dev("fake1")}
	b := newBridge(t, Verbs, 2, 2, false).set(func(c *Config) { c.verbsOpen = f.opener(devs); c.RingBytes = 64 << 10 })
	b.cfgs[1].P2PStreams = 4
	_, errs := b.establish(t)
	require.Error(t, errs[0])
	require.Error(t, errs[1])
	assert.Equal(t, errs[0].Error(), errs[1].Error())
	assert.Contains(t, errs[0].Error(), "members disagree on the bridge settings: point-to-point streams per peer: member 0 (rank 0 on host-a) 0, member 1 (rank 2 on host-b) 4")
	for _, d := range devs {
		assert.True(t, d.closed, "%s freed", d.name)
	}
}

// Many small frames to a receiver that starts late: the sender stops at
// its record window (not the ring), positions wrap the ring many times,
// and everything arrives.
func TestVerbsWindowAndWrap(t *testing.T) {
	f, _, ms := fakeBridge(t, 2, 1, 64<<10, false)
	out, in := ms[0].links[1][0], ms[1].links[0][0]
	ctx, cancel := context.WithTimeout(context.Background(), testenv.Scale(60*time.Second))
	defer cancel()
	const frames = 5000
	sent := make(chan error, 1)
	go func() {
		for i := range frames {
			if err := out.Send(ctx, wire.Header{Kind: wire.KindData, Seq: uint64(i)}, testPayload(uint64(i), i%200)); err != nil {
				sent <- err
				return
			}
		}
		sent <- nil
	}()
	// The sender fills its window and waits.
	require.Eventually(t, func() bool {
		out.mu.Lock()
		defer out.mu.Unlock()
		return len(out.recEnds) == verbsWindow
	}, testenv.Scale(10*time.Second), time.Millisecond)
	time.Sleep(20 * time.Millisecond)
	out.mu.Lock()
	assert.Equal(t, verbsWindow, len(out.recEnds), "the window holds")
	assert.LessOrEqual(t, out.head-out.tail, out.rCap, "within credit")
	out.mu.Unlock()
	for i := range frames {
		require.NoError(t, in.Recv(ctx, func(h wire.Header, p []byte) error {
			if h.Seq != uint64(i) || !bytes.Equal(p, testPayload(uint64(i), i%200)) {
				return fmt.Errorf("frame %d arrived as %d", i, h.Seq)
			}
			return nil
		}))
	}
	require.NoError(t, <-sent)
	out.mu.Lock()
	assert.Greater(t, out.head, 10*out.rCap, "the ring wrapped many times")
	out.mu.Unlock()
	f.mu.Lock()
	assert.Zero(t, f.rnr)
	f.mu.Unlock()
}

// Frames held in place keep their ring space (and what follows) until
// released, in any order; a sender out of credit waits for the release.
func TestVerbsHeldFramesPinTheRing(t *testing.T) {
	_, _, ms := fakeBridge(t, 2, 1, 64<<10, false)
	out, in := ms[0].links[1][0], ms[1].links[0][0]
	ctx, cancel := context.WithTimeout(context.Background(), testenv.Scale(30*time.Second))
	defer cancel()
	big := 30 << 10 // two fill the ring
	for i := range 2 {
		require.NoError(t, out.Send(ctx, wire.Header{Kind: wire.KindData, Seq: uint64(i)}, testPayload(uint64(i), big)))
	}
	h0, p0, rel0, err := in.RecvHold(ctx)
	require.NoError(t, err)
	h1, p1, rel1, err := in.RecvHold(ctx)
	require.NoError(t, err)
	assert.Equal(t, uint64(0), h0.Seq)
	assert.Equal(t, uint64(1), h1.Seq)
	third := make(chan error, 1)
	go func() { third <- out.Send(ctx, wire.Header{Kind: wire.KindData, Seq: 2}, testPayload(2, big)) }()
	rel1() // the second first: the first still pins the ring
	select {
	case err := <-third:
		t.Fatalf("the third frame was sent while the first held the ring: %v", err)
	case <-time.After(50 * time.Millisecond):
	}
	assert.Equal(t, testPayload(0, big), p0, "a held frame stays intact")
	rel0()
	rel0() // releasing twice does nothing
	require.NoError(t, <-third)
	assert.Equal(t, testPayload(1, big), p1)
	require.NoError(t, in.Recv(ctx, func(h wire.Header, p []byte) error {
		assert.Equal(t, uint64(2), h.Seq)
		assert.Equal(t, testPayload(2, big), p)
		return nil
	}))
}

// Payloads in registered memory are written in place; others through
// staging; a registration is freed once released and unused.
func TestVerbsRegisteredPayloadsAreZeroCopy(t *testing.T) {
	f, _, ms := fakeBridge(t, 2, 2, 1<<20, true)
	out, in := ms[0].links[1][1], ms[1].links[0][1]
	ctx, cancel := context.WithTimeout(context.Background(), testenv.Scale(30*time.Second))
	defer cancel()
	region := testPayload(7, 2<<20)
	var r Registrar = ms[0]
	release, err := r.Register(region)
	require.NoError(t, err)
	again, err := r.Register(region[1<<20:]) // covered: a reference on the same registration
	require.NoError(t, err)
	f.mu.Lock()
	mrs := len(f.mrs)
	f.mu.Unlock()
	recvd := make(chan error, 1)
	go func() {
		for i, want := range [][]byte{region[:256<<10], region[1<<20 : 1<<20+700<<10], region[5 : 5+(100<<10)], testPayload(9, 256<<10)} {
			err := in.Recv(ctx, func(h wire.Header, p []byte) error {
				if h.Seq != uint64(i) || !bytes.Equal(p, want) {
					return fmt.Errorf("frame %d damaged", i)
				}
				return nil
			})
			if err != nil {
				recvd <- err
				return
			}
		}
		recvd <- nil
	}()
	for i, p := range [][]byte{region[:256<<10], region[1<<20 : 1<<20+700<<10], region[5 : 5+(100<<10)]} {
		require.NoError(t, out.Send(ctx, wire.Header{Kind: wire.KindData, Seq: uint64(i)}, p))
	}
	zc := ms[0].regs.zeroCopied.Load()
	assert.Equal(t, int64(256<<10+700<<10+100<<10), zc, "registered payloads went in place")
	require.NoError(t, out.Send(ctx, wire.Header{Kind: wire.KindData, Seq: 3}, testPayload(9, 256<<10)))
	assert.Equal(t, zc, ms[0].regs.zeroCopied.Load())
	assert.GreaterOrEqual(t, ms[0].regs.copied.Load(), int64(256<<10))
	require.NoError(t, <-recvd)
	release()
	release()
	f.mu.Lock()
	assert.Equal(t, mrs, len(f.mrs), "still referenced")
	f.mu.Unlock()
	again()
	f.mu.Lock()
	assert.Equal(t, mrs-1, len(f.mrs), "freed")
	f.mu.Unlock()
	_, err = r.Register(nil)
	assert.Error(t, err)
}

// A zero-copy send whose write the peer never acknowledges returns when
// the mesh closes, only after the write was flushed (nothing reads the
// caller's memory afterwards).
func TestVerbsCloseFlushesAZeroCopyWrite(t *testing.T) {
	f, _, ms := fakeBridge(t, 2, 1, 1<<20, false)
	out := ms[0].links[1][0]
	region := testPayload(3, 512<<10)
	release, err := ms[0].Register(region)
	require.NoError(t, err)
	defer release()
	f.mu.Lock()
	f.fault = func(q *fakeQP, wr uint64, imm uint32, withImm bool, n int) fakeFault {
		if n > 256<<10 {
			return faultHold
		}
		return faultNone
	}
	f.mu.Unlock()
	errc := make(chan error, 1)
	go func() { errc <- out.Send(context.Background(), wire.Header{Kind: wire.KindData}, region) }()
	select {
	case err := <-errc:
		t.Fatalf("the send returned before its write completed: %v", err)
	case <-time.After(100 * time.Millisecond):
	}
	require.NoError(t, ms[0].Close())
	err = <-errc
	require.ErrorIs(t, err, ErrClosed)
}

// The peer refuses a write (its record's key or address is wrong): the
// stream fails naming the peer, and every stream to it breaks.
func TestVerbsRemoteAccessErrorNamesPeer(t *testing.T) {
	f, _, ms := fakeBridge(t, 2, 2, 64<<10, false)
	f.mu.Lock()
	f.fault = func(q *fakeQP, wr uint64, imm uint32, withImm bool, n int) fakeFault {
		if n > 0 {
			return faultRemAccess
		}
		return faultNone
	}
	f.mu.Unlock()
	ctx, cancel := context.WithTimeout(context.Background(), testenv.Scale(30*time.Second))
	defer cancel()
	// The frame was copied and Send returned; its refusal breaks every
	// stream to the peer: a receiver on another stream wakes with it.
	require.NoError(t, ms[0].Stream(1, 0).Send(ctx, wire.Header{Kind: wire.KindData}, []byte("x")))
	err := ms[0].Stream(1, 1).Recv(ctx, func(wire.Header, []byte) error { return nil })
	var pe *PeerError
	require.ErrorAs(t, err, &pe)
	assert.Contains(t, err.Error(), "member 1 (rank 2 on host-b")
	assert.Contains(t, err.Error(), "refused a write into its receive ring")
	err = ms[0].Stream(1, 0).Send(ctx, wire.Header{Kind: wire.KindData}, []byte("y"))
	assert.ErrorContains(t, err, "refused a write into its receive ring", "the sender learns too")
}

// A peer that vanishes (its process died): a member that only waits on
// it learns within seconds, naming it, whether the HCA fails requests to
// it after its retries (real HCAs) or never answers them (rdma_rxe), then
// through the keep-alives.
func TestVerbsSilentPeerIsFound(t *testing.T) {
	for _, silent := range []bool{false, true} {
		t.Run(fmt.Sprintf("silent %v", silent), func(t *testing.T) {
			f, devs, ms := fakeBridge(t, 2, 1, 64<<10, false)
			f.mu.Lock()
			f.silent = silent
			f.mu.Unlock()
			for _, q := range f.qpsOf(devs[1]) {
				f.mu.Lock()
				q.errored = true // gone without a word
				f.mu.Unlock()
			}
			ctx, cancel := context.WithTimeout(context.Background(), testenv.Scale(60*time.Second))
			defer cancel()
			t0 := time.Now()
			err := ms[0].Stream(1, 0).Recv(ctx, func(wire.Header, []byte) error { return nil })
			require.ErrorIs(t, err, ErrConnClosed)
			assert.Contains(t, err.Error(), "member 1 (rank 2 on host-b")
			assert.Contains(t, err.Error(), "of rank 2 (pid")
			if silent {
				assert.Contains(t, err.Error(), "keep-alives unanswered")
			} else {
				assert.Contains(t, err.Error(), "no acknowledgement after 8 tries")
			}
			assert.Less(t, time.Since(t0), testenv.Scale(30*time.Second))
		})
	}
}

// shortKeepAlives makes the keep-alive deadlines short for t, still not
// sub-second (a loaded machine must not lose a live peer), and puts them
// back once t's meshes are closed (the first cleanup runs last): the
// meshes' goroutines read them until then.
func shortKeepAlives(t *testing.T) {
	k, d := verbsKeepAlive, verbsDeadAfter
	t.Cleanup(func() { verbsKeepAlive, verbsDeadAfter = k, d })
	verbsKeepAlive, verbsDeadAfter = testenv.Scale(time.Second), testenv.Scale(2*time.Second)
}

// A peer lost while this member's posts to it stay inside the device's
// library (rdma_rxe after the link went down: the keep-alive's own ping
// is such a post): the member waiting on it still learns within the
// keep-alive deadline, not when the post returns.
func TestVerbsSilentPeerWithStuckPosts(t *testing.T) {
	shortKeepAlives(t)
	f, devs, ms := fakeBridge(t, 2, 1, 64<<10, false)
	gate := make(chan struct{})
	t.Cleanup(func() { close(gate) }) // before the meshes close (cleanups run last first)
	lost := f.qpsOf(devs[1])
	f.mu.Lock()
	f.silent, f.stuckPosts = true, gate
	for _, q := range lost {
		q.errored = true // gone without a word
	}
	f.mu.Unlock()
	ctx, cancel := context.WithTimeout(context.Background(), 10*(verbsKeepAlive+verbsDeadAfter))
	defer cancel()
	t0 := time.Now()
	err := ms[0].Stream(1, 0).Recv(ctx, func(wire.Header, []byte) error { return nil })
	require.ErrorIs(t, err, ErrConnClosed)
	assert.Contains(t, err.Error(), "keep-alives unanswered")
	assert.Contains(t, err.Error(), "member 1 (rank 2 on host-b")
	assert.Less(t, time.Since(t0), 3*(verbsKeepAlive+verbsDeadAfter))
}

// A peer that is alive but sends nothing answers the keep-alives: a member
// waiting on it for many keep-alive periods is not fooled into taking it
// for dead; once it vanishes, it is.
func TestVerbsKeepAlivesTellAliveFromDead(t *testing.T) {
	shortKeepAlives(t)
	f, devs, ms := fakeBridge(t, 2, 1, 64<<10, false)
	f.mu.Lock()
	f.silent = true
	f.mu.Unlock()
	ctx, cancel := context.WithTimeout(context.Background(), 3*(verbsKeepAlive+verbsDeadAfter))
	defer cancel()
	t1 := time.Now()
	err := ms[0].Control(1).Recv(ctx, func(wire.Header, []byte) error { return nil })
	t.Logf("alive for %v", time.Since(t1))
	require.ErrorIs(t, err, context.DeadlineExceeded, "a live peer stays alive")
	for _, q := range f.qpsOf(devs[1]) {
		f.mu.Lock()
		q.errored = true
		f.mu.Unlock()
	}
	ctx, cancel = context.WithTimeout(context.Background(), testenv.Scale(20*time.Second))
	defer cancel()
	t0 := time.Now()
	err = ms[0].Control(1).Recv(ctx, func(wire.Header, []byte) error { return nil })
	require.ErrorIs(t, err, ErrConnClosed)
	assert.Contains(t, err.Error(), "keep-alives unanswered")
	t.Logf("found dead after %v", time.Since(t0))
}

// A peer that stops reading: the sender's credit runs out and its
// deadline names the peer; nothing overflows.
func TestVerbsStalledReaderHitsDeadline(t *testing.T) {
	f, _, ms := fakeBridge(t, 2, 1, 64<<10, false)
	out := ms[0].Stream(1, 0)
	ctx, cancel := context.WithTimeout(context.Background(), testenv.Scale(2*time.Second))
	defer cancel()
	var err error
	for i := 0; err == nil && i < 1000; i++ {
		err = out.Send(ctx, wire.Header{Kind: wire.KindData, Seq: uint64(i)}, make([]byte, 10<<10))
	}
	require.ErrorIs(t, err, context.DeadlineExceeded)
	assert.Contains(t, err.Error(), "send to member 1 (rank 2 on host-b")
	f.mu.Lock()
	assert.Zero(t, f.rnr)
	f.mu.Unlock()
}

// Abort reaches the peer with its message; Close reaches it as a close.
func TestVerbsAbortAndClose(t *testing.T) {
	_, _, ms := fakeBridge(t, 3, 1, 64<<10, false)
	ctx, cancel := context.WithTimeout(context.Background(), testenv.Scale(30*time.Second))
	defer cancel()
	ms[0].Abort(errors.New("reduce failed: out of memory"))
	err := ms[1].Control(0).Recv(ctx, func(wire.Header, []byte) error { return nil })
	require.ErrorContains(t, err, "member 0 (rank 0 on host-a")
	require.ErrorContains(t, err, "failed: reduce failed: out of memory")
	err = ms[1].Control(0).Send(ctx, wire.Header{Kind: wire.KindData}, nil)
	require.ErrorContains(t, err, "failed: reduce failed", "its sender learns too")
	err = ms[1].Stream(0, 0).Recv(ctx, func(wire.Header, []byte) error { return nil })
	require.ErrorContains(t, err, "failed: reduce failed", "every stream carries the abort")
	require.NoError(t, ms[2].Close())
	err = ms[1].Stream(2, 0).Recv(ctx, func(wire.Header, []byte) error { return nil })
	require.ErrorIs(t, err, ErrPeerClosed)
	// Calls on a closed mesh fail at once.
	require.ErrorIs(t, ms[0].Stream(1, 0).Send(ctx, wire.Header{Kind: wire.KindData}, nil), ErrClosed)
}

// A peer that writes more than its credit, or announces nonsense, is a
// protocol error naming it.
func TestVerbsProtocolErrorsNamePeer(t *testing.T) {
	for _, tc := range []struct {
		name string
		imm  uint32
		want string
	}{
		{"overrun", immData | uint32((34<<10)/64), "beyond its credit"},
		{"too long", immData | immValue, "announced"},
		{"ping on a data stream", immPing, "immediate value 0x80000000 on stream 0"},
		{"pong with a value", immPong | 3, "immediate value 0xc0000003"},
		{"credit beyond head", immCredit | 77, "credit up to"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			f, _, ms := fakeBridge(t, 2, 1, 64<<10, false)
			in := ms[1].links[0][0]
			if tc.name == "overrun" {
				in.mu.Lock()
				in.arrived = in.cap // the ring is full already
				in.mu.Unlock()
			}
			out := ms[0].links[1][0]
			f.mu.Lock()
			var q *fakeQP
			for _, x := range f.qps {
				if x.d.name == "fake0" && x.key == out.qp.(*fakeQP).key {
					q = x
				}
			}
			q.deliver(ibverbs.OpcodeRecvWriteImm, tc.imm, 0)
			f.mu.Unlock()
			ctx, cancel := context.WithTimeout(context.Background(), testenv.Scale(10*time.Second))
			defer cancel()
			err := in.Recv(ctx, func(wire.Header, []byte) error { return nil })
			require.ErrorContains(t, err, "member 0 (rank 0 on host-a")
			require.ErrorContains(t, err, "protocol error")
			require.ErrorContains(t, err, tc.want)
		})
	}
}

// A forged record (a ring key that is not the member's): the honest
// members' writes into the forger's ring are refused and every member's
// set-up fails with that cause, the honest ones' naming the forger, in
// both orders the forger's queue pairs can meet their writes.
func TestVerbsForgedRecordFailsSetup(t *testing.T) {
	for _, o := range forgedRaceOrders {
		t.Run(o.name, func(t *testing.T) {
			f := newFakeFabric()
			devs := []*fakeDev{f.dev("fake0"), f.dev("fake1"), f.dev("fake2")}
			b := newBridge(t, Verbs, 3, 2, false).set(func(c *Config) {
				c.verbsOpen = f.opener(devs)
				c.RingBytes = 64 << 10
				c.Timeout = testenv.Scale(20 * time.Second)
			})
			b.cfgs[2].verbsForge = func(e *verbsEndpoint) { e.RingKey ^= 0x5a5a }
			orderForgedRace(b, o.heldInRTR)
			_, errs := b.establish(t)
			checkForgedRace(t, errs, o.heldInRTR)
			for _, d := range devs {
				assert.True(t, d.closed, "%s freed", d.name)
			}
		})
	}
}

// forgedRaceOrders are the two orders in which the forger's control queue
// pairs can meet the honest members' first writes (issue 9: unloaded, the
// forger was ready to send first; under load, not yet).
var forgedRaceOrders = []struct {
	name      string
	heldInRTR bool
}{
	{"forger ready to send first", false},
	{"forger still ready to receive", true},
}

// orderForgedRace orders, for a bridge of 3 whose member 2 forges its
// ring key, the forger's control queue pairs' moves and the honest
// members' first writes to it. heldInRTR false: each honest member holds
// its first write until the forger's queue pair to it is ready to send.
// heldInRTR true: each honest member writes once the forger's queue pair
// to it is ready to receive, and the forger holds its move to
// ready-to-send until its device has refused both writes (which fails
// both queue pairs).
func orderForgedRace(b *bridge, heldInRTR bool) {
	const forger = 2
	ctl := b.cfgs[0].Streams + b.cfgs[0].P2PStreams
	var ready [forger]chan struct{} // the forger's queue pair to member i is where the order wants it
	for i := range ready {
		ready[i] = make(chan struct{})
	}
	var refused atomic.Int32
	allRefused := make(chan struct{})
	wait := func(ctx context.Context, ch chan struct{}) error {
		select {
		case <-ch:
			return nil
		case <-ctx.Done():
			return ctx.Err()
		}
	}
	for i := range b.cfgs {
		b.cfgs[i].verbsConnectStep = func(ctx context.Context, peer, st int, qp vQP, sending bool) error {
			switch {
			case st != ctl:
				return nil
			case i != forger && peer == forger && sending:
				return wait(ctx, ready[i])
			case i == forger && sending && !heldInRTR:
				close(ready[peer])
			case i == forger && !sending && heldInRTR:
				close(ready[peer])
				if err := awaitQPState(ctx, qp, ibverbs.QPError); err != nil {
					return err
				}
				if refused.Add(1) == forger {
					close(allRefused)
				}
				return wait(ctx, allRefused)
			}
			return nil
		}
	}
}

// awaitQPState polls qp until its device has it in state want.
func awaitQPState(ctx context.Context, qp vQP, want ibverbs.QPState) error {
	for {
		st, err := qp.state()
		if err != nil || st == want {
			return err
		}
		select {
		case <-ctx.Done():
			return ctx.Err()
		case <-time.After(time.Millisecond):
		}
	}
}

// checkForgedRace checks the errors of orderForgedRace's bridge: every
// member's says that a write into the forger's ring was refused, the
// honest members' name the forger, and the forger's own (when no other
// member's failure reached it first) says what its device did.
func checkForgedRace(t *testing.T, errs []error, heldInRTR bool) {
	t.Helper()
	for i, err := range errs {
		require.Error(t, err, "member %d", i)
		t.Logf("member %d: %v", i, err)
		assert.Contains(t, err.Error(), "refused a write into its receive ring", "member %d", i)
		if i != 2 {
			assert.Contains(t, err.Error(), "member 2 (rank 4 on host-c", "member %d", i)
		}
	}
	if re := (*rendezvous.RemoteError)(nil); !errors.As(errs[2], &re) {
		assert.ErrorIs(t, errs[2], ErrRingRefused)
		assert.Contains(t, errs[2].Error(), "this member's device refused a write into its receive ring")
		if heldInRTR {
			assert.ErrorIs(t, errs[2], ibverbs.ErrQPInError)
			assert.Regexp(t, `^bridge setup: connect its control queue pair with member [01] \(rank [02] on host-[ab], .*\): this member's device refused a write into its receive ring from that member before the control queue pair was ready to send`, errs[2].Error())
		}
	}
}

// Members must agree on the link layer; a bad record is refused.
func TestVerbsRecordsAgree(t *testing.T) {
	f := newFakeFabric()
	devs := []*fakeDev{f.dev("fake0"), f.dev("fake1")}
	b := newBridge(t, Verbs, 2, 1, false).set(func(c *Config) { c.verbsOpen = f.opener(devs) })
	b.cfgs[1].verbsForge = func(e *verbsEndpoint) { e.LinkLayer = "InfiniBand" }
	_, errs := b.establish(t)
	for _, err := range errs {
		require.ErrorContains(t, err, "the verbs transport needs one link layer: member 0 (rank 0 on host-a) uses fake0 port 1 (Ethernet), member 1 (rank 2 on host-b) uses fake1 port 1 (InfiniBand)")
	}
	b = newBridge(t, Verbs, 2, 1, false).set(func(c *Config) { c.verbsOpen = f.opener(devs) })
	b.cfgs[0].verbsForge = func(e *verbsEndpoint) { e.QPNs = "zz" }
	_, errs = b.establish(t)
	for _, err := range errs {
		require.ErrorContains(t, err, "member 0 (rank 0 on host-a) published a bad verbs endpoint record: 2 hex digits of queue pair numbers for 2 members")
	}
}

// Without an RDMA device (this machine's kernel has none), asking for
// verbs fails every member with the reason; nothing falls back to TCP.
func TestVerbsWithoutDevice(t *testing.T) {
	names, err := ibverbs.Devices()
	if err == nil && len(names) > 0 {
		t.Skip("this machine has RDMA devices: verbs_rxe_test.go runs on them")
	}
	b := newBridge(t, Verbs, 2, 1, false).set(func(c *Config) { c.Timeout = testenv.Scale(20 * time.Second) })
	_, errs := b.establish(t)
	for i, err := range errs {
		require.Error(t, err)
		msg := err.Error()
		assert.True(t, strings.Contains(msg, "libibverbs") || strings.Contains(msg, "RDMA"), "member %d: %s", i, msg)
		// Each finds the same; a slower one may read the other's failure.
		assert.True(t, strings.HasSuffix(msg, strings.TrimPrefix(errs[0].Error(), "bridge setup: ")) || strings.HasSuffix(errs[0].Error(), strings.TrimPrefix(msg, "bridge setup: ")),
			"member %d: %s; member 0: %s", i, msg, errs[0])
	}
}

func TestVerbsRecordCodec(t *testing.T) {
	var h wire.Header
	h.Kind, h.Seq, h.Step = wire.KindData, 5, 3
	h.Seal([]byte("abc"), true)
	b := make([]byte, 128)
	putVerbsRecord(b, verbsRecord{length: 128, flags: verbsRecFirst | verbsRecLast, seg: 3, seq: 9, hdr: h})
	r, err := parseVerbsRecord(b, 9)
	require.NoError(t, err)
	assert.Equal(t, h, r.hdr)
	assert.Equal(t, uint32(3), r.seg)
	for _, tc := range []struct {
		name string
		mod  func(b []byte) []byte
		seq  uint32
		want string
	}{
		{"wrong seq", func(b []byte) []byte { return b }, 8, "record 9 found where record 8 belongs"},
		{"length", func(b []byte) []byte { return b[:64] }, 9, "says 128 bytes, its announcement 64"},
		{"short", func(b []byte) []byte { return b[:10] }, 9, "a record of 10 bytes"},
		{"flags", func(b []byte) []byte { b[4] = 8; return b }, 9, "unknown flags"},
		{"segment", func(b []byte) []byte { b[8] = 100; return b }, 9, "holds a segment of 100"},
		{"reserved", func(b []byte) []byte { b[20] = 1; return b }, 9, "reserved"},
		{"wire header", func(b []byte) []byte { b[32] = 0; return b }, 9, "bad magic"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			c := append([]byte(nil), b...)
			_, err := parseVerbsRecord(tc.mod(c), tc.seq)
			assert.ErrorContains(t, err, tc.want)
		})
	}
}

// Sender and receiver place records by the same rule, so no skip needs
// marking; credit positions survive their 30-bit wrap.
func TestVerbsPlacementAndCredit(t *testing.T) {
	const cp = 4096
	var head, arrived uint64
	r := rand.New(rand.NewPCG(1, 2))
	for range 10000 {
		n := 64 * (1 + r.Uint64N(cp/2/64))
		pos, used := place(n, head, cp)
		a, next, err := arrive(n, arrived, head, cp, cp/2)
		require.NoError(t, err)
		require.Equal(t, pos, a.pos)
		require.LessOrEqual(t, pos%cp+n, uint64(cp), "records never wrap")
		head += used
		arrived = next
		require.Equal(t, head, arrived)
	}
	_, _, err := arrive(128, 4096, 0, cp, cp/2)
	assert.ErrorContains(t, err, "beyond its credit")
	_, _, err = arrive(3000, 0, 0, cp, cp/2)
	assert.ErrorContains(t, err, "announced")

	unit := uint64(immValue+1) * 64
	for _, tc := range []struct{ tail, pos, head uint64 }{
		{0, 640, 1 << 20},
		{unit - 64, unit + 128, unit + 4096},
		{5*unit + 64, 5*unit + 64, 5*unit + 64},
		{7*unit - 128, 7*unit + 64, 8 * unit},
	} {
		got, ok := creditPos(creditImm(tc.pos), tc.tail, tc.head)
		assert.True(t, ok)
		assert.Equal(t, tc.pos, got)
	}
	_, ok := creditPos(creditImm(4096), 0, 1024)
	assert.False(t, ok, "beyond what was written")
}

// The selftest's device step over the fake: the port as chosen, and the
// loopback write checked.
func TestVerbsCheckLoopback(t *testing.T) {
	f := newFakeFabric()
	rep, err := VerbsCheck(context.Background(), VerbsCheckOptions{open: func(ctx context.Context, c *Config) (verbsPort, vDev, error) {
		return f.opener([]*fakeDev{f.dev("fake0")})(ctx, c)
	}})
	require.NoError(t, err)
	assert.Equal(t, "fake0", rep.Device)
	assert.Equal(t, 1<<20, rep.LoopbackBytes)
	assert.Equal(t, "fake0 port 1 ACTIVE, Ethernet, active MTU 1024, RoCE v2 GID 1 ::ffff:10.0.0.1 on fake0 (the test's fake)", rep.Describe())
	f.mu.Lock()
	f.fault = func(*fakeQP, uint64, uint32, bool, int) fakeFault { return faultRemAccess }
	f.mu.Unlock()
	_, err = VerbsCheck(context.Background(), VerbsCheckOptions{open: func(ctx context.Context, c *Config) (verbsPort, vDev, error) {
		return f.opener([]*fakeDev{f.dev("fake1")})(ctx, c)
	}})
	require.ErrorContains(t, err, "loopback on fake1 port 1: queue pair 0: ")
}

// Which port and GID a member takes, from what libibverbs lists.
func TestPickVerbsPort(t *testing.T) {
	gid := func(idx int, ip string, typ ibverbs.GIDType) ibverbs.GIDEntry {
		var g ibverbs.GID
		copy(g[:], net.ParseIP(ip).To16())
		return ibverbs.GIDEntry{Index: idx, GID: g, Type: typ}
	}
	port := func(n int, ll ibverbs.LinkLayer, st ibverbs.PortState, gids ...ibverbs.GIDEntry) verbsPortInfo {
		return verbsPortInfo{Num: n, Attr: ibverbs.PortAttr{State: st, LinkLayer: ll, ActiveMTU: 5, LID: 7}, GIDs: gids}
	}
	roce := verbsDevInfo{Name: "mlx5_0", Ports: []verbsPortInfo{port(1, ibverbs.LinkEthernet, ibverbs.PortActive,
		gid(0, "fe80::1", ibverbs.GIDTypeRoCEv1), gid(1, "fe80::1", ibverbs.GIDTypeRoCEv2), gid(2, "::ffff:10.0.0.1", ibverbs.GIDTypeRoCEv1), gid(3, "::ffff:10.0.0.1", ibverbs.GIDTypeRoCEv2))}}
	roce2 := verbsDevInfo{Name: "mlx5_1", Ports: []verbsPortInfo{port(1, ibverbs.LinkEthernet, ibverbs.PortActive,
		gid(0, "fe80::2", ibverbs.GIDTypeRoCEv1), gid(1, "::ffff:10.1.0.1", ibverbs.GIDTypeRoCEv2))}}
	down := verbsDevInfo{Name: "mlx5_2", Ports: []verbsPortInfo{port(1, ibverbs.LinkEthernet, ibverbs.PortDown)}}
	ib := verbsDevInfo{Name: "mlx5_3", Ports: []verbsPortInfo{port(1, ibverbs.LinkInfiniBand, ibverbs.PortActive, gid(0, "fe80::3", ibverbs.GIDTypeIB))}}
	broken := verbsDevInfo{Name: "rxe9", Err: errors.New("no provider")}
	tests := []struct {
		name string
		devs []verbsDevInfo
		want verbsWant
		dev  string
		gid  int
		how  string
		err  string
	}{
		{"by the store's route", []verbsDevInfo{roce, roce2}, verbsWant{gidIndex: -1, ip: net.ParseIP("10.1.0.1"), ifname: "ens2"}, "mlx5_1", 1,
			"its GID has 10.1.0.1 of ens2, the interface that routes to the store", ""},
		{"RoCE v2 over v1", []verbsDevInfo{roce}, verbsWant{gidIndex: -1, ip: net.ParseIP("10.0.0.1")}, "mlx5_0", 3, "", ""},
		{"store on this host", []verbsDevInfo{broken, down, roce}, verbsWant{gidIndex: -1, ip: net.ParseIP("127.0.0.1")}, "mlx5_0", 3,
			"the first active port (the store is on this host)", ""},
		{"no RoCE GID with the address: InfiniBand", []verbsDevInfo{roce2, ib}, verbsWant{gidIndex: -1, ip: net.ParseIP("192.168.1.5"), ifname: "eth0"}, "mlx5_3", 0,
			"the first active InfiniBand port", ""},
		{"no RoCE GID with the address, no IB", []verbsDevInfo{roce2}, verbsWant{gidIndex: -1, ip: net.ParseIP("192.168.1.5"), ifname: "eth0"}, "", 0, "",
			"no active RDMA port has a GID with 192.168.1.5 (of eth0, the interface that routes to the store) and no InfiniBand port is active (have: mlx5_1 port 1 Ethernet ACTIVE): set GPUBRIDGE_IB_HCA (and GPUBRIDGE_IB_GID_INDEX), or GPUBRIDGE_IFNAME"},
		{"GPUBRIDGE_IB_HCA", []verbsDevInfo{roce, roce2}, verbsWant{hca: "mlx5_1", gidIndex: -1}, "mlx5_1", 1, "GPUBRIDGE_IB_HCA=mlx5_1", ""},
		{"GPUBRIDGE_IB_HCA with port and GID index", []verbsDevInfo{roce}, verbsWant{hca: "mlx5_0:1", gidIndex: 1}, "mlx5_0", 1,
			"GPUBRIDGE_IB_HCA=mlx5_0:1, GPUBRIDGE_IB_GID_INDEX=1", ""},
		{"unknown HCA", []verbsDevInfo{roce}, verbsWant{hca: "mlx9", gidIndex: -1}, "", 0, "", "GPUBRIDGE_IB_HCA=mlx9: no such RDMA device (have: mlx5_0 port 1 Ethernet ACTIVE)"},
		{"no such port", []verbsDevInfo{roce}, verbsWant{hca: "mlx5_0:2", gidIndex: -1}, "", 0, "", "GPUBRIDGE_IB_HCA=mlx5_0:2: mlx5_0 has no port 2"},
		{"port down", []verbsDevInfo{down}, verbsWant{hca: "mlx5_2:1", gidIndex: -1}, "", 0, "", "mlx5_2 port 1 is DOWN, not ACTIVE"},
		{"no such GID", []verbsDevInfo{roce}, verbsWant{hca: "mlx5_0", gidIndex: 9}, "", 0, "", "GPUBRIDGE_IB_GID_INDEX=9: mlx5_0 port 1 has no such GID"},
		{"broken device", []verbsDevInfo{broken}, verbsWant{hca: "rxe9", gidIndex: -1}, "", 0, "", "GPUBRIDGE_IB_HCA=rxe9: no provider"},
		{"none", nil, verbsWant{gidIndex: -1}, "", 0, "", "no RDMA device: libibverbs finds none"},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			p, err := pickVerbsPort(tc.devs, tc.want)
			if tc.err != "" {
				require.ErrorContains(t, err, tc.err)
				return
			}
			require.NoError(t, err)
			assert.Equal(t, tc.dev, p.dev)
			assert.Equal(t, tc.gid, p.gid.Index)
			if tc.how != "" {
				assert.Equal(t, tc.how, p.how)
			}
		})
	}
	t.Setenv(EnvIBGIDIndex, "x")
	_, err := verbsWantFromEnv()
	assert.ErrorContains(t, err, "GPUBRIDGE_IB_GID_INDEX=\"x\"")
	t.Setenv(EnvIBGIDIndex, "3")
	t.Setenv(EnvIBHCA, " mlx5_0:1 ")
	w, err := verbsWantFromEnv()
	require.NoError(t, err)
	assert.Equal(t, verbsWant{hca: "mlx5_0:1", gidIndex: 3}, w)
}

// A sender that keeps finishing its waits does not hide a receiver that
// waits on the same stream: the silent peer is still found.
func TestVerbsBusySenderDoesNotHideAWaitingReceiver(t *testing.T) {
	shortKeepAlives(t)
	f, devs, ms := fakeBridge(t, 2, 1, 1<<20, false)
	f.mu.Lock()
	f.silent = true
	for _, q := range f.qps {
		if q.d == devs[1] {
			q.errored = true
		}
	}
	f.mu.Unlock()
	ctx, cancel := context.WithTimeout(context.Background(), testenv.Scale(30*time.Second))
	defer cancel()
	st := ms[0].Stream(1, 0)
	stop := make(chan struct{})
	done := make(chan struct{})
	go func() {
		defer close(done)
		for {
			select {
			case <-stop:
				return
			default:
			}
			// Small frames through staging: each Send waits briefly and
			// returns (the fake holds nothing for the staging ring's sake).
			if st.Send(ctx, wire.Header{Kind: wire.KindData}, []byte("x")) != nil {
				return
			}
			time.Sleep(time.Millisecond)
		}
	}()
	err := st.Recv(ctx, func(wire.Header, []byte) error { return nil })
	close(stop)
	<-done
	require.ErrorIs(t, err, ErrConnClosed)
	assert.Contains(t, err.Error(), "keep-alives unanswered")
}
