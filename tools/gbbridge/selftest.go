package main

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"strconv"
	"strings"
	"time"

	"github.com/gpubridge/gpubridge/lib/bridge"
	"github.com/gpubridge/gpubridge/lib/cli"
	"github.com/gpubridge/gpubridge/lib/harness"
	"github.com/gpubridge/gpubridge/lib/transport"
)

type selftestCmd struct {
	memberFlags
	Members  []int `help:"Member counts to run on this host, one run each." default:"2,4"`
	Full     bool  `help:"The exhaustive sweep: every collective × dtype × op at 1, 7, 1021, 65537 and 1048579 elements and at 64 MiB, the compressed all_reduce (fp8, bf16: every dtype they take, sum and avg, at those sizes, with and without error feedback) and zstd on every collective and dtype (638 checks on 2 members, minutes), the all_reduce sweep to 64 MiB, and the perftest-style rows from 2 B to 8 MiB in every run. Default: a representative subset (every collective, dtype and op, and every codec; 93 checks on 2 members) and short sweeps, seconds on 2 cores."`
	JSON     bool  `help:"Print one JSON object (schema gpubridge.selftest/v1) instead of the perftest-style tables and the verdict line."`
	Perf     bool  `help:"Measure the link in perftest's style (ib_write_bw, ib_write_lat columns); default: in the first run only, every run with --full." negatable:"" default:"true"`
	Progress bool  `help:"A line per check on stderr as they run (default: when stderr is a terminal)." hidden:""`
	Child    bool  `help:"This process is a member of a local run (set by the parent): no device step, no verdict of its own." hidden:""`
}

// Run is `gbbridge selftest`: with no store, the device step (verbs) and
// one run of members as processes on this host per --members count; with
// a store, this process is one member of a selftest across hosts. Either
// way a line per step on stderr, the tables and the verdict (or JSON) on
// stdout, exit 0 (pass), 1 (a check failed) or 2 (could not run).
func (c *selftestCmd) Run(env *cli.Env) error {
	progress := c.Progress || (c.Store == "" && cli.IsTerminal(env.Stderr))
	sum := harness.SelftestSummary{Schema: harness.SelftestSchema, Version: cli.Version, OK: true, Full: c.Full, Runs: []harness.RunReport{}}
	if c.Transport == string(transport.Verbs) && !c.Child {
		fmt.Fprintf(env.Stderr, "selftest: device: finding the RDMA port and writing through a loopback queue pair\n")
		dev, err := transport.VerbsCheck(env.Ctx, transport.VerbsCheckOptions{StoreAddr: c.storeOr("127.0.0.1:0"), Timeout: c.Timeout})
		if err != nil {
			sum.OK, sum.Verdict = false, "FAIL: verbs device: "+err.Error()
			return c.finish(env, sum, cli.ExitUsage)
		}
		fmt.Fprintf(env.Stderr, "selftest: device: %s; loopback: %d bytes written and checked in %.1f ms\n", dev.Describe(), dev.LoopbackBytes, dev.LoopbackMicros/1e3)
		sum.Device = dev
	}
	if c.Store != "" {
		return c.acrossHosts(env, sum, progress)
	}
	code := cli.ExitOK
	for i, n := range c.Members {
		fmt.Fprintf(env.Stderr, "selftest: run %d of %d: %d members as processes on this host\n", i+1, len(c.Members), n)
		rep, runCode := c.localRun(env, n, progress, c.Perf && (i == 0 || c.Full))
		sum.OK = sum.OK && runCode == cli.ExitOK
		code = max(code, runCode)
		sum.Runs = append(sum.Runs, rep)
	}
	sum.Verdict = verdict(sum)
	return c.finish(env, sum, code)
}

func (f memberFlags) storeOr(def string) string {
	if f.Store != "" {
		return f.Store
	}
	return def
}

// options are a member's run: the cases, the sweeps, the steps' lines.
func (c *selftestCmd) options(m *bridge.Member, perf bool, progress io.Writer, steps io.Writer) harness.SelftestOptions {
	o := harness.SelftestOptions{Cases: harness.QuickCases(m.Size), Sweep: harness.QuickSweep, Progress: progress, Steps: steps}
	p := harness.QuickPerf
	if c.Full {
		o.Cases, o.Sweep, p = harness.Cases(m.Size), harness.FullSweep, harness.FullPerf
	}
	if perf {
		o.Perf = &p
	}
	return o
}

// acrossHosts is one member of a run across hosts: member 0 prints the
// summary (with its device step); every member exits with the verdict.
func (c *selftestCmd) acrossHosts(env *cli.Env, sum harness.SelftestSummary, progress bool) error {
	return c.withMember(env, func(ctx context.Context, m *bridge.Member) error {
		var prog io.Writer
		if progress {
			prog = env.Stderr
		}
		if !c.Child || m.Self == 0 {
			fmt.Fprintf(env.Stderr, "selftest: member %d of %d over %s\n", m.Self, m.Size, m.Mesh.Describe())
		}
		steps := env.Stderr
		if c.Child && m.Self != 0 {
			steps = nil
		}
		rep, err := harness.SelftestRun(ctx, m, c.options(m, c.Perf, prog, steps))
		code := cli.ExitOK
		switch {
		case errors.Is(err, harness.ErrChecksFailed):
			code = cli.ExitFail
		case err != nil:
			code = cli.ExitFail
			rep.Failures = append(rep.Failures, harness.Failure{Case: "run", Error: err.Error()})
		}
		sum.Runs, sum.OK = append(sum.Runs, rep), code == cli.ExitOK
		sum.Verdict = verdict(sum)
		if m.Self != 0 {
			if !c.Child {
				fmt.Fprintln(env.Stderr, "selftest:", sum.Verdict)
			}
			if code != cli.ExitOK {
				return cli.Silent(code)
			}
			return nil
		}
		return c.finish(env, sum, code)
	})
}

