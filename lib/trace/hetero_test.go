package trace

import (
	"strings"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

func ns(v int64) *int64 { return &v }

// One rank's step split, by hand: what is blocked, what waits for a peer,
// what is compute before the last call and after it.
func TestSplitSteps(t *testing.T) {
	view := func(rank int, arrived, end int64, async bool) RankView {
		return RankView{Rank: rank, Arrived: arrived, End: ns(end), Result: ResultOK, Async: async,
			Phases: []Phase{{Name: "bridge", Start: arrived, End: ns(end)}}}
	}
	merged := func(seq int64, last int64, v RankView) Merged {
		return Merged{Group: "g", Seq: seq, Complete: true, LastArrival: last, Ranks: []RankView{v}}
	}
	for _, tc := range []struct {
		name   string
		colls  []Merged
		want   StepSplit
		phases int64
	}{
		{"no collective: all compute", nil,
			StepSplit{StepNs: 100, ReadyNs: 100, ComputeNs: 100}, 0},
		// A synchronous all_reduce at 60 that ends at 80; the last peer
		// arrived at 70: 10 waiting, 10 transfer; 20 compute after.
		{"one synchronous", []Merged{merged(1, 70, view(0, 60, 80, false))},
			StepSplit{StepNs: 100, ReadyNs: 60, PostNs: 20, ComputeNs: 80, CommNs: 20, WaitNs: 10, TransferNs: 10, Collectives: 1}, 20},
		// DDP: buckets called at 30 and 50 (async, overlapping backward),
		// the last ends at 75; the last peer's last call at 55: blocked
		// 50-75, of which 50-55 waiting.
		{"async buckets", []Merged{merged(1, 35, view(0, 30, 45, true)), merged(2, 55, view(0, 50, 75, true))},
			StepSplit{StepNs: 100, ReadyNs: 50, PostNs: 25, ComputeNs: 75, CommNs: 25, WaitNs: 5, TransferNs: 20, Collectives: 2}, 40},
		// A collective called before the step (a sampler's plan) is not
		// the step's.
		{"outside the step", []Merged{merged(1, 0, view(0, -20, -5, false))},
			StepSplit{StepNs: 100, ReadyNs: 100, ComputeNs: 100}, 0},
	} {
		t.Run(tc.name, func(t *testing.T) {
			got := SplitSteps(tc.colls, []Step{{Rank: 0, Step: 3, Samples: 8, Start: 0, End: 100}})
			require.Len(t, got, 1)
			g := got[0]
			assert.Equal(t, tc.phases, g.Phases["bridge"])
			g.Phases = nil
			w := tc.want
			w.Step, w.Samples, w.Start, w.End = 3, 8, 0, 100
			assert.Equal(t, w, g)
		})
	}
}

// On a GPU the host queues a step in 2 ms and the device runs it: the
// split is of the device's timeline. Rank 0's stream passes its work at 30
// (the end of "running"), the peer's at 40; the collective ends on the
// device at 55; the step's events: 10 and 60.
func TestSplitStepsOnTheDevice(t *testing.T) {
	dev := func(rank int, passed, end int64) RankView {
		return RankView{Rank: rank, Arrived: 1, End: ns(2), Result: ResultOK, Async: true, Phases: []Phase{
			{Name: "queued", Start: 1, End: ns(1)},
			{Name: "running", Start: 1, End: ns(1), GPUStart: ns(passed - 1), GPUEnd: ns(passed)},
			{Name: "bridge", Start: 1, End: ns(2), GPUStart: ns(passed), GPUEnd: ns(end)},
		}}
	}
	m := []Merged{{Group: "g", Seq: 1, Size: 2, Complete: true, LastArrival: 1, Ranks: []RankView{dev(0, 30, 55), dev(1, 40, 55)}}}
	got := SplitSteps(m, []Step{{Rank: 0, Step: 0, Samples: 4, Start: 0, End: 3, GPUStart: ns(10), GPUEnd: ns(60)}})
	require.Len(t, got, 1)
	g := got[0]
	assert.True(t, g.Device)
	assert.Equal(t, StepSplit{Rank: 0, Step: 0, Samples: 4, Start: 0, End: 3, StepNs: 50, ReadyNs: 20, PostNs: 5,
		ComputeNs: 25, CommNs: 25, WaitNs: 10, TransferNs: 15, Device: true, Collectives: 1,
		Phases: map[string]int64{"running": 1, "bridge": 25}}, g)
	// Without the peer's device times, the host's timeline.
	m[0].Ranks[1].Phases[1].GPUEnd = nil
	assert.False(t, SplitSteps(m, []Step{{Rank: 0, Step: 0, Samples: 4, Start: 0, End: 3, GPUStart: ns(10), GPUEnd: ns(60)}})[0].Device)
}

func mixedSim() HeteroSimOptions {
	return HeteroSimOptions{Classes: []SimClass{{"fast", 8, 1e6}, {"slow", 6, 2e6}, {"one", 1, 1.5e6}},
		Steps: 600, GlobalBatch: 15 * 16, Uniform: true, OverheadNs: 2e6, PostNs: 5e6, CollectiveNs: 3e6,
		Jitter: 0.05, LinkJitter: 0.05, Seed: 7}
}

func diagnose(t *testing.T, o HeteroSimOptions, det HeteroOptions) HeteroReport {
	t.Helper()
	run, err := SimulateHetero(o)
	require.NoError(t, err)
	srcs := run.Records(1 << 20)
	in := HeteroInput{Classes: map[int]string{}}
	var steps []Step
	for _, s := range srcs {
		in.Classes[s.Rank()] = s.Header.Hardware.Class
		steps = append(steps, s.Steps...)
	}
	in.Splits = SplitSteps(Merge(srcs).Collectives, steps)
	rep, err := Hetero(in, det)
	require.NoError(t, err)
	return rep
}

// Classes twice as slow as others, with equal shares: the plain detector
// flags every slow rank in every window; the class-aware one flags none,
// and learns each class's pace.
func TestHeteroExpectedDifferencesAreNotDegradation(t *testing.T) {
	o := mixedSim()
	rep := diagnose(t, o, HeteroOptions{})
	assert.Empty(t, rep.Summary.Degraded)
	assert.Empty(t, rep.Summary.SlowLink)
	assert.Equal(t, 15, rep.Summary.Ranks)
	assert.Equal(t, 3, rep.Summary.Classes)
	assert.Equal(t, 6, rep.Summary.Windows)
	require.Len(t, rep.Classes, 3)
	// 16 samples each: (2 ms + 16 x pace) / 16 per sample.
	for i, want := range []float64{1125, 2125, 1625} {
		assert.InDelta(t, want, rep.Classes[i].ExpectedUsPerSample, want*0.02, rep.Classes[i].Class)
	}
	for _, r := range rep.Ranks {
		assert.Equal(t, VerdictOK, r.Verdict, "rank %d", r.Rank)
		assert.Equal(t, 5, r.Windows)
	}
	run, err := SimulateHetero(o)
	require.NoError(t, err)
	_, sum := Stragglers(Merge(run.Records(1<<20)).Collectives, nil, StragglerOptions{}, false)
	assert.Equal(t, []int{8, 9, 10, 11, 12, 13, 14}, sum.Flagged) // the slow class, and the one between
}

// A 5% slower rank of a large class, of a small one, and the class of one
// rank: flagged as degraded compute in the first window after it slows,
// and only it.
func TestHeteroDegradedCompute(t *testing.T) {
	for _, victim := range []int{3, 12, 14} {
		o := mixedSim()
		o.Slow = []Slowdown{{Rank: victim, Factor: 0.05, From: 300}}
		rep := diagnose(t, o, HeteroOptions{})
		assert.Equal(t, []int{victim}, rep.Summary.Degraded, "victim %d", victim)
		r := rep.Ranks[victim]
		assert.Equal(t, VerdictDegraded, r.Verdict)
		require.NotNil(t, r.FirstFlaggedWindow)
		assert.Equal(t, 3, *r.FirstFlaggedWindow)
		assert.EqualValues(t, 300, *r.FirstFlaggedStep)
		assert.Greater(t, r.Confidence, 0.999)
		for _, w := range rep.Windows {
			if w.Rank == victim && w.Window >= 3 {
				assert.Equal(t, VerdictDegraded, w.Verdict)
				assert.InDelta(t, 0.05, w.Slowdown, 0.03)
			}
		}
	}
}

// The all_reduce 60% slower from step 300, compute as before: every rank
// says slow link, none degraded.
func TestHeteroSlowLink(t *testing.T) {
	o := mixedSim()
	o.SlowLink = []Slowdown{{Factor: 0.6, From: 300}}
	rep := diagnose(t, o, HeteroOptions{})
	assert.Empty(t, rep.Summary.Degraded)
	assert.Len(t, rep.Summary.SlowLink, 15)
	for _, w := range rep.Windows {
		switch {
		case w.Window < 1:
			assert.Equal(t, VerdictCalibrating, w.Verdict)
		case w.Window < 3:
			assert.Equal(t, VerdictOK, w.Verdict, "rank %d window %d", w.Rank, w.Window)
		default:
			assert.Equal(t, VerdictSlowLink, w.Verdict)
			assert.Equal(t, "island", w.Link)
			assert.InDelta(t, 0.6, w.LinkSlowdown, 0.05)
		}
	}
}

// Windows at scale: the ROC's rows count what they should.
func TestHeteroROC(t *testing.T) {
	rows, err := HeteroROC(HeteroROCOptions{
		Sim: HeteroSimOptions{Classes: []SimClass{{"a", 16, 1e6}, {"b", 16, 2e6}}, Steps: 1000, GlobalBatch: 512,
			Uniform: true, OverheadNs: 2e6, CollectiveNs: 3e6, Jitter: 0.05, Seed: 3},
		Slowdowns: []float64{0.1}, Trials: 3, Onset: 500,
	})
	require.NoError(t, err)
	require.Len(t, rows, 1)
	r := rows[0]
	assert.Equal(t, 1.0, r.Detected1)
	assert.Equal(t, 0, r.FalseFlags)
	assert.Equal(t, 3*(31*9+4), r.CleanWindows)
	assert.EqualValues(t, 100, r.DelayP50)
	// Uniform shares: the plain detector flags the slow class throughout.
	assert.Greater(t, r.ClassicFlags, 3*16*9*9/10)
}

func TestHeteroSimChecks(t *testing.T) {
	good := mixedSim()
	require.NoError(t, good.Check())
	for _, bad := range []func(o *HeteroSimOptions){
		func(o *HeteroSimOptions) { o.Classes = nil },
		func(o *HeteroSimOptions) { o.Classes = []SimClass{{"a", 1, 1}} },
		func(o *HeteroSimOptions) { o.GlobalBatch = 3 },
		func(o *HeteroSimOptions) { o.Classes[0].SampleNs = 0 },
		func(o *HeteroSimOptions) { o.Jitter = 0.7 },
		func(o *HeteroSimOptions) { o.Slow = []Slowdown{{Rank: 15, Factor: 0.1}} },
	} {
		o := mixedSim()
		o.Classes = append([]SimClass(nil), o.Classes...)
		bad(&o)
		assert.Error(t, o.Check(), "%+v", o)
	}
	// Shares: uniform, or in proportion to speed, summing to the batch.
	o := HeteroSimOptions{Classes: []SimClass{{"a", 2, 1}, {"b", 2, 2}}, GlobalBatch: 48}
	s, _, _ := o.shares()
	assert.Equal(t, []int{16, 16, 8, 8}, s)
	o.Uniform = true
	s, _, _ = o.shares()
	assert.Equal(t, []int{12, 12, 12, 12}, s)
}

// Step records are read, checked, and written back.
func TestStepRecords(t *testing.T) {
	head := `{"schema":"gpubridge.trace/v1","kind":"rank","rank":2,"clock":{"offset_ns":0,"error_ns":0},"hardware":{"vendor":"amd","class":"amd (simulated)","simulated":true}}` + "\n"
	ok := head + `{"schema":"gpubridge.trace/v1","kind":"step","rank":2,"step":0,"samples":12,"start":10,"end":30}` + "\n"
	srcs, err := NewReader(Limits{}).DecodeLines(strings.NewReader(ok), "t")
	require.NoError(t, err)
	require.Len(t, srcs, 1)
	assert.Equal(t, []Step{{Rank: 2, Step: 0, Samples: 12, Start: 10, End: 30}}, srcs[0].Steps)
	assert.Equal(t, "amd (simulated)", srcs[0].Header.Hardware.Class)
	var b strings.Builder
	require.NoError(t, WriteSources(&b, srcs))
	assert.Contains(t, b.String(), `"kind":"step","rank":2,"step":0,"samples":12`)
	assert.Contains(t, b.String(), `"hardware":{"vendor":"amd","class":"amd (simulated)","simulated":true}`)
	for _, bad := range []struct{ line, msg string }{
		{`{"schema":"gpubridge.trace/v1","kind":"step","rank":1,"step":0,"samples":1,"start":0,"end":1}`, "step record of rank 1 in rank 2's"},
		{`{"schema":"gpubridge.trace/v1","kind":"step","rank":2,"step":4,"samples":1,"start":5,"end":1}`, "step record #4: ends (1) before it starts (5)"},
		{`{"schema":"gpubridge.trace/v1","kind":"step","rank":2,"step":4,"samples":-1,"start":0,"end":1}`, "step record #4: samples -1"},
		{`{"schema":"gpubridge.trace/v1","kind":"step","rank":2,"step":-1,"samples":1,"start":0,"end":1}`, "step record: step -1"},
		{`{"schema":"gpubridge.trace/v1","kind":"step","rank":2,"step":3,"samples":1,"start":0,"end":1,"gpu_start":5}`, "step record #3: gpu_start and gpu_end"},
	} {
		_, err := NewReader(Limits{}).DecodeLines(strings.NewReader(head+bad.line+"\n"), "t")
		require.Error(t, err)
		assert.Contains(t, err.Error(), "t:2: "+bad.msg)
	}
}
