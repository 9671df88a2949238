package feedserver

import (
	"bytes"
	"context"
	"encoding/binary"
	"fmt"
	"math"
	"math/rand/v2"
	"slices"
	"sync"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/gpubridge/gpubridge/lib/codec"
	"github.com/gpubridge/gpubridge/lib/collective"
	"github.com/gpubridge/gpubridge/lib/feed"
	"github.com/gpubridge/gpubridge/lib/reduce"
)

// randomValues fills b with values of dt: normal, times scale, rounded to
// dt.
func randomValues(r *rand.Rand, dt reduce.DType, b []byte, scale float64) {
	es := dt.Size()
	for i := 0; i+es <= len(b); i += es {
		f := float32(r.NormFloat64() * scale)
		switch dt {
		case reduce.Float32:
			binary.LittleEndian.PutUint32(b[i:], math.Float32bits(f))
		case reduce.BFloat16:
			binary.LittleEndian.PutUint16(b[i:], reduce.F32ToBF16(f))
		case reduce.Float16:
			binary.LittleEndian.PutUint16(b[i:], reduce.F32ToF16(f))
		default:
			panic(dt)
		}
	}
}

// residualOf returns a copy of key's residual (nil: none, or not made yet).
func (f *feedback) residualOf(key uint64) []byte {
	f.mu.Lock()
	defer f.mu.Unlock()
	if r := f.keys[fbKey{key: key}]; r != nil {
		return slices.Clone(r.mem)
	}
	return nil
}

// doneStats decodes a DONE's bridge stats.
func doneStats(t *testing.T, d feed.DoneMsg) feed.BridgeStats {
	t.Helper()
	require.Len(t, d.Ext, 1)
	var b feed.BridgeStats
	require.NoError(t, feed.DecodeBridgeStats(d.Ext[0].Value, &b))
	return b
}

// TestCompressedAllReduce runs lossy all_reduces through feed servers over
// collective.Comms on in-memory meshes (2 members: the exchange; 3: the
// ring), for every dtype each codec takes, sum and avg, streamed or not,
// over consecutive calls with one feedback key and one call without: every
// member's result and residual are bit for bit ReferenceAllReduceCodec's,
// and the DONE's stats count packed bytes and codec time.
func TestCompressedAllReduce(t *testing.T) {
	const E = 70001 // values: not a multiple of 1024, several chunks
	const key = 42
	for _, members := range []int{2, 3} {
		for _, id := range []codec.ID{codec.MXFP8, codec.BF16} {
			for _, dt := range lossyTakes[id] {
				t.Run(fmt.Sprintf("members=%d/%s/%s", members, id, dt), func(t *testing.T) {
					e := startFeeds(t, commBridges(t, members, 64<<10), nil)
					ctx := context.Background()
					n := E * dt.Size()
					packed, err := codec.MaxPackedLen(id, dt, E)
					require.NoError(t, err)
					regs := mapRegions(t, e.clients, n)
					r := rand.New(rand.NewPCG(uint64(members), uint64(id)<<8|uint64(dt)))
					resid := make([][]byte, members)
					for m := range resid {
						resid[m] = make([]byte, 4*E)
					}
					calls := []struct {
						op       reduce.Op
						keyed    bool
						streamed bool
					}{{reduce.Sum, true, false}, {reduce.Avg, true, true}, {reduce.Sum, false, false}, {reduce.Sum, true, true}}
					for k, cl := range calls {
						inputs := make([][]byte, members)
						for m := range members {
							randomValues(r, dt, regs[m].Mem[:n], 100)
							inputs[m] = slices.Clone(regs[m].Mem[:n])
						}
						var residuals [][]byte
						if cl.keyed {
							residuals = resid
						}
						want, res := collective.ReferenceAllReduceCodec(id, cl.op, dt, inputs, residuals, members)
						dones := make([]feed.DoneMsg, members)
						parallel(t, members, func(m int) (err error) {
							req := feed.Request{Kind: feed.MsgAllReduce, Codec: uint8(id), DType: dt, Op: cl.op, Buf: regs[m].Span(0, n), Peer: -1,
								FeedbackKey: key, HasFeedbackKey: cl.keyed}
							if !cl.streamed {
								dones[m], err = e.clients[m].Do(ctx, req)
								return err
							}
							req.Flags = feed.FlagStreamed
							c, err := e.clients[m].Start(req, nil)
							if err != nil {
								return err
							}
							for end := 0; end < n; {
								end = min(end+50000, n)
								if err := c.Ready(end); err != nil {
									return err
								}
							}
							dones[m], err = c.Wait(ctx)
							return err
						})
						for m := range members {
							require.True(t, bytes.Equal(want, regs[m].Mem[:n]), "call %d, member %d: result differs from the reference", k, m)
							got := e.servers[m].fb.residualOf(key)
							if cl.keyed {
								require.True(t, bytes.Equal(res[m], got), "call %d, member %d: residual differs from the reference", k, m)
								resid[m] = res[m]
							} else {
								require.True(t, bytes.Equal(resid[m], got), "call %d, member %d: a call without the key changed its residual", k, m)
							}
							// The exchange sends a member's packing once; the
							// ring a share of the partials and of the result.
							b := doneStats(t, dones[m])
							if members == 2 {
								assert.Equal(t, uint64(packed), b.BytesSent, "call %d, member %d: packed bytes", k, m)
							} else {
								assert.LessOrEqual(t, b.BytesSent, uint64(2*packed), "call %d, member %d: packed bytes", k, m)
								assert.Greater(t, b.BytesSent, uint64(packed), "call %d, member %d: packed bytes", k, m)
							}
							assert.NotZero(t, b.CodecNS, "call %d, member %d: codec time", k, m)
							assert.Equal(t, uint64(n), dones[m].Bytes, "DONE's bytes are the result's")
						}
					}
					e.closeAll()
				})
			}
		}
	}
}

