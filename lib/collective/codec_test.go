package collective

import (
	"context"
	"encoding/binary"
	"fmt"
	"math/rand/v2"
	"os"
	"slices"
	"strings"
	"sync"
	"testing"
	"time"
	"unsafe"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/gpubridge/gpubridge/lib/codec"
	"github.com/gpubridge/gpubridge/lib/reduce"
	"github.com/gpubridge/gpubridge/lib/store"
	"github.com/gpubridge/gpubridge/lib/store/storetest"
	"github.com/gpubridge/gpubridge/lib/testenv"
	"github.com/gpubridge/gpubridge/lib/transport"
	"github.com/gpubridge/gpubridge/lib/wire"
)

// lossyCases are the codec × dtype pairs a lossy all_reduce takes.
var lossyCases = []struct {
	id codec.ID
	dt reduce.DType
}{
	{codec.MXFP8, reduce.Float32}, {codec.MXFP8, reduce.BFloat16}, {codec.MXFP8, reduce.Float16},
	{codec.BF16, reduce.Float32}, {codec.BF16, reduce.BFloat16},
}

// codecSizes are value counts: one, around a block and a group, several
// chunks (of 1024 values at testChunk), and sizes that leave ring
// segments short or empty.
func codecSizes(members int) []int {
	return []int{1, 31, 33, 1023, 1025, 3*1024 + 5, 2*members*1024 + 5}
}

// codecRun is consecutive lossy all_reduces of one codec, dtype and op on
// a cluster, each member keeping its residual (or none) across the calls,
// checked against ReferenceAllReduceCodec after every call: the results
// on every member, and every member's residual.
type codecRun struct {
	cl       *cluster
	id       codec.ID
	dt       reduce.DType
	op       reduce.Op
	feedback bool
	res      [][]byte
}

func (r *codecRun) call(t *testing.T, inputs [][]byte, what string) {
	t.Helper()
	n := len(r.cl.comms)
	E := len(inputs[0]) / r.dt.Size()
	if r.feedback && r.res == nil {
		r.res = make([][]byte, n)
		for m := range r.res {
			r.res[m] = make([]byte, 4*E)
		}
	}
	want, wantRes := ReferenceAllReduceCodec(r.id, r.op, r.dt, inputs, r.res, n)
	bufs := make([][]byte, n)
	recs := make([]*doneRecorder, n)
	requireNoErrors(t, r.cl.each(func(m int, c *Comm) error {
		bufs[m] = slices.Clone(inputs[m])
		recs[m] = &doneRecorder{buf: bufs[m]}
		cd := Codec{ID: r.id}
		if r.feedback {
			cd.Residual = r.res[m]
		}
		return c.AllReduceCodec(context.Background(), bufs[m], r.dt, r.op, cd, &Progress{Done: recs[m].done})
	}))
	for m := range bufs {
		w := fmt.Sprintf("%s, member %d", what, m)
		requireBits(t, want, bufs[m], r.dt.Size(), "%s", w)
		recs[m].check(t, want, w)
		if r.feedback {
			requireBits(t, wantRes[m], r.res[m], 4, "%s: residual", w)
		}
		if n > 1 {
			assert.Contains(t, []string{AlgoExchange, AlgoRing}, r.cl.comms[m].Algorithm())
		}
	}
}

// The lossy all_reduce equals ReferenceAllReduceCodec bit for bit on every
// member, for every codec, dtype, op and size, without and with error
// feedback over consecutive calls (the residuals too), on 2 to 4 members.
func TestAllReduceCodec(t *testing.T) {
	for _, cfg := range []struct{ members, streams int }{{1, 1}, {2, 2}, {3, 2}, {4, 1}} {
		t.Run(fmt.Sprintf("members=%d/streams=%d", cfg.members, cfg.streams), func(t *testing.T) {
			cl := newCluster(t, cfg.members, cfg.streams, Options{ChunkBytes: testChunk, Workers: 3})
			rng := rand.New(rand.NewPCG(31, uint64(cfg.members)))
			for _, lc := range lossyCases {
				for _, op := range []reduce.Op{reduce.Sum, reduce.Avg} {
					for _, E := range codecSizes(cfg.members) {
						for _, feedback := range []bool{false, true} {
							run := &codecRun{cl: cl, id: lc.id, dt: lc.dt, op: op, feedback: feedback}
							calls := 1
							if feedback {
								calls = 3
							}
							for k := range calls {
								inputs := make([][]byte, cfg.members)
								for m := range inputs {
									inputs[m] = randData(rng, lc.dt, E)
								}
								run.call(t, inputs, fmt.Sprintf("%s %s %s, %d values, feedback %v, call %d", lc.id, lc.dt, op, E, feedback, k))
							}
						}
					}
				}
			}
		})
	}
}

