package collective

import (
	"context"
	"errors"
	"fmt"
	"math/rand/v2"
	"slices"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/gpubridge/gpubridge/lib/reduce"
	"github.com/gpubridge/gpubridge/lib/testenv"
	"github.com/gpubridge/gpubridge/lib/transport"
)

// smallDirect makes every buffer take the direct path and cuts it into
// small pieces, for the duration of the test.
func smallDirect(t *testing.T) {
	oldMin, oldMin2, oldPiece := directMin, directMin2, pieceMin
	directMin, directMin2, pieceMin = 1, 1, 128
	t.Cleanup(func() { directMin, directMin2, pieceMin = oldMin, oldMin2, oldPiece })
}

// directModes are the direct all_reduce's two modes: copying (peers'
// memory read-only) and writing through (transport.Config.PeerWrite on
// every member), with the algorithm each reports.
var directModes = []struct {
	name  string
	write bool
	algo  string
}{{"copy", false, AlgoDirect}, {"write", true, AlgoDirectWrite}}

// newDirectCluster is newCluster over in-memory meshes that map peers
// writable when write is set.
func newDirectCluster(t testing.TB, n, streams int, o Options, write bool) *cluster {
	t.Helper()
	meshes := transport.NewMemWith(n, transport.MemOptions{Streams: streams, CRC: true, PeerWrite: write})
	return newClusterMesh(t, meshes, o, DefaultMaxUnexpected)
}

// shared returns a copy of in that member m's mesh shares with its peers
// (withdrawn at the end of the test).
func shared(t *testing.T, cl *cluster, m int, in []byte) []byte {
	t.Helper()
	// A larger region, so that the buffer starts at an offset in it.
	region := make([]byte, len(in)+256)
	buf := region[128 : 128+len(in)]
	copy(buf, in)
	sh := cl.meshes[m].(transport.Sharer)
	id, err := sh.Share(-1, region)
	require.NoError(t, err)
	t.Cleanup(func() { sh.Unshare(id) })
	return buf
}

// The direct all-reduce gives ReferenceAllReduce's bits for every dtype
// and op, on 2 to 5 members, ragged sizes, one or several streams, copying
// or writing through, and reports every result range once, final when
// reported.
func TestDirectAllReduce(t *testing.T) {
	smallDirect(t)
	for _, mode := range directModes {
		for _, cfg := range []struct{ members, streams int }{{2, 1}, {2, 3}, {3, 2}, {4, 4}, {5, 1}} {
			t.Run(fmt.Sprintf("%s/members=%d/streams=%d", mode.name, cfg.members, cfg.streams), func(t *testing.T) {
				testDirectAllReduce(t, cfg.members, cfg.streams, mode.write, mode.algo)
			})
		}
	}
}

func testDirectAllReduce(t *testing.T, members, streams int, write bool, algo string) {
	cl := newDirectCluster(t, members, streams, Options{SmallBytes: -1, ChunkBytes: testChunk, Workers: 3}, write)
	rng := rand.New(rand.NewPCG(11, uint64(members)))
	for _, dt := range reduce.AllDTypes() {
		for _, op := range supportedOps(dt) {
			for _, n := range testSizes(dt.Size(), members)[1:] {
				inputs := make([][]byte, members)
				for m := range inputs {
					inputs[m] = randData(rng, dt, n)
				}
				want := ReferenceAllReduceAlgo(algo, op, dt, inputs, members)
				bufs := make([][]byte, members)
				recs := make([]*doneRecorder, members)
				for m := range bufs {
					bufs[m] = shared(t, cl, m, inputs[m])
					recs[m] = &doneRecorder{buf: bufs[m]}
				}
				requireNoErrors(t, cl.each(func(m int, c *Comm) error {
					return c.AllReduce(context.Background(), bufs[m], dt, op, &Progress{Done: recs[m].done})
				}))
				for m := range bufs {
					what := fmt.Sprintf("%s %s, %d elements, member %d", dt, op, n, m)
					requireBits(t, want, bufs[m], dt.Size(), "%s", what)
					recs[m].check(t, want, what)
					require.Equal(t, algo, cl.comms[m].Algorithm(), what)
				}
			}
		}
	}
}

