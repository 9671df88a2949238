package harness

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"os"
	"runtime/pprof"
	"strconv"
	"time"

	"github.com/gpubridge/gpubridge/lib/cli"
	"github.com/gpubridge/gpubridge/lib/reduce"
)

// SelftestSchema is the schema of gbbridge selftest's summary.
const SelftestSchema = "gpubridge.selftest/v1"

// Common are the settings selftest and bench share.
type Common struct {
	Store     string // join members across hosts through this store; "" runs members here
	Rank      int
	WorldSize int
	Namespace string
	Transport string // auto, tcp, shm
	Streams   int
	ChunkB    int
	CRC       bool
	Workers   int
	Timeout   time.Duration
	Log       *slog.Logger
}

// memberArgs are the flags that make a child process a member.
func (c Common) memberArgs(cmd string, rank, n int, storeAddr, ns string) []string {
	return []string{cmd, "--store", storeAddr, "--rank", strconv.Itoa(rank), "--world-size", strconv.Itoa(n),
		"--namespace", ns, "--transport", c.Transport, "--streams", strconv.Itoa(c.Streams),
		"--chunk", strconv.Itoa(c.ChunkB), "--crc=" + strconv.FormatBool(c.CRC),
		"--workers", strconv.Itoa(c.Workers), "--timeout", c.Timeout.String()}
}

func (c Common) join(ctx context.Context) (*Member, error) {
	if c.WorldSize < 2 || c.Rank < 0 || c.Rank >= c.WorldSize {
		return nil, fmt.Errorf("with --store, --rank (0..N-1) and --world-size N >= 2 are needed; got rank %d of %d", c.Rank, c.WorldSize)
	}
	return Join(ctx, JoinOptions{Store: c.Store, Namespace: c.Namespace, Rank: c.Rank, Size: c.WorldSize,
		Transport: c.Transport, Streams: c.Streams, ChunkB: c.ChunkB, CRC: c.CRC, Workers: c.Workers,
		Timeout: c.Timeout, Log: c.Log})
}

// SelftestSummary is gbbridge selftest's output.
type SelftestSummary struct {
	Schema  string      `json:"schema"`
	Version string      `json:"version"`
	OK      bool        `json:"ok"`
	Runs    []RunReport `json:"runs"`
}

// Selftest runs the selftest: with no store, 2 and then 4 members as
// processes on this host; with a store, this process is one member of a
// selftest across hosts. It returns a cli exit-coded error.
func Selftest(ctx context.Context, c Common, members []int, progress bool, stdout, stderr io.Writer) error {
	if c.Store != "" {
		m, err := c.join(ctx)
		if err != nil {
			return cli.CannotRun(err)
		}
		defer m.Close()
		var prog io.Writer
		if progress {
			prog = stderr
		}
		err = SelftestMember(ctx, m, Cases(m.Size), true, stdout, prog)
		if errors.Is(err, ErrChecksFailed) {
			return cli.Silent(cli.ExitFail)
		}
		if err != nil {
			return cli.Failed(err)
		}
		return nil
	}
	sum := SelftestSummary{Schema: SelftestSchema, Version: cli.Version, OK: true, Runs: []RunReport{}}
	code := cli.ExitOK
	for _, n := range members {
		var out bytes.Buffer
		ns := fmt.Sprintf("selftest-%d-%d", n, time.Now().UnixNano())
		err := Launch(ctx, n, func(rank int, addr string) []string {
			args := c.memberArgs("selftest", rank, n, addr, ns)
			if progress && rank == 0 {
				args = append(args, "--progress")
			}
			return args
		}, &out, stderr, c.Log)
		var rep RunReport
		if jerr := json.Unmarshal(out.Bytes(), &rep); jerr != nil {
			// No report: the members could not set up or crashed.
			sum.OK = false
			rep = RunReport{Members: n, Failed: 1, Failures: []Failure{{Case: "setup", Error: fmt.Sprint(err)}}}
			code = max(code, cli.ExitUsage)
		}
		if rep.Failed > 0 || err != nil {
			sum.OK = false
			code = max(code, cli.ExitFail)
		}
		sum.Runs = append(sum.Runs, rep)
		fmt.Fprintf(stderr, "selftest: %d members over %s: %d checks, %d failed, %.1fs\n", n, rep.Transport, rep.Cases, rep.Failed, rep.Seconds)
		for _, f := range rep.Failures {
			fmt.Fprintf(stderr, "selftest: FAILED %s: %s%s\n", f.Case, f.Error, wrongText(f.Wrong))
		}
	}
	if err := writeJSON(stdout, sum); err != nil {
		return cli.CannotRun(err)
	}
	if code != cli.ExitOK {
		return cli.Silent(code)
	}
	return nil
}

func wrongText(w int64) string {
	if w == 0 {
		return ""
	}
	return fmt.Sprintf("%d wrong elements", w)
}

// BenchOptions are gbbridge bench's settings.
type BenchOptions struct {
	Common
	Members int
	Sweep   SweepOptions
	JSON    bool
}

// Bench times a collective: with no store over --members processes on this
// host, else as one member of a bench across hosts. Member 0 prints rows.
func Bench(ctx context.Context, o BenchOptions, stdout, stderr io.Writer) error {
	if err := reduce.Supported(o.Sweep.Op, o.Sweep.DType); err != nil && (o.Sweep.Coll == "all_reduce" || o.Sweep.Coll == "reduce_scatter") {
		return cli.CannotRun(err)
	}
	if o.Store == "" {
		ns := fmt.Sprintf("bench-%d", time.Now().UnixNano())
		err := Launch(ctx, o.Members, func(rank int, addr string) []string {
			args := o.memberArgs("bench", rank, o.Members, addr, ns)
			return append(args, "--op", o.Sweep.Op.String(), "--dtype", o.Sweep.DType.String(),
				"--collective", o.Sweep.Coll, "--sizes", sizesArg(o.Sweep.Sizes),
				"--iters", strconv.Itoa(o.Sweep.Iters), "--warmup", strconv.Itoa(o.Sweep.Warmup),
				"--json="+strconv.FormatBool(o.JSON))
		}, stdout, stderr, o.Log)
		var me *MemberExit
		if errors.As(err, &me) {
			return cli.Silent(me.Code)
		}
		if err != nil {
			return cli.CannotRun(err)
		}
		return nil
	}
	m, err := o.join(ctx)
	if err != nil {
		return cli.CannotRun(err)
	}
	defer m.Close()
	if stop, err := startProfile(m.Rank); err != nil {
		return cli.CannotRun(err)
	} else {
		defer stop()
	}
	o.Sweep.ChunkB = o.ChunkB
	wrong := int64(0)
	if m.Rank == 0 && !o.JSON {
		WriteHeaderText(stdout, o.Sweep.Coll, m.Size, m.Mesh.Describe())
	}
	o.Sweep.Row = func(r BenchRow) {
		wrong += r.Wrong
		if m.Rank != 0 {
			return
		}
		if o.JSON {
			_ = writeJSON(stdout, r)
		} else {
			WriteRowText(stdout, r)
		}
	}
	if _, err := Sweep(ctx, m, o.Sweep); err != nil {
		return cli.Failed(err)
	}
	if wrong > 0 {
		return cli.Failed(fmt.Errorf("%d wrong elements", wrong))
	}
	return nil
}

func sizesArg(s []int64) string {
	var b bytes.Buffer
	for i, v := range s {
		if i > 0 {
			b.WriteByte(',')
		}
		b.WriteString(strconv.FormatInt(v, 10))
	}
	return b.String()
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
