package collective

import (
	"context"
	"fmt"

	"github.com/gpubridge/gpubridge/lib/reduce"
)

// Broadcast copies root's buf into every other member's buf. Every member
// passes a buffer of the same length.
func (c *Comm) Broadcast(ctx context.Context, buf []byte, root int, p *Progress) error {
	desc := fmt.Sprintf("%s from member %d", fmtBytes(len(buf)), root)
	if root < 0 || root >= c.size {
		return &Error{Op: kBroadcast.String(), Desc: desc, Err: invalid("root %d is not a member (0..%d)", root, c.size-1)}
	}
	C := c.chunk
	cl, err := c.begin(ctx, kBroadcast, desc, fingerprint(kBroadcast, len(buf), 0, 0, root, C), p)
	if err != nil {
		return err
	}
	return c.run(cl, func() error {
		switch {
		case len(buf) == 0:
			return nil
		case c.size == 1:
			return cl.whole(len(buf), func() error { return nil })
		}
		// A chain root, root+1, ..., root-1: each member forwards every
		// chunk as soon as it has it.
		n, r := c.size, c.self
		pos := mod(r-root, n)
		pp := &pipe{
			cl: cl, next: -1, prev: -1, steps: 1,
			sendSeg: func(int) int { return 0 }, recvSeg: func(int) int { return 0 },
			segLen:  func(int) int { return len(buf) },
			chunk:   C,
			sendLag: 0,
			recvLag: 0, recvFrom: 1, recvTo: 0,
			primary: pos == 1, // the member before is the root: it waits for nobody
			payload: func(_, _, _, off, m int) ([]byte, error) {
				if pos == 0 {
					if err := cl.ready(off + m); err != nil {
						return nil, err
					}
				}
				return buf[off : off+m], nil
			},
			sent: func(_, _, _, off, m int) error {
				cl.done(off, m)
				return nil
			},
			recv: func(_, _, _, off, m int, p []byte) error {
				copy(buf[off:off+m], p)
				if pos == n-1 {
					cl.done(off, m)
				}
				return nil
			},
		}
		if pos > 0 {
			pp.prev = mod(r-1, n)
		}
		if pos < n-1 {
			pp.next = mod(r+1, n)
		}
		return pp.run()
	})
}

// AllGather sets out to the concatenation of every member's in, in member
// order: len(out) = Size*len(in). in may be this member's own slot of out
// (out[Self*len(in):(Self+1)*len(in)]) and must not overlap out otherwise.
func (c *Comm) AllGather(ctx context.Context, out, in []byte, p *Progress) error {
	L := len(in)
	desc := fmt.Sprintf("%s per member", fmtBytes(L))
	if len(out) != c.size*L {
		return &Error{Op: kAllGather.String(), Desc: desc, Err: invalid("output of %d bytes, want %d members × %d bytes = %d", len(out), c.size, L, c.size*L)}
	}
	slot := out[c.self*L : (c.self+1)*L]
	alias := sameSlice(in, slot)
	if !alias && overlap(in, out) {
		return &Error{Op: kAllGather.String(), Desc: desc, Err: invalid("the input overlaps the output other than as this member's own slot")}
	}
	C := c.chunk
	cl, err := c.begin(ctx, kAllGather, desc, fingerprint(kAllGather, L, 0, 0, 0, C), p)
	if err != nil {
		return err
	}
	return c.run(cl, func() error {
		switch {
		case L == 0:
			return nil
		case c.size == 1:
			return cl.whole(L, func() error { copy(slot, in); return nil })
		}
		// A ring: at step t member r sends slot r-t to r+1 and receives
		// slot r-t-1 from r-1.
		n, r := c.size, c.self
		pp := &pipe{
			cl: cl, next: mod(r+1, n), prev: mod(r-1, n), steps: n - 1,
			sendSeg: func(t int) int { return mod(r-t, n) },
			recvSeg: func(t int) int { return mod(r-t-1, n) },
			segLen:  func(int) int { return L },
			chunk:   C,
			sendLag: 1,
			recvLag: 0, recvFrom: 1, recvTo: 0,
			primary: true,
			payload: func(t, j, _, off, m int) ([]byte, error) {
				if t == 0 {
					if err := cl.ready(off + m); err != nil {
						return nil, err
					}
					return in[off : off+m], nil
				}
				return out[j*L+off : j*L+off+m], nil
			},
			sent: func(t, j, _, off, m int) error {
				if t == 0 && !alias {
					copy(slot[off:off+m], in[off:off+m])
				}
				cl.done(j*L+off, m)
				return nil
			},
			recv: func(t, j, _, off, m int, p []byte) error {
				copy(out[j*L+off:j*L+off+m], p)
				if t == n-2 {
					cl.done(j*L+off, m)
				}
				return nil
			},
		}
		return pp.run()
	})
}