// A large buffer (avg) with the default piece sizes and several workers,
// in both modes.
func TestDirectAllReduceLarge(t *testing.T) {
	for _, mode := range directModes {
		for _, members := range []int{2, 3} {
			t.Run(fmt.Sprintf("%s/members=%d", mode.name, members), func(t *testing.T) {
				testDirectAllReduceLarge(t, members, mode.write, mode.algo)
			})
		}
	}
}

func testDirectAllReduceLarge(t *testing.T, members int, write bool, algo string) {
	cl := newDirectCluster(t, members, 4, Options{ChunkBytes: 1 << 20, Workers: 4}, write)
	rng := rand.New(rand.NewPCG(12, uint64(members)))
	const n = 3<<20 + 12345
	inputs := make([][]byte, members)
	bufs := make([][]byte, members)
	for m := range inputs {
		inputs[m] = randData(rng, reduce.BFloat16, n)
		bufs[m] = shared(t, cl, m, inputs[m])
	}
	want := ReferenceAllReduce(reduce.Avg, reduce.BFloat16, inputs, members)
	requireNoErrors(t, cl.each(func(m int, c *Comm) error {
		return c.AllReduce(context.Background(), bufs[m], reduce.BFloat16, reduce.Avg, nil)
	}))
	for m := range bufs {
		requireBits(t, want, bufs[m], 2, "member %d", m)
		assert.Equal(t, algo, cl.comms[m].Algorithm())
	}
}

// With Options.StreamBytes at 1 every copy of a direct collective whose
// piece is large enough streams (lib/ntcopy), as does every write of a
// result into the members' buffers when writing through: all_reduce still
// gives ReferenceAllReduce's bits for every dtype and op (specials
// included), and all_gather its members' inputs, on 2 and 3 members,
// ragged sizes; the same calls with streaming off give the same bytes.
func TestDirectStreamed(t *testing.T) {
	smallDirect(t)
	pieceMin = 8 << 10 // pieces past ntcopy's least streamed copy
	for _, mode := range directModes {
		for _, members := range []int{2, 3} {
			for _, stream := range []int{1, -1} {
				t.Run(fmt.Sprintf("%s/members=%d/stream=%d", mode.name, members, stream), func(t *testing.T) {
					cl := newDirectCluster(t, members, 2, Options{SmallBytes: -1, ChunkBytes: 16 << 10, Workers: 2, StreamBytes: stream}, mode.write)
					testDirectStreamed(t, cl, mode.algo)
				})
			}
		}
	}
}

func testDirectStreamed(t *testing.T, cl *cluster, algo string) {
	members := len(cl.comms)
	rng := rand.New(rand.NewPCG(17, uint64(members)))
	for _, dt := range reduce.AllDTypes() {
		for _, op := range supportedOps(dt) {
			n := (5*members*(8<<10) + 4093) / dt.Size()
			inputs := make([][]byte, members)
			bufs := make([][]byte, members)
			for m := range inputs {
				inputs[m] = randData(rng, dt, n)
				bufs[m] = shared(t, cl, m, inputs[m])
			}
			want := ReferenceAllReduceAlgo(algo, op, dt, inputs, members)
			requireNoErrors(t, cl.each(func(m int, c *Comm) error {
				return c.AllReduce(context.Background(), bufs[m], dt, op, nil)
			}))
			for m := range bufs {
				requireBits(t, want, bufs[m], dt.Size(), "%s %s, member %d", dt, op, m)
				require.Equal(t, algo, cl.comms[m].Algorithm())
			}
		}
	}
	if algo == AlgoDirectWrite {
		return // all_gather has one mode
	}
	const L = 3*(8<<10) + 4093
	var want []byte
	outs, ins := make([][]byte, members), make([][]byte, members)
	for m := range outs {
		in := randBytes(rng, L)
		want = append(want, in...)
		ins[m] = shared(t, cl, m, in)
		outs[m] = make([]byte, members*L)
		garbage(outs[m])
	}
	requireNoErrors(t, cl.each(func(m int, c *Comm) error {
		return c.AllGather(context.Background(), outs[m], ins[m], nil)
	}))
	for m := range outs {
		requireBits(t, want, outs[m], 1, "all_gather, member %d", m)
		require.Equal(t, AlgoDirect, cl.comms[m].Algorithm())
	}
}

