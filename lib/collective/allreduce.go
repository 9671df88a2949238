package collective

import (
	"context"
	"fmt"

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
	// reads or writes them. The ranges are disjoint and cover the result
	// exactly once before the collective returns successfully (empty
	// ranges are not reported). It may be called from several goroutines
	// at once. nil: not reported.
	Done func(off, n int)
}

// AllReduce reduces buf over every member, in place: afterwards every
// member's buf holds the same bytes, the reduction of all members' inputs
// with op in the order the package documentation gives.
func (c *Comm) AllReduce(ctx context.Context, buf []byte, dt reduce.DType, op reduce.Op, p *Progress) error {
	desc := fmt.Sprintf("%s %s, %s", dt, op, fmtBytes(len(buf)))
	if err := reduce.Supported(op, dt); err != nil {
		return &Error{Op: kAllReduce.String(), Desc: desc, Err: invalid("%v", err)}
	}
	es := dt.Size()
	if len(buf)%es != 0 {
		return &Error{Op: kAllReduce.String(), Desc: desc, Err: invalid("length %d is not a multiple of the %s element size %d", len(buf), dt, es)}
	}
	C := c.chunkFor(es)
	cl, err := c.begin(ctx, kAllReduce, desc, fingerprint(kAllReduce, len(buf), dt, op, 0, C), p)
	if err != nil {
		return err
	}
	return c.run(cl, func() error {
		switch {
		case len(buf) == 0:
			return nil
		case c.size == 1:
			return cl.whole(len(buf), func() error { return reduce.Finish(op, dt, buf, 1) })
		case c.size == 2:
			return c.exchange(cl, buf, dt, op, C)
		}
		return c.ringAllReduce(cl, buf, dt, op, C)
	})
}

// exchange is the two-member all-reduce: both members send their whole
// buffer, chunk by chunk, and reduce each peer chunk as it arrives, member
// 0's value first.
func (c *Comm) exchange(cl *call, buf []byte, dt reduce.DType, op reduce.Op, C int) error {
	peer := 1 - c.self
	w := c.workersPer(min(c.streams, (len(buf)+C-1)/C))
	zero := func(int) int { return 0 }
	pp := &pipe{
		cl: cl, next: peer, prev: peer, steps: 1,
		sendSeg: zero, recvSeg: zero,
		segLen:  func(int) int { return len(buf) },
		chunk:   C,
		sendLag: -1,
		// Own chunk c is overwritten by the reduction only once sent.
		recvLag: 0, recvFrom: 0, recvTo: 0,
		primary: true,
		payload: func(_, _, _, off, n int) ([]byte, error) {
			if err := cl.ready(off + n); err != nil {
				return nil, err
			}
			return buf[off : off+n], nil
		},
		recv: func(_, _, _, off, n int, p []byte) error {
			own := buf[off : off+n]
			var err error
			if c.self == 0 {
				err = reduce.CombineParallel(op, dt, own, own, p, w)
			} else {
				err = reduce.CombineParallel(op, dt, own, p, own, w)
			}
			if err == nil {
				err = reduce.Finish(op, dt, own, 2)
			}
			if err != nil {
				return err
			}
			cl.done(off, n)
			return nil
		},
	}
	return pp.run()
}

// ringSegments returns the segment bounds of a ring all-reduce of L bytes
// of es-byte elements over n members: segment j holds elements
// [j*ceil(E/n), (j+1)*ceil(E/n)) of the E = L/es, clipped to E.
func ringSegments(L, es, n int) (off func(j int) int, length func(j int) int) {
	per := (L/es + n - 1) / n * es
	off = func(j int) int { return min(j*per, L) }
	length = func(j int) int { return min(j*per+per, L) - off(j) }
	return off, length
}

// ringAllReduce is the pipelined ring: a reduce-scatter (steps 0..n-2)
// then an all-gather (steps n-1..2n-3). At step t member r sends segment
// r-t-1 to r+1 and receives segment r-t-2 from r-1 (mod n); in the first
// half it reduces the received partial (the earlier operand) with its own
// input, so segment j accumulates members j+1, j+2, ..., j and ends final at
// member j at step n-2; in the second half the final segments travel on.
func (c *Comm) ringAllReduce(cl *call, buf []byte, dt reduce.DType, op reduce.Op, C int) error {
	n, r := c.size, c.self
	segOff, segLen := ringSegments(len(buf), dt.Size(), n)
	w := c.workersPer(min(c.streams, (segLen(0)+C-1)/C))
	pp := &pipe{
		cl: cl, next: mod(r+1, n), prev: mod(r-1, n), steps: 2*n - 2,
		sendSeg: func(t int) int { return mod(r-t-1, n) },
		recvSeg: func(t int) int { return mod(r-t-2, n) },
		segLen:  segLen,
		chunk:   C,
		sendLag: 1,
		// In the all-gather a received segment lands where this member
		// sent the same segment's partial n-1 steps before.
		recvLag: n - 1, recvFrom: n - 1, recvTo: 2*n - 3,
		primary: true,
		payload: func(t, j, _, off, m int) ([]byte, error) {
			at := segOff(j) + off
			if t == 0 {
				if err := cl.ready(at + m); err != nil {
					return nil, err
				}
			}
			return buf[at : at+m], nil
		},
		sent: func(t, j, _, off, m int) error {
			if t >= n-1 {
				cl.done(segOff(j)+off, m)
			}
			return nil
		},
		prep: func(t, j, _, off, m int) error {
			if t <= n-2 {
				return cl.ready(segOff(j) + off + m)
			}
			return nil
		},
		recv: func(t, j, _, off, m int, p []byte) error {
			at := segOff(j) + off
			own := buf[at : at+m]
			if t >= n-1 {
				copy(own, p)
				if t == 2*n-3 {
					cl.done(at, m)
				}
				return nil
			}
			if err := reduce.CombineParallel(op, dt, own, p, own, w); err != nil {
				return err
			}
			if t == n-2 {
				return reduce.Finish(op, dt, own, n)
			}
			return nil
		},
	}
	return pp.run()
}
