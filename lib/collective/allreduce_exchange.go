package collective

import (
	"github.com/gpubridge/gpubridge/lib/codec"
	"github.com/gpubridge/gpubridge/lib/reduce"
	"time"
)

// exchange is the two-member all-reduce: both members send their whole
// buffer, chunk by chunk, and reduce each peer chunk as it arrives, member
// 0's value first.
func (c *Comm) exchange(cl *call, buf []byte, dt reduce.DType, op reduce.Op, C int) error {
	peer := 1 - c.self
	if cl.codec == codec.Raw {
		C = SpreadChunk(len(buf), C, c.streams, dt.Size())
	}
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
		recv: func(_, _, ch, off, n int, p []byte) error {
			own := buf[off : off+n]
			t0 := time.Now()
			defer cl.reduced(ch, t0)
			var err error
			if c.self == 0 {
				err = reduce.CombineParallel(op, dt, own, own, p, w)
			} else {
				err = reduce.CombineParallel(op, dt, own, p, own, w)
			}
			if err == nil {
				err = reduce.Finish(op, dt, own, 2)
			}
			return err
		},
		received: func(_, _, _, off, n int) { cl.done(off, n) },
	}
	return pp.run()
}
