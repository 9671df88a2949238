package discover

import (
	"context"
	"errors"
	"fmt"
	"os"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/gpubridge/gpubridge/lib/store"
	"github.com/gpubridge/gpubridge/lib/store/storetest"
	"github.com/gpubridge/gpubridge/lib/testenv"
)

// job runs ranks of a job on addr, each with the claim of pid base+rank on
// host "node-a", and returns their results by rank (only those run).
func job(t *testing.T, addr, ns string, recs []*Record, base int, ranks ...int) map[int]result {
	t.Helper()
	out := make(map[int]result)
	var mu sync.Mutex
	var wg sync.WaitGroup
	for _, r := range ranks {
		wg.Add(1)
		go func() {
			defer wg.Done()
			res := exchangeAs(t, addr, ns, recs, r, &Claim{Host: "node-a", PID: base + r, Start: 7})
			mu.Lock()
			out[r] = res
			mu.Unlock()
		}()
	}
	wg.Wait()
	return out
}

// exchangeAs runs one rank's Exchange with the given claim.
func exchangeAs(t *testing.T, addr, ns string, recs []*Record, rank int, c *Claim) result {
	t.Helper()
	ctx := context.Background()
	cl, err := store.Dial(ctx, addr, store.WithConnectTimeout(testenv.Scale(10*time.Second)))
	if err != nil {
		return result{err: err}
	}
	defer cl.Close()
	rec := *recs[rank]
	start := time.Now()
	topo, err := Exchange(ctx, cl, &rec, Options{Namespace: ns, Rank: rank, WorldSize: len(recs),
		Timeout: testenv.Scale(20 * time.Second), Claim: c})
	return result{topo: topo, err: err, took: time.Since(start)}
}

func failureOf(t *testing.T, r result, what string) *Failure {
	t.Helper()
	var f *Failure
	require.True(t, errors.As(r.err, &f), "%s: want a *Failure, got %v", what, r.err)
	return f
}

// TestExchangeSecondJobOnTheStore is issue 9's defect 5: job B's ranks 1-3
// reach job A's store (same MASTER_PORT, no run id: the same namespace)
// after A decided. They must not adopt A's outcome; each fails naming the
// process that holds its rank.
func TestExchangeSecondJobOnTheStore(t *testing.T) {
	addr := storetest.Start(t)
	const ns = "job-default/attempt-0"
	recs := mk([]string{"nvidia", "nvidia", "amd", "amd"}, nil)
	a := job(t, addr, ns, recs, 1000, 0, 1, 2, 3)
	for r, res := range a {
		require.NoError(t, res.err, "job A rank %d", r)
	}

	b := job(t, addr, ns, recs, 2000, 1, 2, 3)
	for r, res := range b {
		f := failureOf(t, res, fmt.Sprintf("job B rank %d", r))
		require.Len(t, f.Problems, 1)
		assert.Equal(t, fmt.Sprintf("rank %d is already claimed in namespace %s by pid %d on host node-a (this is pid %d on host node-a): "+
			"is another job using this store (same MASTER_PORT)? give each job its own port or run id (TORCHELASTIC_RUN_ID, or GPUBRIDGE_NAMESPACE)",
			r, ns, 1000+r, 2000+r), f.Problems[0])
	}

	// Job A's outcome stands, and A's own ranks may run discovery again
	// (same processes).
	again := job(t, addr, ns, recs, 1000, 0, 1, 2, 3)
	for r, res := range again {
		require.NoError(t, res.err, "job A rank %d again", r)
		assert.Equal(t, a[0].topo.Digest, res.topo.Digest)
	}
}

