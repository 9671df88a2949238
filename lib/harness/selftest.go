package harness

import (
	"context"
	"encoding/binary"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"time"

	"github.com/gpubridge/gpubridge/lib/bridge"
	"github.com/gpubridge/gpubridge/lib/codec"
	"github.com/gpubridge/gpubridge/lib/collective"
	"github.com/gpubridge/gpubridge/lib/reduce"
	"github.com/gpubridge/gpubridge/lib/transport"
)

// Case is one selftest check.
type Case struct {
	Coll  string       `json:"collective"`
	DType reduce.DType `json:"-"`
	Op    reduce.Op    `json:"-"`
	Elems int          `json:"elements"`
	Root  int          `json:"root,omitempty"`
	// Codec packs the collective's frames (docs/COMPRESSION.md): a lossy
	// all_reduce is checked against collective.ReferenceAllReduceCodec,
	// zstd against the raw references.
	Codec codec.ID `json:"-"`
	// Feedback is how many consecutive lossy all_reduces the check runs
	// with a residual per member (error feedback), each result and every
	// residual checked; 0: one call without.
	Feedback int `json:"-"`
}

func (c Case) String() string {
	var s string
	switch c.Coll {
	case "broadcast":
		s = fmt.Sprintf("broadcast %s root %d, %d elements", c.DType, c.Root, c.Elems)
	case "all_gather":
		s = fmt.Sprintf("all_gather %s, %d elements per member", c.DType, c.Elems)
	case "barrier", "p2p":
		return c.Coll
	default:
		s = fmt.Sprintf("%s %s %s, %d elements", c.Coll, c.DType, c.Op, c.Elems)
	}
	if c.Codec != codec.Raw {
		s += ", " + c.Codec.Versioned()
	}
	if c.Feedback > 0 {
		s += fmt.Sprintf(" with error feedback over %d calls", c.Feedback)
	}
	return s
}

// selftestSizes are the element counts every collective × dtype × op runs
// at: one element, odd sizes, several chunks.
var selftestSizes = []int{1, 7, 1021, 65537, 1<<20 + 3}

// SelftestLargeBytes is the size of the largest buffers: every collective ×
// dtype runs once at this size (with sum, or no op).
const SelftestLargeBytes = 64 << 20

// QuickCases is the default selftest's representative subset of
// Cases(n), picked from it: every op on every dtype that has it at 7
// elements; every collective on every dtype at odd sizes (broadcast also
// at one element); several chunks over every stream (float32 and float64
// all_reduce, int64 reduce_scatter, uint8 all_gather at 1048579
// elements); barrier and p2p; and compressed: the lossy all_reduce of
// every codec and dtype it takes (sum and avg, with and without error
// feedback, over several chunks for fp8 float32), and zstd on every
// collective.
func QuickCases(n int) []Case {
	big := selftestSizes[len(selftestSizes)-1]
	quick := func(c Case) bool {
		switch {
		case c.Codec.Lossy():
			return quickLossy[fmt.Sprint(c.Codec, c.DType, c.Op, c.Elems, c.Feedback)]
		case c.Codec == codec.Zstd:
			return c.Elems == 65537 && (c.Coll == "all_reduce" && c.DType == reduce.Float32 ||
				c.Coll == "reduce_scatter" && c.DType == reduce.BFloat16 || c.Coll == "broadcast" && c.DType == reduce.Float16 ||
				c.Coll == "all_gather" && c.DType == reduce.Uint8) || c.Elems == 7 && c.Coll == "all_reduce" && c.DType == reduce.Int64
		}
		switch c.Coll {
		case "all_reduce":
			return c.Elems == 7 || c.Elems == 65537 && c.Op == reduce.Sum ||
				c.Elems == big && c.Op == reduce.Sum && (c.DType == reduce.Float32 || c.DType == reduce.Float64)
		case "reduce_scatter":
			return c.Elems == 1021 && c.Op == reduce.Max || c.Elems == big && c.Op == reduce.Sum && c.DType == reduce.Int64
		case "broadcast":
			return c.Elems == 1 || c.Elems == 65537
		case "all_gather":
			return c.Elems == 1021 || c.Elems == big && c.DType == reduce.Uint8
		}
		return true // barrier, p2p
	}
	var cs []Case
	for _, c := range Cases(n) {
		if quick(c) {
			cs = append(cs, c)
		}
	}
	return cs
}

