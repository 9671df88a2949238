package trace

import (
	"errors"
	"math"
	"sort"
)

// HeteroOptions set the heterogeneity-aware diagnosis (docs/STRAGGLERS.md,
// "Mixed hardware").
type HeteroOptions struct {
	Window    int     // steps per window (default 100)
	Calibrate int     // the calibration: this many steps from the first (default Window)
	Threshold float64 // score at or above which compute is degraded, or a link slow (default 5)
	// Clip: values are clipped at this many robust SDs around each rank's
	// window median (default 1.5, near Huber's 1.345: step times have
	// heavy tails, and the clipped mean's error is corrected for the
	// clipping, so a tight clip costs little under Gaussian jitter and gains
	// much under heavy tails; docs/STRAGGLERS.md).
	Clip float64
	// MinSlowdown: degraded compute is at least this much slower per
	// sample than expected (default 0.01: 1%), so that a real but
	// negligible drift in a very quiet job is not a verdict.
	MinSlowdown float64
	// MinLinkSlowdown: a slow link's transfer time is at least this much
	// longer than in the calibration (default 0.25).
	MinLinkSlowdown float64
}

func (o HeteroOptions) withDefaults() HeteroOptions {
	if o.Window <= 0 {
		o.Window = 100
	}
	if o.Calibrate <= 0 {
		o.Calibrate = o.Window
	}
	if o.Threshold <= 0 {
		o.Threshold = 5
	}
	if o.Clip <= 0 {
		o.Clip = 1.5
	}
	if o.MinSlowdown <= 0 {
		o.MinSlowdown = 0.01
	}
	if o.MinLinkSlowdown <= 0 {
		o.MinLinkSlowdown = 0.25
	}
	return o
}

// HeteroData is what the detector reads, per step (rows, in order, the
// same training step on every rank) and rank (columns).
type HeteroData struct {
	Classes  []string    // each column's hardware class
	Ready    [][]float64 // ns of the compute that scales with the samples (StepSplit.ReadyNs)
	Samples  [][]float64 // samples the rank computed in the step
	Transfer [][]float64 // ns of communication with every rank there (nil: no link scores)
}

// HeteroScore is one rank's verdict inputs in one window.
type HeteroScore struct {
	Window      int
	Rank        int // column
	Lo, Hi      int // rows [Lo, Hi)
	Calibrating bool
	Valid       int     // rows with a per-sample time
	Score       float64 // compute: mean log excess over its class and its own history, over its standard error
	Slowdown    float64 // observed / expected compute per sample, less 1 (from the clipped mean excess)
	ObservedNs  float64 // compute per sample: expected times the clipped excess
	ExpectedNs  float64 // what its class peers took in the same steps (geometric mean), times its own history's ratio to them
	// SEDev is the standard error of the window's mean log excess: a
	// verdict of ok is as sure as MinSlowdown is above it.
	SEDev        float64
	Mean         float64 // clipped mean log excess over its history
	LinkScore    float64
	LinkSlowdown float64
	clippedSum   float64
}

// ErrNoCalibration: no class has a per-sample time in the calibration.
var ErrNoCalibration = errors.New("no per-sample compute time in the calibration steps (step records with samples > 0 and collectives?)")

