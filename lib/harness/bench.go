package harness

import (
	"context"
	"encoding/binary"
	"fmt"
	"io"
	"math"
	"time"

	"github.com/gpubridge/gpubridge/lib/bridge"
	"github.com/gpubridge/gpubridge/lib/reduce"
)

// BenchSchema is the schema of gbbridge bench's JSON lines.
const BenchSchema = "gpubridge.bench/v1"

// BenchRow is one row of a bench: nccl-tests' columns plus what ran.
type BenchRow struct {
	Schema     string  `json:"schema"`
	Collective string  `json:"collective"`
	Members    int     `json:"members"`
	Transport  string  `json:"transport"`
	Size       int64   `json:"size"`
	Count      int64   `json:"count"`
	Type       string  `json:"type"`
	Redop      string  `json:"redop"`
	Root       int     `json:"root"`
	TimeUS     float64 `json:"time_us"`
	AlgBW      float64 `json:"algbw_gbps"`
	BusBW      float64 `json:"busbw_gbps"`
	// Wrong counts the elements, over all members, that differed bit for
	// bit from the expected result in one more call after timing.
	Wrong int64 `json:"wrong"`
	// Checked says that Wrong comes from that check. Every row of this
	// version is checked; rows of older versions lack the field, and their
	// exchange and memcpy rows were not checked.
	Checked bool `json:"checked"`
	// Algorithm is what the collective ran (collective.Comm.Algorithm:
	// exchange, ring, chain, direct); the exchange and memcpy rows name
	// themselves. Rows of older versions lack it.
	Algorithm string `json:"algorithm,omitempty"`
}

// SweepOptions choose what a bench times.
type SweepOptions struct {
	Coll   string // all_reduce, broadcast, all_gather, reduce_scatter
	DType  reduce.DType
	Op     reduce.Op
	Sizes  []int64 // bytes of the whole buffer (all_gather: the output, reduce_scatter: the input)
	Iters  int
	Warmup int
	// ChunkB is the frame size of the raw exchange.
	ChunkB int
	// Row, if set, receives each row as soon as it is measured (member 0).
	Row func(BenchRow)
}

// BusFactor is nccl-tests' factor from algorithm to bus bandwidth.
func BusFactor(coll string, n int) float64 {
	switch coll {
	case "all_reduce", "exchange":
		return 2 * float64(n-1) / float64(n)
	case "all_gather", "reduce_scatter":
		return float64(n-1) / float64(n)
	}
	return 1
}

// Sweep times one collective at every size. Every member runs it; rows are
// returned (and passed to o.Row) on every member, with the time the slowest
// member measured.
func Sweep(ctx context.Context, m *bridge.Member, o SweepOptions) ([]BenchRow, error) {
	var rows []BenchRow
	for _, size := range o.Sizes {
		row, err := sweepSize(ctx, m, o, size)
		if err != nil {
			return rows, err
		}
		rows = append(rows, row)
		if o.Row != nil {
			o.Row(row)
		}
	}
	return rows, nil
}

