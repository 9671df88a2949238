package collective

import (
	"context"
	"encoding/binary"
	"fmt"
	"math/rand/v2"
	"sync/atomic"
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

// splitSmall is the SplitBytes of the tests: a few chunks of testChunk.
const splitSmall = 4 * testChunk

// Two members from SplitBytes on run the ring of two and keep the
// exchange's order (x0 op x1 in both halves): every dtype and op, sizes
// around the threshold (odd element counts make the halves unequal), raw
// and zstd, over the in-memory mesh, real TCP (frames in pieces) and shm
// rings; every member holds ReferenceAllReduce's bits and reports every
// range once, final.
func TestSplitExchange(t *testing.T) {
	meshes := map[string]func(t *testing.T) []transport.Mesh{
		"mem":  func(*testing.T) []transport.Mesh { return transport.NewMem(2, 3, false) },
		"tcp":  func(t *testing.T) []transport.Mesh { return realMeshes(t, transport.TCP, 2, 3) },
		"shm":  func(t *testing.T) []transport.Mesh { return realMeshes(t, transport.SHM, 2, 2) },
		"recv": func(*testing.T) []transport.Mesh { return withoutHold(transport.NewMem(2, 2, false)) },
	}
	for name, mk := range meshes {
		t.Run(name, func(t *testing.T) {
			cl := newClusterMesh(t, mk(t), Options{ChunkBytes: testChunk, Workers: 2, SplitBytes: splitSmall, Timeout: testenv.Scale(30 * time.Second)}, DefaultMaxUnexpected)
			rng := rand.New(rand.NewPCG(95, uint64(len(name))))
			for _, dt := range reduce.AllDTypes() {
				es := dt.Size()
				for _, L := range []int{splitSmall - es, splitSmall, splitSmall + es, 7*testChunk + 3*es} {
					for _, op := range reduce.AllOps() {
						if op == reduce.Avg && !dt.IsFloat() {
							continue
						}
						inputs := [][]byte{randData(rng, dt, L/es), randData(rng, dt, L/es)}
						plantNaNs(dt, inputs)
						want := ReferenceAllReduce(op, dt, inputs, 2)
						algo := map[bool]string{true: AlgoRing, false: AlgoExchange}[L >= splitSmall]
						runAllReduce(t, cl, dt, op, Codec{}, inputs, want, algo, fmt.Sprintf("%s %s, %d bytes", dt, op, L))
					}
				}
			}
			inputs := [][]byte{randData(rng, reduce.Float32, 2*splitSmall/4+1), randData(rng, reduce.Float32, 2*splitSmall/4+1)}
			want := ReferenceAllReduce(reduce.Sum, reduce.Float32, inputs, 2)
			runAllReduce(t, cl, reduce.Float32, reduce.Sum, Codec{ID: codec.Zstd}, inputs, want, AlgoRing, "zstd")
		})
	}
}

// withoutHold hides the streams' Holder, so that the pipe receives frames
// with Recv.
func withoutHold(meshes []transport.Mesh) []transport.Mesh {
	out := make([]transport.Mesh, len(meshes))
	for i, m := range meshes {
		out[i] = noHoldMesh{m}
	}
	return out
}

// plantNaNs puts NaNs of other payloads at the same place in both
// inputs, first and last element (one in each half), so that x1 op x0
// would be other bits than x0 op x1 (the first NaN operand wins: package
// reduce).
func plantNaNs(dt reduce.DType, inputs [][]byte) {
	if !dt.IsFloat() {
		return
	}
	sp := specialBits[dt]
	es := dt.Size()
	for m, in := range inputs {
		nan := sp[len(sp)-1-m] // two NaNs with payloads
		var w [8]byte
		binary.LittleEndian.PutUint64(w[:], nan)
		copy(in[:es], w[:es])
		copy(in[len(in)-es:], w[:es])
	}
}

// The planted NaNs tell the orders apart, so a ring of two in the ring's
// own order (the partial first) would fail TestSplitExchange.
func TestSplitOrderMatters(t *testing.T) {
	for _, dt := range []reduce.DType{reduce.Float16, reduce.BFloat16, reduce.Float32, reduce.Float64} {
		rng := rand.New(rand.NewPCG(95, 3))
		x0, x1 := randData(rng, dt, 64), randData(rng, dt, 64)
		plantNaNs(dt, [][]byte{x0, x1})
		ab, err := reduce.Reference(reduce.Sum, dt, [][]byte{x0, x1})
		require.NoError(t, err)
		ba, err := reduce.Reference(reduce.Sum, dt, [][]byte{x1, x0})
		require.NoError(t, err)
		es := dt.Size()
		assert.NotEqual(t, ab[:es], ba[:es], "%s", dt)
		assert.NotEqual(t, ab[len(ab)-es:], ba[len(ba)-es:], "%s", dt)
		assert.Equal(t, ab, ReferenceAllReduceAlgo(AlgoRing, reduce.Sum, dt, [][]byte{x0, x1}, 2), "%s: the ring of two keeps the exchange's order", dt)
	}
}

// A streamed input (Progress.Ready) is read as it becomes ready; the ring
// of two reduces into a half only once that half is ready.
func TestSplitReady(t *testing.T) {
	cl := newCluster(t, 2, 2, Options{ChunkBytes: testChunk, SplitBytes: splitSmall})
	rng := rand.New(rand.NewPCG(96, 1))
	inputs := [][]byte{randData(rng, reduce.Float32, 3*splitSmall/4-1), randData(rng, reduce.Float32, 3*splitSmall/4-1)}
	runReady(t, cl, inputs, ReferenceAllReduce(reduce.Sum, reduce.Float32, inputs, 2), 700, AlgoRing)
}

// Options.SplitBytes: 0 is the default, negative is off, the threshold is
// inclusive, and only two members split; the order a Comm reports stays
// the exchange's.
func TestSplitBytesOption(t *testing.T) {
	for _, tt := range []struct {
		split, members, size int
		want                 bool
	}{
		{0, 2, DefaultSplitBytes, true},
		{0, 2, DefaultSplitBytes - 4, false},
		{-1, 2, 1 << 30, false},
		{64, 2, 64, true},
		{64, 2, 60, false},
		{64, 3, 1 << 20, false},
	} {
		cl := newCluster(t, tt.members, 1, Options{SplitBytes: tt.split})
		assert.Equal(t, tt.want, cl.comms[0].splits(tt.size), "SplitBytes %d, %d members, %d bytes", tt.split, tt.members, tt.size)
		if tt.members == 2 {
			assert.Equal(t, AlgoExchange, cl.comms[0].AllReduceOrder(tt.size))
		}
	}
}

// Segments are cut into a chunk per stream, whole elements, at least
// MinSpreadChunk and at most the call's chunk.
func TestSpreadChunk(t *testing.T) {
	for _, tt := range []struct{ L, C, streams, es, want int }{
		{8 << 20, 4 << 20, 8, 4, 1 << 20},  // 16 MiB: a megabyte per stream
		{32 << 20, 4 << 20, 8, 4, 4 << 20}, // 64 MiB: the call's chunk
		{12 << 20, 4 << 20, 8, 4, 3 << 19}, // 1.5 MiB per stream
		{1 << 20, 4 << 20, 8, 4, 1 << 20},  // never below a megabyte
		{1 << 20, 1 << 10, 8, 4, 1 << 10},  // nor above the call's chunk
		{(8 << 20) + 8, 4 << 20, 8, 8, 1<<20 + 8},
		{10 << 20, 4 << 20, 3, 2, 3495254}, // ceil(10 MiB / 3), even
		{6, 4 << 20, 8, 2, 1 << 20},
	} {
		got := SpreadChunk(tt.L, tt.C, tt.streams, tt.es)
		assert.Equal(t, tt.want, got, "%+v", tt)
		assert.Zero(t, got%tt.es, "%+v: whole elements", tt)
	}
}

// Members whose SplitBytes differ fail at once, every one with a message
// that names the option.
func TestSplitBytesMismatch(t *testing.T) {
	timeout := testenv.Scale(10 * time.Second)
	meshes := transport.NewMem(2, 2, false)
	cl := &cluster{meshes: meshes}
	for m, mesh := range meshes {
		cl.comms = append(cl.comms, newComm(mesh, Options{ChunkBytes: testChunk, Timeout: timeout, SplitBytes: []int{splitSmall, -1}[m]}, DefaultMaxUnexpected))
	}
	t.Cleanup(cl.close)
	start := time.Now()
	errs := cl.each(func(m int, c *Comm) error {
		return c.AllReduce(context.Background(), make([]byte, 2*splitSmall), reduce.Float32, reduce.Sum, nil)
	})
	assert.Less(t, time.Since(start), timeout/2, "a mismatch must not wait for the timeout")
	for m, err := range errs {
		require.Error(t, err, "member %d", m)
		t.Logf("member %d: %v", m, err)
		assert.ErrorContains(t, err, "SplitBytes", "member %d", m)
	}
}

// countMesh counts the frames sent on each data stream (its streams have
// only the methods of transport.Stream).
type countMesh struct {
	transport.Mesh
	sent []atomic.Int64
}

type countStream struct {
	transport.Stream
	n *atomic.Int64
}

func (m *countMesh) Stream(peer, i int) transport.Stream {
	return countStream{m.Mesh.Stream(peer, i), &m.sent[i]}
}

func (s countStream) Send(ctx context.Context, h wire.Header, p []byte) error {
	s.n.Add(1)
	return s.Stream.Send(ctx, h, p)
}

// With a chunk larger than a stream's share, a raw exchange and a ring of
// two cut their segments into a chunk per stream, and the results stay
// the reference's.
func TestSpreadChunksRun(t *testing.T) {
	const streams = 3
	for _, tt := range []struct {
		L     int
		algo  string
		sends int64 // frames per stream
	}{
		{3<<20 + 4, AlgoExchange, 1},
		{6<<20 + 8, AlgoRing, 2},
	} {
		mem := transport.NewMem(2, streams, false)
		meshes := make([]transport.Mesh, 2)
		counts := make([]*countMesh, 2)
		for m := range mem {
			counts[m] = &countMesh{Mesh: mem[m], sent: make([]atomic.Int64, streams)}
			meshes[m] = counts[m]
		}
		cl := newClusterMesh(t, meshes, Options{ChunkBytes: 4 << 20, SplitBytes: 5 << 20}, DefaultMaxUnexpected)
		rng := rand.New(rand.NewPCG(97, uint64(tt.L)))
		inputs := [][]byte{randData(rng, reduce.Float32, tt.L/4), randData(rng, reduce.Float32, tt.L/4)}
		runAllReduce(t, cl, reduce.Float32, reduce.Sum, Codec{}, inputs, ReferenceAllReduce(reduce.Sum, reduce.Float32, inputs, 2), tt.algo, tt.algo)
		for m := range counts {
			for s := range streams {
				assert.Equal(t, tt.sends, counts[m].sent[s].Load(), "%s, member %d, stream %d", tt.algo, m, s)
			}
		}
		cl.close()
	}
}
