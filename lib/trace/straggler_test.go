package trace

import (
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

// A 10% slowdown under 5% jitter is a score of about 20 in a 100-step
// window: flagged in the first window after the onset, every time, and no
// clean rank-window reaches the threshold (docs/STRAGGLERS.md has the
// rates for smaller slowdowns, measured the same way).
func TestDetectsTenPercent(t *testing.T) {
	rows, err := ROC(ROCOptions{
		Sim:       SimOptions{Ranks: 32, Steps: 2000, ComputeNs: 1e8, CollectiveNs: 5e6, Jitter: 0.05, Seed: 3},
		Slowdowns: []float64{0.1}, Trials: 5, Onset: 1000,
	})
	require.NoError(t, err)
	require.Len(t, rows, 1)
	r := rows[0]
	assert.Equal(t, 1.0, r.Detected1)
	assert.Equal(t, 0, r.FalseFlags)
	assert.Equal(t, 5*(31*20+10), r.CleanWindows)
	assert.InDelta(t, 20, r.SlowScoreMean, 3)
	assert.EqualValues(t, 100, r.DelayP50)
}

// No slowdown: scores of clean ranks are standard normal-ish (mean 0,
// spread 1), for light and heavy tails alike.
func TestCleanScores(t *testing.T) {
	for _, dist := range []string{"gaussian", "uniform", "lognormal", "t3"} {
		t.Run(dist, func(t *testing.T) {
			arr, _, err := Simulate(SimOptions{Ranks: 64, Steps: 3000, ComputeNs: 1e8, Jitter: 0.05, Dist: dist, Seed: 11})
			require.NoError(t, err)
			s := ScoreWindows(arr, StragglerOptions{})
			require.Len(t, s, 64*30)
			sum, sq, top := 0.0, 0.0, 0.0
			for _, w := range s {
				sum += w.Score
				sq += w.Score * w.Score
				top = max(top, w.Score)
			}
			n := float64(len(s))
			assert.InDelta(t, 0, sum/n, 0.1)
			assert.InDelta(t, 1, sq/n, 0.25)
			assert.Less(t, top, 5.0)
		})
	}
}

func TestSimulateChecks(t *testing.T) {
	for _, o := range []SimOptions{
		{Ranks: 1, Steps: 10, ComputeNs: 1},
		{Ranks: 4, Steps: 0, ComputeNs: 1},
		{Ranks: 4, Steps: 10, ComputeNs: 1, Jitter: 0.9},
		{Ranks: 4, Steps: 10, ComputeNs: 1, Dist: "cauchy"},
		{Ranks: 4, Steps: 10, ComputeNs: 1, Slow: []Slowdown{{Rank: 4, Factor: 0.1}}},
	} {
		assert.Error(t, o.Check(), "%+v", o)
	}
	o := SimOptions{Ranks: 4, Steps: 3, ComputeNs: 10, CollectiveNs: 1, Seed: 1}
	arr, ends, err := Simulate(o)
	require.NoError(t, err)
	assert.Equal(t, [][]float64{{10, 10, 10, 10}, {21, 21, 21, 21}, {32, 32, 32, 32}}, arr)
	assert.Equal(t, []float64{11, 22, 33}, ends)
	srcs := Records(o, arr, ends, 64)
	require.Len(t, srcs, 4)
	assert.Len(t, Merge(srcs).Collectives, 3)
}

// The CLI's view: a simulated job through records, merge and the detector
// names the slowed rank and nothing else.
func TestStragglersOnRecords(t *testing.T) {
	o := SimOptions{Ranks: 16, Steps: 600, ComputeNs: 1e8, CollectiveNs: 1e6, Jitter: 0.05, Seed: 5,
		Slow: []Slowdown{{Rank: 9, Factor: 0.1, From: 200}}}
	arr, ends, err := Simulate(o)
	require.NoError(t, err)
	m := Merge(Records(o, arr, ends, 1<<20))
	flags, sum := Stragglers(m.Collectives, nil, StragglerOptions{}, false)
	assert.Equal(t, []int{9}, sum.Flagged)
	assert.Equal(t, 6, sum.Windows)
	require.Len(t, flags, 4) // windows 2-5
	for _, f := range flags {
		assert.Equal(t, 9, f.Rank)
		assert.Equal(t, "before the call", f.Phase)
		assert.Greater(t, f.Confidence, 0.99)
	}
}