// Values that stress the codecs: NaNs of both signs and payloads, ±Inf,
// ±0, denormals of every dtype, the largest finite values, and blocks
// mixing huge and tiny values.
func TestAllReduceCodecSpecials(t *testing.T) {
	for _, members := range []int{2, 3} {
		cl := newCluster(t, members, 2, Options{ChunkBytes: testChunk})
		for _, lc := range lossyCases {
			sp := specialBits[lc.dt]
			es := lc.dt.Size()
			const E = 2*1024 + 100
			inputs := make([][]byte, members)
			for m := range inputs {
				inputs[m] = make([]byte, E*es)
				for i := range E {
					var w [8]byte
					binary.LittleEndian.PutUint64(w[:], sp[(i*7+m*5+i/32)%len(sp)])
					copy(inputs[m][i*es:], w[:es])
				}
			}
			for _, op := range []reduce.Op{reduce.Sum, reduce.Avg} {
				run := &codecRun{cl: cl, id: lc.id, dt: lc.dt, op: op, feedback: true}
				for k := range 2 {
					run.call(t, inputs, fmt.Sprintf("%d members, specials %s %s %s, call %d", members, lc.id, lc.dt, op, k))
				}
			}
		}
	}
}

// Large buffers over the default chunk and several workers: chunks are
// packed and unpacked by more than one goroutine each.
func TestAllReduceCodecParallel(t *testing.T) {
	old := minParVals
	minParVals = 2048
	t.Cleanup(func() { minParVals = old })
	for _, members := range []int{2, 3} {
		cl := newCluster(t, members, 2, Options{ChunkBytes: 256 << 10, Workers: 8})
		rng := rand.New(rand.NewPCG(41, uint64(members)))
		for _, lc := range lossyCases[:2] {
			run := &codecRun{cl: cl, id: lc.id, dt: lc.dt, op: reduce.Avg, feedback: true}
			for k := range 2 {
				inputs := make([][]byte, members)
				for m := range inputs {
					inputs[m] = randData(rng, lc.dt, 70_000+17)
				}
				run.call(t, inputs, fmt.Sprintf("%d members, %s %s, call %d", members, lc.id, lc.dt, k))
			}
		}
	}
}

// zstdData is n values of dt for the lossless tests: random values, and
// runs of zeros (a plane zstd packs rather than huff0).
func zstdData(rng *rand.Rand, dt reduce.DType, n int) []byte {
	b := randData(rng, dt, n)
	for i := n / 3; i < n/2; i++ {
		clear(b[i*dt.Size() : (i+1)*dt.Size()])
	}
	return b
}

