package collective

import (
	"context"
	"encoding/binary"
	"fmt"
	"math"
	"math/rand/v2"
	"slices"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/gpubridge/gpubridge/lib/reduce"
	"github.com/gpubridge/gpubridge/lib/testenv"
)

const testChunk = 1 << 10

var testConfigs = []struct{ members, streams int }{
	{1, 1}, {2, 1}, {2, 2}, {2, 4}, {3, 1}, {3, 2}, {3, 4}, {4, 1}, {4, 4}, {5, 2},
}

// testSizes are element counts: empty, one, a few, around one chunk, and
// several chunks per ring segment (odd, so segments and chunks are ragged).
func testSizes(es, members int) []int {
	per := testChunk / es
	return []int{0, 1, 7, per - 1, per + 1, 2*members*per + 5}
}

func supportedOps(dt reduce.DType) []reduce.Op {
	var ops []reduce.Op
	for _, op := range reduce.AllOps() {
		if reduce.Supported(op, dt) == nil {
			ops = append(ops, op)
		}
	}
	return ops
}

func TestAllReduce(t *testing.T) {
	for _, cfg := range testConfigs {
		t.Run(fmt.Sprintf("members=%d/streams=%d", cfg.members, cfg.streams), func(t *testing.T) {
			// SmallBytes of 4 chunks: the smaller sizes run recursive
			// doubling (3 or more members), the largest the ring.
			cl := newCluster(t, cfg.members, cfg.streams, Options{ChunkBytes: testChunk, Workers: 3, SmallBytes: 4 * testChunk})
			rng := rand.New(rand.NewPCG(uint64(cfg.members), uint64(cfg.streams)))
			seq := uint64(0)
			for _, dt := range reduce.AllDTypes() {
				for _, op := range supportedOps(dt) {
					for _, n := range testSizes(dt.Size(), cfg.members) {
						inputs := make([][]byte, cfg.members)
						for m := range inputs {
							inputs[m] = randData(rng, dt, n)
						}
						want := wantAllReduce(cl.comms[0], op, dt, inputs)
						bufs := make([][]byte, cfg.members)
						recs := make([]*doneRecorder, cfg.members)
						errs := cl.each(func(m int, c *Comm) error {
							bufs[m] = slices.Clone(inputs[m])
							recs[m] = &doneRecorder{buf: bufs[m]}
							return c.AllReduce(context.Background(), bufs[m], dt, op, &Progress{Done: recs[m].done})
						})
						requireNoErrors(t, errs)
						seq++
						for m := range bufs {
							what := fmt.Sprintf("%s %s, %d elements, member %d", dt, op, n, m)
							requireBits(t, want, bufs[m], dt.Size(), "%s", what)
							recs[m].check(t, want, what)
							require.Equal(t, seq, cl.comms[m].Seq())
						}
					}
				}
			}
		})
	}
}

