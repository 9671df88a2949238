package collective

import (
	"bytes"
	"context"
	"fmt"
	"math/rand/v2"
	"slices"
	"sync"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/gpubridge/gpubridge/lib/ntcopy"
	"github.com/gpubridge/gpubridge/lib/reduce"
	"github.com/gpubridge/gpubridge/lib/transport"
	"github.com/gpubridge/gpubridge/lib/wire"
)

// spyMesh hands every frame its member receives to onRecv (with the
// sending peer) before the collective sees it.
type spyMesh struct {
	transport.Mesh
	transport.Sharer
	onRecv func(from int, h wire.Header)
}

func (m spyMesh) Stream(peer, i int) transport.Stream {
	return spyStream{Stream: m.Mesh.Stream(peer, i), onRecv: func(h wire.Header) { m.onRecv(peer, h) }}
}

// spyStream has only transport.Stream's methods: every frame goes through
// Recv.
type spyStream struct {
	transport.Stream
	onRecv func(wire.Header)
}

func (s spyStream) Recv(ctx context.Context, fn func(wire.Header, []byte) error) error {
	return s.Stream.Recv(ctx, func(h wire.Header, p []byte) error {
		s.onRecv(h)
		return fn(h, p)
	})
}

// Writing through, the owner of a piece writes it into every member's
// buffer before its final: when a final arrives, the receiver's buffer
// holds the piece's result already. The test then spoils the owner's own
// copy of the piece, which a member that still copied would take, and
// counts the copied frames, of which there are none. 2, 3 and 4 members;
// sum, avg and max of float32, bfloat16 and int64; several pieces per
// member and stream, odd tails.
func TestDirectWriteThrough(t *testing.T) {
	smallDirect(t)
	const spoil = 0xA5
	for _, members := range []int{2, 3, 4} {
		t.Run(fmt.Sprint("members=", members), func(t *testing.T) {
			var (
				mu       sync.Mutex
				bufs     [][]byte
				want     []byte
				pieces   []dpiece
				spoiled  map[uint32]bool
				finals   int
				copied   int
				problems []string
			)
			onRecv := func(to, from int, h wire.Header) {
				k, step, _ := decodeStep(h.Step)
				if h.Kind != wire.KindData || k != kAllReduce {
					return
				}
				mu.Lock()
				defer mu.Unlock()
				switch step {
				case stepCopied:
					copied++
				case stepFinal:
					finals++
					p := pieces[h.Chunk]
					if !bytes.Equal(bufs[to][p.off:p.off+p.n], want[p.off:p.off+p.n]) {
						problems = append(problems, fmt.Sprintf("member %d's piece %d did not hold the result when its final came", to, h.Chunk))
					}
					if !spoiled[h.Chunk] {
						spoiled[h.Chunk] = true
						for i := range bufs[from][p.off : p.off+p.n] {
							bufs[from][p.off+i] = spoil
						}
					}
				}
			}
			meshes := transport.NewMemWith(members, transport.MemOptions{Streams: 2, CRC: true, PeerWrite: true})
			for m, mesh := range meshes {
				meshes[m] = spyMesh{Mesh: mesh, Sharer: mesh.(transport.Sharer), onRecv: func(from int, h wire.Header) { onRecv(m, from, h) }}
			}
			cl := newClusterMesh(t, meshes, Options{SmallBytes: -1, ChunkBytes: testChunk, Workers: 3}, DefaultMaxUnexpected)
			rng := rand.New(rand.NewPCG(18, uint64(members)))
			for _, dt := range []reduce.DType{reduce.Float32, reduce.BFloat16, reduce.Int64} {
				for _, op := range []reduce.Op{reduce.Sum, reduce.Avg, reduce.Max} {
					if reduce.Supported(op, dt) != nil {
						continue
					}
					what := fmt.Sprintf("%s %s", dt, op)
					n := 7*members*testChunk/dt.Size() + 3
					inputs := make([][]byte, members)
					for m := range inputs {
						inputs[m] = randData(rng, dt, n)
					}
					mu.Lock()
					want = ReferenceAllReduceAlgo(AlgoDirectWrite, op, dt, inputs, members)
					pieces = cl.comms[0].allReducePieces(len(want), dt.Size())
					spoiled, finals, copied = map[uint32]bool{}, 0, 0
					bufs = make([][]byte, members)
					for m := range bufs {
						bufs[m] = shared(t, cl, m, inputs[m])
					}
					mu.Unlock()
					require.Greater(t, len(pieces), 4*members, "%s: several pieces per member and stream", what)
					recs := make([]*doneRecorder, members)
					requireNoErrors(t, cl.each(func(m int, c *Comm) error {
						recs[m] = &doneRecorder{buf: bufs[m]}
						return c.AllReduce(context.Background(), bufs[m], dt, op, &Progress{Done: recs[m].done})
					}))
					require.Empty(t, problems, what)
					assert.Zero(t, copied, "%s: copied frames", what)
					assert.Equal(t, len(pieces)*(members-1), finals, what)
					for m := range members {
						recs[m].check(t, want, fmt.Sprintf("%s, member %d", what, m))
						assert.Equal(t, AlgoDirectWrite, cl.comms[m].Algorithm())
						for i, p := range pieces {
							got, exp := bufs[m][p.off:p.off+p.n], want[p.off:p.off+p.n]
							if p.owner == m {
								exp = bytes.Repeat([]byte{spoil}, p.n) // nothing wrote it after its final
							}
							require.True(t, bytes.Equal(exp, got), "%s: member %d, piece %d of member %d", what, m, i, p.owner)
						}
					}
				}
			}
		})
	}
}