// zstd/v1 frames give every collective raw's bits, for every dtype (and
// plain bytes), on 1 to 3 members, Progress reported as for raw.
func TestCodecLossless(t *testing.T) {
	ctx := context.Background()
	for _, cfg := range []struct{ members, streams int }{{1, 1}, {2, 2}, {3, 2}} {
		t.Run(fmt.Sprintf("members=%d/streams=%d", cfg.members, cfg.streams), func(t *testing.T) {
			n := cfg.members
			// The smaller sizes run recursive doubling (3 members), the
			// largest the ring.
			cl := newCluster(t, n, cfg.streams, Options{ChunkBytes: testChunk, Workers: 2, SmallBytes: 4 * testChunk})
			rng := rand.New(rand.NewPCG(51, uint64(n)))
			for _, dt := range reduce.AllDTypes() {
				es := dt.Size()
				for i, E := range []int{1, 7, testChunk/es + 1, 2*n*testChunk/es + 5} {
					what := fmt.Sprintf("%s, %d values", dt, E)
					// The frames do not depend on the op: one per size.
					ops := supportedOps(dt)
					for _, op := range ops[i%len(ops) : i%len(ops)+1] {
						inputs := make([][]byte, n)
						for m := range inputs {
							inputs[m] = zstdData(rng, dt, E)
						}
						want := wantAllReduce(cl.comms[0], op, dt, inputs)
						bufs := make([][]byte, n)
						recs := make([]*doneRecorder, n)
						requireNoErrors(t, cl.each(func(m int, c *Comm) error {
							bufs[m] = slices.Clone(inputs[m])
							recs[m] = &doneRecorder{buf: bufs[m]}
							return c.AllReduceCodec(ctx, bufs[m], dt, op, Codec{ID: codec.Zstd}, &Progress{Done: recs[m].done})
						}))
						for m := range bufs {
							requireBits(t, want, bufs[m], es, "all_reduce %s %s, member %d", what, op, m)
							recs[m].check(t, want, fmt.Sprintf("all_reduce %s %s, member %d", what, op, m))
						}

						rsIn := make([][]byte, n)
						for m := range rsIn {
							rsIn[m] = zstdData(rng, dt, E*n)
						}
						wantRS := ReferenceReduceScatter(op, dt, rsIn, n)
						outs := make([][]byte, n)
						requireNoErrors(t, cl.each(func(m int, c *Comm) error {
							outs[m] = make([]byte, E*es)
							return c.ReduceScatterCodec(ctx, outs[m], rsIn[m], dt, op, Codec{ID: codec.Zstd}, nil)
						}))
						for m := range outs {
							requireBits(t, wantRS[m], outs[m], es, "reduce_scatter %s %s, member %d", what, op, m)
						}
					}
					for _, planes := range []reduce.DType{0, dt} {
						cd := Codec{ID: codec.Zstd, DType: planes}
						inputs := make([][]byte, n)
						var want []byte
						for m := range inputs {
							inputs[m] = zstdData(rng, dt, E)
							want = append(want, inputs[m]...)
						}
						root := E % n
						bufs := make([][]byte, n)
						outs := make([][]byte, n)
						recs := make([]*doneRecorder, n)
						requireNoErrors(t, cl.each(func(m int, c *Comm) error {
							bufs[m] = make([]byte, E*es)
							if m == root {
								copy(bufs[m], inputs[m])
							}
							if err := c.BroadcastCodec(ctx, bufs[m], root, cd, nil); err != nil {
								return err
							}
							outs[m] = make([]byte, n*E*es)
							recs[m] = &doneRecorder{buf: outs[m]}
							return c.AllGatherCodec(ctx, outs[m], inputs[m], cd, &Progress{Done: recs[m].done})
						}))
						for m := range bufs {
							requireBits(t, inputs[root], bufs[m], es, "broadcast %s from %d, planes %v, member %d", what, root, planes, m)
							requireBits(t, want, outs[m], es, "all_gather %s, planes %v, member %d", what, planes, m)
							recs[m].check(t, want, fmt.Sprintf("all_gather %s, member %d", what, m))
						}
					}
				}
			}
		})
	}
}

// A compressed call never takes the direct path, even where every
// member's buffer is shared (a raw call there does): its bits are the
// codec's on every transport.
func TestCodecNotDirect(t *testing.T) {
	smallDirect(t)
	ctx := context.Background()
	for _, members := range []int{2, 3} {
		cl := newCluster(t, members, 2, Options{SmallBytes: -1, ChunkBytes: testChunk})
		rng := rand.New(rand.NewPCG(61, uint64(members)))
		inputs := make([][]byte, members)
		for m := range inputs {
			inputs[m] = randData(rng, reduce.Float32, 5000)
		}
		bufs := make([][]byte, members)
		for m := range bufs {
			bufs[m] = shared(t, cl, m, inputs[m])
		}
		for _, cd := range []Codec{{}, {ID: codec.Zstd}, {ID: codec.MXFP8}, {ID: codec.BF16}} {
			want, _ := ReferenceAllReduceCodec(cd.ID, reduce.Sum, reduce.Float32, inputs, nil, members)
			if !cd.ID.Lossy() {
				// SmallBytes is off: the direct path, or the ring for zstd.
				want = ReferenceAllReduceAlgo(AlgoDirect, reduce.Sum, reduce.Float32, inputs, members)
			}
			requireNoErrors(t, cl.each(func(m int, c *Comm) error {
				copy(bufs[m], inputs[m])
				return c.AllReduceCodec(ctx, bufs[m], reduce.Float32, reduce.Sum, cd, nil)
			}))
			wantAlgo := AlgoDirect
			if cd.ID != codec.Raw {
				wantAlgo = map[int]string{2: AlgoExchange, 3: AlgoRing}[members]
			}
			for m := range bufs {
				requireBits(t, want, bufs[m], 4, "%d members, %s, member %d", members, cd.ID, m)
				assert.Equal(t, wantAlgo, cl.comms[m].Algorithm(), "%d members, %s", members, cd.ID)
			}
		}
		outs := make([][]byte, members)
		for m := range outs {
			outs[m] = shared(t, cl, m, make([]byte, members*len(inputs[m])))
		}
		for _, cd := range []Codec{{}, {ID: codec.Zstd, DType: reduce.Float32}} {
			requireNoErrors(t, cl.each(func(m int, c *Comm) error {
				copy(bufs[m], inputs[m])
				return c.AllGatherCodec(ctx, outs[m], bufs[m], cd, nil)
			}))
			for m := range outs {
				assert.Equal(t, slices.Concat(inputs...), outs[m])
				assert.Equal(t, map[bool]string{true: AlgoDirect, false: AlgoRing}[cd.ID == codec.Raw], cl.comms[m].Algorithm())
			}
		}
	}
}

