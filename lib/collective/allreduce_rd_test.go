package collective

import (
	"context"
	"fmt"
	"math/rand/v2"
	"slices"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/gpubridge/gpubridge/lib/codec"
	"github.com/gpubridge/gpubridge/lib/reduce"
	"github.com/gpubridge/gpubridge/lib/testenv"
	"github.com/gpubridge/gpubridge/lib/transport"
	"github.com/gpubridge/gpubridge/lib/wire"
)

// rdSmall is the SmallBytes of the recursive-doubling tests: two chunks,
// so that buffers at the threshold travel in several chunks and streams.
const rdSmall = 2 * testChunk

// rdSizes are byte counts around rdSmall for elements of es bytes: one
// element, a ragged few, the largest below and at the threshold (recursive
// doubling), the smallest above it (the ring).
func rdSizes(es int) []int {
	at := rdSmall / es * es
	return []int{es, 7 * es, at - es, at, at + es}
}

// runAllReduce runs one all_reduce of inputs on every member of cl and
// checks that every member ends with want's bits, ran algo, and reported
// every result range once.
func runAllReduce(t *testing.T, cl *cluster, dt reduce.DType, op reduce.Op, cd Codec, inputs [][]byte, want []byte, algo, what string) {
	t.Helper()
	bufs := make([][]byte, len(inputs))
	recs := make([]*doneRecorder, len(inputs))
	requireNoErrors(t, cl.each(func(m int, c *Comm) error {
		bufs[m] = slices.Clone(inputs[m])
		recs[m] = &doneRecorder{buf: bufs[m]}
		return c.AllReduceCodec(context.Background(), bufs[m], dt, op, cd, &Progress{Done: recs[m].done})
	}))
	for m := range bufs {
		requireBits(t, want, bufs[m], dt.Size(), "%s, member %d", what, m)
		recs[m].check(t, want, fmt.Sprintf("%s, member %d", what, m))
		require.Equal(t, algo, cl.comms[m].Algorithm(), "%s, member %d", what, m)
	}
}

// Recursive doubling on 2 to 9 members (powers of two and folds of 1 to 3
// extra members), every dtype and op, sizes across SmallBytes: every member
// holds the bits of ReferenceAllReduceAlgo of the algorithm that ran, which
// is ReferenceAllReduce's for a Comm of the default SmallBytes.
func TestRecursiveDoubling(t *testing.T) {
	for members := 2; members <= 9; members++ {
		t.Run(fmt.Sprint("members=", members), func(t *testing.T) {
			streams := 1 + members%3
			cl := newCluster(t, members, streams, Options{ChunkBytes: testChunk, Workers: 2, SmallBytes: rdSmall})
			rng := rand.New(rand.NewPCG(91, uint64(members)))
			for _, dt := range reduce.AllDTypes() {
				for i, L := range rdSizes(dt.Size()) {
					algo := exactAlgo(members, L, rdSmall)
					if members > 2 {
						require.Equal(t, map[bool]string{true: AlgoRecursiveDoubling, false: AlgoRing}[L <= rdSmall], algo)
					}
					// Every op at the threshold, one op per size else.
					ops := supportedOps(dt)
					if L != rdSmall/dt.Size()*dt.Size() {
						ops = ops[i%len(ops) : i%len(ops)+1]
					}
					for _, op := range ops {
						inputs := make([][]byte, members)
						for m := range inputs {
							inputs[m] = randData(rng, dt, L/dt.Size())
						}
						want := ReferenceAllReduceAlgo(algo, op, dt, inputs, members)
						require.Equal(t, want, wantAllReduce(cl.comms[0], op, dt, inputs))
						runAllReduce(t, cl, dt, op, Codec{}, inputs, want, algo, fmt.Sprintf("%s %s, %d bytes", dt, op, L))
					}
				}
			}
		})
	}
}