// sweepSize times the collective at one size, then runs it once more on
// fresh data and checks that result element by element.
func sweepSize(ctx context.Context, m *bridge.Member, o SweepOptions, size int64) (BenchRow, error) {
	n, sz := m.Size, int64(o.DType.Size())
	// Whole elements, and for the segmented collectives whole elements per
	// member.
	unit := sz
	if o.Coll == "all_gather" || o.Coll == "reduce_scatter" {
		unit = sz * int64(n)
	}
	size = max(size/unit*unit, unit)
	b, err := newBenchBufs(m, o.Coll, size, n)
	if err != nil {
		return BenchRow{}, err
	}
	defer b.free()
	fillBench(o, m.Self, b.buf, b.in)
	// What the timed calls ran (the time's all_reduce runs after them).
	algo := o.Coll
	slowest, err := timeCalls(ctx, m, o, func() error {
		err := b.run(ctx, m, o, nil)
		if o.Coll != "exchange" && o.Coll != "memcpy" {
			algo = m.Comm.Algorithm()
		}
		return err
	})
	if err != nil {
		return BenchRow{}, err
	}
	// The exchange keeps what arrives this time, to compare it with what
	// the peer sent.
	fillBench(o, m.Self, b.buf, b.in)
	var got []byte
	if o.Coll == "exchange" {
		got = make([]byte, len(b.buf))
	}
	if err := b.run(ctx, m, o, got); err != nil {
		return BenchRow{}, err
	}
	wrong, err := checkBench(o, n, m.Self, b.buf, b.in, got)
	if err != nil {
		return BenchRow{}, err
	}
	totalWrong, err := sumAcross(ctx, m, int64(wrong))
	if err != nil {
		return BenchRow{}, err
	}
	algbw := float64(size) / slowest / 1e9
	row := BenchRow{
		Schema: BenchSchema, Collective: o.Coll, Members: n, Transport: m.Mesh.Describe(),
		Size: size, Count: size / sz, Type: o.DType.String(), Redop: o.Op.String(),
		TimeUS: slowest * 1e6, AlgBW: algbw, BusBW: algbw * BusFactor(o.Coll, n), Wrong: totalWrong, Checked: true,
		Algorithm: algo,
	}
	switch o.Coll {
	case "memcpy":
		row.BusBW, row.Redop = algbw, "none"
	case "broadcast", "all_gather", "exchange":
		row.Redop = "none"
	}
	return row, nil
}

// timeCalls runs call o.Warmup times, meets the other members, times
// o.Iters calls and returns the slowest member's mean, in seconds.
func timeCalls(ctx context.Context, m *bridge.Member, o SweepOptions, call func() error) (float64, error) {
	for i := 0; i < o.Warmup; i++ {
		if err := call(); err != nil {
			return 0, err
		}
	}
	if err := m.Comm.Barrier(ctx); err != nil {
		return 0, err
	}
	start := time.Now()
	for i := 0; i < o.Iters; i++ {
		if err := call(); err != nil {
			return 0, err
		}
	}
	return maxAcross(ctx, m, time.Since(start).Seconds()/float64(o.Iters))
}

// benchBufs are one size's buffers: buf holds the result (and the input of
// the in-place collectives), in a separate input. The collectives' buffers
// are shared with the peers where the mesh shares memory (SharedBuffer);
// the exchange's and memcpy's are not (they do not use it).
type benchBufs struct {
	buf, in []byte
	frees   []func()
}

func newBenchBufs(m *bridge.Member, coll string, size int64, n int) (*benchBufs, error) {
	b := &benchBufs{}
	alloc := func(dst *[]byte, size int64) error {
		if coll == "exchange" || coll == "memcpy" {
			*dst = make([]byte, size)
			return nil
		}
		buf, free, err := SharedBuffer(m, size)
		if err != nil {
			b.free()
			return err
		}
		*dst = buf
		b.frees = append(b.frees, free)
		return nil
	}
	bufLen, inLen := size, int64(0)
	switch coll {
	case "memcpy":
		inLen = size
	case "all_gather":
		inLen = size / int64(n)
	case "reduce_scatter":
		bufLen, inLen = size/int64(n), size
	}
	if err := alloc(&b.buf, bufLen); err != nil {
		return nil, err
	}
	if inLen > 0 {
		if err := alloc(&b.in, inLen); err != nil {
			return nil, err
		}
	}
	return b, nil
}

// free releases the buffers.
func (b *benchBufs) free() {
	for _, f := range b.frees {
		f()
	}
	b.frees = nil
}