// ReduceScatter reduces in over every member and leaves segment m of the
// result (bytes [m*len(out), (m+1)*len(out))) in member m's out: len(in) =
// Size*len(out). out may be this member's own segment of in and must not
// overlap in otherwise. in is not modified (except through that alias).
func (c *Comm) ReduceScatter(ctx context.Context, out, in []byte, dt reduce.DType, op reduce.Op, p *Progress) error {
	L := len(out)
	desc := fmt.Sprintf("%s %s, %s per member", dt, op, fmtBytes(L))
	if err := reduce.Supported(op, dt); err != nil {
		return &Error{Op: kReduceScatter.String(), Desc: desc, Err: invalid("%v", err)}
	}
	es := dt.Size()
	if L%es != 0 {
		return &Error{Op: kReduceScatter.String(), Desc: desc, Err: invalid("output length %d is not a multiple of the %s element size %d", L, dt, es)}
	}
	if len(in) != c.size*L {
		return &Error{Op: kReduceScatter.String(), Desc: desc, Err: invalid("input of %d bytes, want %d members × %d bytes = %d", len(in), c.size, L, c.size*L)}
	}
	own := in[c.self*L : (c.self+1)*L]
	if !sameSlice(out, own) && overlap(out, in) {
		return &Error{Op: kReduceScatter.String(), Desc: desc, Err: invalid("the output overlaps the input other than as this member's own segment")}
	}
	C := c.chunkFor(es)
	cl, err := c.begin(ctx, kReduceScatter, desc, fingerprint(kReduceScatter, L, dt, op, 0, C), p)
	if err != nil {
		return err
	}
	return c.run(cl, func() error {
		switch {
		case L == 0:
			return nil
		case c.size == 1:
			return cl.whole(L, func() error { copy(out, in); return reduce.Finish(op, dt, out, 1) })
		}
		return c.ringReduceScatter(cl, out, in, dt, op, C)
	})
}

// ringReduceScatter is the first half of ringAllReduce over segments of
// len(out): at step t (0..n-2) member r sends segment r-t-1 and receives
// segment r-t-2, so segment j accumulates members j+1, ..., j and ends at
// member j. With two members, member 0's value is the earlier operand.
// Partials wait for their next step in a double buffer (scratch), as the
// input is not modified.
func (c *Comm) ringReduceScatter(cl *call, out, in []byte, dt reduce.DType, op reduce.Op, C int) error {
	n, r, L := c.size, c.self, len(out)
	var scratch [2][]byte
	if n >= 3 {
		need := min(2, n-2) * L
		if cap(c.scratch) < need {
			c.scratch = make([]byte, need)
		}
		scratch[0] = c.scratch[:L]
		if n >= 4 {
			scratch[1] = c.scratch[L : 2*L]
		}
	}
	w := c.workersPer(min(c.streams, (L+C-1)/C))
	pp := &pipe{
		cl: cl, next: mod(r+1, n), prev: mod(r-1, n), steps: n - 1,
		sendSeg: func(t int) int { return mod(r-t-1, n) },
		recvSeg: func(t int) int { return mod(r-t-2, n) },
		segLen:  func(int) int { return L },
		chunk:   C,
		sendLag: 1,
		// The partial received at step t goes to scratch[t%2], which the
		// send of step t-1 reads.
		recvLag: 1, recvFrom: 2, recvTo: n - 3,
		primary: true,
		payload: func(t, j, _, off, m int) ([]byte, error) {
			if t == 0 {
				if err := cl.ready(j*L + off + m); err != nil {
					return nil, err
				}
				return in[j*L+off : j*L+off+m], nil
			}
			return scratch[(t-1)%2][off : off+m], nil
		},
		prep: func(_, j, _, off, m int) error { return cl.ready(j*L + off + m) },
		recv: func(t, j, _, off, m int, p []byte) error {
			mine := in[j*L+off : j*L+off+m]
			if t < n-2 {
				return reduce.CombineParallel(op, dt, scratch[t%2][off:off+m], p, mine, w)
			}
			dst := out[off : off+m]
			var err error
			if n == 2 && r == 0 {
				err = reduce.CombineParallel(op, dt, dst, mine, p, w)
			} else {
				err = reduce.CombineParallel(op, dt, dst, p, mine, w)
			}
			if err == nil {
				err = reduce.Finish(op, dt, dst, n)
			}
			if err != nil {
				return err
			}
			cl.done(off, m)
			return nil
		},
	}
	return pp.run()
}
