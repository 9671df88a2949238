package collective

import (
	"context"
	"errors"
	"fmt"
	"math/rand/v2"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/gpubridge/gpubridge/lib/reduce"
	"github.com/gpubridge/gpubridge/lib/testenv"
	"github.com/gpubridge/gpubridge/lib/transport"
	"github.com/gpubridge/gpubridge/lib/wire"
)

// piecesHold makes newCluster's streams pieceHoldStreams and its
// communicators overlap the reading of pieces with their reduction
// (Options.Overlap on).
var piecesHold bool

type pieceHoldMesh struct{ transport.Mesh }

func (m pieceHoldMesh) Stream(peer, i int) transport.Stream {
	return newPieceHoldStream(m.Mesh.Stream(peer, i))
}

// pieceHoldStream is a pieceStream whose receiver may hold the pieces
// (transport.PieceHolder), as TCP streams let it: each piece is copied into
// one of transport.MaxHeldPieces buffers, and a piece beyond them waits for
// a release. A released buffer is overwritten with garbage at once, so that
// a piece used after its release gives wrong bits.
type pieceHoldStream struct {
	pieceStream
	free chan []byte
}

func newPieceHoldStream(st transport.Stream) pieceHoldStream {
	free := make(chan []byte, transport.MaxHeldPieces)
	for range transport.MaxHeldPieces {
		free <- make([]byte, testPiece)
	}
	return pieceHoldStream{pieceStream{st}, free}
}

var (
	heldPieces     atomic.Int64 // handed out by pieceHoldStreams, not released yet
	doubleReleases atomic.Int64 // releases of a piece released already
)

func (s pieceHoldStream) RecvPiecesHold(ctx context.Context, check func(wire.Header) error, fn func(off int, p []byte, release func()) error) error {
	return s.Recv(ctx, func(h wire.Header, p []byte) error {
		if err := check(h); err != nil {
			return err
		}
		for off := 0; off < len(p); off += testPiece {
			var b []byte
			select {
			case b = <-s.free:
			case <-ctx.Done():
				return ctx.Err()
			}
			n := copy(b, p[off:])
			heldPieces.Add(1)
			var once atomic.Bool
			release := func() {
				if !once.CompareAndSwap(false, true) {
					doubleReleases.Add(1)
					return
				}
				garbage(b)
				heldPieces.Add(-1)
				s.free <- b
			}
			if err := fn(off, b[:n], release); err != nil {
				return err
			}
		}
		return nil
	})
}

// requireOverlapped checks that the pieces of some stream were read ahead
// of their reduction since overlaps was before when want, and none
// otherwise, and that every piece a pieceHoldStream handed out was
// released once.
func requireOverlapped(t testing.TB, want bool, before int64) {
	t.Helper()
	if want {
		require.Greater(t, overlaps.Load(), before, "no stream's pieces were read ahead of their reduction")
	} else {
		require.Equal(t, before, overlaps.Load(), "pieces read ahead of their reduction")
	}
	requireReleased(t)
}

// requireReleased checks that every piece a pieceHoldStream handed out was
// released once.
func requireReleased(t testing.TB) {
	t.Helper()
	require.Zero(t, heldPieces.Load(), "pieces never released")
	require.Zero(t, doubleReleases.Load(), "pieces released twice")
}

// The collectives, their streamed inputs and their failures work with
// the pieces read ahead of their reduction.
func TestPiecesOverlap(t *testing.T) {
	piecesHold = true
	defer func() { piecesHold = false }()
	before := overlaps.Load()
	t.Run("AllReduce", TestAllReduce)
	t.Run("Broadcast", TestBroadcast)
	t.Run("AllGather", TestAllGather)
	t.Run("ReduceScatter", TestReduceScatter)
	t.Run("Ready", TestReady)
	t.Run("Mismatch", TestMismatch)
	// (runCore's others: a member that stalls on the ring's or the
	// exchange's data streams, the failures that matter here.)
	for _, cfg := range []stallCase{{2, "all_reduce"}, {4, "all_reduce"}} {
		t.Run(fmt.Sprintf("StalledMember/%s/%d", cfg.op, cfg.members), func(t *testing.T) { testStalledMember(t, cfg) })
	}
	t.Run("PeerClosed", TestPeerClosed)
	requireOverlapped(t, true, before)
}