// TestAllReduceOrder pins the documented reduction order with values whose
// float32 sum depends on it.
func TestAllReduceOrder(t *testing.T) {
	f32 := func(v ...float32) []byte {
		b := make([]byte, 0, 4*len(v))
		for _, x := range v {
			b = binary.LittleEndian.AppendUint32(b, math.Float32bits(x))
		}
		return b
	}
	// The ring (above SmallBytes; here with it off): with 3 members and
	// 3 elements, segment j is element j; it sums x[j+1] + x[j+2] + x[j]
	// in float32.
	big, one := float32(1<<24), float32(1)
	inputs := [][]byte{f32(big, big, big), f32(one, one, one), f32(-big, -big, -big)}
	got := ReferenceAllReduceAlgo(AlgoRing, reduce.Sum, reduce.Float32, inputs, 3)
	// element 0: x1 + x2 + x0 = (1 - 2^24) + 2^24 = 1
	// element 1: x2 + x0 + x1 = 0 + 1 = 1
	// element 2: x0 + x1 + x2 = (2^24 + 1 rounds to 2^24) - 2^24 = 0
	assert.Equal(t, f32(1, 1, 0), got)
	// Recursive doubling (the default for small buffers): member 2 is
	// folded into member 0 first, (x0 + x2) + x1 = 0 + 1 = 1 everywhere.
	rd := ReferenceAllReduceAlgo(AlgoRecursiveDoubling, reduce.Sum, reduce.Float32, inputs, 3)
	assert.Equal(t, f32(1, 1, 1), rd)
	assert.Equal(t, rd, ReferenceAllReduce(reduce.Sum, reduce.Float32, inputs, 3), "12 bytes are small")

	for _, o := range []struct {
		small int
		want  []byte
		algo  string
	}{{-1, got, AlgoRing}, {0, rd, AlgoRecursiveDoubling}} {
		cl := newCluster(t, 3, 1, Options{SmallBytes: o.small})
		bufs := [][]byte{slices.Clone(inputs[0]), slices.Clone(inputs[1]), slices.Clone(inputs[2])}
		requireNoErrors(t, cl.each(func(m int, c *Comm) error {
			return c.AllReduce(context.Background(), bufs[m], reduce.Float32, reduce.Sum, nil)
		}))
		for m := range bufs {
			assert.Equal(t, o.want, bufs[m], "member %d, SmallBytes %d", m, o.small)
			assert.Equal(t, o.algo, cl.comms[m].Algorithm())
			assert.Equal(t, o.algo, cl.comms[m].AllReduceOrder(len(bufs[m])))
		}
	}
	// Two members: member 0 first, on both.
	two := ReferenceAllReduce(reduce.Sum, reduce.Float32, [][]byte{f32(big + 2), f32(one)}, 2)
	assert.Equal(t, f32(big+2+1), two)
}

// TestAllReduceLarge runs an odd size of several MiB with the default chunk
// and many small chunks.
func TestAllReduceLarge(t *testing.T) {
	if testing.Short() {
		t.Skip("-short: skips the multi-MiB buffers (make test runs them)")
	}
	for _, cfg := range []struct{ members, streams, chunk int }{{2, 4, 0}, {2, 3, 64 << 10}, {4, 2, 0}, {3, 4, 64 << 10}} {
		t.Run(fmt.Sprintf("members=%d/streams=%d/chunk=%d", cfg.members, cfg.streams, cfg.chunk), func(t *testing.T) {
			cl := newCluster(t, cfg.members, cfg.streams, Options{ChunkBytes: cfg.chunk, Workers: 4})
			rng := rand.New(rand.NewPCG(7, uint64(cfg.members)))
			const n = 3<<20 + 12345
			inputs := make([][]byte, cfg.members)
			for m := range inputs {
				inputs[m] = randData(rng, reduce.Float32, n)
			}
			want := ReferenceAllReduce(reduce.Sum, reduce.Float32, inputs, cfg.members)
			bufs := make([][]byte, cfg.members)
			requireNoErrors(t, cl.each(func(m int, c *Comm) error {
				bufs[m] = slices.Clone(inputs[m])
				return c.AllReduce(context.Background(), bufs[m], reduce.Float32, reduce.Sum, nil)
			}))
			for m := range bufs {
				requireBits(t, want, bufs[m], 4, "member %d", m)
			}
		})
	}
}

func TestBroadcast(t *testing.T) {
	for _, cfg := range testConfigs {
		t.Run(fmt.Sprintf("members=%d/streams=%d", cfg.members, cfg.streams), func(t *testing.T) {
			cl := newCluster(t, cfg.members, cfg.streams, Options{ChunkBytes: testChunk})
			rng := rand.New(rand.NewPCG(1, uint64(cfg.members)))
			for _, size := range testSizes(1, 2) {
				for root := range cfg.members {
					src := randBytes(rng, size)
					bufs := make([][]byte, cfg.members)
					recs := make([]*doneRecorder, cfg.members)
					requireNoErrors(t, cl.each(func(m int, c *Comm) error {
						bufs[m] = make([]byte, size)
						if m == root {
							copy(bufs[m], src)
						}
						recs[m] = &doneRecorder{buf: bufs[m]}
						return c.Broadcast(context.Background(), bufs[m], root, &Progress{Done: recs[m].done})
					}))
					for m := range bufs {
						what := fmt.Sprintf("%d bytes from %d, member %d", size, root, m)
						requireBits(t, src, bufs[m], 1, "%s", what)
						recs[m].check(t, src, what)
					}
				}
			}
		})
	}
}

