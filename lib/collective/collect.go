package collective

import (
	"context"

	"github.com/gpubridge/gpubridge/lib/codec"
	"github.com/gpubridge/gpubridge/lib/reduce"
)

// Progress streams a collective: the input becomes ready as a growing
// prefix, and result ranges are reported as they become final.
type Progress struct {
	// Ready blocks until input bytes [0,end) are ready; nil: all ready.
	// The collective calls it before it reads or sends input bytes below
	// end. Calls come from several goroutines at once (one per stream),
	// so Ready must be safe for concurrent use, and their end values are
	// not always increasing; a call for an end at or below one already
	// granted is not made. An error fails the collective.
	Ready func(ctx context.Context, end int) error
	// Done is called once per final result range: the bytes [off,off+n)
	// of the result hold their final value and the collective no longer
	// writes them, nor does any other member (on the direct path,
	// copying, other members may read them until the call returns). The
	// ranges are disjoint and cover the result
	// exactly once before the collective returns successfully (empty
	// ranges are not reported). It may be called from several goroutines
	// at once. nil: not reported.
	Done func(off, n int)
}

// args are a data collective's arguments as every member must pass them:
// they make its fingerprint (frame.go) and its description in errors.
type args struct {
	kind  kind
	desc  string // "float32 sum, 64 MiB"
	n     int    // bytes per member: the buffer, or one member's slot
	dt    reduce.DType
	op    reduce.Op
	root  int
	chunk int
	// codec packs the frames; cdt is the dtype of the values they carry
	// (what a lossless codec splits into planes; 0: bytes).
	codec codec.ID
	cdt   reduce.DType
	// packed: the caller packed the bytes with codec already (a lossy id
	// on all_gather): the frames carry the id and the bytes as they are.
	packed bool
	// small is the resolved Options.SmallBytes when the call may run
	// recursive doubling (it decides the order of the sums), else 0.
	small int
}

// refuse is a misuse found before the call started (ErrInvalid).
func (a *args) refuse(format string, v ...any) error {
	return &Error{Op: a.kind.String(), Desc: a.desc, Err: invalid(format, v...)}
}

// checkReduce refuses an op the dtype has not, or a length of what (n
// bytes) that is no whole number of elements.
func (a *args) checkReduce(what string, n int) error {
	if err := reduce.Supported(a.op, a.dt); err != nil {
		return a.refuse("%v", err)
	}
	if es := a.dt.Size(); n%es != 0 {
		return a.refuse("%s %d is not a multiple of the %s element size %d", what, n, a.dt, es)
	}
	return nil
}

// collect runs a data collective once its arguments are checked: it takes
// the next sequence number, then does nothing for 0 bytes, runs alone (the
// input read once ready, the result reported whole) with one member, and
// the algorithm otherwise.
func (c *Comm) collect(ctx context.Context, a args, p *Progress, alone func() error, algorithm func(cl *call) error) error {
	cl, err := c.begin(ctx, a.kind, a.desc, fingerprint(a.kind, a.n, a.dt, a.op, a.root, a.chunk, a.codec, a.small), p)
	if err != nil {
		return err
	}
	cl.codec, cl.cdt, cl.packed, cl.small = a.codec, a.cdt, a.packed, a.small
	return c.run(cl, func() error {
		switch {
		case a.n == 0:
			c.ran(AlgoLocal)
			return nil
		case c.size == 1:
			c.ran(AlgoLocal)
			return cl.whole(a.n, alone)
		}
		return algorithm(cl)
	})
}
