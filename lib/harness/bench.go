package harness

import (
	"context"
	"encoding/binary"
	"fmt"
	"io"
	"math"
	"slices"
	"time"

	"github.com/gpubridge/gpubridge/lib/bridge"
	"github.com/gpubridge/gpubridge/lib/codec"
	"github.com/gpubridge/gpubridge/lib/collective"
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
	// Codec packs the collective's frames: raw, bf16/v1, fp8/v1, zstd/v1
	// (the exchange and memcpy anchors: raw). Rows of older versions lack
	// it (raw).
	Codec string `json:"codec,omitempty"`
	// Feedback says that each member kept an error-feedback residual
	// across the calls (a lossy all_reduce).
	Feedback bool `json:"feedback,omitempty"`
	// Data is what the buffers held: "pattern" (small integers, exact in
	// every dtype) or "random" (random values in [-8, 8), random bits for
	// integers). Rows of older versions lack it (pattern).
	Data string `json:"data,omitempty"`
	// SentBytes is what member 0 sent in one call, as it travelled
	// (collective.Stats.BytesSent: packed, for a compressed call; the
	// exchange: the buffer); 0 for memcpy.
	SentBytes int64 `json:"sent_bytes,omitempty"`
	// Iters is how many calls the time is the mean of (SweepOptions.Iters,
	// or more under MinTime). Rows of older versions lack it.
	Iters int `json:"iters,omitempty"`
	// ReduceUS, SendWaitUS and SpilledBytes are from this member's
	// checked call (collective.Stats: time in the reduction kernels and
	// receivers' waits for this member's own sends, summed over the
	// streams, and bytes copied aside meanwhile); the row is member 0's.
	ReduceUS     float64 `json:"reduce_us,omitempty"`
	SendWaitUS   float64 `json:"send_wait_us,omitempty"`
	SpilledBytes uint64  `json:"spilled_bytes,omitempty"`
}