func TestAllGather(t *testing.T) {
	for _, cfg := range testConfigs {
		for _, alias := range []bool{false, true} {
			t.Run(fmt.Sprintf("members=%d/streams=%d/inplace=%v", cfg.members, cfg.streams, alias), func(t *testing.T) {
				cl := newCluster(t, cfg.members, cfg.streams, Options{ChunkBytes: testChunk})
				rng := rand.New(rand.NewPCG(2, uint64(cfg.members)))
				for _, size := range testSizes(1, 2) {
					inputs := make([][]byte, cfg.members)
					var want []byte
					for m := range inputs {
						inputs[m] = randBytes(rng, size)
						want = append(want, inputs[m]...)
					}
					outs := make([][]byte, cfg.members)
					recs := make([]*doneRecorder, cfg.members)
					requireNoErrors(t, cl.each(func(m int, c *Comm) error {
						outs[m] = make([]byte, cfg.members*size)
						garbage(outs[m])
						in := slices.Clone(inputs[m])
						if alias {
							in = outs[m][m*size : (m+1)*size]
							copy(in, inputs[m])
						}
						recs[m] = &doneRecorder{buf: outs[m]}
						return c.AllGather(context.Background(), outs[m], in, &Progress{Done: recs[m].done})
					}))
					for m := range outs {
						what := fmt.Sprintf("%d bytes each, member %d", size, m)
						requireBits(t, want, outs[m], 1, "%s", what)
						recs[m].check(t, want, what)
					}
				}
			})
		}
	}
}

func TestReduceScatter(t *testing.T) {
	for _, cfg := range testConfigs {
		t.Run(fmt.Sprintf("members=%d/streams=%d", cfg.members, cfg.streams), func(t *testing.T) {
			cl := newCluster(t, cfg.members, cfg.streams, Options{ChunkBytes: testChunk, Workers: 2})
			rng := rand.New(rand.NewPCG(3, uint64(cfg.members)))
			for _, dt := range reduce.AllDTypes() {
				for _, op := range supportedOps(dt) {
					for i, n := range testSizes(dt.Size(), 1) {
						alias := i%2 == 1
						inputs := make([][]byte, cfg.members)
						for m := range inputs {
							inputs[m] = randData(rng, dt, n*cfg.members)
						}
						want := ReferenceReduceScatter(op, dt, inputs, cfg.members)
						outs := make([][]byte, cfg.members)
						recs := make([]*doneRecorder, cfg.members)
						ins := make([][]byte, cfg.members)
						requireNoErrors(t, cl.each(func(m int, c *Comm) error {
							ins[m] = slices.Clone(inputs[m])
							L := n * dt.Size()
							if alias {
								outs[m] = ins[m][m*L : (m+1)*L]
							} else {
								outs[m] = make([]byte, L)
								garbage(outs[m])
							}
							recs[m] = &doneRecorder{buf: outs[m]}
							return c.ReduceScatter(context.Background(), outs[m], ins[m], dt, op, &Progress{Done: recs[m].done})
						}))
						for m := range outs {
							what := fmt.Sprintf("%s %s, %d elements per member, member %d, in place %v", dt, op, n, m, alias)
							requireBits(t, want[m], outs[m], dt.Size(), "%s", what)
							recs[m].check(t, want[m], what)
							if !alias {
								requireBits(t, inputs[m], ins[m], dt.Size(), "%s: input modified", what)
							}
						}
					}
				}
			}
		})
	}
}