// quickLossy are the lossy checks of QuickCases: codec, dtype, op,
// elements, calls with error feedback.
var quickLossy = map[string]bool{
	fmt.Sprint(codec.MXFP8, reduce.Float32, reduce.Avg, 65537, 3):   true,
	fmt.Sprint(codec.MXFP8, reduce.Float32, reduce.Sum, 1<<20+3, 0): true,
	fmt.Sprint(codec.MXFP8, reduce.BFloat16, reduce.Sum, 1021, 3):   true,
	fmt.Sprint(codec.MXFP8, reduce.Float16, reduce.Sum, 7, 0):       true,
	fmt.Sprint(codec.BF16, reduce.Float32, reduce.Sum, 65537, 3):    true,
	fmt.Sprint(codec.BF16, reduce.BFloat16, reduce.Avg, 1021, 0):    true,
}

// Cases lists every check of a selftest of n members.
func Cases(n int) []Case {
	var cs []Case
	for _, dt := range reduce.AllDTypes() {
		large := SelftestLargeBytes / dt.Size()
		for _, elems := range append(selftestSizes, large) {
			ops := reduce.AllOps()
			if elems == large {
				ops = []reduce.Op{reduce.Sum}
			}
			for _, op := range ops {
				if reduce.Supported(op, dt) != nil {
					continue
				}
				cs = append(cs, Case{Coll: "all_reduce", DType: dt, Op: op, Elems: elems})
				cs = append(cs, Case{Coll: "reduce_scatter", DType: dt, Op: op, Elems: elems})
			}
			cs = append(cs, Case{Coll: "broadcast", DType: dt, Elems: elems, Root: (elems + len(cs)) % n})
			cs = append(cs, Case{Coll: "all_gather", DType: dt, Elems: elems})
		}
	}
	cs = append(cs, Case{Coll: "barrier"}, Case{Coll: "p2p"})
	return append(cs, codecCases(n)...)
}

// codecCases are the compressed checks of Cases(n): the lossy all_reduce
// of every codec and dtype it takes, sum and avg, at every selftest size,
// once without and over 3 calls with error feedback; zstd on every
// collective and dtype at 7 and 65537 elements.
func codecCases(n int) []Case {
	var cs []Case
	for _, id := range []codec.ID{codec.MXFP8, codec.BF16} {
		for _, dt := range reduce.AllDTypes() {
			if codec.Supports(id, dt) != nil {
				continue
			}
			for _, elems := range selftestSizes {
				for _, op := range []reduce.Op{reduce.Sum, reduce.Avg} {
					for _, fb := range []int{0, 3} {
						cs = append(cs, Case{Coll: "all_reduce", DType: dt, Op: op, Elems: elems, Codec: id, Feedback: fb})
					}
				}
			}
		}
	}
	for _, dt := range reduce.AllDTypes() {
		for _, elems := range []int{7, 65537} {
			for _, coll := range []string{"all_reduce", "reduce_scatter", "broadcast", "all_gather"} {
				cs = append(cs, Case{Coll: coll, DType: dt, Op: reduce.Sum, Elems: elems, Root: (elems + len(cs)) % n, Codec: codec.Zstd})
			}
		}
	}
	return cs
}

// Failure is a check that failed.
type Failure struct {
	Case  string `json:"case"`
	Wrong int64  `json:"wrong_elements,omitempty"`
	Error string `json:"error,omitempty"`
}

// RunReport is what member 0 reports of one selftest run.
type RunReport struct {
	Members   int        `json:"members"`
	Transport string     `json:"transport"`
	Cases     int        `json:"cases"`
	Failed    int        `json:"failed"`
	Failures  []Failure  `json:"failures"`
	Bandwidth []BenchRow `json:"bandwidth"`
	// WriteBW and WriteLat are the link's perftest-style rows (members 0
	// and 1), when measured.
	WriteBW  []BWRow  `json:"write_bw,omitempty"`
	WriteLat []LatRow `json:"write_lat,omitempty"`
	Seconds  float64  `json:"seconds"`
}

