package discover

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"net"
	"os"
	"time"

	"github.com/gpubridge/gpubridge/lib/cli"
	"github.com/gpubridge/gpubridge/lib/store"
)

// FailureSchema is the schema of the JSON a failed discovery prints.
const FailureSchema = "gpubridge.discover-failure/v1"

// RunOptions are one rank's settings for RunCLI.
type RunOptions struct {
	Store       string // HOST:PORT; empty: MASTER_ADDR:MASTER_PORT
	Rank        int
	WorldSize   int
	LocalRank   int // -1: unknown
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
	if o.Rank < 0 {
		return errors.New("--rank is required (or RANK / GPUBRIDGE_RANK)")
	}
	if o.WorldSize < 1 {
		return errors.New("--world-size is required (or WORLD_SIZE / GPUBRIDGE_WORLD_SIZE)")
	}
	if o.Rank >= o.WorldSize {
		return fmt.Errorf("--rank %d is not below --world-size %d", o.Rank, o.WorldSize)
	}
	if o.Store == "" {
		host, port := o.getenv("MASTER_ADDR"), o.getenv("MASTER_PORT")
		if host == "" || port == "" {
			return errors.New("--store is required (or GPUBRIDGE_STORE, or MASTER_ADDR and MASTER_PORT)")
		}
		o.Store = net.JoinHostPort(host, port)
	}
	if _, _, err := net.SplitHostPort(o.Store); err != nil {
		return fmt.Errorf("--store %q: %w", o.Store, err)
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
		Timeout: o.Timeout, Log: o.Log,
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