// Options.StreamBytes: 0 is the default, negative is off, anything else
// the threshold; ntcopy runs from it on.
func TestStreamBytesOption(t *testing.T) {
	for _, c := range []struct{ in, want int }{{0, DefaultStreamBytes}, {-1, -1}, {-7, -1}, {1, 1}, {5 << 20, 5 << 20}} {
		cl := newCluster(t, 2, 1, Options{StreamBytes: c.in})
		assert.Equal(t, c.want, cl.comms[0].stream, "StreamBytes %d", c.in)
	}
}

// When any member's buffer is not shared, every member runs the usual
// algorithm, with the same bits, whether or not the meshes let peers
// write.
func TestDirectFallback(t *testing.T) {
	smallDirect(t)
	for _, mode := range directModes {
		for _, members := range []int{2, 3} {
			t.Run(fmt.Sprintf("%s/members=%d", mode.name, members), func(t *testing.T) {
				testDirectFallback(t, newDirectCluster(t, members, 2, Options{SmallBytes: -1, ChunkBytes: testChunk}, mode.write))
			})
		}
	}
}

func testDirectFallback(t *testing.T, cl *cluster) {
	members := len(cl.comms)
	rng := rand.New(rand.NewPCG(13, uint64(members)))
	inputs := make([][]byte, members)
	bufs := make([][]byte, members)
	for m := range inputs {
		inputs[m] = randData(rng, reduce.Float32, 3001)
		if m == members-1 {
			bufs[m] = slices.Clone(inputs[m]) // not shared
		} else {
			bufs[m] = shared(t, cl, m, inputs[m])
		}
	}
	want := ReferenceAllReduceAlgo(AlgoDirect, reduce.Sum, reduce.Float32, inputs, members)
	requireNoErrors(t, cl.each(func(m int, c *Comm) error {
		return c.AllReduce(context.Background(), bufs[m], reduce.Float32, reduce.Sum, nil)
	}))
	algo := AlgoExchange
	if members > 2 {
		algo = AlgoRing
	}
	for m := range bufs {
		requireBits(t, want, bufs[m], 4, "member %d", m)
		assert.Equal(t, algo, cl.comms[m].Algorithm())
	}
}

// Streamed input: a member reads no byte of a peer (or of itself) before
// that member's Ready granted it, and writing through, writes no result
// there before (the gate would overwrite it). Every input starts as
// garbage; members mix streamed and whole inputs.
func TestDirectReady(t *testing.T) {
	smallDirect(t)
	for _, mode := range directModes {
		for _, cfg := range []struct{ members, streams int }{{2, 1}, {2, 4}, {3, 2}, {4, 3}} {
			t.Run(fmt.Sprintf("%s/members=%d/streams=%d", mode.name, cfg.members, cfg.streams), func(t *testing.T) {
				testDirectReady(t, cfg.members, cfg.streams, mode.write, mode.algo)
			})
		}
	}
}

