package harness

import (
	"bytes"
	"context"
	"encoding/json"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	"go.uber.org/goleak"

	"github.com/gpubridge/gpubridge/lib/bridge"
	"github.com/gpubridge/gpubridge/lib/codec"
	"github.com/gpubridge/gpubridge/lib/collective"
	"github.com/gpubridge/gpubridge/lib/reduce"
	"github.com/gpubridge/gpubridge/lib/testenv"
	"github.com/gpubridge/gpubridge/lib/transport"
	"github.com/gpubridge/gpubridge/lib/wire"
)

func TestMain(m *testing.M) { goleak.VerifyTestMain(m) }

// memMembers joins n members over in-memory meshes.
func memMembers(t *testing.T, n int) []*bridge.Member {
	t.Helper()
	meshes := transport.NewMem(n, 2, true)
	ms := make([]*bridge.Member, n)
	for i := range ms {
		ms[i] = &bridge.Member{Self: i, Size: n, Mesh: meshes[i],
			Comm: collective.New(meshes[i], collective.Options{ChunkBytes: 4096, Timeout: testenv.Scale(30 * time.Second)})}
	}
	t.Cleanup(func() {
		for _, m := range ms {
			_ = m.Comm.Close()
			_ = m.Mesh.Close()
		}
	})
	return ms
}

// each runs f on every member concurrently.
func each(ms []*bridge.Member, f func(m *bridge.Member) error) []error {
	errs := make([]error, len(ms))
	done := make(chan struct{})
	for i, m := range ms {
		go func() { errs[i] = f(m); done <- struct{}{} }()
	}
	for range ms {
		<-done
	}
	return errs
}

func TestSelftestCasesPass(t *testing.T) {
	for _, n := range []int{2, 3} {
		ms := memMembers(t, n)
		var cases []Case
		for _, c := range Cases(n) {
			if c.Elems <= 1021 { // the small cases: every collective × dtype × op
				cases = append(cases, c)
			}
		}
		var out bytes.Buffer
		errs := each(ms, func(m *bridge.Member) error {
			return SelftestMember(context.Background(), m, cases, false, &out, nil)
		})
		for i, err := range errs {
			require.NoError(t, err, "member %d", i)
		}
		var rep RunReport
		require.NoError(t, json.Unmarshal(out.Bytes(), &rep))
		assert.Equal(t, n, rep.Members)
		assert.Equal(t, len(cases), rep.Cases)
		assert.Zero(t, rep.Failed, "%v", rep.Failures)
	}
}

func TestCasesCoverEveryCollectiveDTypeOp(t *testing.T) {
	seen := map[string]bool{}
	for _, c := range Cases(4) {
		seen[c.Coll+"/"+c.DType.String()+"/"+c.Op.String()] = true
	}
	for _, dt := range reduce.AllDTypes() {
		for _, op := range reduce.AllOps() {
			if reduce.Supported(op, dt) != nil {
				continue
			}
			assert.True(t, seen["all_reduce/"+dt.String()+"/"+op.String()], "all_reduce %s %s", dt, op)
			assert.True(t, seen["reduce_scatter/"+dt.String()+"/"+op.String()], "reduce_scatter %s %s", dt, op)
		}
	}
	assert.True(t, seen["p2p/"+reduce.DType(0).String()+"/"+reduce.Op(0).String()])
}

// A wrong result is counted: the selftest can fail.
func TestCountWrong(t *testing.T) {
	want := []byte{1, 2, 3, 4, 5, 6, 7, 8}
	got := append([]byte(nil), want...)
	assert.Zero(t, countWrong(got, want, 4))
	got[5] ^= 1
	assert.Equal(t, 1, countWrong(got, want, 4))
	assert.Equal(t, 1, countWrong(got[:4], want, 4), "a short result counts its missing elements")

	buf := make([]byte, 64*4)
	for _, op := range []reduce.Op{reduce.Sum, reduce.Max, reduce.Min, reduce.Prod, reduce.Avg} {
		fillPattern(buf, reduce.Float32, 0, op)
		w, err := countPatternWrong(buf, reduce.Float32, op, 1, 0)
		require.NoError(t, err)
		assert.Zero(t, w, "one member's pattern is its own reduction (%s)", op)
		w, err = countPatternWrong(buf, reduce.Float32, op, 3, 0)
		require.NoError(t, err)
		assert.Positive(t, w, "%s over 3 members differs from one member's values", op)
	}
}