// Misuse of a codec is refused before anything is sent (ErrInvalid, no
// sequence number taken) and leaves the communicator usable.
func TestCodecInvalid(t *testing.T) {
	cl := newCluster(t, 2, 1, Options{Timeout: testenv.Scale(20 * time.Second)})
	c := cl.comms[0]
	ctx := context.Background()
	b := make([]byte, 4096)
	res := make([]byte, 4096)
	fp8, bf16 := Codec{ID: codec.MXFP8}, Codec{ID: codec.BF16}
	ar := func(dt reduce.DType, op reduce.Op, cd Codec) func() error {
		return func() error { return c.AllReduceCodec(ctx, b, dt, op, cd, nil) }
	}
	tests := []struct {
		name string
		call func() error
		want string
	}{
		{"fp8 max", ar(reduce.Float32, reduce.Max, fp8), "codec fp8/v1 is lossy: it compresses floating sum and avg only, not max"},
		{"bf16 prod", ar(reduce.Float32, reduce.Prod, bf16), "not prod"},
		{"fp8 int32", ar(reduce.Int32, reduce.Sum, fp8), "fp8 takes float32, bfloat16 or float16"},
		{"fp8 float64", ar(reduce.Float64, reduce.Sum, fp8), "fp8 takes float32, bfloat16 or float16"},
		{"bf16 float16", ar(reduce.Float16, reduce.Avg, bf16), "float16 is already 2 bytes a value"},
		{"unknown codec", ar(reduce.Float32, reduce.Sum, Codec{ID: 9}), "codec 9 is unknown to this gpubridge"},
		{"residual short", ar(reduce.Float32, reduce.Sum, Codec{ID: codec.MXFP8, Residual: res[:100]}), "residual of 100 bytes for 1024 values, want 4096"},
		{"residual for bfloat16 values", ar(reduce.BFloat16, reduce.Sum, Codec{ID: codec.MXFP8, Residual: res}), "residual of 4096 bytes for 2048 values, want 8192"},
		{"residual overlaps", ar(reduce.Float32, reduce.Sum, Codec{ID: codec.MXFP8, Residual: b}), "the residual overlaps the buffer"},
		{"residual raw", ar(reduce.Float32, reduce.Sum, Codec{Residual: res}), "a residual (error feedback) is for the lossy codecs (bf16, fp8), not raw"},
		{"residual zstd", ar(reduce.Float32, reduce.Sum, Codec{ID: codec.Zstd, Residual: res}), "not zstd/v1"},
		{"fp8 broadcast", func() error { return c.BroadcastCodec(ctx, b, 0, fp8, nil) }, "codec fp8/v1 is lossy: broadcast stays exact"},
		{"residual on a packed all_gather", func() error {
			return c.AllGatherCodec(ctx, make([]byte, 2*len(b)), b, Codec{ID: codec.BF16, Residual: res}, nil)
		}, "a residual (error feedback) is for a lossy all_reduce, not all_gather"},
		{"fp8 reduce_scatter", func() error {
			return c.ReduceScatterCodec(ctx, b[:1024], b[2048:], reduce.Float32, reduce.Sum, fp8, nil)
		}, "reduce_scatter stays exact"},
		{"residual reduce_scatter", func() error {
			return c.ReduceScatterCodec(ctx, b[:1024], b[2048:], reduce.Float32, reduce.Sum, Codec{ID: codec.Zstd, Residual: res}, nil)
		}, "a residual (error feedback) is for a lossy all_reduce, not reduce_scatter"},
		{"zstd ragged broadcast", func() error {
			return c.BroadcastCodec(ctx, b[:6], 0, Codec{ID: codec.Zstd, DType: reduce.Float32}, nil)
		}, "6 bytes are not whole float32 elements"},
		{"zstd bad dtype", func() error { return c.BroadcastCodec(ctx, b, 0, Codec{ID: codec.Zstd, DType: 99}, nil) }, "is not a dtype"},
		{"unknown codec broadcast", func() error { return c.BroadcastCodec(ctx, b, 0, Codec{ID: 200}, nil) }, "codec 200 is unknown"},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			err := tt.call()
			require.ErrorIs(t, err, ErrInvalid)
			require.ErrorContains(t, err, tt.want)
			var e *Error
			require.ErrorAs(t, err, &e)
			assert.Zero(t, e.Seq)
		})
	}
	assert.Zero(t, c.Seq())
	requireNoErrors(t, cl.each(func(m int, c *Comm) error {
		return c.AllReduceCodec(ctx, make([]byte, 4096), reduce.Float32, reduce.Sum, fp8, nil)
	}))
}

