package trace

import (
	"math"
	"sort"
)

// HeteroSchema is the schema of gbtrace stragglers --hetero's lines.
const HeteroSchema = "gpubridge.trace-hetero/v1"

// Verdicts of the heterogeneity-aware diagnosis.
const (
	VerdictOK          = "ok"
	VerdictDegraded    = "degraded compute"
	VerdictSlowLink    = "slow link"
	VerdictCalibrating = "calibrating"
)

// HeteroClass is one hardware class and what its calibration learned.
type HeteroClass struct {
	Schema string `json:"schema"`
	Kind   string `json:"kind"` // "class"
	Class  string `json:"class"`
	Ranks  []int  `json:"ranks"`
	// ExpectedUsPerSample: the class's compute per sample in the
	// calibration (the median rank's median step), and the samples per
	// second of one of its ranks at that pace.
	ExpectedUsPerSample float64 `json:"expected_us_per_sample"`
	SamplesPerS         float64 `json:"samples_per_s"`
}

// HeteroWindow is one rank's diagnosis in one window of steps.
type HeteroWindow struct {
	Schema    string  `json:"schema"`
	Kind      string  `json:"kind"` // "window"
	Rank      int     `json:"rank"`
	Class     string  `json:"class"`
	Window    int     `json:"window"`
	FirstStep int64   `json:"first_step"`
	LastStep  int64   `json:"last_step"`
	Steps     int     `json:"steps"`
	Samples   float64 `json:"samples"` // per step, mean
	// Per step, means (µs): the step; its compute (inferred), of which
	// ready (to the last collective's call) and post (after it);
	// communication (blocked), of which waiting for peers and transfer.
	StepUs     float64 `json:"step_us"`
	ComputeUs  float64 `json:"compute_us"`
	ReadyUs    float64 `json:"ready_us"`
	PostUs     float64 `json:"post_us"`
	CommUs     float64 `json:"comm_us"`
	WaitUs     float64 `json:"wait_us"`
	TransferUs float64 `json:"transfer_us"`
	// Compute per sample (µs): expected (its class peers in the same
	// steps, times its calibrated ratio to them) and observed.
	ExpectedUsPerSample float64            `json:"expected_us_per_sample"`
	ObservedUsPerSample float64            `json:"observed_us_per_sample"`
	Slowdown            float64            `json:"slowdown"` // observed / expected - 1
	Score               float64            `json:"score"`
	LinkSlowdown        float64            `json:"link_slowdown"` // transfer against the calibration's, less 1
	LinkScore           float64            `json:"link_score"`
	Link                string             `json:"link,omitempty"` // slow link: the step whose time grew most ("bridge", "island amd", ...)
	Verdict             string             `json:"verdict"`
	Confidence          float64            `json:"confidence"`
	PhasesUs            map[string]float64 `json:"phases_us"` // per step, summed over its collectives
	Flagged             bool               `json:"flagged"`
}

// HeteroRank is one rank over the whole run.
type HeteroRank struct {
	Schema              string  `json:"schema"`
	Kind                string  `json:"kind"` // "rank"
	Rank                int     `json:"rank"`
	Class               string  `json:"class"`
	Windows             int     `json:"windows"` // scored (after the calibration)
	Degraded            int     `json:"degraded_windows"`
	SlowLink            int     `json:"slow_link_windows"`
	Verdict             string  `json:"verdict"` // the worst window's: degraded compute, else slow link, else ok
	Confidence          float64 `json:"confidence"`
	FirstFlaggedWindow  *int    `json:"first_flagged_window"`
	FirstFlaggedStep    *int64  `json:"first_flagged_step"`
	ExpectedUsPerSample float64 `json:"expected_us_per_sample"` // over the scored windows (geometric mean)
	ObservedUsPerSample float64 `json:"observed_us_per_sample"`
	WaitUs              float64 `json:"wait_us"`     // per step, mean over the scored windows
	TransferUs          float64 `json:"transfer_us"` // per step
	Samples             float64 `json:"samples"`     // per step
}