func TestSweepRowsAreExact(t *testing.T) {
	for _, coll := range []string{"all_reduce", "broadcast", "all_gather", "reduce_scatter", "exchange", "memcpy"} {
		n := 2
		ms := memMembers(t, n)
		rows := make([][]BenchRow, n)
		errs := each(ms, func(m *bridge.Member) error {
			r, err := Sweep(context.Background(), m, SweepOptions{Coll: coll, DType: reduce.BFloat16, Op: reduce.Sum,
				Sizes: []int64{8, 10000, 1 << 20}, Iters: 2, Warmup: 1, ChunkB: 4096})
			rows[m.Self] = r
			return err
		})
		for i, err := range errs {
			require.NoError(t, err, "%s member %d", coll, i)
		}
		require.Len(t, rows[0], 3)
		for _, r := range rows[0] {
			assert.Zero(t, r.Wrong, "%s %+v", coll, r)
			assert.True(t, r.Checked, "%s %+v", coll, r)
			assert.Positive(t, r.AlgBW)
			assert.InDelta(t, r.AlgBW*BusFactor(coll, n), r.BusBW, 1e-9)
			assert.Equal(t, BenchSchema, r.Schema)
		}
	}
}

// MinTime stretches the timed calls of a short call, and every member runs
// (and reports) the same count; without it Iters stand.
func TestSweepMinTime(t *testing.T) {
	for _, minTime := range []time.Duration{0, time.Second} {
		n := 2
		ms := memMembers(t, n)
		rows := make([][]BenchRow, n)
		errs := each(ms, func(m *bridge.Member) error {
			r, err := Sweep(context.Background(), m, SweepOptions{Coll: "all_reduce", DType: reduce.Float32, Op: reduce.Sum,
				Sizes: []int64{8}, Iters: 2, Warmup: 0, ChunkB: 4096, MinTime: minTime})
			rows[m.Self] = r
			return err
		})
		for i, err := range errs {
			require.NoError(t, err, "member %d", i)
		}
		require.Len(t, rows[0], 1)
		require.Len(t, rows[1], 1)
		assert.Equal(t, rows[0][0].Iters, rows[1][0].Iters, "the members agree on the count")
		assert.Zero(t, rows[0][0].Wrong)
		if minTime == 0 {
			assert.Equal(t, 2, rows[0][0].Iters)
		} else {
			// An 8-byte in-memory call takes microseconds; under any load
			// far less than half a second.
			assert.Greater(t, rows[0][0].Iters, 2)
		}
	}
}

func TestTimedCalls(t *testing.T) {
	for _, tt := range []struct {
		iters   int
		minTime time.Duration
		per     float64
		want    int
	}{
		{5, 200 * time.Millisecond, 0.001, 200},
		{5, 200 * time.Millisecond, 0.0015, 134}, // rounded up
		{5, 200 * time.Millisecond, 0.1, 5},      // never fewer than iters
		{5, 200 * time.Millisecond, 1e-9, MaxTimedCalls},
		{5, 200 * time.Millisecond, 0, MaxTimedCalls},
		{20000, time.Second, 1e-6, 20000},
	} {
		assert.Equal(t, tt.want, timedCalls(tt.iters, tt.minTime, tt.per), "%+v", tt)
	}
}

// Compressed rows are checked too: the lossy all_reduce against the
// codec's reference (with and without error feedback, pattern and random
// data), zstd on every collective against the exact results.
func TestSweepRowsCodecs(t *testing.T) {
	for _, tt := range []struct {
		coll     string
		id       codec.ID
		dt       reduce.DType
		op       reduce.Op
		feedback bool
		random   bool
	}{
		{"all_reduce", codec.MXFP8, reduce.Float32, reduce.Sum, false, false},
		{"all_reduce", codec.MXFP8, reduce.BFloat16, reduce.Avg, true, true},
		{"all_reduce", codec.BF16, reduce.Float32, reduce.Avg, true, false},
		{"all_reduce", codec.Zstd, reduce.Float16, reduce.Max, false, true},
		{"broadcast", codec.Zstd, reduce.Float32, reduce.Sum, false, true},
		{"all_gather", codec.Zstd, reduce.Int32, reduce.Sum, false, false},
		{"reduce_scatter", codec.Zstd, reduce.BFloat16, reduce.Sum, false, true},
	} {
		for _, n := range []int{2, 3} {
			ms := memMembers(t, n)
			rows := make([][]BenchRow, n)
			errs := each(ms, func(m *bridge.Member) error {
				r, err := Sweep(context.Background(), m, SweepOptions{Coll: tt.coll, DType: tt.dt, Op: tt.op,
					Sizes: []int64{8, 100000}, Iters: 2, Warmup: 1, Codec: tt.id, Feedback: tt.feedback, Random: tt.random})
				rows[m.Self] = r
				return err
			})
			for i, err := range errs {
				require.NoError(t, err, "%+v, %d members, member %d", tt, n, i)
			}
			require.Len(t, rows[0], 2)
			for _, r := range rows[0] {
				assert.Zero(t, r.Wrong, "%+v", r)
				assert.True(t, r.Checked)
				assert.Equal(t, tt.id.Versioned(), r.Codec)
				assert.Equal(t, tt.feedback, r.Feedback)
				assert.Equal(t, map[bool]string{true: "random", false: "pattern"}[tt.random], r.Data)
				assert.Positive(t, r.SentBytes)
			}
			if tt.id == codec.MXFP8 && n == 2 {
				big := rows[0][1]
				assert.Equal(t, int64(codec.MXFP8Len(int(big.Count))), big.SentBytes, "fp8 sends the packing")
			}
		}
	}
}

