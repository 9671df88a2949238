package main

import (
	"fmt"
	"time"

	"github.com/gpubridge/gpubridge/lib/cli"
	"github.com/gpubridge/gpubridge/lib/harness"
	"github.com/gpubridge/gpubridge/lib/reduce"
)

// memberFlags are what selftest and bench share: how members meet and how
// the bridge between them is set up.
type memberFlags struct {
	Store     string        `help:"Join a run across hosts through this c10d store (HOST:PORT); without it the members run as processes on this host over an embedded store." placeholder:"HOST:PORT"`
	Rank      int           `help:"With --store: this member's index." default:"-1"`
	WorldSize int           `help:"With --store: the number of members." default:"-1"`
	Namespace string        `help:"With --store: key namespace of the run (every member the same)." default:"gbbridge"`
	Transport string        `help:"Bridge transport: auto (shm when every member is on this host, else tcp), tcp or shm." enum:"auto,tcp,shm" default:"auto"`
	Streams   int           `help:"TCP connections (shm rings) per pair of members (8: see docs/BENCHMARKS.md)." default:"8"`
	Chunk     byteSize      `help:"Pipelining unit of the collectives (K, M, G: powers of 1024)." default:"4M" placeholder:"BYTES"`
	CRC       bool          `help:"CRC32C on every frame between members (off by default: it costs 25-45% at 256 MiB on a 2-core host, see docs/BENCHMARKS.md)." negatable:""`
	Workers   int           `help:"Goroutines that reduce at once; 0: one per CPU." default:"0"`
	Timeout   time.Duration `help:"Deadline of the setup and of each collective." default:"60s"`
}

func (f memberFlags) common(env *cli.Env) harness.Common {
	return harness.Common{Store: f.Store, Rank: f.Rank, WorldSize: f.WorldSize, Namespace: f.Namespace,
		Transport: f.Transport, Streams: f.Streams, ChunkB: int(f.Chunk), CRC: f.CRC, Workers: f.Workers,
		Timeout: f.Timeout, Log: env.Log}
}

type selftestCmd struct {
	memberFlags
	Members  []int `help:"Member counts to run on this host, one run each." default:"2,4"`
	Progress bool  `help:"Progress on stderr (default: when stderr is a terminal)." hidden:""`
}

func (c *selftestCmd) Run(env *cli.Env) error {
	progress := c.Progress || (c.Store == "" && cli.IsTerminal(env.Stderr))
	return harness.Selftest(env.Ctx, c.common(env), c.Members, progress, env.Stdout, env.Stderr)
}

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

func (c *benchCmd) Run(env *cli.Env) error {
	op, err := reduce.ParseOp(c.Op)
	if err != nil {
		return cli.CannotRun(err)
	}
	dt, err := reduce.ParseDType(c.DType)
	if err != nil {
		return cli.CannotRun(err)
	}
	sizes := harness.DefaultSizes()
	if c.Sizes != "" {
		if sizes, err = harness.ParseSizes(c.Sizes); err != nil {
			return cli.CannotRun(fmt.Errorf("--sizes: %w", err))
		}
	}
	if c.Iters < 1 || c.Warmup < 0 {
		return cli.CannotRun(fmt.Errorf("--iters must be at least 1 and --warmup at least 0"))
	}
	if c.Store == "" && c.Members < 2 {
		return cli.CannotRun(fmt.Errorf("--members must be at least 2"))
	}
	return harness.Bench(env.Ctx, harness.BenchOptions{
		Common: c.common(env), Members: c.Members, JSON: c.JSON,
		Sweep: harness.SweepOptions{Coll: c.Collective, DType: dt, Op: op, Sizes: sizes, Iters: c.Iters, Warmup: c.Warmup},
	}, env.Stdout, env.Stderr)
}
