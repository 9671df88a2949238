package main

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"os"
	"runtime/pprof"
	"strconv"
	"strings"
	"time"

	"github.com/gpubridge/gpubridge/lib/bridge"
	"github.com/gpubridge/gpubridge/lib/cli"
	"github.com/gpubridge/gpubridge/lib/harness"
	"github.com/gpubridge/gpubridge/lib/reduce"
)

type benchCmd struct {
	memberFlags
	Members    int    `help:"Members to run as processes on this host (without --store)." default:"2"`
	Collective string `help:"What to time: all_reduce, broadcast, all_gather, reduce_scatter; exchange (the raw 2-member TCP/shm exchange: the ceiling) or memcpy (one core's copy: the anchor)." enum:"all_reduce,broadcast,all_gather,reduce_scatter,exchange,memcpy" default:"all_reduce"`
	Op         string `help:"Reduction: sum, prod, max, min, avg." default:"sum"`
	DType      string `name:"dtype" help:"Element type: float16, bfloat16, float32, float64, int8, uint8, int32, int64." default:"float32"`
	Sizes      string `help:"Buffer sizes in bytes, comma-separated, K/M/G suffixes (default 8 B … 1 GiB in steps of 8)." placeholder:"LIST"`
	Iters      int    `help:"Timed calls per size." default:"5"`
	Warmup     int    `help:"Untimed calls per size before timing." default:"1"`
	JSON       bool   `help:"JSON lines (schema gpubridge.bench/v1) instead of nccl-tests columns."`
}

// Run is `gbbridge bench`: with no store over --members processes on this
// host, else as one member of a bench across hosts. Member 0 prints rows.
func (c *benchCmd) Run(env *cli.Env) error {
	sweep, err := c.sweep()
	if err != nil {
		return cli.CannotRun(err)
	}
	if c.Store != "" {
		return c.withMember(env, func(ctx context.Context, m *bridge.Member) error {
			return c.member(ctx, env, m, sweep)
		})
	}
	ns := fmt.Sprintf("bench-%d", time.Now().UnixNano())
	err = harness.Launch(env.Ctx, c.Members, func(rank int, addr string) []string {
		return append(c.memberArgs("bench", rank, c.Members, addr, ns),
			"--op", sweep.Op.String(), "--dtype", sweep.DType.String(), "--collective", c.Collective, "--sizes", sizesArg(sweep.Sizes),
			"--iters", strconv.Itoa(c.Iters), "--warmup", strconv.Itoa(c.Warmup), "--json="+strconv.FormatBool(c.JSON))
	}, env.Stdout, env.Stderr, env.Log)
	var me *harness.MemberExit
	if errors.As(err, &me) {
		return cli.Silent(me.Code)
	}
	if err != nil {
		return cli.CannotRun(err)
	}
	return nil
}

// sweep checks the flags and says what to time.
func (c *benchCmd) sweep() (harness.SweepOptions, error) {
	op, err := reduce.ParseOp(c.Op)
	if err != nil {
		return harness.SweepOptions{}, err
	}
	dt, err := reduce.ParseDType(c.DType)
	if err != nil {
		return harness.SweepOptions{}, err
	}
	sizes := harness.DefaultSizes()
	if c.Sizes != "" {
		if sizes, err = harness.ParseSizes(c.Sizes); err != nil {
			return harness.SweepOptions{}, fmt.Errorf("--sizes: %w", err)
		}
	}
	if c.Iters < 1 || c.Warmup < 0 {
		return harness.SweepOptions{}, fmt.Errorf("--iters must be at least 1 and --warmup at least 0")
	}
	if c.Store == "" && c.Members < 2 {
		return harness.SweepOptions{}, fmt.Errorf("--members must be at least 2")
	}
	if err := reduce.Supported(op, dt); err != nil && (c.Collective == "all_reduce" || c.Collective == "reduce_scatter") {
		return harness.SweepOptions{}, err
	}
	return harness.SweepOptions{Coll: c.Collective, DType: dt, Op: op, Sizes: sizes, Iters: c.Iters,
		Warmup: c.Warmup, ChunkB: int(c.Chunk)}, nil
}

// member times the sweep as one joined member; member 0 prints the rows.
func (c *benchCmd) member(ctx context.Context, env *cli.Env, m *bridge.Member, o harness.SweepOptions) error {
	stop, err := startProfile(m.Self)
	if err != nil {
		return cli.CannotRun(err)
	}
	defer stop()
	if m.Self == 0 && !c.JSON {
		harness.WriteHeaderText(env.Stdout, o.Coll, m.Size, m.Mesh.Describe())
	}
	wrong := int64(0)
	o.Row = func(r harness.BenchRow) {
		wrong += r.Wrong
		switch {
		case m.Self != 0:
		case c.JSON:
			_ = json.NewEncoder(env.Stdout).Encode(r)
		default:
			harness.WriteRowText(env.Stdout, r)
		}
	}
	if _, err := harness.Sweep(ctx, m, o); err != nil {
		return cli.Failed(err)
	}
	if wrong > 0 {
		return cli.Failed(fmt.Errorf("%d wrong elements", wrong))
	}
	return nil
}

func sizesArg(s []int64) string {
	parts := make([]string, len(s))
	for i, v := range s {
		parts[i] = strconv.FormatInt(v, 10)
	}
	return strings.Join(parts, ",")
}

// startProfile writes a CPU profile of this member to
// $GPUBRIDGE_CPUPROFILE.<rank> when that variable is set (for finding what
// limits a benchmark; see docs/BENCHMARKS.md).
func startProfile(rank int) (func(), error) {
	path := os.Getenv("GPUBRIDGE_CPUPROFILE")
	if path == "" {
		return func() {}, nil
	}
	f, err := os.Create(path + "." + strconv.Itoa(rank))
	if err != nil {
		return nil, fmt.Errorf("cpu profile: %w", err)
	}
	if err := pprof.StartCPUProfile(f); err != nil {
		f.Close()
		return nil, fmt.Errorf("cpu profile: %w", err)
	}
	return func() { pprof.StopCPUProfile(); f.Close() }, nil
}
