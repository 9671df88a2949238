package collective

import (
	"context"
	"time"

	"github.com/gpubridge/gpubridge/lib/reduce"
)

// ReduceScatter reduces in over every member and leaves segment m of the
// result (bytes [m*len(out), (m+1)*len(out))) in member m's out: len(in) =
// Size*len(out). out may be this member's own segment of in and must not
// overlap in otherwise. in is not modified (except through that alias).
// ReduceScatterCodec (codec.go) is the same with compressed frames.
func (c *Comm) ReduceScatter(ctx context.Context, out, in []byte, dt reduce.DType, op reduce.Op, p *Progress) error {
	return c.ReduceScatterCodec(ctx, out, in, dt, op, Codec{}, p)
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
		recv: func(t, j, ch, off, m int, p []byte) error {
			mine := in[j*L+off : j*L+off+m]
			t0 := time.Now()
			defer cl.reduced(ch, t0)
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
			return err
		},
		received: func(t, _, _, off, m int) {
			if t == n-2 {
				cl.done(off, m)
			}
		},
	}
	return pp.run()
}
