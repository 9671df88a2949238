package collective

import (
	"context"
)

// AllGather sets out to the concatenation of every member's in, in member
// order: len(out) = Size*len(in). in may be this member's own slot of out
// (out[Self*len(in):(Self+1)*len(in)]) and must not overlap out otherwise.
// AllGatherCodec (codec.go) is the same with compressed frames.
func (c *Comm) AllGather(ctx context.Context, out, in []byte, p *Progress) error {
	return c.AllGatherCodec(ctx, out, in, Codec{}, p)
}

// ringAllGather is the ring: at step t member r sends slot r-t to r+1 and
// receives slot r-t-1 from r-1, in chunks of C bytes; alias says that in
// is this member's own slot of out.
func (c *Comm) ringAllGather(cl *call, out, in []byte, alias bool, C int) error {
	n, r, L := c.size, c.self, len(in)
	slot := out[r*L : (r+1)*L]
	// The slots arrive final: over TCP they are read straight into out
	// (into), but for the last step's past Options.StreamBytes, which
	// travel no further and go to memory with non-temporal stores instead
	// (last; ringAllReduce says why).
	last, streamed := c.copier(len(out)), c.streamed(len(out))
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
		into: func(t, j, _, off, m int) []byte {
			if t == n-2 && streamed {
				return nil
			}
			return out[j*L+off : j*L+off+m]
		},
		recv: func(t, j, _, off, m int, p []byte) error {
			if t == n-2 {
				last(out[j*L+off:j*L+off+m], p)
				return nil
			}
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
}
