package main

import (
	"bufio"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"sort"
	"strconv"
	"strings"
	"text/tabwriter"

	"github.com/gpubridge/gpubridge/lib/cli"
	"github.com/gpubridge/gpubridge/lib/trace"
)

// inputs are what every reading command takes.
type inputs struct {
	Paths      []string `arg:"" optional:"" name:"path" help:"Trace files, dumps, torch Flight Recorder dumps, or directories of them; none: stdin."`
	Format     string   `help:"json: JSON Lines for jq; text: a table." enum:"json,text" default:"json"`
	MaxRecords int      `help:"Refuse inputs of more records than this (a bound on memory)." default:"20000000"`
}

func (in *inputs) load(env *cli.Env, rank int) ([]*trace.Source, error) {
	rd := trace.NewReader(trace.Limits{MaxRecords: in.MaxRecords})
	srcs, err := rd.LoadRank(in.Paths, env.Stdin, rank)
	if err != nil {
		return nil, cli.CannotRun(err)
	}
	return srcs, nil
}

// jsonl writes values as JSON Lines.
func jsonl[T any](w io.Writer, vals []T) error {
	bw := bufio.NewWriter(w)
	enc := json.NewEncoder(bw)
	for _, v := range vals {
		if err := enc.Encode(v); err != nil {
			return err
		}
	}
	return bw.Flush()
}

func table(w io.Writer, head []string, rows [][]string) error {
	tw := tabwriter.NewWriter(w, 2, 4, 2, ' ', 0)
	fmt.Fprintln(tw, strings.Join(head, "\t"))
	for _, r := range rows {
		fmt.Fprintln(tw, strings.Join(r, "\t"))
	}
	return tw.Flush()
}

func f3(x float64) string { return strconv.FormatFloat(x, 'f', 3, 64) }

// merged loads the inputs and merges them (the alignment's warnings on
// stderr).
func (in *inputs) merged(env *cli.Env) ([]*trace.Source, trace.MergeResult, error) {
	srcs, err := in.load(env, -1)
	if err != nil {
		return nil, trace.MergeResult{}, err
	}
	res := trace.Merge(srcs)
	for _, w := range res.Warnings {
		env.Log.Warn(w)
	}
	return srcs, res, nil
}

// ---- merge ----

type mergeCmd struct {
	inputs
}

func (c *mergeCmd) Run(env *cli.Env) error {
	_, res, err := c.merged(env)
	if err != nil {
		return err
	}
	if c.Format == "json" {
		return jsonl(env.Stdout, res.Collectives)
	}
	var rows [][]string
	for _, m := range res.Collectives {
		t := "-"
		if m.TimeNs != nil {
			t = f3(float64(*m.TimeNs) / 1e3)
		}
		rows = append(rows, []string{m.Group, fmt.Sprint(m.Seq), m.Op, trace.Human(m.Bytes), fmt.Sprintf("%d/%d", m.Seen, m.Size),
			t, f3(float64(m.SkewNs) / 1e3), fmt.Sprint(m.LastRank), fmt.Sprint(len(m.Mismatches))})
	}
	return table(env.Stdout, []string{"GROUP", "SEQ", "OP", "BYTES", "RANKS", "TIME_US", "SKEW_US", "LAST", "MISMATCHES"}, rows)
}

// ---- summary ----

type summaryCmd struct {
	inputs
}

func (c *summaryCmd) Run(env *cli.Env) error {
	_, res, err := c.merged(env)
	if err != nil {
		return err
	}
	rows := trace.Summarize(res.Collectives)
	if c.Format == "json" {
		return jsonl(env.Stdout, rows)
	}
	var out [][]string
	for _, r := range rows {
		names := make([]string, 0, len(r.Phases))
		for n := range r.Phases {
			names = append(names, n)
		}
		sort.Slice(names, func(i, j int) bool { return r.Phases[names[i]] > r.Phases[names[j]] })
		var top []string
		for _, n := range names[:min(3, len(names))] {
			top = append(top, fmt.Sprintf("%s %.0f%%", n, 100*r.Phases[n]))
		}
		out = append(out, []string{r.Op, fmt.Sprint(r.GroupSize), "<=" + r.Label, fmt.Sprint(r.Count), fmt.Sprint(r.Failed),
			f3(r.P50Us), f3(r.P99Us), f3(r.AlgBW), f3(r.BusBW), strings.Join(top, ", ")})
	}
	return table(env.Stdout, []string{"OP", "RANKS", "SIZE", "COUNT", "FAILED", "P50_US", "P99_US", "ALGBW_GBPS", "BUSBW_GBPS", "PHASES"}, out)
}

