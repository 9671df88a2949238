package harness

import (
	"context"
	"errors"
	"fmt"
	"io"
	"math"
	"slices"
	"time"

	"github.com/gpubridge/gpubridge/lib/bridge"
	"github.com/gpubridge/gpubridge/lib/reduce"
	"github.com/gpubridge/gpubridge/lib/wire"
)

// The selftest's link measurement in perftest's style (ib_write_bw and
// ib_write_lat columns), over the bridge's own streams between members 0
// and 1: what the transport carries, with the collectives out of the way.
// Other members wait. The frames use the data streams only (the control
// streams belong to the communicator), between collectives.

// BWRow is one ib_write_bw-style row: frames of Bytes, Iterations of them
// spread over every data stream, per repetition.
type BWRow struct {
	Bytes      int     `json:"bytes"`
	Iterations int     `json:"iterations"`
	PeakMBps   float64 `json:"bw_peak_mbps"`
	AvgMBps    float64 `json:"bw_average_mbps"`
	MsgRate    float64 `json:"msg_rate_mpps"`
}

// LatRow is one ib_write_lat-style row: half the round trip of a frame of
// Bytes on data stream 0, in microseconds.
type LatRow struct {
	Bytes      int     `json:"bytes"`
	Iterations int     `json:"iterations"`
	Min        float64 `json:"t_min_us"`
	Max        float64 `json:"t_max_us"`
	Typical    float64 `json:"t_typical_us"`
	Avg        float64 `json:"t_avg_us"`
	Stdev      float64 `json:"t_stdev_us"`
	P99        float64 `json:"p99_us"`
	P999       float64 `json:"p99_9_us"`
}

// PerfOptions size the measurement.
type PerfOptions struct {
	BWSizes  []int
	LatSizes []int
	// BWBytes is about how much one bandwidth repetition sends, in at
	// least 4 and at most BWIters frames; Reps repetitions give the peak
	// and the average.
	BWBytes int
	BWIters int
	Reps    int
	// LatIters round trips per latency size, after LatIters/10 warm-up.
	LatIters int
}

// QuickPerf and FullPerf are the selftest's default and --full sweeps
// (--full: perftest -a's sizes, 2 B to 8 MiB).
var (
	QuickPerf = PerfOptions{BWSizes: []int{64 << 10, 1 << 20}, LatSizes: []int{8, 64 << 10}, BWBytes: 32 << 20, BWIters: 1000, Reps: 3, LatIters: 200}
	FullPerf  = PerfOptions{BWSizes: powersOfTwo(2, 8<<20), LatSizes: powersOfTwo(2, 8<<20), BWBytes: 64 << 20, BWIters: 5000, Reps: 3, LatIters: 1000}
)

func powersOfTwo(lo, hi int) []int {
	var s []int
	for n := lo; n <= hi; n *= 2 {
		s = append(s, n)
	}
	return s
}

// Perf runs the measurement on a joined member; member 0 gets the rows.
func Perf(ctx context.Context, m *bridge.Member, o PerfOptions) ([]BWRow, []LatRow, error) {
	if m.Self > 1 {
		return nil, nil, m.Comm.Barrier(ctx)
	}
	var bw []BWRow
	var lat []LatRow
	for _, n := range o.BWSizes {
		r, err := perfBW(ctx, m, o, n)
		if err != nil {
			return bw, lat, fmt.Errorf("write_bw at %d bytes: %w", n, err)
		}
		bw = append(bw, r)
	}
	for _, n := range o.LatSizes {
		r, err := perfLat(ctx, m, o, n)
		if err != nil {
			return bw, lat, fmt.Errorf("write_lat at %d bytes: %w", n, err)
		}
		lat = append(lat, r)
	}
	return bw, lat, m.Comm.Barrier(ctx)
}

// perfBW streams frames of n bytes from member 0 to member 1 over every
// data stream; member 1 answers each repetition with one frame on stream
// 0 once it has them all, which ends member 0's clock.
func perfBW(ctx context.Context, m *bridge.Member, o PerfOptions, n int) (BWRow, error) {
	streams := m.Mesh.Streams()
	iters := max(4, o.BWBytes/max(n, 1))
	if o.BWIters > 0 {
		iters = min(iters, max(o.BWIters, 4))
	}
	iters = (iters + streams - 1) / streams * streams
	buf := make([]byte, n)
	fillRandom(buf, reduce.Uint8, seedFor(uint64(n)))
	peer := 1 - m.Self
	row := BWRow{Bytes: n, Iterations: iters}
	var total time.Duration
	for range max(o.Reps, 1) {
		t0 := time.Now()
		err := eachStream(ctx, streams, func(ctx context.Context, s int) error {
			st := m.Mesh.Stream(peer, s)
			for i := s; i < iters; i += streams {
				if m.Self == 0 {
					if err := st.Send(ctx, wire.Header{Kind: wire.KindData, Chunk: uint32(i)}, buf); err != nil {
						return err
					}
					continue
				}
				if err := st.Recv(ctx, func(h wire.Header, p []byte) error {
					if int(h.Chunk) != i || len(p) != n {
						return fmt.Errorf("stream %d: frame %d of %d bytes, want %d of %d", s, h.Chunk, len(p), i, n)
					}
					return nil
				}); err != nil {
					return err
				}
			}
			return nil
		})
		if err == nil {
			err = pingPong(ctx, m, 1, nil)
		}
		if err != nil {
			return row, err
		}
		d := time.Since(t0)
		total += d
		row.PeakMBps = max(row.PeakMBps, float64(iters*n)/d.Seconds()/1e6)
	}
	reps := max(o.Reps, 1)
	row.AvgMBps = float64(reps*iters*n) / total.Seconds() / 1e6
	row.MsgRate = float64(reps*iters) / total.Seconds() / 1e6
	return row, nil
}