// A member whose codec differs from the others' makes every member fail,
// naming it and both codecs, at once (not after the timeout).
func TestCodecMismatch(t *testing.T) {
	ctx := context.Background()
	tests := []struct {
		name    string
		members int
		codecs  []codec.ID
		bytes   int
	}{
		{"exchange raw vs fp8", 2, []codec.ID{codec.Raw, codec.MXFP8}, 4096},
		{"exchange raw vs fp8, direct descriptors", 2, []codec.ID{codec.Raw, codec.MXFP8}, 256 << 10},
		{"exchange bf16 vs zstd", 2, []codec.ID{codec.BF16, codec.Zstd}, 4096},
		{"ring zstd vs raw", 3, []codec.ID{codec.Raw, codec.Raw, codec.Zstd}, 4096},
		{"ring fp8 vs bf16", 4, []codec.ID{codec.MXFP8, codec.BF16, codec.MXFP8, codec.MXFP8}, 64 << 10},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			timeout := testenv.Scale(10 * time.Second)
			cl := newCluster(t, tt.members, 2, Options{ChunkBytes: testChunk, Timeout: timeout})
			start := time.Now()
			errs := cl.each(func(m int, c *Comm) error {
				return c.AllReduceCodec(ctx, make([]byte, tt.bytes), reduce.Float32, reduce.Sum, Codec{ID: tt.codecs[m]}, nil)
			})
			assert.Less(t, time.Since(start), timeout/2, "a mismatch must not wait for the timeout")
			direct := 0
			for m, err := range errs {
				require.Error(t, err, "member %d", m)
				t.Logf("member %d: %v", m, err)
				assert.ErrorContains(t, err, "every member must compress alike", "member %d", m)
				for _, id := range tt.codecs {
					assert.ErrorContains(t, err, id.Versioned(), "member %d names both codecs", m)
				}
				// A member after one of another codec names it in its own
				// words, unless another member's abort came first.
				prev := mod(m-1, tt.members)
				if strings.Contains(err.Error(), fmt.Sprintf("member %d sent %s frames in all_reduce #1, this member's call uses %s", prev, tt.codecs[prev].Versioned(), tt.codecs[m].Versioned())) {
					direct++
				}
			}
			assert.Positive(t, direct, "no member named the one before it")
		})
	}
}

// codecMesh sends every data frame with another codec byte.
type codecMesh struct {
	transport.Mesh
	id uint8
}

type codecStream struct {
	transport.Stream
	id uint8
}

func (m codecMesh) Stream(peer, i int) transport.Stream {
	return codecStream{m.Mesh.Stream(peer, i), m.id}
}

func (s codecStream) Send(ctx context.Context, h wire.Header, p []byte) error {
	h.Codec = s.id
	return s.Stream.Send(ctx, h, p)
}

// A frame with a codec id this build does not know is refused with
// codec.UnknownError's text, naming the member that sent it.
func TestCodecUnknownOnWire(t *testing.T) {
	meshes := transport.NewMem(2, 1, false)
	meshes[0] = codecMesh{meshes[0], 7}
	cl := newClusterMesh(t, meshes, Options{Timeout: testenv.Scale(10 * time.Second)}, DefaultMaxUnexpected)
	errs := cl.each(func(m int, c *Comm) error {
		return c.AllReduceCodec(context.Background(), make([]byte, 64), reduce.Float32, reduce.Sum, Codec{ID: codec.MXFP8}, nil)
	})
	require.Error(t, errs[1])
	assert.ErrorIs(t, errs[1], codec.ErrUnknown)
	assert.ErrorContains(t, errs[1], "member 0: "+(&codec.UnknownError{ID: 7}).Error())
	// Member 0 may have finished its part; its next call learns of the
	// failure.
	if errs[0] == nil {
		errs[0] = cl.comms[0].Barrier(context.Background())
	}
	assert.ErrorContains(t, errs[0], "codec 7 is unknown")
}

// zstdCorruptMesh damages the zstd/v1 chunk in every data frame member 0
// sends: its raw length says one byte more.
type zstdCorruptMesh struct{ transport.Mesh }

type zstdCorruptStream struct{ transport.Stream }

func (m zstdCorruptMesh) Stream(peer, i int) transport.Stream {
	return zstdCorruptStream{m.Mesh.Stream(peer, i)}
}