// ---- hang ----

type hangCmd struct {
	inputs
	MismatchCap int `help:"Report at most this many mismatched calls per group." default:"10"`
}

func (c *hangCmd) Run(env *cli.Env) error {
	srcs, err := c.load(env, -1)
	if err != nil {
		return err
	}
	reps := trace.Hang(srcs, trace.HangOptions{MismatchCap: c.MismatchCap})
	if c.Format == "json" {
		err = jsonl(env.Stdout, reps)
	} else {
		for _, r := range reps {
			fmt.Fprintf(env.Stdout, "%s: %s\n", r.Status, r.Verdict)
			for _, w := range r.Where {
				line := fmt.Sprintf("  rank %d: #%d %s %s", w.Rank, w.Seq, w.Op, w.State)
				if w.Step != "" {
					line += " in step " + w.Step
				}
				if w.StepNs != nil {
					line += fmt.Sprintf(" for %.3f s", float64(*w.StepNs)/1e9)
				}
				if w.Error != "" {
					line += ": " + w.Error
				}
				fmt.Fprintln(env.Stdout, line)
			}
			for _, m := range r.Mismatches {
				fmt.Fprintf(env.Stdout, "  mismatch %s\n", m.Text)
			}
		}
	}
	if err != nil {
		return err
	}
	for _, r := range reps {
		if r.Status != "ok" {
			return cli.Failed(errors.New(r.Verdict))
		}
	}
	return nil
}

// ---- stragglers ----

type stragglersCmd struct {
	inputs
	Window          int      `help:"Collectives per window (with --hetero: training steps per window)." default:"100"`
	Threshold       float64  `help:"Score (mean lateness over its standard error; with --hetero, mean excess compute per sample or transfer time) at or above which a rank is flagged; docs/STRAGGLERS.md has the rates." default:"5"`
	Op              string   `help:"Only collectives of this op (all_reduce, all_gather, ...)." placeholder:"OP"`
	Group           string   `help:"Only this group." placeholder:"NAME"`
	All             bool     `help:"Print every rank's score in every window, not only the flagged."`
	Hetero          bool     `help:"Mixed hardware: each rank's steps (gpubridge.observe.step records) split into compute and communication; compute per sample judged against the rank's hardware class and its own history, communication against its history; verdict per rank: ok, degraded compute, slow link (docs/STRAGGLERS.md)."`
	Calibrate       int      `help:"--hetero: the calibration, in steps from the first (0: one window)." default:"0"`
	Class           []string `sep:"none" help:"--hetero: RANKS=NAME puts ranks (3, 0-3, 0,2,5) in hardware class NAME, over what the records say; repeatable." placeholder:"RANKS=NAME"`
	MinSlowdown     float64  `help:"--hetero: degraded compute is at least this much slower per sample than expected." default:"0.01"`
	MinLinkSlowdown float64  `help:"--hetero: a slow link's transfer time is at least this much longer than in the calibration." default:"0.25"`
}

