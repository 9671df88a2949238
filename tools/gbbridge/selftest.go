package main

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"time"

	"github.com/gpubridge/gpubridge/lib/bridge"
	"github.com/gpubridge/gpubridge/lib/cli"
	"github.com/gpubridge/gpubridge/lib/harness"
)

type selftestCmd struct {
	memberFlags
	Members  []int `help:"Member counts to run on this host, one run each." default:"2,4"`
	Progress bool  `help:"Progress on stderr (default: when stderr is a terminal)." hidden:""`
}

// Run is `gbbridge selftest`: with no store, one run of members as
// processes on this host per --members count, summarised as one JSON
// object; with a store, this process is one member of a selftest across
// hosts.
func (c *selftestCmd) Run(env *cli.Env) error {
	progress := c.Progress || (c.Store == "" && cli.IsTerminal(env.Stderr))
	if c.Store != "" {
		return c.withMember(env, func(ctx context.Context, m *bridge.Member) error {
			var prog io.Writer
			if progress {
				prog = env.Stderr
			}
			err := harness.SelftestMember(ctx, m, harness.Cases(m.Size), true, env.Stdout, prog)
			if errors.Is(err, harness.ErrChecksFailed) {
				return cli.Silent(cli.ExitFail)
			}
			if err != nil {
				return cli.Failed(err)
			}
			return nil
		})
	}
	sum := harness.SelftestSummary{Schema: harness.SelftestSchema, Version: cli.Version, OK: true, Runs: []harness.RunReport{}}
	code := cli.ExitOK
	for _, n := range c.Members {
		rep, runCode := c.localRun(env, n, progress)
		sum.OK = sum.OK && runCode == cli.ExitOK
		code = max(code, runCode)
		sum.Runs = append(sum.Runs, rep)
	}
	if err := json.NewEncoder(env.Stdout).Encode(sum); err != nil {
		return cli.CannotRun(err)
	}
	if code != cli.ExitOK {
		return cli.Silent(code)
	}
	return nil
}

// localRun runs n members as processes on this host and returns member 0's
// report with the run's exit code: 1 a check failed or a member failed, 2
// the members left no report (they could not set up, or crashed).
func (c *selftestCmd) localRun(env *cli.Env, n int, progress bool) (harness.RunReport, int) {
	var out bytes.Buffer
	ns := fmt.Sprintf("selftest-%d-%d", n, time.Now().UnixNano())
	err := harness.Launch(env.Ctx, n, func(rank int, addr string) []string {
		args := c.memberArgs("selftest", rank, n, addr, ns)
		if progress && rank == 0 {
			args = append(args, "--progress")
		}
		return args
	}, &out, env.Stderr, env.Log)
	code := cli.ExitOK
	var rep harness.RunReport
	if jerr := json.Unmarshal(out.Bytes(), &rep); jerr != nil {
		rep = harness.RunReport{Members: n, Failed: 1, Failures: []harness.Failure{{Case: "setup", Error: fmt.Sprint(err)}}}
		code = cli.ExitUsage
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
	return fmt.Sprintf("%d wrong elements", w)
}
