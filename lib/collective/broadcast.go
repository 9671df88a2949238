package collective

import (
	"context"
)

// Broadcast copies root's buf into every other member's buf. Every member
// passes a buffer of the same length. BroadcastCodec (codec.go) is the
// same with compressed frames.
func (c *Comm) Broadcast(ctx context.Context, buf []byte, root int, p *Progress) error {
	return c.BroadcastCodec(ctx, buf, root, Codec{}, p)
}

// broadcast is the chain root, root+1, ..., root-1: each member forwards
// every chunk (of C bytes) as soon as it has it.
func (c *Comm) broadcast(cl *call, buf []byte, root, C int) error {
	c.ran(AlgoChain)
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
		// What arrives is final: over TCP it is read straight into buf
		// (a copy of ours would read buf's lines first as well).
		into: func(_, _, _, off, m int) []byte { return buf[off : off+m] },
		recv: func(_, _, _, off, m int, p []byte) error {
			copy(buf[off:off+m], p)
			return nil
		},
		received: func(_, _, _, off, m int) {
			if pos == n-1 {
				cl.done(off, m)
			}
		},
	}
	if pos > 0 {
		pp.prev = mod(r-1, n)
	}
	if pos < n-1 {
		pp.next = mod(r+1, n)
	}
	return pp.run()
}