// The overlapped path gives the reference's bits: frames of one piece
// (which keep the one goroutine), of several with a ragged last, several
// chunks per stream, 2 and 4 members (exchange and ring), sum and max,
// float32 and bfloat16; Overlap off takes the one-goroutine path over the
// same streams, with the same bits.
func TestOverlapAllReduce(t *testing.T) {
	for _, members := range []int{2, 4} {
		for _, streams := range []int{1, 2} {
			for _, overlap := range []Overlap{OverlapOn, OverlapOff} {
				t.Run(fmt.Sprintf("members=%d/streams=%d/overlap=%s", members, streams, overlap), func(t *testing.T) {
					meshes := transport.NewMem(members, streams, false)
					for i, m := range meshes {
						meshes[i] = pieceHoldMesh{m}
					}
					cl := newClusterMesh(t, meshes, Options{ChunkBytes: testChunk, SmallBytes: -1, Overlap: overlap}, DefaultMaxUnexpected)
					rng := rand.New(rand.NewPCG(97, uint64(members*10+streams)))
					for _, dt := range []reduce.DType{reduce.Float32, reduce.BFloat16} {
						es := dt.Size()
						for _, sz := range []struct {
							what  string
							bytes int
						}{
							{"one piece", testPiece - 2*es},
							{"a piece and a ragged one", members * (testPiece + es)},
							{"one chunk, ragged last piece", members * (testChunk - 3*es)},
							{"chunks per stream", members * (3*streams*testChunk + 5*es)},
						} {
							for _, op := range []reduce.Op{reduce.Sum, reduce.Max} {
								inputs := make([][]byte, members)
								for m := range inputs {
									inputs[m] = randData(rng, dt, sz.bytes/es)
								}
								want := wantAllReduce(cl.comms[0], op, dt, inputs)
								algo := map[bool]string{true: AlgoExchange, false: AlgoRing}[members == 2]
								before := overlaps.Load()
								runAllReduce(t, cl, dt, op, Codec{}, inputs, want, algo, fmt.Sprintf("%s %s, %s", dt, op, sz.what))
								// A stream that receives one piece in the
								// call reads it and reduces it, without a
								// hand-over (the ring's receives one per
								// step).
								one := sz.what == "one piece" && members == 2
								requireOverlapped(t, overlap == OverlapOn && !one, before)
							}
						}
					}
				})
			}
		}
	}
}

// The other collectives read ahead too, with their results exact.
func TestOverlapCollectives(t *testing.T) {
	const members = 3
	meshes := transport.NewMem(members, 2, false)
	for i, m := range meshes {
		meshes[i] = pieceHoldMesh{m}
	}
	cl := newClusterMesh(t, meshes, Options{ChunkBytes: testChunk, Overlap: OverlapOn}, DefaultMaxUnexpected)
	rng := rand.New(rand.NewPCG(98, 1))
	const L = 3*testChunk + 20
	ins := make([][]byte, members)
	for m := range ins {
		ins[m] = randData(rng, reduce.BFloat16, members*L/2)
	}
	wantRS := ReferenceReduceScatter(reduce.Max, reduce.BFloat16, ins, members)
	before := overlaps.Load()
	outs, bc, ag := make([][]byte, members), make([][]byte, members), make([][]byte, members)
	requireNoErrors(t, cl.each(func(m int, c *Comm) error {
		outs[m] = make([]byte, L)
		if err := c.ReduceScatter(context.Background(), outs[m], ins[m], reduce.BFloat16, reduce.Max, nil); err != nil {
			return err
		}
		bc[m] = make([]byte, len(ins[m]))
		if m == 2 {
			copy(bc[m], ins[m])
		}
		if err := c.Broadcast(context.Background(), bc[m], 2, nil); err != nil {
			return err
		}
		ag[m] = make([]byte, members*L)
		return c.AllGather(context.Background(), ag[m], ins[m][:L], nil)
	}))
	for m := range outs {
		requireBits(t, wantRS[m], outs[m], 2, "reduce_scatter, member %d", m)
		requireBits(t, ins[2], bc[m], 2, "broadcast, member %d", m)
		for k := range members {
			requireBits(t, ins[k][:L], ag[m][k*L:(k+1)*L], 2, "all_gather slot %d, member %d", k, m)
		}
	}
	requireOverlapped(t, true, before)
}