// SelftestOptions say what a member's selftest run does.
type SelftestOptions struct {
	Cases []Case
	// Sweep is the all_reduce bandwidth sweep's sizes (none: no sweep).
	Sweep []int64
	// Perf, when set, measures the link in perftest's style.
	Perf *PerfOptions
	// Progress receives a line per check while they run (member 0; nil:
	// none), Steps a line as each step ends.
	Progress, Steps io.Writer
}

// QuickSweep and FullSweep are the all_reduce sweep's sizes.
var (
	QuickSweep = []int64{1 << 20, 16 << 20}
	FullSweep  = []int64{1 << 20, 16 << 20, 64 << 20}
)

// ErrChecksFailed marks a selftest whose checks failed (exit 1).
var ErrChecksFailed = errors.New("selftest checks failed")

// SelftestMember runs the cases on a joined member, then (with sweep) a
// short all_reduce bandwidth sweep, and on member 0 writes the run's report
// as one JSON line to out. Progress lines go to progress when it is not nil.
func SelftestMember(ctx context.Context, m *bridge.Member, cases []Case, sweep bool, out, progress io.Writer) error {
	o := SelftestOptions{Cases: cases, Progress: progress}
	if sweep {
		o.Sweep = FullSweep
	}
	rep, err := SelftestRun(ctx, m, o)
	if m.Self == 0 {
		if werr := json.NewEncoder(out).Encode(rep); werr != nil {
			return werr
		}
	}
	return err
}

// SelftestRun runs a member's part of a selftest run and returns the
// report (complete on member 0): the cases, then, if they passed, the
// all_reduce sweep and the perftest-style rows. The error is
// ErrChecksFailed when a check failed, or what stopped the run.
func SelftestRun(ctx context.Context, m *bridge.Member, o SelftestOptions) (RunReport, error) {
	start := time.Now()
	cases, progress := o.Cases, o.Progress
	rep := RunReport{Members: m.Size, Transport: m.Mesh.Describe(), Cases: len(cases), Failures: []Failure{}}
	step := func(format string, args ...any) {
		if o.Steps != nil && m.Self == 0 {
			fmt.Fprintf(o.Steps, format+"\n", args...)
		}
	}
	for i, c := range cases {
		wrong, err := runCase(ctx, m, c, uint64(i))
		if err != nil {
			// The bridge is broken: every later case would fail the same way.
			rep.Failures = append(rep.Failures, Failure{Case: c.String(), Error: err.Error()})
			rep.Failed = len(cases) - i
			break
		}
		total, err := sumAcross(ctx, m, int64(wrong))
		if err != nil {
			rep.Failures = append(rep.Failures, Failure{Case: c.String(), Error: err.Error()})
			rep.Failed = len(cases) - i
			break
		}
		if total != 0 {
			rep.Failures = append(rep.Failures, Failure{Case: c.String(), Wrong: total})
			rep.Failed++
		}
		if progress != nil && m.Self == 0 {
			fmt.Fprintf(progress, "\r%d members: %d/%d checks, %d failed", m.Size, i+1, len(cases), rep.Failed)
		}
	}
	if progress != nil && m.Self == 0 {
		fmt.Fprintln(progress)
	}
	step("selftest: %d members: %d checks bit for bit, %d failed (%.1fs)", m.Size, len(cases), rep.Failed, time.Since(start).Seconds())
	if rep.Failed == 0 && len(o.Sweep) > 0 {
		t0 := time.Now()
		iters := 5
		if len(o.Sweep) < len(FullSweep) {
			iters = 3
		}
		rows, err := Sweep(ctx, m, SweepOptions{Coll: "all_reduce", DType: reduce.Float32, Op: reduce.Sum,
			Sizes: o.Sweep, Iters: iters, Warmup: 1})
		if err != nil {
			rep.Failures = append(rep.Failures, Failure{Case: "bandwidth sweep", Error: err.Error()})
			rep.Failed++
		}
		rep.Bandwidth = rows
		step("selftest: %d members: all_reduce sweep at %d sizes (%.1fs)", m.Size, len(rows), time.Since(t0).Seconds())
	}
	if rep.Failed == 0 && o.Perf != nil {
		t0 := time.Now()
		bw, lat, err := Perf(ctx, m, *o.Perf)
		if err != nil {
			rep.Failures = append(rep.Failures, Failure{Case: "perftest-style sweep", Error: err.Error()})
			rep.Failed++
		}
		rep.WriteBW, rep.WriteLat = bw, lat
		step("selftest: %d members: write_bw at %d sizes, write_lat at %d (%.1fs)", m.Size, len(bw), len(lat), time.Since(t0).Seconds())
	}
	if rep.Bandwidth == nil {
		rep.Bandwidth = []BenchRow{}
	}
	rep.Seconds = time.Since(start).Seconds()
	if rep.Failed > 0 {
		return rep, ErrChecksFailed
	}
	return rep, nil
}

