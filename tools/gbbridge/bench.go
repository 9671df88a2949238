package main

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"os"
	"runtime/pprof"
	"runtime/trace"
	"strconv"
	"strings"
	"time"

	"github.com/gpubridge/gpubridge/lib/bridge"
	"github.com/gpubridge/gpubridge/lib/cli"
	"github.com/gpubridge/gpubridge/lib/codec"
	"github.com/gpubridge/gpubridge/lib/harness"
	"github.com/gpubridge/gpubridge/lib/reduce"
)

type benchCmd struct {
	memberFlags
	Members    int           `help:"Members to run as processes on this host (without --store)." default:"2"`
	Collective string        `help:"What to time: all_reduce, broadcast, all_gather, reduce_scatter; exchange (the raw 2-member TCP/shm exchange: the ceiling) or memcpy (one core's copy: the anchor)." enum:"all_reduce,broadcast,all_gather,reduce_scatter,exchange,memcpy" default:"all_reduce"`
	Op         string        `help:"Reduction: sum, prod, max, min, avg." default:"sum"`
	DType      string        `name:"dtype" help:"Element type: float16, bfloat16, float32, float64, int8, uint8, int32, int64." default:"float32"`
	Sizes      string        `help:"Buffer sizes in bytes, comma-separated, K/M/G suffixes (default 8 B … 1 GiB in steps of 8)." placeholder:"LIST"`
	Iters      int           `help:"Timed calls per size." default:"5"`
	Warmup     int           `help:"Untimed calls per size before timing." default:"1"`
	MinTime    time.Duration `name:"min-time" help:"Where --iters calls take less than this, time as many calls again as fill it (at most 10000; the row's iters says how many). 0: --iters calls at every size." default:"0s"`
	JSON       bool          `help:"JSON lines (schema gpubridge.bench/v1) instead of nccl-tests columns."`
	Codec      string        `help:"Compression of the collective's frames (docs/COMPRESSION.md): raw, bf16 or fp8 (lossy: a floating sum or avg all_reduce, checked against the codec's reference), zstd (lossless, every collective). The exchange and memcpy anchors stay raw." default:"raw"`
	Feedback   bool          `help:"With bf16 or fp8: each member keeps an error-feedback residual (4 bytes per value) across the calls."`
	Data       string        `help:"What the buffers hold: pattern (small integers, exact in every dtype) or random (random values in [-8, 8), random bits for integers: zstd packs them about as well as float32 gradients). Every result is checked either way." enum:"pattern,random" default:"pattern"`
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
			"--iters", strconv.Itoa(c.Iters), "--warmup", strconv.Itoa(c.Warmup), "--min-time", c.MinTime.String(), "--json="+strconv.FormatBool(c.JSON),
			"--codec", sweep.Codec.String(), "--feedback="+strconv.FormatBool(c.Feedback), "--data", c.Data)
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
	if c.MinTime < 0 {
		return harness.SweepOptions{}, fmt.Errorf("--min-time must be 0 or more")
	}
	if c.Store == "" && c.Members < 2 {
		return harness.SweepOptions{}, fmt.Errorf("--members must be at least 2")
	}
	if err := reduce.Supported(op, dt); err != nil && (c.Collective == "all_reduce" || c.Collective == "reduce_scatter") {
		return harness.SweepOptions{}, err
	}
	id, err := codec.Parse(c.Codec)
	if err != nil {
		return harness.SweepOptions{}, fmt.Errorf("--codec: %w", err)
	}
	if id.Lossy() {
		switch {
		case c.Collective != "all_reduce" && c.Collective != "exchange" && c.Collective != "memcpy":
			return harness.SweepOptions{}, fmt.Errorf("--codec %s is lossy: it compresses all_reduce only (%s stays exact; use raw or zstd)", id, c.Collective)
		case op != reduce.Sum && op != reduce.Avg:
			return harness.SweepOptions{}, fmt.Errorf("--codec %s is lossy: it compresses sum and avg only, not %s", id, op)
		}
		if err := codec.Supports(id, dt); err != nil {
			return harness.SweepOptions{}, fmt.Errorf("--codec: %w", err)
		}
	} else if c.Feedback {
		return harness.SweepOptions{}, fmt.Errorf("--feedback is for the lossy codecs (bf16, fp8), not %s", id)
	}
	return harness.SweepOptions{Coll: c.Collective, DType: dt, Op: op, Sizes: sizes, Iters: c.Iters,
		Warmup: c.Warmup, MinTime: c.MinTime, ChunkB: int(c.Chunk), Codec: id, Feedback: c.Feedback, Random: c.Data == "random"}, nil
}

// describe says, for the header, what the rows run beside the transport:
// the codec, error feedback, random data ("" for the plain default).
func describe(o harness.SweepOptions) string {
	var parts []string
	if o.Codec != codec.Raw && o.Coll != "exchange" && o.Coll != "memcpy" {
		parts = append(parts, "codec "+o.Codec.Versioned())
	}
	if o.Feedback {
		parts = append(parts, "error feedback")
	}
	if o.Random {
		parts = append(parts, "random data")
	}
	return strings.Join(parts, ", ")
}

// member times the sweep as one joined member; member 0 prints the rows.
func (c *benchCmd) member(ctx context.Context, env *cli.Env, m *bridge.Member, o harness.SweepOptions) error {
	stop, err := startProfile(m.Self)
	if err != nil {
		return cli.CannotRun(err)
	}
	defer stop()
	if m.Self == 0 && !c.JSON {
		harness.WriteHeaderText(env.Stdout, o.Coll, m.Size, m.Mesh.Describe(), describe(o))
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

// startProfile writes a CPU profile of this member (bench: its member
// index; serve: its rank) to $GPUBRIDGE_CPUPROFILE.<rank> and a Go
// execution trace (go tool trace: where goroutines wait, not only where
// they run) to $GPUBRIDGE_GOTRACE.<rank>
// when those variables are set (for finding what limits a benchmark; see
// docs/BENCHMARKS.md).
func startProfile(rank int) (func(), error) {
	var stops []func()
	stop := func() {
		for i := len(stops) - 1; i >= 0; i-- {
			stops[i]()
		}
	}
	if path := os.Getenv("GPUBRIDGE_CPUPROFILE"); path != "" {
		f, err := os.Create(path + "." + strconv.Itoa(rank))
		if err != nil {
			return nil, fmt.Errorf("cpu profile: %w", err)
		}
		if err := pprof.StartCPUProfile(f); err != nil {
			f.Close()
			return nil, fmt.Errorf("cpu profile: %w", err)
		}
		stops = append(stops, func() { pprof.StopCPUProfile(); f.Close() })
	}
	if path := os.Getenv("GPUBRIDGE_GOTRACE"); path != "" {
		f, err := os.Create(path + "." + strconv.Itoa(rank))
		if err != nil {
			stop()
			return nil, fmt.Errorf("execution trace: %w", err)
		}
		if err := trace.Start(f); err != nil {
			f.Close()
			stop()
			return nil, fmt.Errorf("execution trace: %w", err)
		}
		stops = append(stops, func() { trace.Stop(); f.Close() })
	}
	return stop, nil
}