// The lossy check compares with the codec's reference: an exact result is
// wrong there.
func TestCheckBenchLossy(t *testing.T) {
	o := SweepOptions{Coll: "all_reduce", DType: reduce.Float32, Op: reduce.Sum, Codec: codec.MXFP8, Random: true}
	const n, E = 2, 4096
	ins := make([][]byte, n)
	for r := range ins {
		ins[r] = make([]byte, 4*E)
		fillMember(o, r, ins[r])
	}
	exact := collective.ReferenceAllReduce(o.Op, o.DType, ins, n)
	want, _ := collective.ReferenceAllReduceCodec(o.Codec, o.Op, o.DType, ins, nil, n)
	w, err := checkBench(o, n, 0, want, nil, nil, "")
	require.NoError(t, err)
	assert.Zero(t, w)
	w, err = checkBench(o, n, 0, exact, nil, nil, "")
	require.NoError(t, err)
	assert.Greater(t, w, E/2, "an exact sum is not what fp8 gives")
}

// corruptMesh flips the first byte of every data frame a member sends.
type corruptMesh struct{ transport.Mesh }

func (c corruptMesh) Stream(peer, i int) transport.Stream {
	return corruptStream{c.Mesh.Stream(peer, i)}
}

type corruptStream struct{ transport.Stream }

func (s corruptStream) Send(ctx context.Context, hdr wire.Header, p []byte) error {
	q := append([]byte(nil), p...)
	q[0] ^= 0xff
	return s.Stream.Send(ctx, hdr, q)
}

// The exchange rows are checked: what arrives is compared with what the
// peer sent, so a damaged frame shows in wrong (it once always read 0).
func TestExchangeRowsCountDamage(t *testing.T) {
	ms := memMembers(t, 2)
	ms[1].Mesh = corruptMesh{ms[1].Mesh} // the exchange's streams; the Comm keeps the clean mesh
	const chunk = 4096
	rows := make([][]BenchRow, 2)
	errs := each(ms, func(m *bridge.Member) error {
		r, err := Sweep(context.Background(), m, SweepOptions{Coll: "exchange", DType: reduce.Float32, Op: reduce.Sum,
			Sizes: []int64{64 << 10}, Iters: 1, Warmup: 1, ChunkB: chunk})
		rows[m.Self] = r
		return err
	})
	for i, err := range errs {
		require.NoError(t, err, "member %d", i)
	}
	require.Len(t, rows[0], 1)
	// Member 0 got (64 KiB / 4 KiB) frames from member 1, each with one bad element.
	assert.Equal(t, int64(16), rows[0][0].Wrong)
	assert.True(t, rows[0][0].Checked)
}

// A frame in the wrong place of the buffer is an error, not data.
func TestExchangeRefusesMisplacedFrame(t *testing.T) {
	ms := memMembers(t, 2)
	buf := make([]byte, 8192)
	ctx, cancel := context.WithTimeout(context.Background(), testenv.Scale(30*time.Second))
	defer cancel()
	errs := each(ms, func(m *bridge.Member) error {
		if m.Self == 1 { // sends chunk 1 first, on the stream where chunk 0 belongs
			return m.Mesh.Stream(0, 0).Send(ctx, wire.Header{Kind: wire.KindData, Chunk: 1}, buf[:4096])
		}
		return exchange(ctx, m, buf, 4096, make([]byte, len(buf)))
	})
	require.Error(t, errs[0])
	assert.Contains(t, errs[0].Error(), "got chunk 1 of 4096 bytes, want chunk 0 of 4096 bytes")
}

func TestMemcpyCheckCountsDifferences(t *testing.T) {
	o := SweepOptions{Coll: "memcpy", DType: reduce.Float32, Op: reduce.Sum}
	buf, in := make([]byte, 64), make([]byte, 64)
	fillPattern(buf, o.DType, 0, o.Op)
	copy(in, buf)
	w, err := checkBench(o, 2, 0, buf, in, nil, "")
	require.NoError(t, err)
	assert.Zero(t, w)
	in[9] ^= 1
	w, err = checkBench(o, 2, 0, buf, in, nil, "")
	require.NoError(t, err)
	assert.Equal(t, 1, w)
}