// sumAcross all-reduces one int64 over the bridge.
func sumAcross(ctx context.Context, m *bridge.Member, v int64) (int64, error) {
	b := make([]byte, 8)
	binary.LittleEndian.PutUint64(b, uint64(v))
	if err := m.Comm.AllReduce(ctx, b, reduce.Int64, reduce.Sum, nil); err != nil {
		return 0, err
	}
	return int64(binary.LittleEndian.Uint64(b)), nil
}

// inputs generates every member's input of a case.
func inputs(c Case, n int, bytesEach int, id uint64) [][]byte {
	in := make([][]byte, n)
	for r := range in {
		in[r] = make([]byte, bytesEach)
		fillRandom(in[r], c.DType, seedFor(id, uint64(r)))
	}
	return in
}

// runCase runs one case and returns how many of this member's result
// elements are wrong.
func runCase(ctx context.Context, m *bridge.Member, c Case, id uint64) (int, error) {
	n, me := m.Size, m.Self
	switch c.Coll {
	case "barrier":
		return 0, m.Comm.Barrier(ctx)
	case "p2p":
		return runP2P(ctx, m, id)
	}
	sz := c.DType.Size()
	cd := collective.Codec{ID: c.Codec, DType: c.DType}
	switch c.Coll {
	case "all_reduce":
		if c.Codec.Lossy() {
			return runLossy(ctx, m, c, id)
		}
		in := inputs(c, n, c.Elems*sz, id)
		want := collective.ReferenceAllReduceAlgo(m.Comm.AllReduceOrder(len(in[me])), c.Op, c.DType, in, n)
		buf := append([]byte(nil), in[me]...)
		if err := m.Comm.AllReduceCodec(ctx, buf, c.DType, c.Op, cd, nil); err != nil {
			return 0, err
		}
		return countWrong(buf, want, sz), nil
	case "reduce_scatter":
		in := inputs(c, n, n*c.Elems*sz, id)
		want := collective.ReferenceReduceScatter(c.Op, c.DType, in, n)[me]
		out := make([]byte, c.Elems*sz)
		if err := m.Comm.ReduceScatterCodec(ctx, out, in[me], c.DType, c.Op, cd, nil); err != nil {
			return 0, err
		}
		return countWrong(out, want, sz), nil
	case "broadcast":
		buf := make([]byte, c.Elems*sz)
		want := make([]byte, len(buf))
		fillRandom(want, c.DType, seedFor(id, uint64(c.Root)))
		if me == c.Root {
			copy(buf, want)
		}
		if err := m.Comm.BroadcastCodec(ctx, buf, c.Root, cd, nil); err != nil {
			return 0, err
		}
		return countWrong(buf, want, sz), nil
	case "all_gather":
		in := inputs(c, n, c.Elems*sz, id)
		var want []byte
		for _, p := range in {
			want = append(want, p...)
		}
		out := make([]byte, len(want))
		if err := m.Comm.AllGatherCodec(ctx, out, in[me], cd, nil); err != nil {
			return 0, err
		}
		return countWrong(out, want, sz), nil
	}
	return 0, fmt.Errorf("unknown collective %q", c.Coll)
}