func testDirectReady(t *testing.T, members, streams int, write bool, algo string) {
	const pause = 200 * time.Microsecond
	cl := newDirectCluster(t, members, streams, Options{SmallBytes: -1, ChunkBytes: testChunk}, write)
	rng := rand.New(rand.NewPCG(14, uint64(members)))
	const n = 3001
	inputs := make([][]byte, members)
	for m := range inputs {
		inputs[m] = randData(rng, reduce.Float32, n)
	}
	t.Run("all_reduce", func(t *testing.T) {
		want := ReferenceAllReduceAlgo(AlgoDirect, reduce.Sum, reduce.Float32, inputs, members)
		bufs := make([][]byte, members)
		for m := range bufs {
			bufs[m] = shared(t, cl, m, make([]byte, len(inputs[m])))
			garbage(bufs[m])
		}
		requireNoErrors(t, cl.each(func(m int, c *Comm) error {
			rec := &doneRecorder{buf: bufs[m]}
			p := &Progress{Done: rec.done}
			if m != 1 {
				g := newReadyGate(t, len(bufs[m]))
				go g.release(bufs[m], inputs[m], 1000, pause)
				p.Ready = g.ready
			} else {
				copy(bufs[m], inputs[m])
			}
			err := c.AllReduce(context.Background(), bufs[m], reduce.Float32, reduce.Sum, p)
			rec.check(t, want, fmt.Sprint("member ", m))
			return err
		}))
		for m := range bufs {
			requireBits(t, want, bufs[m], 4, "member %d", m)
			assert.Equal(t, algo, cl.comms[m].Algorithm())
		}
	})
	if write {
		return // all_gather has one mode
	}
	t.Run("all_gather", func(t *testing.T) {
		var want []byte
		for _, in := range inputs {
			want = append(want, in...)
		}
		outs := make([][]byte, members)
		for m := range outs {
			outs[m] = shared(t, cl, m, make([]byte, members*len(inputs[m])))
			garbage(outs[m])
		}
		requireNoErrors(t, cl.each(func(m int, c *Comm) error {
			L := len(inputs[m])
			in := outs[m][m*L : (m+1)*L]
			rec := &doneRecorder{buf: outs[m]}
			g := newReadyGate(t, L)
			go g.release(in, inputs[m], 1000, pause)
			err := c.AllGather(context.Background(), outs[m], in, &Progress{Ready: g.ready, Done: rec.done})
			rec.check(t, want, fmt.Sprint("member ", m))
			return err
		}))
		for m := range outs {
			requireBits(t, want, outs[m], 1, "member %d", m)
			assert.Equal(t, AlgoDirect, cl.comms[m].Algorithm())
		}
	})
}

// The direct all-gather, with the input apart from the output and as its
// own slot, odd sizes.
func TestDirectAllGather(t *testing.T) {
	smallDirect(t)
	for _, members := range []int{2, 3, 4} {
		t.Run(fmt.Sprint("members=", members), func(t *testing.T) {
			cl := newCluster(t, members, 3, Options{SmallBytes: -1, ChunkBytes: testChunk})
			rng := rand.New(rand.NewPCG(15, uint64(members)))
			for _, L := range []int{1, 7, 4093, 70001} {
				for _, alias := range []bool{false, true} {
					inputs := make([][]byte, members)
					var want []byte
					for m := range inputs {
						inputs[m] = randBytes(rng, L)
						want = append(want, inputs[m]...)
					}
					outs := make([][]byte, members)
					ins := make([][]byte, members)
					for m := range outs {
						outs[m] = make([]byte, members*L)
						garbage(outs[m])
						if alias {
							outs[m] = shared(t, cl, m, outs[m])
							ins[m] = outs[m][m*L : (m+1)*L]
							copy(ins[m], inputs[m])
						} else {
							ins[m] = shared(t, cl, m, inputs[m])
						}
					}
					requireNoErrors(t, cl.each(func(m int, c *Comm) error {
						return c.AllGather(context.Background(), outs[m], ins[m], nil)
					}))
					for m := range outs {
						requireBits(t, want, outs[m], 1, "%d bytes, alias %v, member %d", L, alias, m)
						assert.Equal(t, AlgoDirect, cl.comms[m].Algorithm())
					}
				}
			}
		})
	}
}

// A member that fails in the middle of a direct all-reduce (its Ready
// fails after part of its input went out): every member fails, naming it,
// and the communicators are broken; nothing is left running (goleak). In
// both modes.
func TestDirectPeerFails(t *testing.T) {
	smallDirect(t)
	for _, mode := range directModes {
		for _, members := range []int{2, 3} {
			t.Run(fmt.Sprintf("%s/members=%d", mode.name, members), func(t *testing.T) {
				testDirectPeerFails(t, members, mode.write)
			})
		}
	}
}