// TestExchangeStrangerFirst: job B's rank 1 claims rank 1 before job A's
// rank 1 arrives, while A is still gathering. A's rank 1 finds the claim;
// its conflict becomes the outcome, so every rank of both jobs fails with
// the same message instead of starting with a stranger.
func TestExchangeStrangerFirst(t *testing.T) {
	addr := storetest.Start(t)
	const ns = "shared"
	recs := mk([]string{"nvidia", "nvidia", "amd", "amd"}, nil)
	intruder := make(chan result, 1)
	go func() { intruder <- exchangeAs(t, addr, ns, recs, 1, &Claim{Host: "node-b", PID: 2001}) }()

	c, err := store.Dial(context.Background(), addr)
	require.NoError(t, err)
	defer c.Close()
	kv := c.Prefix(KeyPrefix).Prefix(ns)
	require.NoError(t, kv.Wait(context.Background(), []string{claimKey(1)}, testenv.Scale(20*time.Second)))

	a1 := exchangeAs(t, addr, ns, recs, 1, &Claim{Host: "node-a", PID: 1001})
	want := "rank 1 is already claimed in namespace shared by pid 2001 on host node-b (this is pid 1001 on host node-a): " + conflictAdvice
	assert.Equal(t, []string{want}, failureOf(t, a1, "job A rank 1").Problems)

	rest := job(t, addr, ns, recs, 1000, 0, 2, 3)
	for r, res := range rest {
		assert.Equal(t, []string{want}, failureOf(t, res, fmt.Sprintf("job A rank %d", r)).Problems)
	}
	assert.Equal(t, []string{want}, failureOf(t, <-intruder, "job B rank 1").Problems)
}

// TestExchangeRecordWithoutClaim: a record written over a claimed rank by a
// writer that did not claim it (another job's older tool, or the plugin's
// publish_failure) fails the exchange naming the cause.
func TestExchangeRecordWithoutClaim(t *testing.T) {
	addr := storetest.Start(t)
	const ns = "forged"
	recs := mk([]string{"nvidia", "amd"}, nil)
	ctx := context.Background()
	c, err := store.Dial(ctx, addr)
	require.NoError(t, err)
	defer c.Close()
	kv := c.Prefix(KeyPrefix).Prefix(ns)
	// Rank 1 is claimed by pid 1001, but its record comes from a writer
	// that carries no claim.
	_, err = kv.CompareSet(ctx, claimKey(1), nil, (&Claim{Host: "node-a", PID: 1001}).encode())
	require.NoError(t, err)
	body, err := recs[1].Encode()
	require.NoError(t, err)
	require.NoError(t, kv.Set(ctx, recordKey(1), body))
	_, err = kv.Add(ctx, "reported", 1)
	require.NoError(t, err)
	_, err = kv.Add(ctx, "read", 1) // rank 0 need not wait for it to read the verdict
	require.NoError(t, err)

	r0 := exchangeAs(t, addr, ns, recs, 0, &Claim{Host: "node-a", PID: 1000})
	assert.Equal(t, []string{"the record of rank 1 carries no claim, but rank 1 is claimed in namespace forged by pid 1001 on host node-a: " + conflictAdvice},
		failureOf(t, r0, "rank 0").Problems)
}

func TestClaimProblems(t *testing.T) {
	a := &Claim{Host: "h", PID: 10, Start: 5}
	b := &Claim{Host: "h", PID: 11, Start: 5}
	rec := func(c *Claim) *Record { return &Record{Claim: c} }
	tests := []struct {
		name   string
		recs   []*Record
		claims [][]byte
		want   []string
	}{
		{"all claimed by their writers", []*Record{rec(a), rec(b)}, [][]byte{a.encode(), b.encode()}, nil},
		{"same process, start time unknown on one side", []*Record{rec(&Claim{Host: "h", PID: 10})}, [][]byte{a.encode()}, nil},
		{"publish_failure record, no claim", []*Record{rec(a), rec(nil)}, [][]byte{a.encode(), nil}, nil},
		{"undecodable record skipped", []*Record{nil, rec(b)}, [][]byte{nil, b.encode()}, nil},
		{"claimed by another", []*Record{rec(a), rec(b)}, [][]byte{a.encode(), a.encode()},
			[]string{"the record of rank 1 comes from pid 11 on host h, but rank 1 is claimed in namespace ns by pid 10 on host h: " + conflictAdvice}},
		{"pid reused", []*Record{rec(&Claim{Host: "h", PID: 10, Start: 6})}, [][]byte{a.encode()},
			[]string{"the record of rank 0 comes from pid 10 on host h, but rank 0 is claimed in namespace ns by pid 10 on host h: " + conflictAdvice}},
		{"record claims, store holds none", []*Record{rec(a)}, [][]byte{nil},
			[]string{"the record of rank 0 comes from pid 10 on host h, which holds no claim on rank 0 in namespace ns: " + conflictAdvice}},
		{"record without claim over a claim", []*Record{rec(nil)}, [][]byte{b.encode()},
			[]string{"the record of rank 0 carries no claim, but rank 0 is claimed in namespace ns by pid 11 on host h: " + conflictAdvice}},
		{"garbage claim", []*Record{rec(a)}, [][]byte{[]byte("xyz")},
			[]string{"the record of rank 0 comes from pid 10 on host h, but rank 0 is claimed in namespace ns by something that is not gbdiscover: " + conflictAdvice}},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			assert.Equal(t, tt.want, claimProblems("ns", tt.recs, tt.claims))
		})
	}
}