// runLossy runs a lossy all_reduce case: one call, or c.Feedback
// consecutive calls on fresh inputs with a residual per member, and counts
// the wrong elements of this member's results and residuals against
// collective.ReferenceAllReduceCodec, which keeps every member's residual.
func runLossy(ctx context.Context, m *bridge.Member, c Case, id uint64) (int, error) {
	n, me, sz := m.Size, m.Self, c.DType.Size()
	var mine []byte
	var refRes [][]byte
	if c.Feedback > 0 {
		mine = make([]byte, 4*c.Elems)
		refRes = make([][]byte, n)
		for r := range refRes {
			refRes[r] = make([]byte, 4*c.Elems)
		}
	}
	wrong := 0
	for k := range max(1, c.Feedback) {
		in := inputs(c, n, c.Elems*sz, id<<8|uint64(k))
		var want []byte
		want, refRes = collective.ReferenceAllReduceCodec(c.Codec, c.Op, c.DType, in, refRes, n)
		buf := append([]byte(nil), in[me]...)
		if err := m.Comm.AllReduceCodec(ctx, buf, c.DType, c.Op, collective.Codec{ID: c.Codec, Residual: mine}, nil); err != nil {
			return 0, err
		}
		wrong += countWrong(buf, want, sz)
		if mine != nil {
			wrong += countWrong(mine, refRes[me], 4)
		}
	}
	return wrong, nil
}

// runP2P sends 8 tagged messages of different sizes to the next member and
// receives 8 from the previous one, posting the receives in reverse tag
// order so that matching by tag, not by arrival, is checked.
func runP2P(ctx context.Context, m *bridge.Member, id uint64) (int, error) {
	n, me := m.Size, m.Self
	next, prev := (me+1)%n, (me+n-1)%n
	const msgs = 8
	size := func(tag int) int { return 1 + tag*tag*4099 }
	errc := make(chan error, 2*msgs)
	wrong := make(chan int, msgs)
	for tag := 0; tag < msgs; tag++ {
		go func() {
			b := make([]byte, size(tag))
			fillRandom(b, reduce.Uint8, seedFor(id, uint64(me), uint64(tag)))
			errc <- m.Comm.Send(ctx, next, uint32(tag), b)
		}()
	}
	for tag := msgs - 1; tag >= 0; tag-- {
		go func() {
			want := make([]byte, size(tag))
			fillRandom(want, reduce.Uint8, seedFor(id, uint64(prev), uint64(tag)))
			got := make([]byte, len(want)+16)
			k, err := m.Comm.Recv(ctx, prev, uint32(tag), got)
			if err == nil && k != len(want) {
				err = fmt.Errorf("p2p tag %d from member %d: got %d bytes, want %d", tag, prev, k, len(want))
			}
			if err == nil {
				wrong <- countWrong(got[:k], want, 1)
			}
			errc <- err
		}()
	}
	total := 0
	var first error
	for i := 0; i < 2*msgs; i++ {
		if err := <-errc; err != nil && first == nil {
			first = err
		}
	}
	close(wrong)
	for w := range wrong {
		total += w
	}
	return total, first
}

// SelftestSchema is the schema of gbbridge selftest's summary.
const SelftestSchema = "gpubridge.selftest/v1"

// SelftestSummary is gbbridge selftest's output: one report per run.
type SelftestSummary struct {
	Schema  string `json:"schema"`
	Version string `json:"version"`
	OK      bool   `json:"ok"`
	// Full says the exhaustive sweep ran (--full), not the default subset.
	Full bool `json:"full"`
	// Device is the verbs device step (--transport verbs).
	Device *transport.VerbsCheckReport `json:"device,omitempty"`
	Runs   []RunReport                 `json:"runs"`
	// Verdict is the one line the run ends with: PASS or FAIL and why.
	Verdict string `json:"verdict"`
}