// noPeerWrite is a mesh built without transport.Config.PeerWrite.
type noPeerWrite struct {
	transport.Mesh
	transport.Sharer
}

func (noPeerWrite) PeerWrite() bool { return false }

// One member whose mesh does not let peers write its buffers makes every
// member copy, with the same bits.
func TestDirectWriteMixed(t *testing.T) {
	smallDirect(t)
	for _, members := range []int{2, 3} {
		t.Run(fmt.Sprint("members=", members), func(t *testing.T) {
			meshes := transport.NewMemWith(members, transport.MemOptions{Streams: 2, CRC: true, PeerWrite: true})
			meshes[members-1] = noPeerWrite{meshes[members-1], meshes[members-1].(transport.Sharer)}
			cl := newClusterMesh(t, meshes, Options{SmallBytes: -1, ChunkBytes: testChunk}, DefaultMaxUnexpected)
			rng := rand.New(rand.NewPCG(19, uint64(members)))
			inputs := make([][]byte, members)
			bufs := make([][]byte, members)
			for m := range inputs {
				inputs[m] = randData(rng, reduce.Float32, 3001)
				bufs[m] = shared(t, cl, m, inputs[m])
			}
			want := ReferenceAllReduceAlgo(AlgoDirect, reduce.Avg, reduce.Float32, inputs, members)
			requireNoErrors(t, cl.each(func(m int, c *Comm) error {
				return c.AllReduce(context.Background(), bufs[m], reduce.Float32, reduce.Avg, nil)
			}))
			for m := range bufs {
				requireBits(t, want, bufs[m], 4, "member %d", m)
				assert.Equal(t, AlgoDirect, cl.comms[m].Algorithm(), "member %d", m)
			}
		})
	}
}

// foldParallel gives every destination the reference's bits (Finish
// included), 2 or more operands, each destination an operand or apart,
// over any number of workers, with either copy; it writes nothing once
// the context is done.
func TestFoldParallel(t *testing.T) {
	rng := rand.New(rand.NewPCG(20, 21))
	for _, n := range []int{2, 3, 5} {
		for _, L := range []int{4, 64, 4096 + 12, 300 << 10} {
			srcs := make([][]byte, n)
			for i := range srcs {
				srcs[i] = randData(rng, reduce.Float16, L/2)
			}
			want, err := reduce.Reference(reduce.Avg, reduce.Float16, srcs)
			require.NoError(t, err)
			for _, w := range []int{1, 3} {
				for ci, cp := range []func(dst, src []byte) int{plainCopy, ntcopy.Copy} {
					ops := make([][]byte, n)
					for i := range ops {
						ops[i] = slices.Clone(srcs[i])
					}
					apart := make([]byte, L)
					dsts := append(slices.Clone(ops), apart)
					require.NoError(t, foldParallel(context.Background(), reduce.Avg, reduce.Float16, n, dsts, ops, cp, w))
					for d, dst := range dsts {
						requireBits(t, want, dst, 2, "%d operands of %d bytes, destination %d, %d workers, copy %d", n, L, d, w, ci)
					}
				}
			}
		}
	}
	ctx, cancel := context.WithCancel(context.Background())
	cancel()
	srcs := [][]byte{randData(rng, reduce.Float32, 100), randData(rng, reduce.Float32, 100)}
	dst := make([]byte, 400)
	require.ErrorIs(t, foldParallel(ctx, reduce.Sum, reduce.Float32, 2, [][]byte{dst}, srcs, ntcopy.Copy, 1), errSibling)
	assert.Equal(t, make([]byte, 400), dst)
}

// A descriptor decodes only with known flags and zero reserved bytes, and
// then encodes back to the same bytes.
func FuzzParseDesc(f *testing.F) {
	var b [descSize]byte
	desc{id: 3, off: 128, flags: descShared | descStreamed | descWritable}.put(b[:])
	f.Add(b[:])
	f.Add(make([]byte, descSize))
	f.Fuzz(func(t *testing.T, in []byte) {
		if len(in) < descSize {
			return
		}
		in = in[:descSize]
		d, err := parseDesc(in)
		if err != nil {
			return
		}
		require.Zero(t, d.flags&^(descShared|descStreamed|descWritable))
		var out [descSize]byte
		d.put(out[:])
		require.Equal(t, in, out[:])
	})
}
