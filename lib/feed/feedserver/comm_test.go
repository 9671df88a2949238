package feedserver

import (
	"bytes"
	"context"
	"encoding/binary"
	"fmt"
	"math"
	"math/rand/v2"
	"sort"
	"sync"
	"testing"
	"time"

	"github.com/gpubridge/gpubridge/lib/collective"
	"github.com/gpubridge/gpubridge/lib/feed"
	"github.com/gpubridge/gpubridge/lib/feed/feedtest"
	"github.com/gpubridge/gpubridge/lib/reduce"
	"github.com/gpubridge/gpubridge/lib/testenv"
	"github.com/gpubridge/gpubridge/lib/transport"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

// commBridges returns n collective.Comms over in-memory meshes.
func commBridges(t testing.TB, n int, chunk int) []Bridge {
	t.Helper()
	return commBridgesWith(t, n, chunk, false)
}

// commBridgesWith is commBridges over meshes that let peers write each
// other's shared buffers when peerWrite is set (transport.Config.PeerWrite).
func commBridgesWith(t testing.TB, n int, chunk int, peerWrite bool) []Bridge {
	t.Helper()
	var out []Bridge
	for _, m := range transport.NewMemWith(n, transport.MemOptions{Streams: 2, CRC: true, PeerWrite: peerWrite}) {
		c := collective.New(m, collective.Options{ChunkBytes: chunk, Workers: 2})
		t.Cleanup(func() { _ = c.Close() })
		out = append(out, c)
	}
	return out
}

func randomF32(r *rand.Rand, b []byte) {
	for i := 0; i+4 <= len(b); i += 4 {
		binary.LittleEndian.PutUint32(b[i:], math.Float32bits(float32(r.NormFloat64()*1000)))
	}
}

// TestWithCollective runs every request type through two feed servers over
// collective.Comms on in-memory meshes, checking results bit for bit
// against the collective package's reference.
func TestWithCollective(t *testing.T) {
	const chunk = 4096
	e := startFeeds(t, commBridges(t, 2, chunk), nil)
	ctx := context.Background()
	cs := e.clients
	regs := mapRegions(t, cs, 1<<20)
	r := rand.New(rand.NewPCG(1, 2))

	// all_reduce of odd sizes, plain and streamed.
	for _, n := range []int{4, 4 * 1001, 4 * 65537} {
		for _, streamed := range []bool{false, true} {
			allReduceBitExact(t, cs, regs, r, n, streamed)
		}
	}

	// broadcast from member 1.
	randomF32(r, regs[1].Mem[:40000])
	want := append([]byte(nil), regs[1].Mem[:40000]...)
	parallel(t, 2, func(i int) error { return cs[i].Broadcast(ctx, regs[i].Span(0, 40000), 1) })
	assert.True(t, bytes.Equal(want, regs[0].Mem[:40000]))

	// all_gather, in place: the input is this member's slot of the output.
	const slot = 10000
	for i, reg := range regs {
		for k := 0; k < slot; k++ {
			reg.Mem[100000+i*slot+k] = byte(i*7 + k)
		}
	}
	parallel(t, 2, func(i int) error {
		return cs[i].AllGather(ctx, regs[i].Span(100000, 2*slot), regs[i].Span(100000+i*slot, slot))
	})
	for i := range regs {
		for m := 0; m < 2; m++ {
			for k := 0; k < slot; k += 999 {
				require.Equal(t, byte(m*7+k), regs[i].Mem[100000+m*slot+k])
			}
		}
	}

	// reduce_scatter of bfloat16 max.
	inputs := make([][]byte, 2)
	for i, reg := range regs {
		for k := 0; k < 8000; k += 2 {
			binary.LittleEndian.PutUint16(reg.Mem[200000+k:], uint16(r.Uint32()&0x7f7f))
		}
		inputs[i] = append([]byte(nil), reg.Mem[200000:208000]...)
	}
	wantRS := collective.ReferenceReduceScatter(reduce.Max, reduce.BFloat16, inputs, 2)
	parallel(t, 2, func(i int) error {
		return cs[i].ReduceScatter(ctx, regs[i].Span(300000, 4000), regs[i].Span(200000, 8000), reduce.BFloat16, reduce.Max)
	})
	for i := range regs {
		assert.True(t, bytes.Equal(wantRS[i], regs[i].Mem[300000:304000]), "member %d", i)
	}

	// barrier, then tagged send/recv in both directions while a collective runs.
	parallel(t, 2, func(i int) error { return cs[i].Barrier(ctx) })
	copy(regs[0].Mem[500000:], "hello from zero")
	parallel(t, 2, func(i int) error {
		if i == 0 {
			if err := cs[0].Send(ctx, 1, 5, regs[0].Span(500000, 15)); err != nil {
				return err
			}
			return cs[0].Barrier(ctx)
		}
		if err := cs[1].Barrier(ctx); err != nil {
			return err
		}
		n, err := cs[1].Recv(ctx, 0, 5, regs[1].Span(600000, 100))
		if err == nil && string(regs[1].Mem[600000:600000+n]) != "hello from zero" {
			t.Errorf("received %q", regs[1].Mem[600000:600000+n])
		}
		return err
	})
	e.closeAll()
}

// TestCollectiveMismatch: members that disagree get a bridge error naming
// the peer, and the bridge is broken on both.
func TestCollectiveMismatch(t *testing.T) {
	e := startFeeds(t, commBridges(t, 2, 4096), nil)
	ctx := context.Background()
	regs := mapRegions(t, e.clients, 4096)
	errs := make([]error, 2)
	var wg sync.WaitGroup
	for i := range 2 {
		wg.Add(1)
		go func() {
			defer wg.Done()
			errs[i] = e.clients[i].AllReduce(ctx, regs[i].Span(0, 8*(i+1)), reduce.Float32, reduce.Sum)
		}()
	}
	wg.Wait()
	for i, err := range errs {
		var re *feedtest.RequestError
		require.ErrorAs(t, err, &re, "member %d", i)
		assert.Equal(t, feed.StatusBridgeError, re.Status)
		assert.Contains(t, re.Msg, "member")
		err = e.clients[i].Barrier(ctx)
		require.ErrorAs(t, err, &re)
		assert.Equal(t, feed.StatusBroken, re.Status)
		assert.Contains(t, re.Msg, "bridge broken by an earlier failure")
	}
	e.closeAll()
}

// TestP2PBehindCollective: member 0 sends an all_reduce and then a send
// without waiting; member 1 first waits for that message and only then
// joins the all_reduce. The send must not wait for the all_reduce (as with
// NCCL, where point-to-point runs beside collectives), or both would hang.
func TestP2PBehindCollective(t *testing.T) {
	for _, delay := range []time.Duration{-1, DefaultHandoffDelay, 20 * time.Millisecond} {
		t.Run(delay.String(), func(t *testing.T) {
			e := startFeeds(t, commBridges(t, 2, 4096), func(o *ServerOptions) { o.HandoffDelay = delay })
			ctx, cancel := context.WithTimeout(context.Background(), testenv.Scale(20*time.Second))
			defer cancel()
			regs := mapRegions(t, e.clients, 4096)
			copy(regs[0].Mem[100:], "ping")
			parallel(t, 2, func(i int) error {
				c := e.clients[i]
				if i == 0 {
					ar, err := c.Start(feed.Request{Kind: feed.MsgAllReduce, Buf: regs[0].Span(0, 4), DType: reduce.Float32, Op: reduce.Sum, Peer: -1}, nil)
					if err != nil {
						return err
					}
					if err := c.Send(ctx, 1, 3, regs[0].Span(100, 4)); err != nil {
						return err
					}
					_, err = ar.Wait(ctx)
					return err
				}
				n, err := c.Recv(ctx, 0, 3, regs[1].Span(100, 16))
				if err != nil || n != 4 || string(regs[1].Mem[100:104]) != "ping" {
					return fmt.Errorf("recv: %d bytes, %v", n, err)
				}
				return c.AllReduce(ctx, regs[1].Span(0, 4), reduce.Float32, reduce.Sum)
			})
			e.closeAll()
		})
	}
}

// allReduceBitExact all-reduces n random bytes of float32 on both members,
// streamed or not, and checks the result against the reference and that
// the PROGRESS ranges of a streamed one cover it once.
func allReduceBitExact(t *testing.T, cs []*feedtest.Client, regs []*feedtest.Region, r *rand.Rand, n int, streamed bool) {
	t.Helper()
	ctx := context.Background()
	inputs := make([][]byte, 2)
	for i, reg := range regs {
		randomF32(r, reg.Mem[:n])
		inputs[i] = append([]byte(nil), reg.Mem[:n]...)
	}
	want := collective.ReferenceAllReduce(reduce.Sum, reduce.Float32, inputs, 2)
	var mu sync.Mutex
	cover := make([][][2]uint64, 2)
	parallel(t, 2, func(i int) error {
		req := feed.Request{Kind: feed.MsgAllReduce, Buf: regs[i].Span(0, n), DType: reduce.Float32, Op: reduce.Sum, Peer: -1}
		if !streamed {
			_, err := cs[i].Do(ctx, req)
			return err
		}
		req.Flags = feed.FlagStreamed
		k, err := cs[i].Start(req, func(off, m uint64) {
			mu.Lock()
			cover[i] = append(cover[i], [2]uint64{off, m})
			mu.Unlock()
		})
		if err != nil {
			return err
		}
		for end := 0; end < n; {
			end = min(end+3000, n)
			if err := k.Ready(end); err != nil {
				return err
			}
		}
		_, err = k.Wait(ctx)
		return err
	})
	for i, reg := range regs {
		require.True(t, bytes.Equal(want, reg.Mem[:n]), "member %d, %d bytes, streamed %v: result differs from the reference", i, n, streamed)
		if streamed {
			rs := cover[i]
			sort.Slice(rs, func(a, b int) bool { return rs[a][0] < rs[b][0] })
			var at uint64
			for _, x := range rs {
				require.Equal(t, at, x[0])
				at += x[1]
			}
			require.Equal(t, uint64(n), at)
		}
	}
}

// Over a mesh that shares memory the regions are offered to the other
// members, and a large all_reduce reduces straight from them (and writes
// the results into them, where the meshes let peers write); with NoShare
// the collectives copy through the transport. All are exact, and released
// regions are withdrawn (a new region of the same id works).
func TestSharedRegions(t *testing.T) {
	for _, c := range []struct {
		noShare, peerWrite bool
		want               string
	}{{false, false, collective.AlgoDirect}, {false, true, collective.AlgoDirectWrite}, {true, true, collective.AlgoExchange}} {
		t.Run(fmt.Sprintf("noShare=%v/peerWrite=%v", c.noShare, c.peerWrite), func(t *testing.T) {
			noShare, want := c.noShare, c.want
			bs := commBridgesWith(t, 2, 64<<10, c.peerWrite)
			e := startFeeds(t, bs, func(o *ServerOptions) { o.NoShare = noShare })
			ctx := context.Background()
			r := rand.New(rand.NewPCG(5, 6))
			for round := range 2 {
				regs := mapRegions(t, e.clients, 2<<20)
				for _, streamed := range []bool{false, true} {
					allReduceBitExact(t, e.clients, regs, r, 4*300001, streamed)
					for i, b := range bs {
						assert.Equal(t, want, b.(*collective.Comm).Algorithm(), "round %d, member %d", round, i)
					}
				}
				for i, c := range e.clients {
					require.NoError(t, c.Release(ctx, regs[i]))
				}
			}
			e.closeAll()
		})
	}
}

// A caller-reduces all_reduce (version 2) exchanges the inputs unreduced:
// out holds every member's input in member order, streamed or not, with
// the input in its own slot or apart; the caller reduces. A version 1
// session refuses the flag.
func TestCallerReduces(t *testing.T) {
	const n = 4 * 65537
	for _, members := range []int{2, 3} {
		t.Run(fmt.Sprint("members=", members), func(t *testing.T) {
			e := startFeeds(t, commBridges(t, members, 64<<10), nil)
			ctx := context.Background()
			regs := mapRegions(t, e.clients, (members+1)*n)
			r := rand.New(rand.NewPCG(7, uint64(members)))
			for _, inPlace := range []bool{true, false} {
				for _, streamed := range []bool{false, true} {
					var want []byte
					inputs := make([][]byte, members)
					for i := range members {
						inputs[i] = make([]byte, n)
						randomF32(r, inputs[i])
						want = append(want, inputs[i]...)
					}
					var mu sync.Mutex
					cover := make([]uint64, members)
					parallel(t, members, func(i int) error {
						in := regs[i].Span(members*n, n)
						if inPlace {
							in = regs[i].Span(i*n, n)
						}
						copy(regs[i].Mem[in.Off:], inputs[i])
						req := feed.Request{Kind: feed.MsgAllReduce, Flags: feed.FlagCallerReduces, Buf: in, Out: regs[i].Span(0, members*n),
							DType: reduce.Float32, Op: reduce.Sum, Peer: -1}
						if !streamed {
							d, err := e.clients[i].Do(ctx, req)
							if err == nil && d.Bytes != uint64(members*n) {
								err = fmt.Errorf("DONE says %d bytes", d.Bytes)
							}
							return err
						}
						req.Flags |= feed.FlagStreamed
						k, err := e.clients[i].Start(req, func(_, m uint64) {
							mu.Lock()
							cover[i] += m
							mu.Unlock()
						})
						if err != nil {
							return err
						}
						for end := 0; end < n; {
							end = min(end+10000, n)
							if err := k.Ready(end); err != nil {
								return err
							}
						}
						_, err = k.Wait(ctx)
						return err
					})
					for i := range members {
						require.True(t, bytes.Equal(want, regs[i].Mem[:members*n]), "member %d, in place %v, streamed %v", i, inPlace, streamed)
						if streamed {
							assert.Equal(t, uint64(members*n), cover[i], "PROGRESS covers the output")
						}
					}
				}
			}
			e.closeAll()
		})
	}
	t.Run("version 1", func(t *testing.T) {
		conn, _ := rawFeed(t, newFakeGroup(1, 8)[0], ServerOptions{Members: 1})
		assert.Equal(t, uint16(1), hello(t, conn).Version)
		req := feed.Request{Kind: feed.MsgAllReduce, ID: 1, Flags: feed.FlagCallerReduces, Buf: feed.Span{Region: 1, Len: 4},
			Out: feed.Span{Region: 1, Len: 4}, DType: reduce.Float32, Op: reduce.Sum, Peer: -1}
		_, err := conn.Write(req.Append(nil))
		require.NoError(t, err)
		d, ok := readMsg(t, conn).(*feed.DoneMsg)
		require.True(t, ok)
		assert.Equal(t, feed.StatusBadRequest, d.Status)
		assert.Contains(t, d.Error, "flag caller-reduces (0x2) is feed protocol 2; this feed speaks version 1")
	})
}