func TestOverlapOption(t *testing.T) {
	for o, want := range map[Overlap]bool{OverlapAuto: false, OverlapOn: true, OverlapOff: false} {
		assert.Equal(t, want, o.on(), "%s", o)
	}
	for _, o := range []Overlap{OverlapAuto, OverlapOn, OverlapOff} {
		got, err := ParseOverlap(o.String())
		require.NoError(t, err)
		assert.Equal(t, o, got, "%s", o)
	}
	_, err := ParseOverlap("yes")
	require.ErrorContains(t, err, `overlap "yes": want auto, on or off`)
}

// failingMesh's data streams from member 1 to member 0 fail in the middle
// of the frame of chunk 1 (its third piece), as a connection that breaks
// there does: the call fails with the transport's error, the same with
// the pieces read ahead or not.
type failingMesh struct{ transport.Mesh }

type failingStream struct{ pieceHoldStream }

func (m failingMesh) Stream(peer, i int) transport.Stream {
	return failingStream{newPieceHoldStream(m.Mesh.Stream(peer, i))}
}

var errBrokeMidFrame = &transport.PeerError{Peer: "member 1", Err: fmt.Errorf("%w (stream 1: unexpected EOF): did it die?", transport.ErrConnClosed)}

func (s failingStream) RecvPieces(ctx context.Context, check func(wire.Header) error, fn func(off int, p []byte) error) error {
	return s.RecvPiecesHold(ctx, check, func(off int, p []byte, release func()) error {
		defer release()
		return fn(off, p)
	})
}

func (s failingStream) RecvPiecesHold(ctx context.Context, check func(wire.Header) error, fn func(off int, p []byte, release func()) error) error {
	var chunk uint32
	err := s.pieceHoldStream.RecvPiecesHold(ctx, func(h wire.Header) error {
		chunk = h.Chunk
		return check(h)
	}, func(off int, p []byte, release func()) error {
		if chunk == 1 && off == 2*testPiece {
			release()
			return errBrokeMidFrame
		}
		return fn(off, p, release)
	})
	return err
}

func TestOverlapPeerFailsMidFrame(t *testing.T) {
	texts := map[Overlap]string{}
	for _, overlap := range []Overlap{OverlapOff, OverlapOn} {
		meshes := transport.NewMem(2, 2, false)
		meshes[0] = failingMesh{meshes[0]}
		meshes[1] = pieceHoldMesh{meshes[1]}
		cl := newClusterMesh(t, meshes, Options{ChunkBytes: testChunk, Overlap: overlap, Timeout: testenv.Scale(5 * time.Second)}, DefaultMaxUnexpected)
		before := overlaps.Load()
		errs := cl.each(func(m int, c *Comm) error {
			return c.AllReduce(context.Background(), make([]byte, 6*testChunk), reduce.Float32, reduce.Sum, nil)
		})
		t.Logf("overlap %s: %v", overlap, errs)
		require.ErrorIs(t, errs[0], transport.ErrConnClosed)
		require.ErrorContains(t, errs[0], "all_reduce #1 (float32 sum, 6 KiB): member 1: connection closed (stream 1: unexpected EOF)")
		// Member 1 learns it from member 0's abort (or, having finished,
		// at its next call).
		if errs[1] == nil {
			errs[1] = cl.comms[1].Barrier(context.Background())
		}
		require.ErrorContains(t, errs[1], "connection closed (stream 1: unexpected EOF)")
		requireOverlapped(t, overlap == OverlapOn, before)
		texts[overlap] = errs[0].Error()
	}
	assert.Equal(t, texts[OverlapOff], texts[OverlapOn], "the same error either way")
}