// HeteroSummary ends the output.
type HeteroSummary struct {
	Schema    string  `json:"schema"`
	Kind      string  `json:"kind"` // "summary"
	Ranks     int     `json:"ranks"`
	Classes   int     `json:"classes"`
	Steps     int     `json:"steps"` // steps every rank has a record of
	Skipped   int     `json:"skipped"`
	Windows   int     `json:"windows"`
	Window    int     `json:"window"`
	Calibrate int     `json:"calibrate"`
	Threshold float64 `json:"threshold"`
	Degraded  []int   `json:"degraded"`  // ranks degraded in any window
	SlowLink  []int   `json:"slow_link"` // ranks with a slow link in any window
}

// HeteroInput is what Hetero reads: the steps split (SplitSteps), each
// rank's class and island (for naming a link).
type HeteroInput struct {
	Splits  []StepSplit
	Classes map[int]string
	Islands map[int]string
}

// HeteroReport is Hetero's answer.
type HeteroReport struct {
	Classes []HeteroClass
	Windows []HeteroWindow // every rank-window
	Ranks   []HeteroRank
	Summary HeteroSummary
}

// linkOf names the link behind a collective step.
var linkOf = map[string]string{
	"bridge": "bridge", "copy": "host copies", "copy back": "host copies",
	"island reduce": "island", "island broadcast": "island", "island allgather": "island",
	"island scatter": "island", "native": "island",
}