func (c *stragglersCmd) Run(env *cli.Env) error {
	srcs, res, err := c.merged(env)
	if err != nil {
		return err
	}
	var keep []trace.Merged
	for _, m := range res.Collectives {
		if (c.Op == "" || m.Op == c.Op) && (c.Group == "" || m.Group == c.Group) {
			keep = append(keep, m)
		}
	}
	if c.Hetero {
		return c.hetero(env, srcs, keep)
	}
	if classes := distinctClasses(srcs); len(classes) > 1 {
		env.Log.Warn("the ranks are of several hardware classes: the slower classes show as stragglers; --hetero tells expected differences from degradation",
			"classes", strings.Join(classes, ", "))
	}
	var phases []trace.UserPhase
	for _, s := range srcs {
		off, _ := s.Offset()
		for _, p := range s.Phases {
			p.Start, p.End = p.Start-off, p.End-off
			phases = append(phases, p)
		}
	}
	flags, sum := trace.Stragglers(keep, phases, trace.StragglerOptions{Window: c.Window, Threshold: c.Threshold}, c.All)
	if sum.Windows == 0 {
		env.Log.Warn("no window to score: too few complete collectives", "collectives", len(keep), "window", c.Window)
	}
	if c.Format == "json" {
		if err := jsonl(env.Stdout, flags); err != nil {
			return err
		}
		if err := jsonl(env.Stdout, []trace.StragglerSummary{sum}); err != nil {
			return err
		}
	} else {
		var rows [][]string
		for _, f := range flags {
			rows = append(rows, []string{f.Group, fmt.Sprint(f.Rank), fmt.Sprint(f.Window), fmt.Sprintf("%d-%d", f.FirstSeq, f.LastSeq),
				f3(f.Score), f3(f.LateUs), f.Phase, fmt.Sprint(f.Flagged)})
		}
		if err := table(env.Stdout, []string{"GROUP", "RANK", "WINDOW", "SEQS", "SCORE", "LATE_US", "PHASE", "FLAGGED"}, rows); err != nil {
			return err
		}
		fmt.Fprintf(env.Stdout, "%d windows of %d collectives, %d ranks, threshold %g: flagged %v\n", sum.Windows, sum.Window, sum.Ranks, sum.Threshold, sum.Flagged)
	}
	if len(sum.Flagged) > 0 {
		return cli.Failed(fmt.Errorf("straggler(s): rank(s) %v", sum.Flagged))
	}
	return nil
}

// distinctClasses: the hardware classes the sources' headers name.
func distinctClasses(srcs []*trace.Source) []string {
	seen := map[string]bool{}
	var out []string
	for _, s := range srcs {
		if h := s.Header.Hardware; h != nil && h.Class != "" && !seen[h.Class] {
			seen[h.Class] = true
			out = append(out, h.Class)
		}
	}
	sort.Strings(out)
	return out
}