// ScoreHetero scores every rank's compute per sample against its own
// hardware class and its own history, and its communication against its
// own history, over windows of o.Window steps after the first o.Calibrate
// (docs/STRAGGLERS.md). In log space, x = log(ready / samples): a rank's
// excess in a step is x less its class peers' median x in that step (the
// other ranks of its class; for a class of one rank, its class's calibrated
// x plus the other ranks' median drift from theirs), less its own median
// excess over the calibration. Work that every rank of a class shares (a
// longer sequence, a slower input pipeline) cancels, and so does a rank's
// standing difference from its peers (it does the logging); what is left is
// a change of the rank itself. It is scored as the straggler detector
// scores lateness: clipped at o.Clip robust SDs (pooled over the class),
// mean over its standard error. Expected: the calibrated per-sample time
// of each class, ns.
func ScoreHetero(d HeteroData, o HeteroOptions) ([]HeteroScore, map[string]float64, error) {
	o = o.withDefaults()
	rows := len(d.Ready)
	if rows == 0 {
		return nil, nil, nil
	}
	n := len(d.Classes)
	nan := math.NaN()
	x := make([][]float64, rows)
	for k := range x {
		x[k] = make([]float64, n)
		for r := 0; r < n; r++ {
			x[k][r] = nan
			if s, t := d.Samples[k][r], d.Ready[k][r]; s > 0 && t > 0 {
				x[k][r] = math.Log(t / s)
			}
		}
	}
	classOf, members, names := classIndex(d.Classes)
	cal := min(o.Calibrate, rows)
	// Each class's calibrated per-sample time: the median over the
	// calibration steps of the class's median.
	e := make([]float64, len(names))
	expected := map[string]float64{}
	buf := make([]float64, 0, n)
	for c, ranks := range members {
		var meds []float64
		for k := 0; k < cal; k++ {
			if m, ok := medianOf(x[k], ranks, -1, buf); ok {
				meds = append(meds, m)
			}
		}
		e[c] = nan
		if len(meds) > 0 {
			e[c] = median(meds)
			expected[names[c]] = math.Exp(e[c])
		}
	}
	if len(expected) == 0 {
		return nil, nil, ErrNoCalibration
	}
	// ref[k][r]: what rank r's x would be in step k if it were like its
	// class peers then.
	ref := make([][]float64, rows)
	drift := make([]float64, n)
	vals := make([]float64, 0, n)
	pos := make([]int, n)
	for k := range ref {
		ref[k] = make([]float64, n)
		for j := 0; j < n; j++ {
			drift[j] = x[k][j] - e[classOf[j]]
		}
		for c, ranks := range members {
			if len(ranks) == 1 {
				r := ranks[0]
				others := make([]int, 0, n-1)
				for j := 0; j < n; j++ {
					if classOf[j] != c {
						others = append(others, j)
					}
				}
				ref[k][r] = nan
				if m, ok := medianOf(drift, others, -1, buf); ok {
					ref[k][r] = e[c] + m
				}
				continue
			}
			peerMedians(x[k], ranks, vals, pos, ref[k])
		}
	}
	// y: the excess over the class peers; each rank's own history is the
	// clipped mean of its excess over the calibration and, after it, over
	// every window not flagged.
	y := make([][]float64, rows)
	for k := range y {
		y[k] = make([]float64, n)
		for r := range y[k] {
			y[k][r] = x[k][r] - ref[k][r]
		}
	}
	hist := make([]history, n)
	link := linkBaseline(d.Transfer, cal, n, o.Clip)
	var out []HeteroScore
	for w, lo := 0, 0; lo < rows; w, lo = w+1, lo+o.Window {
		hi := min(lo+o.Window, rows)
		if hi-lo < (o.Window+1)/2 {
			break
		}
		calibrating := lo < cal
		win := make([]HeteroScore, n)
		for r := range win {
			win[r] = HeteroScore{Window: w, Rank: r, Lo: lo, Hi: hi, Calibrating: calibrating}
		}
		for _, ranks := range members {
			scoreClass(y, lo, hi, ranks, hist, o.Clip, win)
		}
		for r := range win {
			s := &win[r]
			if calibrating {
				s.Score, s.SEDev = 0, 0 // its excess is what the history learns, not a verdict
			}
			if s.Valid > 0 {
				// Expected: the class peers' per-sample time in these steps
				// times the rank's own history; observed: that times the
				// clipped excess (a long pause does not count).
				exp := 0.0
				for k := lo; k < hi; k++ {
					if !math.IsNaN(y[k][r]) {
						exp += ref[k][r] + hist[r].base()
					}
				}
				s.ExpectedNs = math.Exp(exp / float64(s.Valid))
				s.ObservedNs = s.ExpectedNs * math.Exp(s.Mean)
				s.Slowdown = math.Exp(s.Mean) - 1
			}
			if !calibrating && link != nil {
				s.LinkScore, s.LinkSlowdown = link.score(d.Transfer, lo, hi, r, o.Clip)
			}
			// The window joins the rank's history when it is plainly
			// normal: |score| under absorbAt (symmetric, so the history
			// stays unbiased), so that a slowdown too small to flag at
			// once is not absorbed before it is.
			if calibrating || math.Abs(s.Score) < absorbAt {
				hist[r].add(s.clippedSum, s.Valid)
			}
		}
		out = append(out, win...)
	}
	return out, expected, nil
}

