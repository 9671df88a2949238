package main

import (
	"bytes"
	"context"
	"encoding/binary"
	"errors"
	"fmt"
	"math"
	"math/rand/v2"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/gpubridge/gpubridge/lib/collective"
	"github.com/gpubridge/gpubridge/lib/discover"
	"github.com/gpubridge/gpubridge/lib/feed"
	"github.com/gpubridge/gpubridge/lib/feed/feedtest"
	"github.com/gpubridge/gpubridge/lib/reduce"
	"github.com/gpubridge/gpubridge/lib/testenv"
	"github.com/gpubridge/gpubridge/lib/transport"
)

// Every rank on the bridge (issue 16): the leaders 0 and 2 serve bridge 0,
// ranks 1 and 3 serve with --no-bridge; they join a pair bridge (1, 3), a
// bridge of three (1, 0, 3) and a bridge of all four. Collectives on each are bit for bit the
// reference, at once; SEND/RECV on the pair both ways at once. Over tcp
// also: members joining one name with other member lists all fail with
// the same words, and a killed member fails its joined bridge's requests
// while bridge 0 goes on.
func TestServeJoin(t *testing.T) {
	for _, tr := range []transport.Kind{discover.BridgeTCP, discover.BridgeSHM} {
		t.Run(string(tr), func(t *testing.T) {
			c := newCluster(t)
			c.kind = tr
			ps := make([]*serveProc, 4)
			var wg sync.WaitGroup
			for rank := range 4 {
				var extra []string
				if rank%2 == 1 {
					extra = []string{"--no-bridge"}
				}
				wg.Go(func() { ps[rank] = start(t, c.args(t, rank, extra...), true) })
			}
			wg.Wait()
			if t.Failed() {
				t.FailNow()
			}
			cls := make([]*feedtest.Client, 4)
			for rank, p := range ps {
				assert.Equal(t, rank%2 == 0, p.ready.Bridge0, "rank %d", rank)
				assert.Equal(t, feed.Version, p.ready.Version)
				if rank%2 == 1 {
					assert.Equal(t, -1, p.ready.Member)
					assert.Equal(t, "none", p.ready.Transport)
				}
				cls[rank] = dial(t, p)
			}
			ctx, cancel := context.WithTimeout(context.Background(), testenv.Scale(60*time.Second))
			defer cancel()
			regs := make([]*feedtest.Region, 4)
			for rank, cl := range cls {
				reg, err := cl.Map(ctx, 1<<20)
				require.NoError(t, err)
				regs[rank] = reg
			}
			onAll := func(ranks []uint32, fn func(rank uint32) error) {
				t.Helper()
				errs := make([]error, len(ranks))
				var wg sync.WaitGroup
				for i, r := range ranks {
					wg.Go(func() { errs[i] = fn(r) })
				}
				wg.Wait()
				for i, err := range errs {
					require.NoError(t, err, "rank %d; stderr:\n%s", ranks[i], ps[ranks[i]].stderr.String())
				}
			}
			pair, all := []uint32{1, 3}, []uint32{3, 2, 1, 0}
			onAll(pair, func(r uint32) error { return cls[r].Join(ctx, 1, "pair/1-3", pair) })
			onAll(all, func(r uint32) error { return cls[r].Join(ctx, 2, "all", all) })
			trio := []uint32{1, 0, 3}
			onAll(trio, func(r uint32) error { return cls[r].Join(ctx, 3, "trio/0-1-3", trio) })
			// Only the pair bridge gets point-to-point streams (the shm
			// rings they need are reserved memory).
			// (The log line is written before the JOIN's answer; the copy
			// of the pipe into stderr may lag.)
			require.Eventually(t, func() bool { return strings.Count(ps[1].stderr.String(), "bridge joined") == 3 },
				testenv.Scale(10*time.Second), 10*time.Millisecond, "stderr:\n%s", ps[1].stderr.String())
			for _, line := range strings.Split(ps[1].stderr.String(), "\n") {
				if !strings.Contains(line, "bridge joined") {
					continue
				}
				assert.Equal(t, strings.Contains(line, "name=pair/1-3"), strings.Contains(line, "and 4 for point-to-point"), "%s", line)
			}
			assert.Contains(t, ps[1].stderr.String(), "and 4 for point-to-point")

			// all_reduce on the pair, the four and bridge 0 at once.
			rnd := rand.New(rand.NewPCG(16, 1))
			runs := []struct {
				id       uint32
				ranks    []uint32
				off, len int
			}{{1, pair, 0, 4 * 40001}, {2, all, 200000, 4 * 30000}, {3, trio, 330000, 4 * 20000}, {0, []uint32{0, 2}, 420000, 4 * 1000}}
			wants := make([][]byte, len(runs))
			for k, run := range runs {
				var inputs [][]byte
				for _, r := range run.ranks {
					randomBytesF32(rnd, regs[r].Mem[run.off:run.off+run.len])
					inputs = append(inputs, bytes.Clone(regs[r].Mem[run.off:run.off+run.len]))
				}
				wants[k] = collective.ReferenceAllReduce(reduce.Sum, reduce.Float32, inputs, len(run.ranks))
			}
			var rw sync.WaitGroup
			for _, run := range runs {
				rw.Go(func() {
					onAll(run.ranks, func(r uint32) error {
						_, err := cls[r].On(run.id).AllReduce(ctx, regs[r].Span(run.off, run.len), reduce.Float32, reduce.Sum)
						return err
					})
				})
			}
			rw.Wait()
			for k, run := range runs {
				for _, r := range run.ranks {
					assert.True(t, bytes.Equal(wants[k], regs[r].Mem[run.off:run.off+run.len]), "bridge %d rank %d", run.id, r)
				}
			}

			// all_gather on the three: every member's slot in member order.
			for _, r := range trio {
				for k := range 1000 {
					regs[r].Mem[450000+k] = byte(int(r)*31 + k)
				}
			}
			onAll(trio, func(r uint32) error {
				return cls[r].On(3).AllGather(ctx, regs[r].Span(460000, 3000), regs[r].Span(450000, 1000))
			})
			for _, r := range trio {
				for slot, from := range trio {
					for k := 0; k < 1000; k += 97 {
						require.Equal(t, byte(int(from)*31+k), regs[r].Mem[460000+slot*1000+k], "rank %d slot %d", r, slot)
					}
				}
			}

			// SEND/RECV on the pair, both ways at once (rank 1 is member 0).
			copy(regs[1].Mem[600000:], "one to three")
			copy(regs[3].Mem[600000:], "three to one")
			onAll([]uint32{1, 3}, func(r uint32) error {
				const got = 700000
				peer, want := 1, "three to one" // rank 1 is member 0
				if r == 3 {
					peer, want = 0, "one to three"
				}
				var sw sync.WaitGroup
				var serr error
				sw.Go(func() { serr = cls[r].On(1).Send(ctx, peer, 7, regs[r].Span(600000, 12)) })
				n, err := cls[r].On(1).Recv(ctx, peer, 7, regs[r].Span(got, 64))
				sw.Wait()
				if err == nil && string(regs[r].Mem[got:got+n]) != want {
					err = fmt.Errorf("received %q, want %q", regs[r].Mem[got:got+n], want)
				}
				return errors.Join(serr, err)
			})
			if tr != discover.BridgeTCP {
				for _, cl := range cls {
					require.NoError(t, cl.Close(ctx))
				}
				for rank, p := range ps {
					assert.Equal(t, 0, p.wait(t), "rank %d; stderr:\n%s", rank, p.stderr.String())
				}
				return
			}

			// One name, two member lists: both fail with the same words.
			texts := make([]string, 2)
			var mw sync.WaitGroup
			for i, r := range pair {
				mw.Go(func() {
					members := pair
					if r == 3 {
						members = []uint32{3, 1}
					}
					err := cls[r].Join(ctx, 4, "mm", members)
					var re *feedtest.RequestError
					if assert.ErrorAs(t, err, &re, "rank %d", r) {
						assert.Equal(t, feed.StatusBridgeError, re.Status)
						_, texts[i], _ = strings.Cut(re.Msg, `agree on the members of bridge "mm": `)
					}
				})
			}
			mw.Wait()
			assert.Contains(t, texts[0], `the members of bridge "mm" disagree on its members: rank `)
			assert.Contains(t, texts[0], "ranks [1,3]")
			assert.Contains(t, texts[0], "ranks [3,1]")
			assert.Equal(t, texts[0], texts[1])
			t.Logf("mismatch: %s", texts[0])

			// Rank 3 killed: rank 1's requests on the pair fail naming it,
			// within the collective timeout; bridge 0 goes on.
			pid := ps[3].cmd.Process.Pid
			require.NoError(t, ps[3].cmd.Process.Kill())
			t0 := time.Now()
			_, err := cls[1].On(1).AllReduce(ctx, regs[1].Span(0, 64), reduce.Float32, reduce.Sum)
			var re *feedtest.RequestError
			require.ErrorAs(t, err, &re)
			assert.Contains(t, []feed.Status{feed.StatusBridgeError, feed.StatusBroken}, re.Status)
			assert.Contains(t, re.Msg, fmt.Sprintf("gbbridge serve of rank 3 (pid %d on host-b) die?", pid))
			assert.Less(t, time.Since(t0), testenv.Scale(25*time.Second))
			t.Logf("after %v rank 1 got: %s", time.Since(t0), re.Msg)
			refused := func() error {
				_, err := cls[1].On(1).AllReduce(ctx, regs[1].Span(0, 64), reduce.Float32, reduce.Sum)
				return err
			}()
			require.ErrorAs(t, refused, &re)
			assert.Equal(t, feed.StatusBroken, re.Status)
			onAll([]uint32{0, 2}, func(r uint32) error { return cls[r].AllReduce(ctx, regs[r].Span(0, 4096), reduce.Float32, reduce.Sum) })
			for _, r := range []int{0, 1, 2} {
				require.NoError(t, cls[r].Close(ctx))
			}
			assert.Equal(t, 0, ps[0].wait(t), "stderr:\n%s", ps[0].stderr.String())
			assert.Equal(t, 0, ps[2].wait(t), "stderr:\n%s", ps[2].stderr.String())
			assert.Equal(t, 1, ps[1].wait(t), "a joined bridge that failed is exit 1")
			assert.Contains(t, ps[1].stderr.String(), `bridge 1 ("pair/1-3")`)
		})
	}
}

