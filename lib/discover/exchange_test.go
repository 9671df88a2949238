package discover

import (
	"context"
	"errors"
	"slices"
	"sync"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	"go.uber.org/goleak"

	"github.com/gpubridge/gpubridge/lib/store"
	"github.com/gpubridge/gpubridge/lib/store/storetest"
	"github.com/gpubridge/gpubridge/lib/testenv"
)

func TestMain(m *testing.M) { goleak.VerifyTestMain(m) }

type result struct {
	topo *Topology
	err  error
	took time.Duration
}

// runRanks runs one Exchange per record, each on its own connection, and
// returns their results by rank. skip lists ranks that never start.
func runRanks(t *testing.T, addr, ns string, recs []*Record, timeout time.Duration, skip ...int) []result {
	t.Helper()
	res := make([]result, len(recs))
	var wg sync.WaitGroup
	for i, r := range recs {
		if slices.Contains(skip, i) {
			continue
		}
		wg.Add(1)
		go func() {
			defer wg.Done()
			start := time.Now()
			ctx := context.Background()
			c, err := store.Dial(ctx, addr, store.WithConnectTimeout(testenv.Scale(10*time.Second)))
			if err != nil {
				res[i].err = err
				return
			}
			defer c.Close()
			res[i].topo, res[i].err = Exchange(ctx, c, r, Options{Namespace: ns, Rank: i, WorldSize: len(recs), Timeout: timeout})
			res[i].took = time.Since(start)
		}()
	}
	wg.Wait()
	return res
}

func TestExchangeAgrees(t *testing.T) {
	addr := storetest.Start(t)
	recs := mk([]string{"nvidia", "nvidia", "amd", "amd", "amd"}, nil)
	res := runRanks(t, addr, "ok", recs, testenv.Scale(30*time.Second))
	for i, r := range res {
		require.NoError(t, r.err, "rank %d", i)
		assert.Equal(t, res[0].topo.Digest, r.topo.Digest)
		assert.Equal(t, i, r.topo.Self.Rank)
	}
	assert.Equal(t, []int{0, 2}, res[0].topo.Bridge.Members)
}

func TestExchangeSameFailureEverywhere(t *testing.T) {
	addr := storetest.Start(t)
	recs := mk([]string{"nvidia", "nvidia", "amd", "amd"}, nil)
	recs[3].Problems = []string{"no GPU behind LOCAL_RANK 3"}
	res := runRanks(t, addr, "bad", recs, testenv.Scale(30*time.Second))
	var want string
	for i, r := range res {
		var f *Failure
		require.True(t, errors.As(r.err, &f), "rank %d: %v", i, r.err)
		if i == 0 {
			want = f.Error()
		}
		assert.Equal(t, want, f.Error())
	}
	assert.Contains(t, want, "rank 3 (h0): no GPU behind LOCAL_RANK 3")
}

func TestExchangeMissingRank(t *testing.T) {
	addr := storetest.Start(t)
	recs := mk([]string{"nvidia", "nvidia", "amd", "amd"}, nil)
	timeout := 2 * time.Second
	res := runRanks(t, addr, "gone", recs, timeout, 2)
	for _, i := range []int{0, 1, 3} {
		var f *Failure
		require.True(t, errors.As(res[i].err, &f), "rank %d: %v", i, res[i].err)
		assert.Equal(t, []string{"rank 2 never reported within 2s (world size 4; every other rank did)"}, f.Problems)
		// Within its deadline, give or take the scheduling of a loaded machine.
		assert.Less(t, res[i].took, timeout+testenv.Scale(2*time.Second), "rank %d must give up within its deadline", i)
	}
}

// A rank that arrives after the others gave up adopts their verdict rather
// than succeeding alone.
func TestExchangeLateRankAdoptsVerdict(t *testing.T) {
	addr := storetest.Start(t)
	recs := mk([]string{"nvidia", "amd"}, nil)
	first := runRanks(t, addr, "late", recs, time.Second, 1)
	var f0 *Failure
	require.True(t, errors.As(first[0].err, &f0), "rank 0: %v", first[0].err)
	late := runRanks(t, addr, "late", recs, testenv.Scale(20*time.Second), 0)
	var f1 *Failure
	require.True(t, errors.As(late[1].err, &f1), "late rank: %v", late[1].err)
	assert.Equal(t, f0.Error(), f1.Error())
	assert.Contains(t, f1.Error(), "rank 1 never reported within 1s")
}

func TestExchangeStoreGone(t *testing.T) {
	addr := storetest.Start(t)
	c, err := store.Dial(context.Background(), addr)
	require.NoError(t, err)
	require.NoError(t, c.Close())
	_, err = Exchange(context.Background(), c, mk(nv(1), nil)[0], Options{Namespace: "x", Rank: 0, WorldSize: 1, Timeout: time.Second})
	var f *Failure
	assert.False(t, errors.As(err, &f), "a store error is not a verdict")
	assert.Error(t, err)
}