func (s zstdCorruptStream) Send(ctx context.Context, h wire.Header, p []byte) error {
	bad := slices.Clone(p)
	binary.LittleEndian.PutUint32(bad[4:], binary.LittleEndian.Uint32(bad[4:])+4)
	return s.Stream.Send(ctx, h, bad)
}

// A zstd frame that does not unpack to its chunk fails the call with an
// error naming the peer that sent it; the others learn of it.
func TestCodecCorruptZstd(t *testing.T) {
	for _, members := range []int{2, 3} {
		meshes := transport.NewMem(members, 2, false)
		meshes[0] = zstdCorruptMesh{meshes[0]}
		cl := newClusterMesh(t, meshes, Options{ChunkBytes: testChunk, Timeout: testenv.Scale(10 * time.Second)}, DefaultMaxUnexpected)
		errs := cl.each(func(m int, c *Comm) error {
			return c.AllReduceCodec(context.Background(), make([]byte, 8192), reduce.Float32, reduce.Sum, Codec{ID: codec.Zstd}, nil)
		})
		require.Error(t, errs[1], "%d members", members)
		assert.ErrorIs(t, errs[1], wire.ErrCorrupt)
		assert.ErrorIs(t, errs[1], codec.ErrLength)
		assert.Regexp(t, `member 0 sent a corrupt frame \(chunk \d+ of step 0 of all_reduce #1: `, errs[1].Error())
		for m, err := range errs {
			if err == nil { // finished its part: its next call learns
				err = cl.comms[m].Barrier(context.Background())
			}
			require.Error(t, err, "%d members, member %d", members, m)
			assert.ErrorContains(t, err, "corrupt frame", "%d members, member %d", members, m)
		}
	}
}

// Stats count the packed bytes that travel and the time the codec took.
func TestCodecStats(t *testing.T) {
	const E = 100_000
	for _, tt := range []struct {
		id     codec.ID
		dt     reduce.DType
		packed int // bytes of the whole buffer's packing
	}{
		{codec.MXFP8, reduce.Float32, codec.MXFP8Len(E)},
		{codec.BF16, reduce.Float32, 2 * E},
		{codec.MXFP8, reduce.BFloat16, codec.MXFP8Len(E)},
	} {
		cl := newCluster(t, 2, 2, Options{ChunkBytes: 64 << 10})
		requireNoErrors(t, cl.each(func(m int, c *Comm) error {
			return c.AllReduceCodec(context.Background(), make([]byte, E*tt.dt.Size()), tt.dt, reduce.Sum, Codec{ID: tt.id}, nil)
		}))
		for m, c := range cl.comms {
			var st Stats
			require.True(t, c.LastStats(&st))
			assert.Equal(t, uint64(tt.packed), st.BytesSent, "%s %s member %d", tt.id, tt.dt, m)
			assert.Equal(t, uint64(tt.packed), st.BytesReceived, "%s %s member %d", tt.id, tt.dt, m)
			assert.Positive(t, st.Codec, "member %d", m)
		}
	}
	// zstd: the frames of a buffer of zeros are far smaller than it.
	cl := newCluster(t, 3, 2, Options{ChunkBytes: 64 << 10})
	requireNoErrors(t, cl.each(func(m int, c *Comm) error {
		return c.AllReduceCodec(context.Background(), make([]byte, 4*E), reduce.Float32, reduce.Sum, Codec{ID: codec.Zstd}, nil)
	}))
	for m, c := range cl.comms {
		var st Stats
		require.True(t, c.LastStats(&st))
		assert.Positive(t, st.BytesSent, "member %d", m)
		assert.Less(t, st.BytesSent, uint64(4*E/100), "member %d", m)
		assert.Positive(t, st.Codec, "member %d", m)
	}
}

// A compressed all_reduce reads its input only once Ready granted it, and
// reports every result range once, final.
func TestCodecReady(t *testing.T) {
	const pause = 100 * time.Microsecond
	for _, members := range []int{2, 3} {
		cl := newCluster(t, members, 2, Options{ChunkBytes: testChunk})
		rng := rand.New(rand.NewPCG(71, uint64(members)))
		const E = 5*1024 + 3
		for _, id := range []codec.ID{codec.MXFP8, codec.Zstd} {
			inputs := make([][]byte, members)
			for m := range inputs {
				inputs[m] = randData(rng, reduce.Float32, E)
			}
			want, _ := ReferenceAllReduceCodec(id, reduce.Avg, reduce.Float32, inputs, nil, members)
			bufs := make([][]byte, members)
			requireNoErrors(t, cl.each(func(m int, c *Comm) error {
				bufs[m] = make([]byte, len(inputs[m]))
				garbage(bufs[m])
				g := newReadyGate(t, len(bufs[m]))
				go g.release(bufs[m], inputs[m], 3000, pause)
				rec := &doneRecorder{buf: bufs[m]}
				err := c.AllReduceCodec(context.Background(), bufs[m], reduce.Float32, reduce.Avg, Codec{ID: id}, &Progress{Ready: g.ready, Done: rec.done})
				rec.check(t, want, fmt.Sprintf("%d members, %s, member %d", members, id, m))
				return err
			}))
			for m := range bufs {
				requireBits(t, want, bufs[m], 4, "%d members, %s, member %d", members, id, m)
			}
		}
	}
}