// Hetero diagnoses every rank's steps: the split of each window's steps,
// the verdict (ok, degraded compute, slow link; calibrating in the
// calibration) with its confidence, per rank over the run, and the classes'
// calibrated per-sample compute. Steps are joined across ranks by index;
// a step some rank has no record of is skipped.
func Hetero(in HeteroInput, o HeteroOptions) (HeteroReport, error) {
	o = o.withDefaults()
	rep := HeteroReport{Summary: HeteroSummary{Schema: HeteroSchema, Kind: "summary", Window: o.Window,
		Calibrate: o.Calibrate, Threshold: o.Threshold, Degraded: []int{}, SlowLink: []int{}}}
	byRank := map[int]map[int64]*StepSplit{}
	count := map[int64]int{}
	for i := range in.Splits {
		s := &in.Splits[i]
		if byRank[s.Rank] == nil {
			byRank[s.Rank] = map[int64]*StepSplit{}
		}
		if _, dup := byRank[s.Rank][s.Step]; !dup {
			byRank[s.Rank][s.Step] = s
			count[s.Step]++
		}
	}
	ranks := make([]int, 0, len(byRank))
	for r := range byRank {
		ranks = append(ranks, r)
	}
	sort.Ints(ranks)
	var steps []int64
	for st, c := range count {
		if c == len(ranks) {
			steps = append(steps, st)
		} else {
			rep.Summary.Skipped++
		}
	}
	sort.Slice(steps, func(i, j int) bool { return steps[i] < steps[j] })
	rep.Summary.Ranks, rep.Summary.Steps = len(ranks), len(steps)
	if len(ranks) < 2 || len(steps) == 0 {
		return rep, nil
	}
	d := HeteroData{Classes: make([]string, len(ranks)), Ready: make([][]float64, len(steps)),
		Samples: make([][]float64, len(steps)), Transfer: make([][]float64, len(steps))}
	for i, r := range ranks {
		d.Classes[i] = in.Classes[r]
		if d.Classes[i] == "" {
			d.Classes[i] = "unknown"
		}
	}
	for k, st := range steps {
		d.Ready[k], d.Samples[k], d.Transfer[k] = make([]float64, len(ranks)), make([]float64, len(ranks)), make([]float64, len(ranks))
		for i, r := range ranks {
			s := byRank[r][st]
			d.Ready[k][i], d.Samples[k][i], d.Transfer[k][i] = float64(s.ReadyNs), float64(s.Samples), float64(s.TransferNs)
		}
	}
	scores, expected, err := ScoreHetero(d, o)
	if err != nil {
		return rep, err
	}
	_, members, names := classIndex(d.Classes)
	for c, cols := range members {
		hc := HeteroClass{Schema: HeteroSchema, Kind: "class", Class: names[c]}
		for _, i := range cols {
			hc.Ranks = append(hc.Ranks, ranks[i])
		}
		if e, ok := expected[names[c]]; ok {
			hc.ExpectedUsPerSample, hc.SamplesPerS = round3(e/1e3), round3(1e9/e)
		}
		rep.Classes = append(rep.Classes, hc)
	}
	rep.Summary.Classes = len(names)
	calPhases := phaseMeans(byRank, ranks, steps, 0, min(o.Calibrate, len(steps)))
	perRank := map[int]*HeteroRank{}
	obsLog, expLog := map[int]float64{}, map[int]float64{}
	windows := map[int]bool{}
	for _, s := range scores {
		r := ranks[s.Rank]
		windows[s.Window] = true
		w := windowLine(s, r, d.Classes[s.Rank], byRank[r], steps, o, len(ranks))
		if w.Verdict == VerdictSlowLink {
			w.Link = grownLink(w.PhasesUs, calPhases[r], in.Islands[r])
		}
		rep.Windows = append(rep.Windows, w)
		hr := perRank[r]
		if hr == nil {
			hr = &HeteroRank{Schema: HeteroSchema, Kind: "rank", Rank: r, Class: w.Class, Verdict: VerdictOK}
			perRank[r] = hr
		}
		if s.Calibrating || s.Valid == 0 {
			continue
		}
		hr.Windows++
		obsLog[r] += math.Log(s.ObservedNs)
		expLog[r] += math.Log(s.ExpectedNs)
		hr.WaitUs += w.WaitUs
		hr.TransferUs += w.TransferUs
		hr.Samples += w.Samples
		switch w.Verdict {
		case VerdictDegraded:
			hr.Degraded++
		case VerdictSlowLink:
			hr.SlowLink++
		}
		if w.Flagged && hr.FirstFlaggedWindow == nil {
			win, step := w.Window, w.FirstStep
			hr.FirstFlaggedWindow, hr.FirstFlaggedStep = &win, &step
		}
		worse := rankOrder(w.Verdict) > rankOrder(hr.Verdict) ||
			(w.Verdict == hr.Verdict && w.Verdict != VerdictOK && w.Confidence > hr.Confidence)
		if worse || (w.Verdict == VerdictOK && hr.Verdict == VerdictOK && (hr.Windows == 1 || w.Confidence < hr.Confidence)) {
			hr.Verdict, hr.Confidence = w.Verdict, w.Confidence
		}
	}
	rep.Summary.Windows = len(windows)
	for _, r := range ranks {
		hr := perRank[r]
		if hr == nil {
			continue
		}
		if n := float64(hr.Windows); n > 0 {
			hr.ObservedUsPerSample, hr.ExpectedUsPerSample = round3(math.Exp(obsLog[r]/n)/1e3), round3(math.Exp(expLog[r]/n)/1e3)
			hr.WaitUs, hr.TransferUs, hr.Samples = round3(hr.WaitUs/n), round3(hr.TransferUs/n), round3(hr.Samples/n)
		}
		if hr.Degraded > 0 {
			rep.Summary.Degraded = append(rep.Summary.Degraded, r)
		}
		if hr.SlowLink > 0 {
			rep.Summary.SlowLink = append(rep.Summary.SlowLink, r)
		}
		rep.Ranks = append(rep.Ranks, *hr)
	}
	return rep, nil
}

func rankOrder(v string) int {
	switch v {
	case VerdictDegraded:
		return 2
	case VerdictSlowLink:
		return 1
	}
	return 0
}