// TestZstdThroughTheFeed: zstd on every collective that takes it gives raw's
// bits, with fewer bytes on the bridge for data that compresses.
func TestZstdThroughTheFeed(t *testing.T) {
	const members = 2
	e := startFeeds(t, commBridges(t, members, 64<<10), nil)
	ctx := context.Background()
	const n = 1 << 18
	regs := mapRegions(t, e.clients, 4*n)
	r := rand.New(rand.NewPCG(9, 9))
	// Small integers: the high byte planes are zeros.
	fill := func(b []byte) {
		for i := 0; i+4 <= len(b); i += 4 {
			binary.LittleEndian.PutUint32(b[i:], uint32(r.IntN(200)))
		}
	}
	zstd := uint8(codec.Zstd)
	check := func(name string, reqs func(m int) feed.Request, want func(inputs [][]byte) [][]byte, in func(m int) []byte, out func(m int) []byte) {
		t.Run(name, func(t *testing.T) {
			inputs := make([][]byte, members)
			for m := range members {
				fill(in(m))
				inputs[m] = slices.Clone(in(m))
			}
			w := want(inputs)
			dones := make([]feed.DoneMsg, members)
			parallel(t, members, func(m int) (err error) {
				dones[m], err = e.clients[m].Do(ctx, reqs(m))
				return err
			})
			for m := range members {
				require.True(t, bytes.Equal(w[m], out(m)), "member %d", m)
				b := doneStats(t, dones[m])
				if b.BytesSent > 0 {
					assert.Less(t, b.BytesSent, uint64(len(inputs[m])), "member %d: zstd packs small integers", m)
					assert.NotZero(t, b.CodecNS)
				}
			}
		})
	}
	check("all_reduce int32 max", func(m int) feed.Request {
		return feed.Request{Kind: feed.MsgAllReduce, Codec: zstd, DType: reduce.Int32, Op: reduce.Max, Buf: regs[m].Span(0, 4*n), Peer: -1}
	}, func(in [][]byte) [][]byte {
		w := collective.ReferenceAllReduce(reduce.Max, reduce.Int32, in, members)
		return [][]byte{w, w}
	}, func(m int) []byte { return regs[m].Mem[:4*n] }, func(m int) []byte { return regs[m].Mem[:4*n] })
	check("broadcast int32 from 1", func(m int) feed.Request {
		return feed.Request{Kind: feed.MsgBroadcast, Codec: zstd, DType: reduce.Int32, Buf: regs[m].Span(0, 4*n), Peer: 1}
	}, func(in [][]byte) [][]byte { return [][]byte{in[1], in[1]} },
		func(m int) []byte { return regs[m].Mem[:4*n] }, func(m int) []byte { return regs[m].Mem[:4*n] })
	check("all_gather bytes", func(m int) feed.Request {
		return feed.Request{Kind: feed.MsgAllGather, Codec: zstd, Buf: regs[m].Span(0, n), Out: regs[m].Span(n, 2*n), Peer: -1}
	}, func(in [][]byte) [][]byte { w := slices.Concat(in...); return [][]byte{w, w} },
		func(m int) []byte { return regs[m].Mem[:n] }, func(m int) []byte { return regs[m].Mem[n : 3*n] })
	check("reduce_scatter float32 sum", func(m int) feed.Request {
		return feed.Request{Kind: feed.MsgReduceScatter, Codec: zstd, DType: reduce.Float32, Op: reduce.Sum, Buf: regs[m].Span(0, 2*n), Out: regs[m].Span(2*n, n), Peer: -1}
	}, func(in [][]byte) [][]byte {
		return collective.ReferenceReduceScatter(reduce.Sum, reduce.Float32, in, members)
	},
		func(m int) []byte { return regs[m].Mem[:2*n] }, func(m int) []byte { return regs[m].Mem[2*n : 3*n] })
	check("caller-reduces int32 sum", func(m int) feed.Request {
		return feed.Request{Kind: feed.MsgAllReduce, Flags: feed.FlagCallerReduces, Codec: zstd, DType: reduce.Int32, Op: reduce.Sum,
			Buf: regs[m].Span(m*n, n), Out: regs[m].Span(0, 2*n), Peer: -1}
	}, func(in [][]byte) [][]byte { w := slices.Concat(in...); return [][]byte{w, w} },
		func(m int) []byte { return regs[m].Mem[m*n : (m+1)*n] }, func(m int) []byte { return regs[m].Mem[:2*n] })
	e.closeAll()
}

