package discover

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
	"github.com/gpubridge/gpubridge/lib/store"
)

// FailureSchema is the schema of the JSON a failed discovery prints.
const FailureSchema = "gpubridge.discover-failure/v1"

// Unset marks RunOptions.Rank and WorldSize that were not given.
const Unset = math.MinInt

// RunOptions are one rank's settings for RunCLI.
type RunOptions struct {
	Store     string // HOST:PORT; empty: MASTER_ADDR:MASTER_PORT
	Rank      int    // Unset: not given
	WorldSize int    // Unset: not given
	LocalRank int    // -1: unknown
	// PID is the rank's process, whose claim on the rank gbdiscover sets in
	// the store (see Claim); 0: gbdiscover's parent.
	PID         int
	Namespace   string
	Timeout     time.Duration
	Bridge      string
	Vendor      string // auto, nvidia, amd
	CPUOnly     bool
	SplitTest   string
	Settings    map[string]string
	SimHostname string
	// SimIsland, in simulation, puts the rank in island <vendor>-<SimIsland>
	// instead of <vendor>, so one machine can stand in for three or more
	// islands.
	SimIsland string
	// Problems are reasons this rank cannot run that the caller found (a
	// bad LOCAL_RANK, a missing tool); they go into the rank's record.
	Problems []string
	Log      *slog.Logger
	Getenv   func(string) string // default os.Getenv
}

func (o *RunOptions) getenv(k string) string {
	if o.Getenv != nil {
		return o.Getenv(k)
	}
	return os.Getenv(k)
}

// DefaultNamespace is the namespace of a job and attempt as launchers name
// them: job-<run id>/attempt-<restart count>.
func DefaultNamespace(getenv func(string) string) string {
	job := getenv("TORCHELASTIC_RUN_ID")
	if job == "" {
		job = getenv("SLURM_JOB_ID")
	}
	if job == "" {
		job = "default"
	}
	attempt := getenv("TORCHELASTIC_RESTART_COUNT")
	if attempt == "" {
		attempt = "0"
	}
	return "job-" + job + "/attempt-" + attempt
}

func (o *RunOptions) resolve() error {
	switch {
	case o.Rank == Unset:
		return errors.New("--rank is required (or RANK / GPUBRIDGE_RANK)")
	case o.WorldSize == Unset:
		return errors.New("--world-size is required (or WORLD_SIZE / GPUBRIDGE_WORLD_SIZE)")
	case o.WorldSize < 1:
		return fmt.Errorf("--world-size %d: the world size must be at least 1", o.WorldSize)
	case o.Rank < 0 || o.Rank >= o.WorldSize:
		return fmt.Errorf("--rank %d: a rank must be >= 0 and < the world size (%d)", o.Rank, o.WorldSize)
	case o.PID < 0:
		return fmt.Errorf("--pid %d: a pid must be positive", o.PID)
	}
	addr, err := store.ResolveAddr(o.Store, o.getenv)
	if err != nil {
		return err
	}
	o.Store = addr
	if o.PID == 0 {
		o.PID = os.Getppid()
	}
	if o.Namespace == "" {
		o.Namespace = DefaultNamespace(o.getenv)
	}
	if o.Timeout <= 0 {
		return fmt.Errorf("--timeout %s must be positive", o.Timeout)
	}
	if o.Log == nil {
		o.Log = slog.New(slog.DiscardHandler)
	}
	return nil
}

// RunCLI is gbdiscover's default command: it reads this rank's probe report
// from probeIn, exchanges records through the store and prints the topology
// (or the failure) as JSON on stdout and the failure on stderr.
func RunCLI(ctx context.Context, o RunOptions, probeIn io.Reader, stdout, stderr io.Writer) error {
	if err := o.resolve(); err != nil {
		return cli.CannotRun(err)
	}
	rec := BuildRecord(o, probeIn)
	ctx, cancel := context.WithTimeout(ctx, o.Timeout)
	defer cancel()
	c, err := store.Dial(ctx, o.Store, store.WithLogger(o.Log))
	if err != nil {
		return cli.CannotRun(fmt.Errorf("rank %d: connect to the store at %s: %w", o.Rank, o.Store, err))
	}
	defer c.Close()
	topo, err := Exchange(ctx, c, rec, Options{
		Namespace: o.Namespace, Rank: o.Rank, WorldSize: o.WorldSize,
		Timeout: o.Timeout, Claim: NewClaim(o.PID), Log: o.Log,
	})
	var failure *Failure
	switch {
	case errors.As(err, &failure):
		out, _ := json.Marshal(struct {
			Schema string `json:"schema"`
			*Failure
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