// SweepOptions choose what a bench times.
type SweepOptions struct {
	Coll   string // all_reduce, broadcast, all_gather, reduce_scatter
	DType  reduce.DType
	Op     reduce.Op
	Sizes  []int64 // bytes of the whole buffer (all_gather: the output, reduce_scatter: the input)
	Iters  int
	Warmup int
	// MinTime, if set, times more than Iters calls at a size whose Iters
	// calls take less: as many as the slowest member's say fill MinTime (at
	// most MaxTimedCalls). A few calls of a few milliseconds measure mostly
	// the first calls after the barrier.
	MinTime time.Duration
	// ChunkB is the frame size of the raw exchange, at most: like the
	// all_reduce, it cuts a buffer of fewer than one ChunkB per stream
	// into a frame per stream (collective.SpreadChunk).
	ChunkB int
	// Row, if set, receives each row as soon as it is measured (member 0).
	Row func(BenchRow)
	// Codec packs the collective's frames (docs/COMPRESSION.md; the
	// exchange and memcpy anchors stay raw). A lossy all_reduce is checked
	// against collective.ReferenceAllReduceCodec.
	Codec codec.ID
	// Feedback keeps an error-feedback residual per member across the
	// calls (a lossy all_reduce); the checked call starts from zero
	// residuals.
	Feedback bool
	// Random fills the buffers with random values (fillValues) instead of
	// the pattern; the results are checked against the references computed
	// from every member's input.
	Random bool
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
	if o.Feedback && o.Codec.Lossy() && o.Coll == "all_reduce" {
		b.res = make([]byte, 4*(size/sz))
	}
	fillBench(o, m.Self, b.buf, b.in)
	// What the timed calls ran (the time's all_reduce runs after them).
	algo := o.Coll
	slowest, iters, err := timeCalls(ctx, m, o, func() error {
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
	clear(b.res)
	var got []byte
	if o.Coll == "exchange" {
		got = make([]byte, len(b.buf))
	}
	if err := b.run(ctx, m, o, got); err != nil {
		return BenchRow{}, err
	}
	sent := int64(0)
	var st collective.Stats
	switch o.Coll {
	case "exchange":
		sent = size
	case "memcpy":
	default:
		if m.Comm.LastStats(&st) {
			sent = int64(st.BytesSent)
		}
	}
	us := func(d time.Duration) float64 { return float64(d) / float64(time.Microsecond) }
	wrong, err := checkBench(o, n, m.Self, b.buf, b.in, got, m.Comm.AllReduceOrder(len(b.buf)))
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
		Algorithm: algo, Codec: o.codecFor().Versioned(), Feedback: b.res != nil, Data: o.data(), SentBytes: sent,
		Iters:    iters,
		ReduceUS: us(st.Reduce), SendWaitUS: us(st.SendWait), SpilledBytes: st.Spilled,
	}
	switch o.Coll {
	case "memcpy":
		row.BusBW, row.Redop = algbw, "none"
	case "broadcast", "all_gather", "exchange":
		row.Redop = "none"
	}
	return row, nil
}

// codecFor is the codec the timed collective runs with: the anchors are
// raw.
func (o SweepOptions) codecFor() codec.ID {
	if o.Coll == "exchange" || o.Coll == "memcpy" {
		return codec.Raw
	}
	return o.Codec
}

// data names what the buffers hold (BenchRow.Data).
func (o SweepOptions) data() string {
	if o.Random {
		return "random"
	}
	return "pattern"
}

// MaxTimedCalls bounds the timed calls MinTime asks for at one size.
const MaxTimedCalls = 10000

// timeCalls runs call o.Warmup times, meets the other members, times
// o.Iters calls and returns the slowest member's mean, in seconds, and how
// many calls it is the mean of. Under o.MinTime, timed calls that took less
// than it are a measure of one call: as many as fill it are timed again
// (the first ones count as warm-up). The count comes from maxAcross, the
// same on every member, so every member runs the same calls.
func timeCalls(ctx context.Context, m *bridge.Member, o SweepOptions, call func() error) (float64, int, error) {
	for i := 0; i < o.Warmup; i++ {
		if err := call(); err != nil {
			return 0, 0, err
		}
	}
	iters := o.Iters
	for {
		if err := m.Comm.Barrier(ctx); err != nil {
			return 0, 0, err
		}
		start := time.Now()
		for i := 0; i < iters; i++ {
			if err := call(); err != nil {
				return 0, 0, err
			}
		}
		mean, err := maxAcross(ctx, m, time.Since(start).Seconds()/float64(iters))
		if err != nil || o.MinTime <= 0 || float64(iters)*mean >= o.MinTime.Seconds() || iters >= MaxTimedCalls {
			return mean, iters, err
		}
		iters = timedCalls(iters, o.MinTime, mean) // more than iters: they fell short
	}
}

// timedCalls is how many calls of per seconds fill minTime: at least iters,
// at most MaxTimedCalls.
func timedCalls(iters int, minTime time.Duration, per float64) int {
	if per <= 0 {
		return max(iters, MaxTimedCalls)
	}
	want := math.Ceil(minTime.Seconds() / per)
	return max(iters, int(min(want, MaxTimedCalls)))
}

// benchBufs are one size's buffers: buf holds the result (and the input of
// the in-place collectives), in a separate input. The collectives' buffers
// are shared with the peers where the mesh shares memory (SharedBuffer);
// the exchange's and memcpy's are not (they do not use it).
type benchBufs struct {
	buf, in []byte
	res     []byte // this member's residual (Feedback), or nil
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
	cd := collective.Codec{ID: o.Codec, DType: o.DType, Residual: b.res}
	switch o.Coll {
	case "all_reduce":
		return m.Comm.AllReduceCodec(ctx, b.buf, o.DType, o.Op, cd, nil)
	case "broadcast":
		return m.Comm.BroadcastCodec(ctx, b.buf, 0, cd, nil)
	case "all_gather":
		return m.Comm.AllGatherCodec(ctx, b.buf, b.in, cd, nil)
	case "reduce_scatter":
		return m.Comm.ReduceScatterCodec(ctx, b.buf, b.in, o.DType, o.Op, cd, nil)
	case "exchange":
		// Frames cut as the all_reduce's exchange cuts them.
		return exchange(ctx, m, b.buf, collective.SpreadChunk(len(b.buf), o.ChunkB, m.Mesh.Streams(), o.DType.Size()), got)
	case "memcpy":
		copy(b.in, b.buf)
		return nil
	}
	return fmt.Errorf("bench: unknown collective %q", o.Coll)
}

// fillBench fills this member's input with its pattern (or random
// values): buf for the in-place collectives (of a broadcast only the
// root's survives), in for all_gather and reduce_scatter.
func fillBench(o SweepOptions, me int, buf, in []byte) {
	if o.Coll == "all_gather" || o.Coll == "reduce_scatter" {
		buf = in
	}
	fillMember(o, me, buf)
}

// fillMember fills b with member m's input.
func fillMember(o SweepOptions, m int, b []byte) {
	if o.Random {
		fillValues(b, o.DType, seedFor(0xbe4c, uint64(m)))
		return
	}
	fillPattern(b, o.DType, m, o.Op)
}

// checkBench counts wrong elements of this member's result: buf (in for
// memcpy, got for the exchange: what arrived from the peer). A lossy
// all_reduce and random data are checked against the references computed
// from every member's input (an exact all_reduce in order, the algorithm
// the member's Comm runs at this size: "" for the default's); the
// pattern's exact results element by element.
func checkBench(o SweepOptions, n, me int, buf, in, got []byte, order string) (int, error) {
	sz := o.DType.Size()
	switch o.Coll {
	case "exchange":
		want := make([]byte, len(got))
		fillMember(o, 1-me, want)
		return countWrong(got, want, sz), nil
	case "memcpy":
		return countWrong(in, buf, sz), nil
	}
	if o.Random || o.Codec.Lossy() && o.Coll == "all_reduce" {
		return countWrong(buf, referenceBench(o, n, me, len(buf), order), sz), nil
	}
	switch o.Coll {
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

// referenceBench is member me's expected result of L bytes: the
// reference of the collective (and codec; zero residuals) over every
// member's input; order as in checkBench.
func referenceBench(o SweepOptions, n, me, L int, order string) []byte {
	inLen := L
	switch o.Coll {
	case "all_gather":
		inLen = L / n
	case "reduce_scatter":
		inLen = L * n
	}
	ins := make([][]byte, n)
	for r := range ins {
		ins[r] = make([]byte, inLen)
		fillMember(o, r, ins[r])
	}
	switch o.Coll {
	case "all_reduce":
		var res [][]byte
		if o.Feedback && o.Codec.Lossy() {
			res = make([][]byte, n)
			for r := range res {
				res[r] = make([]byte, 4*(L/o.DType.Size()))
			}
		}
		if order != "" && !o.Codec.Lossy() {
			return collective.ReferenceAllReduceAlgo(order, o.Op, o.DType, ins, n)
		}
		want, _ := collective.ReferenceAllReduceCodec(o.Codec, o.Op, o.DType, ins, res, n)
		return want
	case "reduce_scatter":
		return collective.ReferenceReduceScatter(o.Op, o.DType, ins, n)[me]
	case "broadcast":
		return ins[0]
	}
	return slices.Concat(ins...)
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

// WriteRowText writes a row in nccl-tests' layout, with the algorithm
// (and, for a compressed row, the codec and the bytes member 0 sent).
func WriteRowText(w io.Writer, r BenchRow) {
	extra := ""
	if r.Codec != "" && r.Codec != "raw" {
		extra = fmt.Sprintf(" %s, %d B sent", r.Codec, r.SentBytes)
	}
	fmt.Fprintf(w, "%12d %12d %9s %7s %12.1f %8.3f %8.3f %6d  %s%s\n", r.Size, r.Count, r.Type, r.Redop, r.TimeUS, r.AlgBW, r.BusBW, r.Wrong, r.Algorithm, extra)
}

// WriteHeaderText writes the column titles of WriteRowText; desc says
// what the rows ran (the codec, the data), when it is not the plain
// default.
func WriteHeaderText(w io.Writer, coll string, n int, transport string, desc string) {
	if desc != "" {
		transport += ", " + desc
	}
	fmt.Fprintf(w, "# gbbridge bench: %s, %d members, %s\n", coll, n, transport)
	fmt.Fprintf(w, "# %10s %12s %9s %7s %12s %8s %8s %6s  %s\n", "size", "count", "type", "redop", "time(us)", "algbw", "busbw", "#wrong", "algorithm")
	fmt.Fprintf(w, "# %10s %12s %9s %7s %12s %8s %8s %6s\n", "(B)", "(elements)", "", "", "", "(GB/s)", "(GB/s)", "")
}