// ReferenceAllReduce follows the default SmallBytes; recursive doubling's
// order differs from the ring's (float sums), and with two members it is
// the exchange's.
func TestReferenceAllReduceAlgo(t *testing.T) {
	rng := rand.New(rand.NewPCG(92, 1))
	for _, members := range []int{2, 3, 5, 8} {
		inputs := make([][]byte, members)
		for m := range inputs {
			inputs[m] = randData(rng, reduce.Float32, 4096)
		}
		rd := ReferenceAllReduceAlgo(AlgoRecursiveDoubling, reduce.Sum, reduce.Float32, inputs, members)
		ring := ReferenceAllReduceAlgo(AlgoRing, reduce.Sum, reduce.Float32, inputs, members)
		assert.Equal(t, rd, ReferenceAllReduce(reduce.Sum, reduce.Float32, inputs, members), "%d members: 16 KiB is small", members)
		if members == 2 {
			assert.Equal(t, ReferenceAllReduceAlgo(AlgoExchange, reduce.Sum, reduce.Float32, inputs, 2), rd)
			continue
		}
		assert.NotEqual(t, rd, ring, "%d members: the orders differ", members)
		big := make([][]byte, members)
		for m := range big {
			big[m] = randData(rng, reduce.Float32, DefaultSmallBytes/4+1)
		}
		assert.Equal(t, ReferenceAllReduceAlgo(AlgoRing, reduce.Sum, reduce.Float32, big, members), ReferenceAllReduce(reduce.Sum, reduce.Float32, big, members))
	}
	// Integers do not depend on the order.
	ints := [][]byte{randData(rng, reduce.Int32, 99), randData(rng, reduce.Int32, 99), randData(rng, reduce.Int32, 99)}
	assert.Equal(t, ReferenceAllReduceAlgo(AlgoRing, reduce.Sum, reduce.Int32, ints, 3), ReferenceAllReduceAlgo(AlgoRecursiveDoubling, reduce.Sum, reduce.Int32, ints, 3))
	assert.Panics(t, func() { ReferenceAllReduceAlgo("tree", reduce.Sum, reduce.Int32, ints, 3) })
	assert.Panics(t, func() { ReferenceAllReduceAlgo(AlgoExchange, reduce.Sum, reduce.Int32, ints, 3) })
}

// Options.SmallBytes: 0 is the default, negative is off, and a value at or
// above the size takes recursive doubling; the threshold is in bytes per
// member, inclusive.
func TestSmallBytesOption(t *testing.T) {
	for _, tt := range []struct {
		small, size int
		want        string
	}{
		{0, DefaultSmallBytes, AlgoRecursiveDoubling},
		{0, DefaultSmallBytes + 4, AlgoRing},
		{-1, 4, AlgoRing},
		{64, 64, AlgoRecursiveDoubling},
		{64, 68, AlgoRing},
	} {
		cl := newCluster(t, 3, 1, Options{SmallBytes: tt.small})
		assert.Equal(t, tt.want, cl.comms[0].AllReduceOrder(tt.size), "SmallBytes %d, %d bytes", tt.small, tt.size)
		assert.Equal(t, AlgoExchange, newCluster(t, 2, 1, Options{SmallBytes: tt.small}).comms[0].AllReduceOrder(tt.size))
	}
}

// Over real TCP (frames in pieces) and shared memory, recursive doubling of
// 3 to 5 members gives the reference's bits, raw and zstd (which takes it
// too); a lossy codec never takes it; a shared buffer below SmallBytes
// takes it rather than the direct path.
func TestRecursiveDoublingRealMeshes(t *testing.T) {
	for _, kind := range []transport.Kind{transport.TCP, transport.SHM} {
		for _, members := range []int{3, 4, 5} {
			t.Run(fmt.Sprintf("%s/members=%d", kind, members), func(t *testing.T) {
				cl := newClusterMesh(t, realMeshes(t, kind, members, 2), Options{ChunkBytes: testChunk, SmallBytes: rdSmall, Timeout: testenv.Scale(30 * time.Second)}, DefaultMaxUnexpected)
				rng := rand.New(rand.NewPCG(93, uint64(members)))
				for _, c := range []struct {
					dt reduce.DType
					op reduce.Op
					cd Codec
					L  int
				}{
					{reduce.Float32, reduce.Sum, Codec{}, rdSmall},
					{reduce.BFloat16, reduce.Avg, Codec{}, 6},
					{reduce.Float16, reduce.Max, Codec{}, rdSmall - 2},
					{reduce.Int64, reduce.Prod, Codec{ID: codec.Zstd}, rdSmall},
					{reduce.Float64, reduce.Sum, Codec{ID: codec.Zstd}, 8},
					{reduce.Float32, reduce.Sum, Codec{}, rdSmall + 4},
				} {
					inputs := make([][]byte, members)
					for m := range inputs {
						inputs[m] = randData(rng, c.dt, c.L/c.dt.Size())
					}
					algo := cl.comms[0].AllReduceOrder(c.L)
					want := ReferenceAllReduceAlgo(algo, c.op, c.dt, inputs, members)
					runAllReduce(t, cl, c.dt, c.op, c.cd, inputs, want, algo, fmt.Sprintf("%s %s %s, %d bytes", c.dt, c.op, c.cd.ID, c.L))
				}
				// A lossy codec runs its own ring at every size.
				inputs := make([][]byte, members)
				for m := range inputs {
					inputs[m] = randData(rng, reduce.Float32, 256)
				}
				want, _ := ReferenceAllReduceCodec(codec.BF16, reduce.Sum, reduce.Float32, inputs, nil, members)
				runAllReduce(t, cl, reduce.Float32, reduce.Sum, Codec{ID: codec.BF16}, inputs, want, AlgoRing, "bf16")
			})
		}
	}
}