func (c *stragglersCmd) hetero(env *cli.Env, srcs []*trace.Source, merged []trace.Merged) error {
	in := trace.HeteroInput{Classes: map[int]string{}, Islands: map[int]string{}}
	var steps []trace.Step
	for _, s := range srcs {
		off, _ := s.Offset()
		r := s.Rank()
		if h := s.Header.Hardware; h != nil && h.Class != "" {
			in.Classes[r] = h.Class
		}
		for _, g := range s.Groups {
			if g.Island != "" {
				in.Islands[r] = g.Island
			}
		}
		for _, st := range s.Steps {
			st.Start, st.End = st.Start-off, st.End-off
			if st.GPUStart != nil {
				a, b := *st.GPUStart-off, *st.GPUEnd-off
				st.GPUStart, st.GPUEnd = &a, &b
			}
			steps = append(steps, st)
		}
	}
	for _, spec := range c.Class {
		ranks, name, err := parseClass(spec)
		if err != nil {
			return cli.CannotRun(err)
		}
		for _, r := range ranks {
			in.Classes[r] = name
		}
	}
	if len(steps) == 0 {
		return cli.CannotRun(errors.New("--hetero needs step records (mark each training step with gpubridge.observe.step(samples=...)); these inputs have none"))
	}
	in.Splits = trace.SplitSteps(merged, steps)
	rep, err := trace.Hetero(in, trace.HeteroOptions{Window: c.Window, Calibrate: c.Calibrate, Threshold: c.Threshold,
		MinSlowdown: c.MinSlowdown, MinLinkSlowdown: c.MinLinkSlowdown})
	if err != nil {
		return cli.CannotRun(err)
	}
	sum := rep.Summary
	if sum.Windows == 0 {
		env.Log.Warn("no window to score: too few steps every rank has a record of", "steps", sum.Steps, "window", c.Window)
	}
	var windows []trace.HeteroWindow
	for _, w := range rep.Windows {
		if w.Flagged || c.All {
			windows = append(windows, w)
		}
	}
	if c.Format == "json" {
		for _, err := range []error{jsonl(env.Stdout, rep.Classes), jsonl(env.Stdout, windows), jsonl(env.Stdout, rep.Ranks),
			jsonl(env.Stdout, []trace.HeteroSummary{sum})} {
			if err != nil {
				return err
			}
		}
	} else {
		var rows [][]string
		for _, r := range rep.Ranks {
			rows = append(rows, []string{fmt.Sprint(r.Rank), r.Class, f3(r.ExpectedUsPerSample), f3(r.ObservedUsPerSample),
				f3(r.WaitUs), f3(r.TransferUs), r.Verdict, strconv.FormatFloat(r.Confidence, 'f', 4, 64)})
		}
		if err := table(env.Stdout, []string{"RANK", "CLASS", "EXPECTED_US/SAMPLE", "OBSERVED_US/SAMPLE", "WAIT_US", "TRANSFER_US", "VERDICT", "CONFIDENCE"}, rows); err != nil {
			return err
		}
		for _, w := range windows {
			fmt.Fprintf(env.Stdout, "  rank %d window %d (steps %d-%d): %s, slowdown %+.1f%% (score %.1f), link %+.1f%% (score %.1f) %s\n",
				w.Rank, w.Window, w.FirstStep, w.LastStep, w.Verdict, 100*w.Slowdown, w.Score, 100*w.LinkSlowdown, w.LinkScore, w.Link)
		}
		fmt.Fprintf(env.Stdout, "%d windows of %d steps after %d of calibration, %d ranks in %d classes, threshold %g: degraded %v, slow link %v\n",
			sum.Windows, sum.Window, sum.Calibrate, sum.Ranks, sum.Classes, sum.Threshold, sum.Degraded, sum.SlowLink)
	}
	if len(sum.Degraded) > 0 || len(sum.SlowLink) > 0 {
		return cli.Failed(fmt.Errorf("degraded compute on rank(s) %v, slow link on rank(s) %v", sum.Degraded, sum.SlowLink))
	}
	return nil
}

// parseClass reads RANKS=NAME: RANKS a comma-separated list of ranks and
// ranges (0-3,6).
func parseClass(s string) ([]int, string, error) {
	bad := fmt.Errorf("--class %q: want RANKS=NAME (0-3,6=h100)", s)
	list, name, ok := strings.Cut(s, "=")
	if !ok || name == "" || list == "" {
		return nil, "", bad
	}
	var out []int
	for _, part := range strings.Split(list, ",") {
		a, b, isRange := strings.Cut(part, "-")
		lo, err := strconv.Atoi(a)
		if err != nil || lo < 0 {
			return nil, "", bad
		}
		hi := lo
		if isRange {
			if hi, err = strconv.Atoi(b); err != nil || hi < lo || hi-lo > 1<<20 {
				return nil, "", bad
			}
		}
		for r := lo; r <= hi; r++ {
			out = append(out, r)
		}
	}
	return out, name, nil
}

// ---- perfetto ----

type perfettoCmd struct {
	Paths      []string `arg:"" optional:"" name:"path" help:"Trace files, dumps, torch Flight Recorder dumps, or directories of them; none: stdin."`
	MaxRecords int      `help:"Refuse inputs of more records than this (a bound on memory)." default:"20000000"`
}

func (c *perfettoCmd) Run(env *cli.Env) error {
	in := inputs{Paths: c.Paths, MaxRecords: c.MaxRecords}
	srcs, err := in.load(env, -1)
	if err != nil {
		return err
	}
	return trace.Perfetto(env.Stdout, srcs)
}

// ---- fr ----

type frCmd struct {
	Paths      []string `arg:"" optional:"" name:"path" help:"torch Flight Recorder dumps (pickle or JSON), or directories of them; none: stdin."`
	Rank       int      `help:"The rank of a dump read from stdin (or of one file whose name ends in no number)." default:"-1"`
	MaxRecords int      `help:"Refuse inputs of more records than this (a bound on memory)." default:"20000000"`
}