// TestReduceScatterMatchesAllReduce: for sizes where the segments agree,
// reduce_scatter gives the all_reduce's segments bit for bit.
func TestReduceScatterMatchesAllReduce(t *testing.T) {
	rng := rand.New(rand.NewPCG(4, 4))
	for _, members := range []int{2, 3, 4, 5} {
		const per = 97
		inputs := make([][]byte, members)
		for m := range inputs {
			inputs[m] = randData(rng, reduce.BFloat16, per*members)
		}
		all := ReferenceAllReduceAlgo(map[bool]string{true: AlgoExchange, false: AlgoRing}[members == 2], reduce.Sum, reduce.BFloat16, inputs, members)
		rs := ReferenceReduceScatter(reduce.Sum, reduce.BFloat16, inputs, members)
		for m := range members {
			requireBits(t, all[m*per*2:(m+1)*per*2], rs[m], 2, "%d members, segment %d", members, m)
		}
	}
}

func TestBarrier(t *testing.T) {
	for _, members := range []int{1, 2, 3, 4, 5} {
		t.Run(fmt.Sprint(members), func(t *testing.T) {
			cl := newCluster(t, members, 1, Options{})
			rng := rand.New(rand.NewPCG(5, uint64(members)))
			for round := range 5 {
				delays := make([]time.Duration, members)
				for m := range delays {
					delays[m] = time.Duration(rng.IntN(20)) * time.Millisecond
				}
				var entered [8]bool
				var mu = make(chan struct{}, 1)
				requireNoErrors(t, cl.each(func(m int, c *Comm) error {
					time.Sleep(delays[m])
					mu <- struct{}{}
					entered[m] = true
					<-mu
					if err := c.Barrier(context.Background()); err != nil {
						return err
					}
					mu <- struct{}{}
					defer func() { <-mu }()
					for p := range members {
						if !entered[p] {
							return fmt.Errorf("round %d: left the barrier before member %d entered", round, p)
						}
					}
					return nil
				}))
			}
		})
	}
}

// TestMixed runs every collective back to back with point-to-point traffic
// between every pair going on at the same time.
func TestMixed(t *testing.T) {
	const members = 3
	cl := newCluster(t, members, 2, Options{ChunkBytes: testChunk})
	ctx := context.Background()
	p2pDone := make(chan []error, 1)
	go func() {
		p2pDone <- cl.each(func(m int, c *Comm) error {
			for i := range 40 {
				for p := range members {
					if p == m {
						continue
					}
					msg := fmt.Appendf(nil, "%d->%d #%d %s", m, p, i, make([]byte, i*100))
					if err := c.Send(ctx, p, uint32(i%3), msg); err != nil {
						return err
					}
				}
				for p := range members {
					if p == m {
						continue
					}
					buf := make([]byte, 8192)
					n, err := c.Recv(ctx, p, uint32(i%3), buf)
					if err != nil {
						return err
					}
					want := fmt.Appendf(nil, "%d->%d #%d %s", p, m, i, make([]byte, i*100))
					if string(buf[:n]) != string(want) {
						return fmt.Errorf("from %d: got %q", p, buf[:min(n, 20)])
					}
				}
			}
			return nil
		})
	}()
	rng := rand.New(rand.NewPCG(6, 6))
	for i := range 20 {
		inputs := [][]byte{randData(rng, reduce.Float32, 3000+i), randData(rng, reduce.Float32, 3000+i), randData(rng, reduce.Float32, 3000+i)}
		want := ReferenceAllReduce(reduce.Sum, reduce.Float32, inputs, members)
		bufs := make([][]byte, members)
		requireNoErrors(t, cl.each(func(m int, c *Comm) error {
			bufs[m] = slices.Clone(inputs[m])
			if err := c.AllReduce(ctx, bufs[m], reduce.Float32, reduce.Sum, nil); err != nil {
				return err
			}
			if err := c.Barrier(ctx); err != nil {
				return err
			}
			out := make([]byte, members*100)
			if err := c.AllGather(ctx, out, bufs[m][:100], nil); err != nil {
				return err
			}
			return c.Broadcast(ctx, bufs[m], i%members, nil)
		}))
		for m := range bufs {
			requireBits(t, want, bufs[m], 4, "round %d member %d", i, m)
		}
	}
	requireNoErrors(t, <-p2pDone)
}