// A streamed input (Progress.Ready) is read as it becomes ready, and the
// result reported once final, on members that fold and those that do not.
func TestRecursiveDoublingReady(t *testing.T) {
	for _, members := range []int{3, 4, 6} {
		t.Run(fmt.Sprint("members=", members), func(t *testing.T) {
			cl := newCluster(t, members, 2, Options{ChunkBytes: testChunk, SmallBytes: rdSmall})
			rng := rand.New(rand.NewPCG(94, uint64(members)))
			inputs := make([][]byte, members)
			for m := range inputs {
				inputs[m] = randData(rng, reduce.Float32, rdSmall/4-3)
			}
			want := ReferenceAllReduceAlgo(AlgoRecursiveDoubling, reduce.Sum, reduce.Float32, inputs, members)
			runReady(t, cl, inputs, want, 300, AlgoRecursiveDoubling)
		})
	}
}

// runReady runs a float32 sum all_reduce of inputs on cl with every
// member's input released piece bytes at a time through Progress.Ready
// (into a buffer of garbage until then), and checks the result against
// want, the ranges reported done, and the algorithm that ran.
func runReady(t *testing.T, cl *cluster, inputs [][]byte, want []byte, piece int, algo string) {
	t.Helper()
	bufs := make([][]byte, len(inputs))
	recs := make([]*doneRecorder, len(inputs))
	gates := make([]*readyGate, len(inputs))
	for m := range bufs {
		bufs[m] = make([]byte, len(inputs[m]))
		garbage(bufs[m])
		recs[m] = &doneRecorder{buf: bufs[m]}
		gates[m] = newReadyGate(t, len(bufs[m]))
		go gates[m].release(bufs[m], inputs[m], piece, 100*time.Microsecond)
	}
	requireNoErrors(t, cl.each(func(m int, c *Comm) error {
		return c.AllReduce(context.Background(), bufs[m], reduce.Float32, reduce.Sum, &Progress{Ready: gates[m].ready, Done: recs[m].done})
	}))
	for m := range bufs {
		requireBits(t, want, bufs[m], 4, "member %d", m)
		recs[m].check(t, want, fmt.Sprintf("member %d", m))
		assert.Equal(t, algo, cl.comms[m].Algorithm(), "member %d", m)
	}
}

// Members whose SmallBytes differ fail at once, every one with a message
// that names the option; with two members SmallBytes is not compared (the
// exchange does not depend on it).
func TestSmallBytesMismatch(t *testing.T) {
	timeout := testenv.Scale(10 * time.Second)
	meshes := transport.NewMem(3, 2, false)
	cl := &cluster{meshes: meshes}
	for m, mesh := range meshes {
		cl.comms = append(cl.comms, newComm(mesh, Options{ChunkBytes: testChunk, Timeout: timeout, SmallBytes: []int{0, 0, 64 << 10}[m]}, DefaultMaxUnexpected))
	}
	t.Cleanup(cl.close)
	start := time.Now()
	errs := cl.each(func(m int, c *Comm) error {
		// 48 KiB: recursive doubling on member 2 only.
		return c.AllReduce(context.Background(), make([]byte, 48<<10), reduce.Float32, reduce.Sum, nil)
	})
	assert.Less(t, time.Since(start), timeout/2, "a mismatch must not wait for the timeout")
	for m, err := range errs {
		require.Error(t, err, "member %d", m)
		t.Logf("member %d: %v", m, err)
		assert.ErrorContains(t, err, "SmallBytes", "member %d", m)
	}

	two := newClusterMesh(t, transport.NewMem(2, 1, false), Options{}, DefaultMaxUnexpected)
	two.comms[1].small = -1
	requireNoErrors(t, two.each(func(m int, c *Comm) error {
		return c.AllReduce(context.Background(), make([]byte, 64), reduce.Float32, reduce.Sum, nil)
	}))
}

