package main

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"math"
	"os"
	"time"

	"github.com/gpubridge/gpubridge/lib/cli"
	"github.com/gpubridge/gpubridge/lib/discover"
	"github.com/gpubridge/gpubridge/lib/store"
	"github.com/gpubridge/gpubridge/lib/transport"
)

// FailureSchema is the schema of the JSON a failed discovery prints.
const FailureSchema = "gpubridge.discover-failure/v1"

type runCmd struct {
	Store     string            `help:"The job's c10d store as HOST:PORT. Default: MASTER_ADDR:MASTER_PORT." env:"GPUBRIDGE_STORE" placeholder:"HOST:PORT"`
	Rank      *int              `help:"This rank's global rank, from 0 to the world size - 1." env:"GPUBRIDGE_RANK,RANK"`
	WorldSize *int              `help:"Number of ranks in the job." env:"GPUBRIDGE_WORLD_SIZE,WORLD_SIZE"`
	PID       int               `help:"The rank's process: gbdiscover claims the rank in the store for it, and a second process claiming the same rank (another job on the same store) fails naming it. Default: gbdiscover's parent process." env:"GPUBRIDGE_RANK_PID" placeholder:"PID"`
	LocalRank int               `help:"This rank's index on its node; picks its GPU. -1: unknown." env:"LOCAL_RANK,SLURM_LOCALID" default:"-1"`
	Namespace string            `help:"Key namespace of this job and attempt. Default: job-<TORCHELASTIC_RUN_ID or SLURM_JOB_ID or default>/attempt-<TORCHELASTIC_RESTART_COUNT or 0>." env:"GPUBRIDGE_NAMESPACE"`
	Timeout   time.Duration     `help:"Deadline of the whole discovery, store connection included." env:"GPUBRIDGE_DISCOVER_TIMEOUT" default:"60s"`
	Transport string            `help:"Bridge transport to ask for (as gbbridge's --transport)." enum:"${transports}" env:"GPUBRIDGE_BRIDGE" default:"auto" aliases:"bridge"`
	Vendor    string            `help:"Vendor of this rank's GPU stack (the torch build); auto takes the vendor of the node's GPUs." enum:"auto,nvidia,amd" default:"auto"`
	CPUOnly   bool              `help:"Run this rank on CPU (Gloo islands) while keeping real vendor detection." env:"GPUBRIDGE_CPU_ONLY"`
	SplitTest string            `help:"Label a single-vendor job as two vendors: half, alternate or node." env:"GPUBRIDGE_SPLIT_TEST" placeholder:"MODE"`
	Setting   map[string]string `help:"A policy setting that must be equal on every rank (repeatable)." placeholder:"KEY=VALUE" env:"GPUBRIDGE_SETTINGS"`
	Hostname  string            `help:"Host name a simulated rank reports, so processes on one machine can stand in for several nodes; ignored on GPUs." env:"GPUBRIDGE_SIM_HOSTNAME"`
	SimIsland string            `help:"In simulation, put this rank in island <vendor>-NAME instead of <vendor>, so one machine can stand in for three or more islands; ignored on GPUs." env:"GPUBRIDGE_SIM_ISLAND" placeholder:"NAME"`
	Probe     string            `help:"gbprobe --json output to read; - is stdin." default:"-" type:"path"`
	Problem   []string          `help:"A problem the caller found on this rank (repeatable); it goes into this rank's record, so every rank's discovery fails naming it. The torch plugin passes a bad LOCAL_RANK and missing tools this way." sep:"none" placeholder:"TEXT"`
}

func (c *runCmd) Run(env *cli.Env) error {
	o := runOptions{
		Store: c.Store, Rank: orUnset(c.Rank), WorldSize: orUnset(c.WorldSize), PID: c.PID,
		Namespace: c.Namespace, Timeout: c.Timeout, Log: env.Log,
		Record: discover.RecordOptions{
			LocalRank: c.LocalRank, ToolVersion: cli.Version, Bridge: transport.Kind(c.Transport), Vendor: c.Vendor,
			CPUOnly: c.CPUOnly, SplitTest: c.SplitTest, Settings: c.Setting, SimHostname: c.Hostname, SimIsland: c.SimIsland,
			Problems: c.Problem,
		},
	}
	in := env.Stdin
	if c.Probe != "-" {
		f, err := os.Open(c.Probe)
		if err != nil {
			return cli.CannotRun(fmt.Errorf("open probe input: %w", err))
		}
		defer f.Close()
		in = f
	}
	return run(env.Ctx, o, in, env.Stdout)
}