// randomBytesF32 fills b with normal float32 values.
func randomBytesF32(r *rand.Rand, b []byte) {
	for k := 0; k+4 <= len(b); k += 4 {
		binary.LittleEndian.PutUint32(b[k:], math.Float32bits(float32(r.NormFloat64())))
	}
}

// TestServeJoinWaitsAsLongAsACollective: members JOIN a bridge when each
// first needs it, which may be as far apart as a collective may wait, so
// the meeting waits for the longer of --setup-timeout and --timeout, not
// for the set-up's alone.
func TestServeJoinWaitsAsLongAsACollective(t *testing.T) {
	c := newCluster(t)
	extra := []string{"--no-bridge", "--setup-timeout", "1s", "--timeout", testenv.Scale(60 * time.Second).String()}
	ps := map[int]*serveProc{1: start(t, c.args(t, 1, extra...), true), 3: start(t, c.args(t, 3, extra...), true)}
	ctx, cancel := context.WithTimeout(context.Background(), testenv.Scale(90*time.Second))
	defer cancel()
	pair := []uint32{1, 3}
	errs := make(chan error, 2)
	for _, r := range []int{1, 3} {
		cl := dial(t, ps[r])
		go func() {
			if r == 3 {
				time.Sleep(3 * time.Second) // past rank 1's --setup-timeout
			}
			errs <- cl.Join(ctx, 1, "late/1-3", pair)
		}()
	}
	for range 2 {
		require.NoError(t, <-errs, "stderr of rank 1:\n%s\nrank 3:\n%s", ps[1].stderr.String(), ps[3].stderr.String())
	}
}