// run calls the collective once; the exchange copies what arrives into
// got when it is not nil.
func (b *benchBufs) run(ctx context.Context, m *bridge.Member, o SweepOptions, got []byte) error {
	switch o.Coll {
	case "all_reduce":
		return m.Comm.AllReduce(ctx, b.buf, o.DType, o.Op, nil)
	case "broadcast":
		return m.Comm.Broadcast(ctx, b.buf, 0, nil)
	case "all_gather":
		return m.Comm.AllGather(ctx, b.buf, b.in, nil)
	case "reduce_scatter":
		return m.Comm.ReduceScatter(ctx, b.buf, b.in, o.DType, o.Op, nil)
	case "exchange":
		return exchange(ctx, m, b.buf, o.ChunkB, got)
	case "memcpy":
		copy(b.in, b.buf)
		return nil
	}
	return fmt.Errorf("bench: unknown collective %q", o.Coll)
}

// fillBench fills this member's input with its pattern: buf for the
// in-place collectives (of a broadcast only the root's survives), in for
// all_gather and reduce_scatter.
func fillBench(o SweepOptions, me int, buf, in []byte) {
	if o.Coll == "all_gather" || o.Coll == "reduce_scatter" {
		buf = in
	}
	fillPattern(buf, o.DType, me, o.Op)
}

// checkBench counts wrong elements of this member's result: buf (in for
// memcpy, got for the exchange: what arrived from the peer).
func checkBench(o SweepOptions, n, me int, buf, in, got []byte) (int, error) {
	sz := o.DType.Size()
	switch o.Coll {
	case "exchange":
		return countSentWrong(got, o.DType, 1-me, o.Op), nil
	case "memcpy":
		return countWrong(in, buf, sz), nil
	case "all_reduce":
		return countPatternWrong(buf, o.DType, o.Op, n, 0)
	case "broadcast":
		want := make([]byte, len(buf))
		fillPattern(want, o.DType, 0, o.Op)
		return countWrong(buf, want, sz), nil
	case "all_gather":
		seg := len(buf) / n
		want := make([]byte, len(buf))
		for r := 0; r < n; r++ {
			fillPattern(want[r*seg:(r+1)*seg], o.DType, r, o.Op)
		}
		return countWrong(buf, want, sz), nil
	case "reduce_scatter":
		// Member me holds segment me of the reduced input.
		return countPatternWrong(buf, o.DType, o.Op, n, me*len(buf)/sz)
	}
	return 0, fmt.Errorf("bench: unknown collective %q", o.Coll)
}

// maxAcross all-reduces one float64 with max over the bridge.
func maxAcross(ctx context.Context, m *bridge.Member, v float64) (float64, error) {
	b := make([]byte, 8)
	binary.LittleEndian.PutUint64(b, math.Float64bits(v))
	if err := m.Comm.AllReduce(ctx, b, reduce.Float64, reduce.Max, nil); err != nil {
		return 0, err
	}
	return math.Float64frombits(binary.LittleEndian.Uint64(b)), nil
}

// WriteRowText writes a row in nccl-tests' layout, with the algorithm.
func WriteRowText(w io.Writer, r BenchRow) {
	fmt.Fprintf(w, "%12d %12d %9s %7s %12.1f %8.3f %8.3f %6d  %s\n", r.Size, r.Count, r.Type, r.Redop, r.TimeUS, r.AlgBW, r.BusBW, r.Wrong, r.Algorithm)
}

// WriteHeaderText writes the column titles of WriteRowText.
func WriteHeaderText(w io.Writer, coll string, n int, transport string) {
	fmt.Fprintf(w, "# gbbridge bench: %s, %d members, %s\n", coll, n, transport)
	fmt.Fprintf(w, "# %10s %12s %9s %7s %12s %8s %8s %6s  %s\n", "size", "count", "type", "redop", "time(us)", "algbw", "busbw", "#wrong", "algorithm")
	fmt.Fprintf(w, "# %10s %12s %9s %7s %12s %8s %8s %6s\n", "(B)", "(elements)", "", "", "", "(GB/s)", "(GB/s)", "")
}