func TestClaimIdentity(t *testing.T) {
	me := NewClaim(os.Getpid())
	assert.Positive(t, me.Start, "the start time of a live process is readable on Linux")
	assert.Equal(t, uint64(0), procStart(1<<30), "no such process")
	assert.True(t, me.Same(NewClaim(os.Getpid())))
	assert.False(t, me.Same(&Claim{Host: me.Host, PID: me.PID, Start: me.Start + 1}), "a reused pid is another process")
	assert.False(t, me.Same(&Claim{Host: me.Host + "x", PID: me.PID, Start: me.Start}))
	assert.False(t, me.Same(nil))
	got, err := decodeClaim(me.encode())
	require.NoError(t, err)
	assert.Equal(t, me, got)
	for _, bad := range []string{"", "{", `{"host":"h"}`, `{"pid":"3"}`, strings.Repeat(" ", MaxClaimBytes+1)} {
		_, err := decodeClaim([]byte(bad))
		assert.Error(t, err, "%q", bad)
	}
}

// TestExchangeRecordTooLarge is issue 9's "a probe too large for the store
// fails with connection reset by peer": a record over the store's 8 MiB
// value limit (here: 9 MiB of problems from the probe) is cut down, and
// every rank fails naming the cause instead of the big rank dying on a
// store error while the others wait for it.
func TestExchangeRecordTooLarge(t *testing.T) {
	addr := storetest.Start(t)
	recs := mk([]string{"nvidia", "nvidia", "amd"}, nil)
	for range 9 {
		recs[2].Problems = append(recs[2].Problems, "probe: "+strings.Repeat("x", 1<<20))
	}
	res := runRanks(t, addr, "big", recs, testenv.Scale(20*time.Second))
	var want []string
	for i, r := range res {
		f := failureOf(t, r, fmt.Sprintf("rank %d", i))
		if i == 0 {
			want = f.Problems
		}
		assert.Equal(t, want, f.Problems, "rank %d", i)
	}
	require.NotEmpty(t, want)
	last := want[len(want)-1]
	assert.Regexp(t, `^rank 2 \(h0\): this rank's record is \d+ bytes, over the 1048576-byte limit of a record \(a probe report with very large fields\?\); it was cut down to its first 9 problems \(of 9\)$`, last)
	for _, p := range want[:len(want)-1] {
		assert.LessOrEqual(t, len(p), 600)
	}
}

func FuzzDecodeClaim(f *testing.F) {
	f.Add((&Claim{Host: "node-a", PID: 1234, Start: 99}).encode())
	f.Add([]byte(`{"host":"h","pid":0}`))
	f.Add([]byte(`{"host":5}`))
	f.Add([]byte(`[]`))
	f.Fuzz(func(t *testing.T, data []byte) {
		c, err := decodeClaim(data)
		if err != nil {
			return
		}
		// A decoded claim names a pid, re-encodes and decodes to itself.
		require.Positive(t, c.PID)
		again, err := decodeClaim(c.encode())
		require.NoError(t, err)
		require.Equal(t, c, again)
		require.True(t, c.Same(again))
		require.NotEmpty(t, claimConflict("ns", 1, data, &Claim{Host: "x", PID: 1}))
	})
}
