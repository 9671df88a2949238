package collective

import (
	"context"
	"fmt"
)

// AllGather sets out to the concatenation of every member's in, in member
// order: len(out) = Size*len(in). in may be this member's own slot of out
// (out[Self*len(in):(Self+1)*len(in)]) and must not overlap out otherwise.
func (c *Comm) AllGather(ctx context.Context, out, in []byte, p *Progress) error {
	L := len(in)
	a := args{kind: kAllGather, desc: fmt.Sprintf("%s per member", fmtBytes(L)), n: L, chunk: c.chunk}
	if len(out) != c.size*L {
		return a.refuse("output of %d bytes, want %d members × %d bytes = %d", len(out), c.size, L, c.size*L)
	}
	slot := out[c.self*L : (c.self+1)*L]
	alias := sameSlice(in, slot)
	if !alias && overlap(in, out) {
		return a.refuse("the input overlaps the output other than as this member's own slot")
	}
	return c.collect(ctx, a, p, func() error { copy(slot, in); return nil }, func(cl *call) error {
		descs, err := c.describe(cl, in)
		if err != nil {
			return err
		}
		if descs != nil {
			c.ran(AlgoDirect)
			return c.directAllGather(cl, out, in, descs)
		}
		// A ring: at step t member r sends slot r-t to r+1 and receives
		// slot r-t-1 from r-1.
		c.ran(AlgoRing)
		n, r := c.size, c.self
		pp := &pipe{
			cl: cl, next: mod(r+1, n), prev: mod(r-1, n), steps: n - 1,
			sendSeg: func(t int) int { return mod(r-t, n) },
			recvSeg: func(t int) int { return mod(r-t-1, n) },
			segLen:  func(int) int { return L },
			chunk:   a.chunk,
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
			recv: func(_, j, _, off, m int, p []byte) error {
				copy(out[j*L+off:j*L+off+m], p)
				return nil
			},
			received: func(t, j, _, off, m int) {
				if t == n-2 {
					cl.done(j*L+off, m)
				}
			},
		}
		return pp.run()
	})
}