func (c *frCmd) Run(env *cli.Env) error {
	in := inputs{Paths: c.Paths, MaxRecords: c.MaxRecords}
	srcs, err := in.load(env, c.Rank)
	if err != nil {
		return err
	}
	return trace.WriteSources(env.Stdout, srcs)
}

// ---- simulate ----

type simulateCmd struct {
	Ranks      int       `help:"Ranks of the job (with --classes: the classes' ranks)." default:"64"`
	Steps      int       `help:"Training steps (one all_reduce each)." default:"10000"`
	Compute    float64   `help:"Mean computation per step, ms." default:"100"`
	Collective float64   `help:"The all_reduce once every rank is there, ms." default:"5"`
	Jitter     float64   `help:"Standard deviation of each rank's computation per step, relative (0.05: 5%), independent per rank and step." default:"0.05"`
	Common     float64   `help:"Standard deviation of a factor all ranks share in a step, relative." default:"0"`
	Dist       string    `help:"Distribution of the jitter." enum:"gaussian,lognormal,uniform,t3,t5" default:"gaussian"`
	Slow       []string  `help:"RANK:FRACTION@STEP: rank computes FRACTION more from STEP on (3:0.02@5000); repeatable." placeholder:"R:F@S"`
	Seed       uint64    `help:"Random seed." default:"1"`
	Bytes      int64     `help:"Bytes of the simulated all_reduce." default:"104857600"`
	ROC        bool      `name:"roc" help:"Measure the straggler detector instead (with --classes, the heterogeneity-aware one): --trials jobs per slowdown, one random rank slowed from --onset."`
	Trials     int       `help:"--roc: jobs per slowdown." default:"40"`
	Slowdowns  []float64 `help:"--roc: slowdowns to measure." default:"0.01,0.02,0.05,0.1"`
	Thresholds []float64 `help:"--roc: thresholds (the ROC's points)." default:"3,4,4.5,5,5.5,6"`
	Onset      int       `help:"--roc: the step the slowdown starts." default:"5000"`
	Window     int       `help:"--roc: collectives (with --classes: steps) per window." default:"100"`

	Classes     []string `help:"Mixed hardware: NAME:RANKS:MS_PER_SAMPLE per class (h100:32:1,mi300x:24:1.3); each rank computes its share of --global-batch at its class's pace (plus --overhead), and records its steps (step records) and class." placeholder:"N:R:MS"`
	GlobalBatch int      `help:"--classes: samples per step over all ranks." default:"2048"`
	Uniform     bool     `help:"--classes: every rank gets the same share (else in proportion to its class's speed, as a rebalancer would)."`
	Overhead    float64  `help:"--classes: compute per step that does not scale with the samples, ms." default:"5"`
	Post        float64  `help:"--classes: compute after the all_reduce (the optimizer), ms." default:"10"`
	LinkJitter  float64  `help:"--classes: standard deviation of the all_reduce's time per step, relative." default:"0"`
	SlowLink    []string `help:"--classes: FRACTION@STEP: the all_reduce takes FRACTION longer from STEP on; repeatable." placeholder:"F@S"`
	Calibrate   int      `help:"--classes --roc: the calibration, in steps (0: one window)." default:"0"`
}

func (c *simulateCmd) Run(env *cli.Env) error {
	var slow []trace.Slowdown
	for _, s := range c.Slow {
		sd, err := parseSlow(s)
		if err != nil {
			return cli.CannotRun(err)
		}
		slow = append(slow, sd)
	}
	if len(c.Classes) > 0 {
		return c.hetero(env, slow)
	}
	if len(c.SlowLink) > 0 {
		return cli.CannotRun(errors.New("--slow-link needs --classes"))
	}
	o := trace.SimOptions{Ranks: c.Ranks, Steps: c.Steps, ComputeNs: c.Compute * 1e6, CollectiveNs: c.Collective * 1e6,
		Jitter: c.Jitter, Common: c.Common, Dist: c.Dist, Seed: c.Seed, Slow: slow}
	if err := o.Check(); err != nil {
		return cli.CannotRun(err)
	}
	if c.ROC {
		rows, err := trace.ROC(trace.ROCOptions{Sim: o, Detector: trace.StragglerOptions{Window: c.Window},
			Slowdowns: c.Slowdowns, Thresholds: c.Thresholds, Trials: c.Trials, Onset: c.Onset})
		if err != nil {
			return cli.CannotRun(err)
		}
		return jsonl(env.Stdout, rows)
	}
	arr, ends, err := trace.Simulate(o)
	if err != nil {
		return cli.CannotRun(err)
	}
	return trace.WriteSources(env.Stdout, trace.Records(o, arr, ends, c.Bytes))
}