// finish prints the summary (JSON, or the tables and the verdict line)
// and returns the exit code's error.
func (c *selftestCmd) finish(env *cli.Env, sum harness.SelftestSummary, code int) error {
	if c.JSON {
		if err := json.NewEncoder(env.Stdout).Encode(sum); err != nil {
			return cli.CannotRun(err)
		}
	} else if !c.Child {
		for _, r := range sum.Runs {
			if err := harness.WritePerf(env.Stdout, r.Members, r.Transport, r.WriteBW, r.WriteLat); err != nil {
				return cli.CannotRun(err)
			}
		}
		fmt.Fprintln(env.Stdout, sum.Verdict)
	}
	if !c.Child {
		fmt.Fprintln(env.Stderr, "selftest:", sum.Verdict)
	}
	if code != cli.ExitOK {
		return cli.Silent(code)
	}
	return nil
}

// verdict is the line the selftest ends with.
func verdict(sum harness.SelftestSummary) string {
	var runs, fails []string
	checks := 0
	transportDesc := ""
	for _, r := range sum.Runs {
		runs = append(runs, strconv.Itoa(r.Members))
		checks += r.Cases
		if transportDesc == "" {
			transportDesc = r.Transport
		}
		for _, f := range r.Failures {
			fails = append(fails, fmt.Sprintf("%d members: %s: %s%s", r.Members, f.Case, f.Error, wrongText(f.Wrong)))
		}
	}
	if sum.Device != nil && transportDesc == "" {
		transportDesc = "verbs on " + sum.Device.Describe()
	}
	if transportDesc == "" {
		transportDesc = "the bridge"
	}
	kind := "the default subset"
	if sum.Full {
		kind = "the full sweep"
	}
	if !sum.OK {
		if len(fails) == 0 {
			fails = []string{"no run completed"}
		}
		return fmt.Sprintf("FAIL: %s: %s", transportDesc, strings.Join(fails, "; "))
	}
	line := fmt.Sprintf("PASS: %s: %s members, %d checks bit for bit (%s)", transportDesc, strings.Join(runs, " and "), checks, kind)
	for _, r := range sum.Runs {
		if n := len(r.WriteBW); n > 0 {
			b := r.WriteBW[n-1]
			line += fmt.Sprintf(", write_bw %.1f MB/s at %s", b.AvgMBps, sizeText(b.Bytes))
		}
		if len(r.WriteLat) > 0 {
			l := r.WriteLat[0]
			line += fmt.Sprintf(", write_lat %.1f us at %s", l.Typical, sizeText(l.Bytes))
		}
	}
	if sum.Device != nil {
		line += fmt.Sprintf("; device %s port %d, loopback ok", sum.Device.Device, sum.Device.Port)
	}
	return line
}

func sizeText(n int) string {
	switch {
	case n >= 1<<20 && n%(1<<20) == 0:
		return fmt.Sprintf("%d MiB", n>>20)
	case n >= 1<<10 && n%(1<<10) == 0:
		return fmt.Sprintf("%d KiB", n>>10)
	}
	return fmt.Sprintf("%d B", n)
}

// localRun runs n members as processes on this host and returns member 0's
// report with the run's exit code: 1 a check failed or a member failed, 2
// the members left no report (they could not set up, or crashed).
func (c *selftestCmd) localRun(env *cli.Env, n int, progress, perf bool) (harness.RunReport, int) {
	var out bytes.Buffer
	ns := fmt.Sprintf("selftest-%d-%d", n, time.Now().UnixNano())
	err := harness.Launch(env.Ctx, n, func(rank int, addr string) []string {
		args := append(c.memberArgs("selftest", rank, n, addr, ns), "--child", "--json", "--perf="+strconv.FormatBool(perf),
			"--full="+strconv.FormatBool(c.Full))
		if progress && rank == 0 {
			args = append(args, "--progress")
		}
		return args
	}, &out, env.Stderr, env.Log)
	code := cli.ExitOK
	var sum harness.SelftestSummary
	var rep harness.RunReport
	if jerr := json.Unmarshal(out.Bytes(), &sum); jerr != nil || len(sum.Runs) != 1 {
		rep = harness.RunReport{Members: n, Failed: 1, Failures: []harness.Failure{{Case: "setup", Error: fmt.Sprint(err)}}}
		code = cli.ExitUsage
	} else {
		rep = sum.Runs[0]
	}
	if rep.Failed > 0 || err != nil {
		code = max(code, cli.ExitFail)
	}
	fmt.Fprintf(env.Stderr, "selftest: %d members over %s: %d checks, %d failed, %.1fs\n", n, rep.Transport, rep.Cases, rep.Failed, rep.Seconds)
	for _, f := range rep.Failures {
		fmt.Fprintf(env.Stderr, "selftest: FAILED %s: %s%s\n", f.Case, f.Error, wrongText(f.Wrong))
	}
	return rep, code
}

func wrongText(w int64) string {
	if w == 0 {
		return ""
	}
	return fmt.Sprintf(" (%d wrong elements)", w)
}