// windowLine is a rank's window: the means of its steps' split and its
// verdict.
func windowLine(s HeteroScore, r int, class string, bySeq map[int64]*StepSplit, steps []int64, o HeteroOptions, ranks int) HeteroWindow {
	w := HeteroWindow{Schema: HeteroSchema, Kind: "window", Rank: r, Class: class, Window: s.Window,
		FirstStep: steps[s.Lo], LastStep: steps[s.Hi-1], Steps: s.Hi - s.Lo, PhasesUs: map[string]float64{}}
	for k := s.Lo; k < s.Hi; k++ {
		x := bySeq[steps[k]]
		w.Samples += float64(x.Samples)
		w.StepUs += float64(x.StepNs)
		w.ComputeUs += float64(x.ComputeNs)
		w.ReadyUs += float64(x.ReadyNs)
		w.PostUs += float64(x.PostNs)
		w.CommUs += float64(x.CommNs)
		w.WaitUs += float64(x.WaitNs)
		w.TransferUs += float64(x.TransferNs)
		for name, ns := range x.Phases {
			w.PhasesUs[name] += float64(ns)
		}
	}
	n := float64(w.Steps)
	w.Samples = round3(w.Samples / n)
	for _, f := range []*float64{&w.StepUs, &w.ComputeUs, &w.ReadyUs, &w.PostUs, &w.CommUs, &w.WaitUs, &w.TransferUs} {
		*f = round3(*f / n / 1e3)
	}
	for name := range w.PhasesUs {
		w.PhasesUs[name] = round3(w.PhasesUs[name] / n / 1e3)
	}
	w.ExpectedUsPerSample, w.ObservedUsPerSample = round3(s.ExpectedNs/1e3), round3(s.ObservedNs/1e3)
	w.Slowdown, w.Score = round6(s.Slowdown), round3(s.Score)
	// (+0: no "-0" in the output)
	w.LinkSlowdown, w.LinkScore = round6(s.LinkSlowdown)+0, round3(s.LinkScore)+0
	switch {
	case s.Calibrating:
		w.Verdict = VerdictCalibrating
	case s.Score >= o.Threshold && s.Slowdown >= o.MinSlowdown:
		w.Verdict, w.Confidence, w.Flagged = VerdictDegraded, round6(Confidence(s.Score, ranks)), true
	case s.LinkScore >= o.Threshold && s.LinkSlowdown >= o.MinLinkSlowdown:
		w.Verdict, w.Confidence, w.Flagged = VerdictSlowLink, round6(Confidence(s.LinkScore, ranks)), true
	default:
		w.Verdict = VerdictOK
		// How sure that the rank is not MinSlowdown or more slower: the
		// one-sided Gaussian chance of its mean excess that far below.
		if s.SEDev > 0 {
			w.Confidence = round6(0.5 * math.Erfc(-(math.Log1p(o.MinSlowdown)-s.Mean)/s.SEDev/math.Sqrt2))
		}
	}
	return w
}

// phaseMeans: each rank's time per step in each phase over rows [lo, hi)
// (µs).
func phaseMeans(byRank map[int]map[int64]*StepSplit, ranks []int, steps []int64, lo, hi int) map[int]map[string]float64 {
	out := map[int]map[string]float64{}
	for _, r := range ranks {
		m := map[string]float64{}
		for k := lo; k < hi; k++ {
			for name, ns := range byRank[r][steps[k]].Phases {
				m[name] += float64(ns) / 1e3 / float64(hi-lo)
			}
		}
		out[r] = m
	}
	return out
}

// grownLink names the link whose steps grew the most over the
// calibration: the bridge, the rank's island, or the leader's host copies.
func grownLink(now, cal map[string]float64, island string) string {
	best, name := 0.0, ""
	keys := make([]string, 0, len(now))
	for k := range now {
		keys = append(keys, k)
	}
	sort.Strings(keys)
	for _, p := range keys {
		link, ok := linkOf[p]
		if !ok {
			continue
		}
		if g := now[p] - cal[p]; g > best {
			best, name = g, link
		}
	}
	if name == "island" && island != "" {
		name = "island " + island
	}
	return name
}
