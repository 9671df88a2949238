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
	Window    int     `help:"Collectives per window." default:"100"`
	Threshold float64 `help:"Score (mean lateness over its standard error) at or above which a rank is flagged; docs/STRAGGLERS.md has the rates." default:"5"`
	Op        string  `help:"Only collectives of this op (all_reduce, all_gather, ...)." placeholder:"OP"`
	Group     string  `help:"Only this group." placeholder:"NAME"`
	All       bool    `help:"Print every rank's score in every window, not only the flagged."`
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
	Ranks      int       `help:"Ranks of the job." default:"64"`
	Steps      int       `help:"Training steps (one all_reduce each)." default:"10000"`
	Compute    float64   `help:"Mean computation per step, ms." default:"100"`
	Collective float64   `help:"The all_reduce once every rank is there, ms." default:"5"`
	Jitter     float64   `help:"Standard deviation of each rank's computation per step, relative (0.05: 5%), independent per rank and step." default:"0.05"`
	Common     float64   `help:"Standard deviation of a factor all ranks share in a step, relative." default:"0"`
	Dist       string    `help:"Distribution of the jitter." enum:"gaussian,lognormal,uniform,t3,t5" default:"gaussian"`
	Slow       []string  `help:"RANK:FRACTION@STEP: rank computes FRACTION more from STEP on (3:0.02@5000); repeatable." placeholder:"R:F@S"`
	Seed       uint64    `help:"Random seed." default:"1"`
	Bytes      int64     `help:"Bytes of the simulated all_reduce." default:"104857600"`
	ROC        bool      `name:"roc" help:"Measure the straggler detector instead: --trials jobs per slowdown, one random rank slowed from --onset."`
	Trials     int       `help:"--roc: jobs per slowdown." default:"40"`
	Slowdowns  []float64 `help:"--roc: slowdowns to measure." default:"0.01,0.02,0.05,0.1"`
	Thresholds []float64 `help:"--roc: thresholds (the ROC's points)." default:"3,4,4.5,5,5.5,6"`
	Onset      int       `help:"--roc: the step the slowdown starts." default:"5000"`
	Window     int       `help:"--roc: collectives per window." default:"100"`
}

func (c *simulateCmd) Run(env *cli.Env) error {
	o := trace.SimOptions{Ranks: c.Ranks, Steps: c.Steps, ComputeNs: c.Compute * 1e6, CollectiveNs: c.Collective * 1e6,
		Jitter: c.Jitter, Common: c.Common, Dist: c.Dist, Seed: c.Seed}
	for _, s := range c.Slow {
		sd, err := parseSlow(s)
		if err != nil {
			return cli.CannotRun(err)
		}
		o.Slow = append(o.Slow, sd)
	}
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