// realMeshes establishes members members over a real transport (tcp:
// loopback connections; shm: rings in /dev/shm) through an in-process
// store.
func realMeshes(t testing.TB, kind transport.Kind, members, streams int) []transport.Mesh {
	t.Helper()
	return realMeshesRing(t, kind, members, streams, 256<<10)
}

// realMeshesRing is realMeshes with shm data rings of ringBytes.
func realMeshesRing(t testing.TB, kind transport.Kind, members, streams, ringBytes int, p2pStreams ...int) []transport.Mesh {
	t.Helper()
	addr := storetest.Start(t)
	host, err := os.Hostname()
	require.NoError(t, err)
	infos := make([]transport.MemberInfo, members)
	for i := range infos {
		infos[i] = transport.MemberInfo{Rank: i, Host: host}
	}
	meshes := make([]transport.Mesh, members)
	errs := make([]error, members)
	var wg sync.WaitGroup
	for i := range members {
		ctx, cancel := context.WithTimeout(context.Background(), testenv.Scale(30*time.Second))
		defer cancel()
		st, err := store.Dial(ctx, addr)
		require.NoError(t, err)
		t.Cleanup(func() { _ = st.Close() })
		cfg := transport.Config{Store: st.Prefix("job-" + strings.ReplaceAll(t.Name(), "/", "-")), Self: i, Members: infos,
			Transport: kind, Streams: streams, ListenHost: "127.0.0.1", Timeout: testenv.Scale(30 * time.Second), RingBytes: ringBytes}
		if len(p2pStreams) > 0 {
			cfg.P2PStreams = p2pStreams[0]
		}
		wg.Go(func() { meshes[i], errs[i] = transport.Establish(ctx, cfg) })
	}
	wg.Wait()
	for i, err := range errs {
		require.NoError(t, err, "member %d", i)
	}
	return meshes
}

// The codecs over real TCP (frames read whole, not in pieces) and shared
// memory meshes: the lossy all_reduce with error feedback over
// consecutive calls, and zstd on every collective, bit for bit against the
// references.
func TestCodecRealMeshes(t *testing.T) {
	ctx := context.Background()
	for _, kind := range []transport.Kind{transport.TCP, transport.SHM} {
		for _, members := range []int{2, 3} {
			t.Run(fmt.Sprintf("%s/members=%d", kind, members), func(t *testing.T) {
				cl := newClusterMesh(t, realMeshes(t, kind, members, 2), Options{ChunkBytes: 64 << 10, Timeout: testenv.Scale(30 * time.Second)}, DefaultMaxUnexpected)
				rng := rand.New(rand.NewPCG(81, uint64(members)))
				const E = 20_003
				for _, lc := range []struct {
					id codec.ID
					dt reduce.DType
				}{{codec.MXFP8, reduce.Float32}, {codec.BF16, reduce.BFloat16}, {codec.MXFP8, reduce.Float16}} {
					run := &codecRun{cl: cl, id: lc.id, dt: lc.dt, op: reduce.Avg, feedback: true}
					for k := range 2 {
						inputs := make([][]byte, members)
						for m := range inputs {
							inputs[m] = randData(rng, lc.dt, E)
						}
						run.call(t, inputs, fmt.Sprintf("%s %s, call %d", lc.id, lc.dt, k))
					}
				}
				zc := Codec{ID: codec.Zstd, DType: reduce.Float32}
				inputs := make([][]byte, members)
				for m := range inputs {
					inputs[m] = zstdData(rng, reduce.Float32, E)
				}
				want := ReferenceAllReduce(reduce.Sum, reduce.Float32, inputs, members)
				L := len(inputs[0]) / 4 / members * 4
				wantRS := ReferenceReduceScatter(reduce.Sum, reduce.Float32, func() [][]byte {
					ins := make([][]byte, members)
					for m := range ins {
						ins[m] = inputs[m][:members*L]
					}
					return ins
				}(), members)
				bufs, bcast, outs, rs := make([][]byte, members), make([][]byte, members), make([][]byte, members), make([][]byte, members)
				requireNoErrors(t, cl.each(func(m int, c *Comm) error {
					bufs[m] = slices.Clone(inputs[m])
					if err := c.AllReduceCodec(ctx, bufs[m], reduce.Float32, reduce.Sum, zc, nil); err != nil {
						return err
					}
					bcast[m] = make([]byte, len(inputs[m]))
					if m == 1 {
						copy(bcast[m], inputs[m])
					}
					if err := c.BroadcastCodec(ctx, bcast[m], 1, zc, nil); err != nil {
						return err
					}
					outs[m] = make([]byte, members*len(inputs[m]))
					if err := c.AllGatherCodec(ctx, outs[m], inputs[m], zc, nil); err != nil {
						return err
					}
					rs[m] = make([]byte, L)
					return c.ReduceScatterCodec(ctx, rs[m], inputs[m][:members*L], reduce.Float32, reduce.Sum, zc, nil)
				}))
				for m := range bufs {
					requireBits(t, want, bufs[m], 4, "zstd all_reduce, member %d", m)
					requireBits(t, inputs[1], bcast[m], 4, "zstd broadcast, member %d", m)
					requireBits(t, slices.Concat(inputs...), outs[m], 4, "zstd all_gather, member %d", m)
					requireBits(t, wantRS[m], rs[m], 4, "zstd reduce_scatter, member %d", m)
				}
			})
		}
	}
}