// absorbAt: windows scoring less than this (in absolute value) join a
// rank's history.
const absorbAt = 2

// history is a rank's own record of its excess over its class peers:
// the clipped values' sum and count.
type history struct {
	sum float64
	n   int
}

func (h *history) add(sum float64, n int) { h.sum, h.n = h.sum+sum, h.n+n }

func (h *history) base() float64 {
	if h.n == 0 {
		return 0
	}
	return h.sum / float64(h.n)
}

// scoreClass scores one class's ranks in one window: each rank's excess
// over its own history, each value clipped around the rank's median in
// the window at clip robust SDs of the class's values around theirs (a
// pause is cut short, a shift is kept); the score is the clipped mean over
// its standard error, from the clipped values' spread around each rank's
// own mean pooled over the class, and counting the error of the history's
// mean (a short history is itself uncertain: without it, false flags come
// in runs).
func scoreClass(y [][]float64, lo, hi int, ranks []int, hist []history, clipAt float64, win []HeteroScore) {
	vals := make(map[int][]float64, len(ranks))
	meds := make(map[int]float64, len(ranks))
	var pool []float64
	for _, r := range ranks {
		b := hist[r].base()
		var v []float64
		for k := lo; k < hi; k++ {
			if !math.IsNaN(y[k][r]) {
				v = append(v, y[k][r]-b)
			}
		}
		win[r].Valid = len(v)
		if len(v) < 2 {
			continue
		}
		vals[r] = v
		meds[r] = median(append([]float64(nil), v...))
		for _, x := range v {
			pool = append(pool, x-meds[r])
		}
	}
	if len(pool) < 2 {
		return
	}
	lim := clipAt * robustSD(pool)
	ss, dof, inside, total := 0.0, 0, 0, 0
	for _, r := range ranks {
		v, ok := vals[r]
		if !ok {
			continue
		}
		sum := 0.0
		for i, x := range v {
			if math.Abs(x-meds[r]) < lim {
				inside++
			}
			total++
			v[i] = meds[r] + clip(x-meds[r], lim)
			sum += v[i]
		}
		m := sum / float64(len(v))
		win[r].Mean = m
		// What joins the history: the clipped values, as excess over the
		// class (not over the history).
		win[r].clippedSum = sum + hist[r].base()*float64(len(v))
		for _, x := range v {
			ss += (x - m) * (x - m)
		}
		dof += len(v) - 1
	}
	if dof == 0 {
		return
	}
	// The clipped mean's error is the clipped values' spread over the share
	// of values inside the bounds (Huber's): clipping hard without it
	// understates the error.
	sd := math.Sqrt(ss/float64(dof)) * float64(total) / float64(max(inside, 1))
	if sd <= 0 {
		sd = 1e-12 // a job without jitter (a simulation): any change is certain
	}
	for r := range vals {
		v := 1 / float64(win[r].Valid)
		if hist[r].n > 0 {
			v += 1 / float64(hist[r].n)
		}
		win[r].SEDev = sd * math.Sqrt(v)
		win[r].Score = win[r].Mean / win[r].SEDev
	}
}

// linkStats is each rank's calibrated log transfer time, its spread, and
// the calibration's length.
type linkStats struct {
	base, sd []float64
	n        int
}

// floorNs keeps a transfer of (almost) nothing finite in log space.
const floorNs = 1000