// perfLat bounces a frame of n bytes between members 0 and 1 on stream 0.
func perfLat(ctx context.Context, m *bridge.Member, o PerfOptions, n int) (LatRow, error) {
	buf := make([]byte, n)
	iters := max(o.LatIters, 2)
	times := make([]float64, 0, iters)
	for i := range iters + iters/10 {
		t0 := time.Now()
		if err := pingPong(ctx, m, m.Self, buf); err != nil {
			return LatRow{}, err
		}
		if i >= iters/10 {
			times = append(times, float64(time.Since(t0).Nanoseconds())/2e3)
		}
	}
	return latRow(n, times), nil
}

// pingPong sends buf from member first to the other on stream 0 and back.
func pingPong(ctx context.Context, m *bridge.Member, first int, buf []byte) error {
	st := m.Mesh.Stream(1-m.Self, 0)
	h := wire.Header{Kind: wire.KindData, Chunk: math.MaxUint32}
	recv := func() error {
		return st.Recv(ctx, func(g wire.Header, p []byte) error {
			if g.Chunk != h.Chunk || len(p) != len(buf) {
				return fmt.Errorf("stream 0: a frame of %d bytes (chunk %d) where the ping-pong's belongs", len(p), g.Chunk)
			}
			return nil
		})
	}
	if m.Self == first {
		if err := st.Send(ctx, h, buf); err != nil {
			return err
		}
		return recv()
	}
	if err := recv(); err != nil {
		return err
	}
	return st.Send(ctx, h, buf)
}

// latRow summarises round trips as ib_write_lat does; t_typical is the
// median.
func latRow(n int, us []float64) LatRow {
	s := slices.Clone(us)
	slices.Sort(s)
	var sum, sq float64
	for _, v := range s {
		sum += v
	}
	avg := sum / float64(len(s))
	for _, v := range s {
		sq += (v - avg) * (v - avg)
	}
	at := func(q float64) float64 { return s[min(len(s)-1, int(q*float64(len(s))))] }
	return LatRow{Bytes: n, Iterations: len(s), Min: s[0], Max: s[len(s)-1], Typical: at(0.5), Avg: avg,
		Stdev: math.Sqrt(sq / float64(len(s))), P99: at(0.99), P999: at(0.999)}
}

// eachStream runs f for every data stream at once; the first error stops
// the others.
func eachStream(ctx context.Context, streams int, f func(ctx context.Context, s int) error) error {
	ctx, cancel := context.WithCancel(ctx)
	defer cancel()
	errc := make(chan error, streams)
	for s := range streams {
		go func() { errc <- f(ctx, s) }()
	}
	var first error
	for range streams {
		if err := <-errc; err != nil && first == nil {
			first = err
			cancel()
		}
	}
	return first
}

// WritePerf prints the rows in perftest's columns.
func WritePerf(w io.Writer, members int, desc string, bw []BWRow, lat []LatRow) error {
	var errs []error
	p := func(format string, args ...any) {
		_, err := fmt.Fprintf(w, format, args...)
		errs = append(errs, err)
	}
	if len(bw) > 0 {
		p("# ib_write_bw style, member 0 to member 1 of %d, every data stream: %s\n", members, desc)
		p("# %-10s %-13s %-18s %-21s %s\n", "#bytes", "#iterations", "BW peak[MB/sec]", "BW average[MB/sec]", "MsgRate[Mpps]")
		for _, r := range bw {
			p("  %-10d %-13d %-18.2f %-21.2f %.6f\n", r.Bytes, r.Iterations, r.PeakMBps, r.AvgMBps, r.MsgRate)
		}
	}
	if len(lat) > 0 {
		p("# ib_write_lat style, member 0 and member 1, stream 0 (half the round trip)\n")
		p("# %-8s %-12s %-12s %-12s %-16s %-12s %-14s %-22s %s\n", "#bytes", "#iterations", "t_min[usec]", "t_max[usec]", "t_typical[usec]",
			"t_avg[usec]", "t_stdev[usec]", "99% percentile[usec]", "99.9% percentile[usec]")
		for _, r := range lat {
			p("  %-8d %-12d %-12.2f %-12.2f %-16.2f %-12.2f %-14.2f %-22.2f %.2f\n", r.Bytes, r.Iterations, r.Min, r.Max, r.Typical, r.Avg, r.Stdev, r.P99, r.P999)
		}
	}
	return errors.Join(errs...)
}