func TestParseSizes(t *testing.T) {
	got, err := ParseSizes("8, 1K,64M,1G,3")
	require.NoError(t, err)
	assert.Equal(t, []int64{8, 1024, 64 << 20, 1 << 30, 3}, got)
	for _, bad := range []string{"", "x", "-1", "0", "1T"} {
		_, err := ParseSizes(bad)
		assert.Error(t, err, bad)
	}
	assert.Equal(t, int64(8), DefaultSizes()[0])
	assert.Equal(t, int64(1<<30), DefaultSizes()[len(DefaultSizes())-1])
}

func TestBusFactor(t *testing.T) {
	assert.Equal(t, 1.0, BusFactor("all_reduce", 2))
	assert.Equal(t, 1.5, BusFactor("all_reduce", 4))
	assert.Equal(t, 0.75, BusFactor("all_gather", 4))
	assert.Equal(t, 0.75, BusFactor("reduce_scatter", 4))
	assert.Equal(t, 1.0, BusFactor("broadcast", 4))
}

// fillPattern encodes each of patternValue's few values once; its bytes are
// every element's value put one by one.
func TestFillPatternBytes(t *testing.T) {
	for _, dt := range []reduce.DType{reduce.Float16, reduce.BFloat16, reduce.Float32, reduce.Float64, reduce.Int8, reduce.Uint8, reduce.Int32, reduce.Int64} {
		for _, op := range []reduce.Op{reduce.Sum, reduce.Prod, reduce.Max} {
			for m := range 4 {
				sz := dt.Size()
				got := make([]byte, 1000*sz+sz-1) // a partial element at the end stays untouched
				fillPattern(got, dt, m, op)
				want := make([]byte, len(got))
				for i := range 1000 {
					putInt(want[i*sz:], dt, patternValue(m, i, op))
				}
				require.Equal(t, want, got, "%s %s member %d", dt, op, m)
			}
		}
	}
}

// The default selftest's subset covers every collective, dtype and op,
// and is a subset of the full sweep (whose checks run in the bridge CLI
// script with --full): nothing the default checks goes unchecked there.
func TestQuickCasesAreASubset(t *testing.T) {
	for _, n := range []int{2, 4} {
		full := map[string]bool{}
		for _, c := range Cases(n) {
			full[c.String()] = true
		}
		seen := map[string]bool{}
		for _, c := range QuickCases(n) {
			assert.True(t, full[c.String()], "%s is not in the full sweep", c)
			seen[c.Coll+"/"+c.DType.String()+"/"+c.Op.String()] = true
			seen[c.Coll+"/"+c.DType.String()] = true
		}
		for _, dt := range reduce.AllDTypes() {
			for _, op := range reduce.AllOps() {
				if reduce.Supported(op, dt) == nil {
					assert.True(t, seen["all_reduce/"+dt.String()+"/"+op.String()], "all_reduce %s %s", dt, op)
				}
			}
			for _, coll := range []string{"reduce_scatter", "broadcast", "all_gather"} {
				assert.True(t, seen[coll+"/"+dt.String()], "%s %s", coll, dt)
			}
		}
		assert.Less(t, len(QuickCases(n)), len(Cases(n))/3)
	}
}

// The perftest-style rows: bandwidth and latency between members 0 and 1
// over the mesh's streams; a third member waits.
func TestPerfRows(t *testing.T) {
	ms := memMembers(t, 3)
	o := PerfOptions{BWSizes: []int{1 << 10, 100 << 10}, LatSizes: []int{8, 4096}, BWBytes: 1 << 20, Reps: 2, LatIters: 20}
	var bw []BWRow
	var lat []LatRow
	errs := each(ms, func(m *bridge.Member) error {
		b, l, err := Perf(context.Background(), m, o)
		if m.Self == 0 {
			bw, lat = b, l
		}
		return err
	})
	for _, err := range errs {
		require.NoError(t, err)
	}
	require.Len(t, bw, 2)
	require.Len(t, lat, 2)
	for _, r := range bw {
		assert.Positive(t, r.AvgMBps)
		assert.GreaterOrEqual(t, r.PeakMBps, r.AvgMBps*0.999)
		assert.Zero(t, r.Iterations%2, "whole rounds over the streams")
	}
	for _, r := range lat {
		assert.Equal(t, 20, r.Iterations)
		assert.LessOrEqual(t, r.Min, r.Typical)
		assert.LessOrEqual(t, r.Typical, r.Max)
		assert.LessOrEqual(t, r.P99, r.Max)
	}
	var out bytes.Buffer
	require.NoError(t, WritePerf(&out, 3, "mem", bw, lat))
	assert.Contains(t, out.String(), "BW peak[MB/sec]")
	assert.Contains(t, out.String(), "99.9% percentile[usec]")
}