// TestReadyStreamsNotHeldBack: with half of the input ready and the rest
// held back, the two-member all_reduce finishes the whole first half. A
// stream waiting in Ready for the second half must not hold up the streams
// whose chunks are ready (Ready calls used to be serialised, so one stream
// blocked on the far end stalled the others until all input was in).
func TestReadyStreamsNotHeldBack(t *testing.T) {
	cl := newCluster(t, 2, 4, Options{ChunkBytes: testChunk})
	ctx := context.Background()
	const n = 32 * testChunk
	half := n / 2
	rng := rand.New(rand.NewPCG(9, 9))
	inputs := [][]byte{randData(rng, reduce.Float32, n/4), randData(rng, reduce.Float32, n/4)}
	want := ReferenceAllReduce(reduce.Sum, reduce.Float32, inputs, 2)
	bufs := make([][]byte, 2)
	gates := make([]*readyGate, 2)
	recs := make([]*doneRecorder, 2)
	for m := range bufs {
		bufs[m] = make([]byte, n)
		gates[m] = newReadyGate(t, n)
		recs[m] = &doneRecorder{buf: bufs[m]}
	}
	release := func(m, from, to int) {
		g := gates[m]
		g.mu.Lock()
		copy(bufs[m][from:to], inputs[m][from:to])
		g.upto = to
		g.cond.Broadcast()
		g.mu.Unlock()
	}
	covered := func(m int) int { // bytes of [0,half) reported final
		recs[m].mu.Lock()
		defer recs[m].mu.Unlock()
		got := 0
		for _, r := range recs[m].ranges {
			got += max(0, min(r[0]+r[1], half)-r[0])
		}
		return got
	}
	errs := make(chan []error, 1)
	go func() {
		errs <- cl.each(func(m int, c *Comm) error {
			return c.AllReduce(ctx, bufs[m], reduce.Float32, reduce.Sum, &Progress{Ready: gates[m].ready, Done: recs[m].done})
		})
	}()
	for m := range bufs {
		release(m, 0, half)
	}
	assert.Eventually(t, func() bool { return covered(0) == half && covered(1) == half }, testenv.Scale(20*time.Second), time.Millisecond,
		"the first half was not finished while the second half was held back")
	for m := range bufs {
		release(m, half, n)
	}
	requireNoErrors(t, <-errs)
	for m := range bufs {
		requireBits(t, want, bufs[m], 4, "member %d", m)
	}
}