// A member that never calls, or closes during the call, makes every other
// member fail within the deadline with an error naming it; the one that
// waited on it directly names it in its own words.
func TestRecursiveDoublingFaults(t *testing.T) {
	for _, cfg := range []struct {
		members, victim int
		direct          []int // the members that wait on the victim itself
	}{
		{3, 2, []int{0}},    // an extra member: its partner waits in the fold
		{3, 1, []int{0}},    // a core member without an extra
		{4, 3, []int{2}},    // round 0
		{5, 0, []int{1, 4}}, // the partner of an extra: the extra waits in the unfold, 1 in round 0
	} {
		t.Run(fmt.Sprintf("stalled/members=%d/victim=%d", cfg.members, cfg.victim), func(t *testing.T) {
			// The grace (a tenth of it) must cover the members' skew at
			// the start on a loaded machine: the partners that report
			// after half of it must come before the others.
			timeout := testenv.Scale(2 * time.Second)
			after := "timed out after " + fmtDuration(timeout) + " waiting for member"
			cl := newCluster(t, cfg.members, 2, Options{ChunkBytes: testChunk, Timeout: timeout})
			start := time.Now()
			errs := cl.each(func(m int, c *Comm) error {
				if m == cfg.victim {
					return nil
				}
				return c.AllReduce(context.Background(), make([]byte, 4<<10), reduce.Float32, reduce.Sum, nil)
			})
			assert.Less(t, time.Since(start), timeout+testenv.Scale(5*time.Second), "bounded by the timeout")
			for m, err := range errs {
				if m == cfg.victim {
					continue
				}
				require.Error(t, err, "member %d", m)
				t.Logf("member %d: %v", m, err)
				assert.ErrorContains(t, err, "all_reduce #1 (float32 sum, 4 KiB)", "member %d", m)
				assert.ErrorContains(t, err, fmt.Sprintf("%s %d", after, cfg.victim), "member %d", m)
				assert.Equal(t, AlgoRecursiveDoubling, cl.comms[m].Algorithm())
			}
			// The first round's partner, or the fold's, names it itself.
			first := cfg.direct[0]
			assert.NotContains(t, errs[first].Error(), "failed:", "member %d reports its own view", first)
			err := cl.comms[cfg.victim].Barrier(context.Background())
			require.ErrorContains(t, err, after)
		})
	}
}

// The schedule's steps fit the frame header up to MaxMembers, and larger
// bridges (deeper trees, many folds) still give the reference's bits.
func TestRecursiveDoublingLarge(t *testing.T) {
	for _, n := range []int{3, 5, 8, 9, 1000, MaxMembers} {
		sh := newRDShape(n)
		assert.True(t, sh.p <= n && n < 2*sh.p && sh.p == 1<<sh.k, "%d members: %+v", n, sh)
		assert.LessOrEqual(t, sh.unfoldStep(), maxStep, "%d members", n)
	}
	for _, members := range []int{17, 31} {
		cl := newCluster(t, members, 1, Options{ChunkBytes: testChunk, Workers: 1})
		rng := rand.New(rand.NewPCG(95, uint64(members)))
		inputs := make([][]byte, members)
		for m := range inputs {
			inputs[m] = randData(rng, reduce.Float32, 300)
		}
		want := ReferenceAllReduceAlgo(AlgoRecursiveDoubling, reduce.Avg, reduce.Float32, inputs, members)
		require.Equal(t, want, ReferenceAllReduce(reduce.Avg, reduce.Float32, inputs, members))
		runAllReduce(t, cl, reduce.Float32, reduce.Avg, Codec{}, inputs, want, AlgoRecursiveDoubling, fmt.Sprintf("%d members", members))
	}
}

// stepShiftStream sends every data frame one step later than it is.
type stepShiftStream struct{ transport.Stream }

func (s stepShiftStream) Send(ctx context.Context, h wire.Header, p []byte) error {
	if h.Kind == wire.KindData {
		k, st, fp := decodeStep(h.Step)
		h.Step = encodeStep(k, st+1, fp)
	}
	return s.Stream.Send(ctx, h, p)
}

type stepShiftMesh struct{ transport.Mesh }

func (m stepShiftMesh) Stream(peer, i int) transport.Stream {
	return stepShiftStream{m.Mesh.Stream(peer, i)}
}

// Frames are checked against the schedule: a member whose frames carry
// other step numbers makes its partner fail at once naming it, and the
// others with that failure.
func TestRecursiveDoublingStepChecked(t *testing.T) {
	timeout := testenv.Scale(10 * time.Second)
	meshes := transport.NewMem(4, 1, false)
	meshes[3] = stepShiftMesh{meshes[3]}
	cl := newClusterMesh(t, meshes, Options{Timeout: timeout}, DefaultMaxUnexpected)
	start := time.Now()
	errs := cl.each(func(m int, c *Comm) error {
		return c.AllReduce(context.Background(), make([]byte, 64), reduce.Float32, reduce.Sum, nil)
	})
	assert.Less(t, time.Since(start), timeout/2, "at once, not after the timeout")
	require.ErrorContains(t, errs[2], "member 3 sent all_reduce #1 step 2 chunk 0 (64 bytes), this member expected step 1 chunk 0 (64 bytes): protocol error")
	// Member 3 may have had all it needed (its peers sent before they
	// checked its frames): it learns in its next call.
	if errs[3] == nil {
		errs[3] = cl.comms[3].Barrier(context.Background())
	}
	for m, err := range errs {
		require.Error(t, err, "member %d", m)
		t.Logf("member %d: %v", m, err)
		assert.ErrorContains(t, err, "protocol error", "member %d", m)
	}
}