// The packing of the buffer and the zstd frames' buffers are kept by the
// Comm and reused by the next call, not made again.
func TestCodecScratchReused(t *testing.T) {
	cl := newCluster(t, 2, 2, Options{ChunkBytes: testChunk})
	run := func(cd Codec) {
		requireNoErrors(t, cl.each(func(m int, c *Comm) error {
			return c.AllReduceCodec(context.Background(), make([]byte, 40000), reduce.Float32, reduce.Sum, cd, nil)
		}))
	}
	at := func(b []byte) uintptr { return uintptr(unsafe.Pointer(unsafe.SliceData(b))) }
	c := cl.comms[0]
	run(Codec{ID: codec.MXFP8})
	first := c.packed
	run(Codec{ID: codec.BF16}) // a longer packing: grown once
	require.NotEqual(t, at(first), at(c.packed))
	packed := at(c.packed)
	run(Codec{ID: codec.MXFP8})
	run(Codec{ID: codec.BF16})
	assert.Equal(t, packed, at(c.packed), "the packing was made again")

	run(Codec{ID: codec.Zstd})
	require.Len(t, c.zstd, 2)
	send, recv := at(c.zstd[0].send), at(c.zstd[0].recv)
	run(Codec{ID: codec.Zstd})
	assert.Equal(t, send, at(c.zstd[0].send))
	assert.Equal(t, recv, at(c.zstd[0].recv))
}

// A lossy id on all_gather marks bytes the caller packed (the GPU leaders'
// caller-reduces exchange): they arrive unchanged, and a member that packed
// with another codec (or not at all) fails every member, naming both.
func TestPackedAllGather(t *testing.T) {
	ctx := context.Background()
	const L = 1000 // not a whole packing of anything: the bytes are opaque here
	t.Run("same codec", func(t *testing.T) {
		cl := newCluster(t, 2, 2, Options{ChunkBytes: 256, Timeout: testenv.Scale(10 * time.Second)})
		ins, outs := make([][]byte, 2), make([][]byte, 2)
		for m := range ins {
			ins[m], outs[m] = randBytes(rand.New(rand.NewPCG(61, uint64(m))), L), make([]byte, 2*L)
		}
		requireNoErrors(t, cl.each(func(m int, c *Comm) error {
			return c.AllGatherCodec(ctx, outs[m], ins[m], Codec{ID: codec.MXFP8, DType: reduce.Float32}, nil)
		}))
		want := append(append([]byte{}, ins[0]...), ins[1]...)
		for m := range outs {
			assert.Equal(t, want, outs[m], "member %d", m)
		}
	})
	t.Run("packed vs raw", func(t *testing.T) {
		cl := newCluster(t, 2, 2, Options{ChunkBytes: 256, Timeout: testenv.Scale(10 * time.Second)})
		ids := []codec.ID{codec.MXFP8, codec.Raw}
		errs := cl.each(func(m int, c *Comm) error {
			return c.AllGatherCodec(ctx, make([]byte, 2*L), make([]byte, L), Codec{ID: ids[m]}, nil)
		})
		for m, err := range errs {
			require.Error(t, err, "member %d", m)
			assert.ErrorContains(t, err, "every member must compress alike", "member %d", m)
		}
	})
}
