package collective

import (
	"github.com/gpubridge/gpubridge/lib/codec"
	"github.com/gpubridge/gpubridge/lib/reduce"
	"time"
)

// exchange is the two-member all-reduce: both members send their whole
// input in, chunk by chunk, and reduce each peer chunk as it arrives,
// member 0's value first, into out. In place (out == in) a chunk is
// overwritten by the reduction only once this member's send of it is
// out; out of place nothing waits for a send: a piece is reduced as it
// arrives, once the input under it is ready.
func (c *Comm) exchange(cl *call, out, in []byte, dt reduce.DType, op reduce.Op, C int) error {
	peer := 1 - c.self
	if cl.codec == codec.Raw {
		C = SpreadChunk(len(in), C, c.streams, dt.Size())
	}
	apart := !sameSlice(out, in)
	w := c.workersPer(min(c.streams, (len(in)+C-1)/C))
	zero := func(int) int { return 0 }
	pp := &pipe{
		cl: cl, next: peer, prev: peer, steps: 1,
		sendSeg: zero, recvSeg: zero,
		segLen:  func(int) int { return len(in) },
		chunk:   C,
		sendLag: -1,
		// Own chunk c is overwritten by the reduction only once sent.
		recvLag: 0, recvFrom: 0, recvTo: 0,
		primary: true,
		payload: func(_, _, _, off, n int) ([]byte, error) {
			if err := cl.ready(off + n); err != nil {
				return nil, err
			}
			return in[off : off+n], nil
		},
		recv: func(_, _, ch, off, n int, p []byte) error {
			if apart {
				if err := cl.ready(off + n); err != nil {
					return err
				}
			}
			own, dst := in[off:off+n], out[off:off+n]
			t0 := time.Now()
			defer cl.reduced(ch, t0)
			var err error
			if c.self == 0 {
				err = reduce.CombineParallel(op, dt, dst, own, p, w)
			} else {
				err = reduce.CombineParallel(op, dt, dst, p, own, w)
			}
			if err == nil {
				err = reduce.Finish(op, dt, dst, 2)
			}
			return err
		},
		received: func(_, _, _, off, n int) { cl.done(off, n) },
	}
	if apart {
		pp.recvFrom, pp.recvTo = 1, 0
	}
	return pp.run()
}