func (c *simulateCmd) hetero(env *cli.Env, slow []trace.Slowdown) error {
	o := trace.HeteroSimOptions{Steps: c.Steps, GlobalBatch: c.GlobalBatch, Uniform: c.Uniform, OverheadNs: c.Overhead * 1e6,
		PostNs: c.Post * 1e6, CollectiveNs: c.Collective * 1e6, Jitter: c.Jitter, Common: c.Common, LinkJitter: c.LinkJitter,
		Dist: c.Dist, Slow: slow, Seed: c.Seed}
	for _, spec := range c.Classes {
		cl, err := parseSimClass(spec)
		if err != nil {
			return cli.CannotRun(err)
		}
		o.Classes = append(o.Classes, cl)
	}
	for _, s := range c.SlowLink {
		frac, step, ok := strings.Cut(s, "@")
		f, err1 := strconv.ParseFloat(frac, 64)
		k, err2 := strconv.Atoi(step)
		if !ok || err1 != nil || err2 != nil {
			return cli.CannotRun(fmt.Errorf("--slow-link %q: want FRACTION@STEP (0.5@3000)", s))
		}
		o.SlowLink = append(o.SlowLink, trace.Slowdown{Factor: f, From: k})
	}
	if err := o.Check(); err != nil {
		return cli.CannotRun(err)
	}
	if c.ROC {
		rows, err := trace.HeteroROC(trace.HeteroROCOptions{Sim: o, Detector: trace.HeteroOptions{Window: c.Window, Calibrate: c.Calibrate},
			Slowdowns: c.Slowdowns, Thresholds: c.Thresholds, Trials: c.Trials, Onset: c.Onset})
		if err != nil {
			return cli.CannotRun(err)
		}
		return jsonl(env.Stdout, rows)
	}
	run, err := trace.SimulateHetero(o)
	if err != nil {
		return cli.CannotRun(err)
	}
	return trace.WriteSources(env.Stdout, run.Records(c.Bytes))
}

// parseSimClass reads NAME:RANKS:MS_PER_SAMPLE.
func parseSimClass(s string) (trace.SimClass, error) {
	bad := fmt.Errorf("--classes %q: want NAME:RANKS:MS_PER_SAMPLE (h100:32:1)", s)
	parts := strings.Split(s, ":")
	if len(parts) != 3 || parts[0] == "" {
		return trace.SimClass{}, bad
	}
	n, err1 := strconv.Atoi(parts[1])
	ms, err2 := strconv.ParseFloat(parts[2], 64)
	if err1 != nil || err2 != nil {
		return trace.SimClass{}, bad
	}
	return trace.SimClass{Name: parts[0], Ranks: n, SampleNs: ms * 1e6}, nil
}

// parseSlow reads RANK:FRACTION@STEP.
func parseSlow(s string) (trace.Slowdown, error) {
	bad := fmt.Errorf("--slow %q: want RANK:FRACTION@STEP (3:0.02@5000)", s)
	rank, rest, ok := strings.Cut(s, ":")
	if !ok {
		return trace.Slowdown{}, bad
	}
	frac, step, ok := strings.Cut(rest, "@")
	if !ok {
		return trace.Slowdown{}, bad
	}
	r, err1 := strconv.Atoi(rank)
	f, err2 := strconv.ParseFloat(frac, 64)
	k, err3 := strconv.Atoi(step)
	if err1 != nil || err2 != nil || err3 != nil {
		return trace.Slowdown{}, bad
	}
	return trace.Slowdown{Rank: r, Factor: f, From: k}, nil
}