// TestReady releases every member's input slowly as a growing prefix,
// starting from garbage: a collective that read input before Ready granted
// it would compute from the garbage.
func TestReady(t *testing.T) {
	const pause = 200 * time.Microsecond
	for _, cfg := range []struct{ members, streams int }{{1, 1}, {2, 1}, {2, 4}, {3, 2}, {4, 3}} {
		t.Run(fmt.Sprintf("members=%d/streams=%d", cfg.members, cfg.streams), func(t *testing.T) {
			// The ring's streaming (allreduce_rd_test.go streams recursive
			// doubling).
			cl := newCluster(t, cfg.members, cfg.streams, Options{ChunkBytes: testChunk, SmallBytes: -1})
			rng := rand.New(rand.NewPCG(8, uint64(cfg.members)))
			ctx := context.Background()
			const n = 3001 // float32 elements
			piece := 1000  // bytes released at a time
			inputs := make([][]byte, cfg.members)
			for m := range inputs {
				inputs[m] = randData(rng, reduce.Float32, n)
			}

			t.Run("all_reduce", func(t *testing.T) {
				want := wantAllReduce(cl.comms[0], reduce.Sum, reduce.Float32, inputs)
				bufs := make([][]byte, cfg.members)
				requireNoErrors(t, cl.each(func(m int, c *Comm) error {
					bufs[m] = make([]byte, len(inputs[m]))
					garbage(bufs[m])
					g := newReadyGate(t, len(bufs[m]))
					go g.release(bufs[m], inputs[m], piece, pause)
					rec := &doneRecorder{buf: bufs[m]}
					err := c.AllReduce(ctx, bufs[m], reduce.Float32, reduce.Sum, &Progress{Ready: g.ready, Done: rec.done})
					rec.check(t, want, fmt.Sprint("member ", m))
					return err
				}))
				for m := range bufs {
					requireBits(t, want, bufs[m], 4, "member %d", m)
				}
			})
			t.Run("broadcast", func(t *testing.T) {
				root := cfg.members - 1
				bufs := make([][]byte, cfg.members)
				requireNoErrors(t, cl.each(func(m int, c *Comm) error {
					bufs[m] = make([]byte, len(inputs[root]))
					garbage(bufs[m])
					g := newReadyGate(t, len(bufs[m]))
					if m == root {
						go g.release(bufs[m], inputs[m], piece, pause)
					}
					return c.Broadcast(ctx, bufs[m], root, &Progress{Ready: g.ready})
				}))
				for m := range bufs {
					requireBits(t, inputs[root], bufs[m], 1, "member %d", m)
				}
			})
			t.Run("all_gather", func(t *testing.T) {
				var want []byte
				for _, in := range inputs {
					want = append(want, in...)
				}
				outs := make([][]byte, cfg.members)
				requireNoErrors(t, cl.each(func(m int, c *Comm) error {
					L := len(inputs[m])
					outs[m] = make([]byte, cfg.members*L)
					in := outs[m][m*L : (m+1)*L]
					garbage(outs[m])
					g := newReadyGate(t, L)
					go g.release(in, inputs[m], piece, pause)
					return c.AllGather(ctx, outs[m], in, &Progress{Ready: g.ready})
				}))
				for m := range outs {
					requireBits(t, want, outs[m], 1, "member %d", m)
				}
			})
			t.Run("reduce_scatter", func(t *testing.T) {
				L := (n / cfg.members) * 4
				ins := make([][]byte, cfg.members)
				for m := range ins {
					ins[m] = inputs[m][:cfg.members*L]
				}
				want := ReferenceReduceScatter(reduce.Max, reduce.Float32, ins, cfg.members)
				outs := make([][]byte, cfg.members)
				requireNoErrors(t, cl.each(func(m int, c *Comm) error {
					in := make([]byte, len(ins[m]))
					garbage(in)
					outs[m] = make([]byte, L)
					g := newReadyGate(t, len(in))
					go g.release(in, ins[m], piece, pause)
					return c.ReduceScatter(ctx, outs[m], in, reduce.Float32, reduce.Max, &Progress{Ready: g.ready})
				}))
				for m := range outs {
					requireBits(t, want[m], outs[m], 4, "member %d", m)
				}
			})
		})
	}
}

// TestReadyError: an error from Ready fails the collective with it.
func TestReadyError(t *testing.T) {
	cl := newCluster(t, 2, 1, Options{ChunkBytes: testChunk, Timeout: testenv.Scale(20 * time.Second)})
	errs := cl.each(func(m int, c *Comm) error {
		buf := make([]byte, 4096)
		var p *Progress
		if m == 1 {
			p = &Progress{Ready: func(context.Context, int) error { return fmt.Errorf("the GPU copy failed") }}
		}
		return c.AllReduce(context.Background(), buf, reduce.Float32, reduce.Sum, p)
	})
	require.ErrorContains(t, errs[1], "input not ready: the GPU copy failed")
	require.ErrorContains(t, errs[0], "member 1")
	require.ErrorContains(t, errs[0], "the GPU copy failed")
}