func testDirectPeerFails(t *testing.T, members int, write bool) {
	cl := newDirectCluster(t, members, 2, Options{SmallBytes: -1, ChunkBytes: testChunk, Timeout: testenv.Scale(20 * time.Second)}, write)
	const L = 64 << 10
	bufs := make([][]byte, members)
	for m := range bufs {
		bufs[m] = shared(t, cl, m, make([]byte, L))
	}
	errs := cl.each(func(m int, c *Comm) error {
		var p *Progress
		if m == 1 {
			p = &Progress{Ready: func(_ context.Context, end int) error {
				if end > L/2 {
					return errors.New("the GPU copy failed")
				}
				return nil
			}}
		}
		return c.AllReduce(context.Background(), bufs[m], reduce.Float32, reduce.Sum, p)
	})
	require.ErrorContains(t, errs[1], "input not ready: the GPU copy failed")
	for m, err := range errs {
		if m == 1 {
			continue
		}
		require.ErrorContains(t, err, "member 1", "member %d", m)
		require.ErrorContains(t, err, "the GPU copy failed", "member %d", m)
	}
	for _, c := range cl.comms {
		assert.ErrorIs(t, c.AllReduce(context.Background(), make([]byte, 4), reduce.Float32, reduce.Sum, nil), ErrBroken)
	}
}

// A member whose input stops coming in the middle of a direct all-reduce
// (it never announces the rest of its pieces): it times out on its input,
// and the other learns that from it. In both modes.
func TestDirectStalledPeer(t *testing.T) {
	smallDirect(t)
	for _, mode := range directModes {
		t.Run(mode.name, func(t *testing.T) { testDirectStalledPeer(t, mode.write) })
	}
}

func testDirectStalledPeer(t *testing.T, write bool) {
	cl := newDirectCluster(t, 2, 2, Options{SmallBytes: -1, ChunkBytes: testChunk, Timeout: testenv.Scale(2 * time.Second)}, write)
	const L = 64 << 10
	bufs := [][]byte{shared(t, cl, 0, make([]byte, L)), shared(t, cl, 1, make([]byte, L))}
	stall := make(chan struct{})
	defer close(stall)
	errs := cl.each(func(m int, c *Comm) error {
		var p *Progress
		if m == 1 {
			p = &Progress{Ready: func(ctx context.Context, end int) error {
				if end > L/2 {
					select {
					case <-stall:
					case <-ctx.Done():
						return ctx.Err()
					}
				}
				return nil
			}}
		}
		return c.AllReduce(context.Background(), bufs[m], reduce.Float32, reduce.Sum, p)
	})
	require.ErrorContains(t, errs[1], "timed out after")
	require.ErrorContains(t, errs[1], "waiting for the input to become ready")
	require.ErrorContains(t, errs[0], "member 1: failed: all_reduce #1")
}

// The chain of three or more operands folds in order, with dst any one of
// them, over any number of workers.
func TestChainParallel(t *testing.T) {
	rng := rand.New(rand.NewPCG(16, 17))
	for _, n := range []int{3, 4, 6} {
		for _, L := range []int{4, 64, 4096 + 12, 300 << 10} {
			srcs := make([][]byte, n)
			for i := range srcs {
				srcs[i] = randData(rng, reduce.Float16, L/2)
			}
			want, err := reduce.Reference(reduce.Sum, reduce.Float16, srcs)
			require.NoError(t, err)
			for _, w := range []int{1, 3} {
				for at := range n {
					ops := make([][]byte, n)
					for i := range ops {
						ops[i] = slices.Clone(srcs[i])
					}
					require.NoError(t, chainParallel(reduce.Sum, reduce.Float16, ops[at], ops, w))
					requireBits(t, want, ops[at], 2, "%d operands of %d bytes, dst = operand %d, %d workers", n, L, at, w)
				}
			}
		}
	}
}