// Over real TCP (PieceHolder: the TCP stream's own buffers, pieces of 512
// KiB) the overlapped path and the one-goroutine path give the reference's
// bits, for frames of one piece, of several with a ragged last, several
// chunks per stream, 2 members (exchange) and 4 (ring); and a peer that
// aborts in the middle of the call is reported the same way by both.
func TestOverlapRealTCP(t *testing.T) {
	ctx := context.Background()
	for _, members := range []int{2, 4} {
		t.Run(fmt.Sprint("members=", members), func(t *testing.T) {
			cl := newClusterMesh(t, realMeshes(t, transport.TCP, members, 2), Options{ChunkBytes: 1 << 20, Timeout: testenv.Scale(30 * time.Second)}, DefaultMaxUnexpected)
			rng := rand.New(rand.NewPCG(99, uint64(members)))
			for _, c := range []struct {
				dt      reduce.DType
				op      reduce.Op
				bytes   int
				several bool // pieces per stream in the call
			}{
				// One piece per stream and call (2 members; the ring's
				// 6 steps of 50 KiB for 4).
				{reduce.BFloat16, reduce.Max, 200 << 10, false},
				// Chunks of 2 pieces, a ragged last chunk.
				{reduce.Float32, reduce.Sum, members*(2<<20) + members*4*1234, true},
			} {
				inputs := make([][]byte, members)
				for m := range inputs {
					inputs[m] = randData(rng, c.dt, c.bytes/c.dt.Size())
				}
				want := wantAllReduce(cl.comms[0], c.op, c.dt, inputs)
				for _, on := range []bool{true, false} {
					for _, cm := range cl.comms {
						cm.overlap = on
					}
					before := overlaps.Load()
					runAllReduce(t, cl, c.dt, c.op, Codec{}, inputs, want, map[bool]string{true: AlgoExchange, false: AlgoRing}[members == 2],
						fmt.Sprintf("%s %s, %d bytes, overlap %v", c.dt, c.op, c.bytes, on))
					requireOverlapped(t, on && c.several, before)
				}
			}
		})
	}
	t.Run("abort", func(t *testing.T) {
		for _, on := range []bool{true, false} {
			cl := newClusterMesh(t, realMeshes(t, transport.TCP, 2, 2), Options{ChunkBytes: 1 << 20, Timeout: testenv.Scale(30 * time.Second)}, DefaultMaxUnexpected)
			const n = 8 << 20
			var abort, first sync.Once
			started := make(chan struct{}) // member 0 has a result chunk: it is in the call
			errs := cl.each(func(m int, c *Comm) error {
				c.overlap = on
				p := &Progress{Done: func(int, int) { first.Do(func() { close(started) }) }}
				if m == 1 {
					// Part of the input goes out, then the member gives up.
					p = &Progress{Ready: func(ctx context.Context, end int) error {
						if end > n/2 {
							select {
							case <-started:
							case <-ctx.Done():
								return ctx.Err()
							}
							abort.Do(func() { c.Mesh().Abort(errors.New("GPU fell off the bus")) })
							<-ctx.Done()
							return ctx.Err()
						}
						return nil
					}}
				}
				return c.AllReduce(ctx, make([]byte, n), reduce.Float32, reduce.Sum, p)
			})
			t.Logf("overlap %v: %v", on, errs[0])
			require.ErrorContains(t, errs[0], "all_reduce #1 (float32 sum, 8 MiB): ")
			require.ErrorContains(t, errs[0], "member 1")
			require.ErrorContains(t, errs[0], "GPU fell off the bus")
			require.False(t, strings.Contains(errs[0].Error(), "timed out"), "promptly: %v", errs[0])
		}
	})
}