// TestLossyCallerReduces: the bridge exchanges the members' packings as
// they are (streamed or not), and a caller that reduces them as §3a says
// ends with the bits of the bridge's own compressed exchange.
func TestLossyCallerReduces(t *testing.T) {
	const E = 5000
	for _, id := range []codec.ID{codec.MXFP8, codec.BF16} {
		for _, dt := range lossyTakes[id] {
			for _, streamed := range []bool{false, true} {
				t.Run(fmt.Sprintf("%s/%s/streamed=%v", id, dt, streamed), func(t *testing.T) {
					e := startFeeds(t, commBridges(t, 2, 16<<10), nil)
					ctx := context.Background()
					p, err := codec.MaxPackedLen(id, dt, E)
					require.NoError(t, err)
					regs := mapRegions(t, e.clients, 2*p)
					r := rand.New(rand.NewPCG(uint64(id), uint64(dt)))
					inputs := make([][]byte, 2)
					packed := make([][]byte, 2)
					for m := range 2 {
						inputs[m] = make([]byte, E*dt.Size())
						randomValues(r, dt, inputs[m], 10)
						packed[m] = make([]byte, p)
						_, err := codec.EncodeChunk(id, packed[m], dt, inputs[m], codec.LosslessOptions{})
						require.NoError(t, err)
						copy(regs[m].Mem[m*p:], packed[m])
					}
					var mu sync.Mutex
					cover := make([]int, 2)
					parallel(t, 2, func(m int) error {
						req := feed.Request{Kind: feed.MsgAllReduce, Flags: feed.FlagCallerReduces, Codec: uint8(id), DType: dt, Op: reduce.Avg,
							Buf: regs[m].Span(m*p, p), Out: regs[m].Span(0, 2*p), Peer: -1}
						if !streamed {
							_, err := e.clients[m].Do(ctx, req)
							return err
						}
						req.Flags |= feed.FlagStreamed
						c, err := e.clients[m].Start(req, func(_, k uint64) {
							mu.Lock()
							cover[m] += int(k)
							mu.Unlock()
						})
						if err != nil {
							return err
						}
						if err := c.Ready(p); err != nil {
							return err
						}
						_, err = c.Wait(ctx)
						return err
					})
					want := slices.Concat(packed...)
					for m := range 2 {
						require.True(t, bytes.Equal(want, regs[m].Mem[:2*p]), "member %d: the slots are the packings", m)
						if streamed {
							assert.Equal(t, 2*p, cover[m])
						}
					}
					// The caller's reduction: dec(slot 0) + dec(slot 1), avg, the dtype.
					acc := make([]byte, 4*E)
					require.NoError(t, codec.DecodeChunk(id, acc, reduce.Float32, packed[0]))
					if id == codec.MXFP8 {
						require.NoError(t, codec.DecodeAddMXFP8(acc, packed[1]))
					} else {
						require.NoError(t, codec.DecodeAddBF16(acc, packed[1]))
					}
					require.NoError(t, reduce.Finish(reduce.Avg, reduce.Float32, acc, 2))
					ref, _ := collective.ReferenceAllReduceCodec(id, reduce.Avg, dt, inputs, nil, 2)
					assert.True(t, bytes.Equal(ref, narrowTo(dt, acc)), "the caller's reduction is the bridge's exchange, bit for bit")
					e.closeAll()
				})
			}
		}
	}
}

// narrowTo rounds float32 values to dt (nearest even), as the caller does
// last.
func narrowTo(dt reduce.DType, f32 []byte) []byte {
	if dt == reduce.Float32 {
		return f32
	}
	out := make([]byte, len(f32)/2)
	for i := range len(out) / 2 {
		f := math.Float32frombits(binary.LittleEndian.Uint32(f32[4*i:]))
		h := reduce.F32ToBF16(f)
		if dt == reduce.Float16 {
			h = reduce.F32ToF16(f)
		}
		binary.LittleEndian.PutUint16(out[2*i:], h)
	}
	return out
}
