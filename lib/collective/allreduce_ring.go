package collective

import (
	"github.com/gpubridge/gpubridge/lib/codec"
	"github.com/gpubridge/gpubridge/lib/reduce"
	"time"
)

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
// Two members (from Options.SplitBytes) keep the exchange's order instead,
// x0 op x1 in both halves, so that which of the two runs changes no bit.
// Raw calls cut the segments into chunks small enough to use every stream
// (SpreadChunk).
func (c *Comm) ringAllReduce(cl *call, buf []byte, dt reduce.DType, op reduce.Op, C int) error {
	n, r := c.size, c.self
	segOff, segLen := ringSegments(len(buf), dt.Size(), n)
	if cl.codec == codec.Raw {
		C = SpreadChunk(segLen(0), C, c.streams, dt.Size())
	}
	w := c.workersPer(min(c.streams, (segLen(0)+C-1)/C))
	// The all-gather's segments arrive final: over TCP they are read
	// straight into buf (into), but for the last step's past
	// Options.StreamBytes, which travel no further: the kernel's copy
	// would read every line of buf from memory before writing it, so they
	// come through a piece that stays in cache and go to memory with
	// non-temporal stores (last), as over the other transports.
	last, streamed := c.copier(len(buf)), c.streamed(len(buf))
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
		into: func(t, j, _, off, m int) []byte {
			if t < n-1 || t == 2*n-3 && streamed {
				return nil
			}
			at := segOff(j) + off
			return buf[at : at+m]
		},
		recv: func(t, j, ch, off, m int, p []byte) error {
			at := segOff(j) + off
			own := buf[at : at+m]
			if t == 2*n-3 {
				last(own, p)
				return nil
			}
			if t >= n-1 {
				copy(own, p)
				return nil
			}
			t0 := time.Now()
			defer cl.reduced(ch, t0)
			a, b := p, own // the partial first
			if n == 2 && r == 0 {
				a, b = own, p // x0 op x1, as the exchange
			}
			if err := reduce.CombineParallel(op, dt, own, a, b, w); err != nil {
				return err
			}
			if t == n-2 {
				return reduce.Finish(op, dt, own, n)
			}
			return nil
		},
		received: func(t, j, _, off, m int) {
			if t == 2*n-3 {
				cl.done(segOff(j)+off, m)
			}
		},
	}
	return pp.run()
}