func linkBaseline(t [][]float64, cal, n int, clipAt float64) *linkStats {
	if t == nil || cal < 2 {
		return nil
	}
	l := &linkStats{base: make([]float64, n), sd: make([]float64, n), n: cal}
	v := make([]float64, cal)
	for r := 0; r < n; r++ {
		for k := 0; k < cal; k++ {
			v[k] = math.Log(math.Max(t[k][r], floorNs))
		}
		med := median(append([]float64(nil), v...))
		// A floor of 1%: a simulated link without jitter has none.
		l.sd[r] = math.Max(robustSD(append([]float64(nil), v...)), 0.01)
		sum := 0.0
		for _, x := range v {
			sum += med + clip(x-med, clipAt*l.sd[r])
		}
		l.base[r] = sum / float64(cal)
	}
	return l
}

// score: rank r's mean log transfer over rows [lo, hi) against its
// calibration, each value clipped around the window's median, over its
// standard error (the calibration's included); and the slowdown.
func (l *linkStats) score(t [][]float64, lo, hi, r int, clipAt float64) (float64, float64) {
	v := make([]float64, 0, hi-lo)
	for k := lo; k < hi; k++ {
		v = append(v, math.Log(math.Max(t[k][r], floorNs)))
	}
	med := median(append([]float64(nil), v...))
	lim := clipAt * l.sd[r]
	sum, inside := 0.0, 0
	for _, x := range v {
		if math.Abs(x-med) < lim {
			inside++
		}
		sum += med + clip(x-med, lim)
	}
	m := sum/float64(len(v)) - l.base[r]
	sd := l.sd[r] * float64(len(v)) / float64(max(inside, 1)) // Huber's correction, as scoreClass's
	return m / (sd * math.Sqrt(1/float64(len(v))+1/float64(l.n))), math.Exp(m) - 1
}

// classIndex numbers the classes in order of their first rank: each
// column's class number, each class's columns, the names.
func classIndex(classes []string) ([]int, [][]int, []string) {
	num := map[string]int{}
	of := make([]int, len(classes))
	var members [][]int
	var names []string
	for r, c := range classes {
		i, ok := num[c]
		if !ok {
			i = len(names)
			num[c] = i
			names = append(names, c)
			members = append(members, nil)
		}
		of[r] = i
		members[i] = append(members[i], r)
	}
	return of, members, names
}

// peerMedians sets out[r], for each column r of ranks, to the median of v
// over the other columns of ranks (NaNs left out; NaN when none is left),
// from one sort.
func peerMedians(v []float64, ranks []int, vals []float64, pos []int, out []float64) {
	idx := make([]int, 0, len(ranks))
	for _, j := range ranks {
		if !math.IsNaN(v[j]) {
			idx = append(idx, j)
		}
	}
	sort.Slice(idx, func(a, b int) bool { return v[idx[a]] < v[idx[b]] })
	vals = vals[:0]
	for p, j := range idx {
		vals = append(vals, v[j])
		pos[j] = p
	}
	for _, r := range ranks {
		if math.IsNaN(v[r]) {
			out[r] = math.NaN()
			if len(vals) > 0 {
				out[r] = sortedMedian(vals, -1)
			}
			continue
		}
		out[r] = math.NaN()
		if len(vals) > 1 {
			out[r] = sortedMedian(vals, pos[r])
		}
	}
}

// sortedMedian is the median of sorted values without the one at index
// skip (-1: all of them).
func sortedMedian(s []float64, skip int) float64 {
	at := func(i int) float64 {
		if skip >= 0 && i >= skip {
			return s[i+1]
		}
		return s[i]
	}
	m := len(s)
	if skip >= 0 {
		m--
	}
	if m%2 == 1 {
		return at(m / 2)
	}
	return (at(m/2-1) + at(m/2)) / 2
}

// medianOf is the median of v over the columns cols but skip (-1: none),
// leaving out NaNs; false when none is left. buf is scratch space.
func medianOf(v []float64, cols []int, skip int, buf []float64) (float64, bool) {
	buf = buf[:0]
	for _, j := range cols {
		if j != skip && !math.IsNaN(v[j]) {
			buf = append(buf, v[j])
		}
	}
	if len(buf) == 0 {
		return 0, false
	}
	sort.Float64s(buf)
	m := len(buf) / 2
	if len(buf)%2 == 1 {
		return buf[m], true
	}
	return (buf[m-1] + buf[m]) / 2, true
}