// unset marks runOptions.Rank and WorldSize that were not given.
const unset = math.MinInt

func orUnset(p *int) int {
	if p == nil {
		return unset
	}
	return *p
}

// runOptions are one rank's settings for run.
type runOptions struct {
	Store     string // HOST:PORT; empty: MASTER_ADDR:MASTER_PORT
	Rank      int    // unset: not given
	WorldSize int    // unset: not given
	// PID is the rank's process, whose claim on the rank gbdiscover sets in
	// the store (see discover.Claim); 0: gbdiscover's parent.
	PID       int
	Namespace string
	Timeout   time.Duration
	// Record is what goes into the rank's record; resolve sets its Rank
	// and WorldSize, and its Getenv is this command's.
	Record discover.RecordOptions
	Log    *slog.Logger
	Getenv func(string) string // default os.Getenv
}

// resolve checks the options and fills in their defaults. Its errors are
// usage errors.
func (o *runOptions) resolve() error {
	if o.Getenv == nil {
		o.Getenv = os.Getenv
	}
	switch {
	case o.Rank == unset:
		return errors.New("--rank is required (or RANK / GPUBRIDGE_RANK)")
	case o.WorldSize == unset:
		return errors.New("--world-size is required (or WORLD_SIZE / GPUBRIDGE_WORLD_SIZE)")
	case o.WorldSize < 1:
		return fmt.Errorf("--world-size %d: the world size must be at least 1", o.WorldSize)
	case o.Rank < 0 || o.Rank >= o.WorldSize:
		return fmt.Errorf("--rank %d: a rank must be >= 0 and < the world size (%d)", o.Rank, o.WorldSize)
	case o.PID < 0:
		return fmt.Errorf("--pid %d: a pid must be positive", o.PID)
	}
	addr, err := store.ResolveAddr(o.Store, o.Getenv)
	if err != nil {
		return err
	}
	o.Store = addr
	if o.PID == 0 {
		o.PID = os.Getppid()
	}
	if o.Namespace == "" {
		o.Namespace = discover.DefaultNamespace(o.Getenv)
	}
	if o.Timeout <= 0 {
		return fmt.Errorf("--timeout %s must be positive", o.Timeout)
	}
	if o.Log == nil {
		o.Log = slog.New(slog.DiscardHandler)
	}
	o.Record.Rank, o.Record.WorldSize, o.Record.Getenv = o.Rank, o.WorldSize, o.Getenv
	return nil
}

// run is gbdiscover's default command: it reads this rank's probe report
// from probeIn, exchanges records through the store and prints the topology
// (or the failure) as JSON on stdout; the failure goes on stderr too, as
// the error cli.Main prints.
func run(ctx context.Context, o runOptions, probeIn io.Reader, stdout io.Writer) error {
	if err := o.resolve(); err != nil {
		return cli.CannotRun(err)
	}
	rec := discover.BuildRecord(o.Record, probeIn)
	ctx, cancel := context.WithTimeout(ctx, o.Timeout)
	defer cancel()
	c, err := store.Dial(ctx, o.Store, store.WithLogger(o.Log))
	if err != nil {
		return cli.CannotRun(fmt.Errorf("rank %d: connect to the store at %s: %w", o.Rank, o.Store, err))
	}
	defer c.Close()
	topo, err := discover.Exchange(ctx, c, rec, discover.Options{
		Namespace: o.Namespace, Rank: o.Rank, WorldSize: o.WorldSize,
		Timeout: o.Timeout, Claim: discover.NewClaim(o.PID), Log: o.Log,
	})
	var failure *discover.Failure
	switch {
	case errors.As(err, &failure):
		out, _ := json.Marshal(struct {
			Schema string `json:"schema"`
			*discover.Failure
		}{FailureSchema, failure})
		fmt.Fprintf(stdout, "%s\n", out)
		return cli.Failed(failure)
	case err != nil:
		return cli.CannotRun(fmt.Errorf("rank %d: %w", o.Rank, err))
	}
	out, err := json.MarshalIndent(topo, "", "  ")
	if err != nil {
		return cli.CannotRun(fmt.Errorf("encode topology: %w", err))
	}
	if topo.SplitTest != "" {
		o.Log.Warn("split test: a single-vendor job labeled as two vendors; results are not mixed-vendor results", "mode", topo.SplitTest)
	}
	_, err = fmt.Fprintf(stdout, "%s\n", out)
	return err
}
