package collective

import (
	"context"
	"fmt"

	"github.com/gpubridge/gpubridge/lib/reduce"
)

// AllReduce reduces buf over every member, in place: afterwards every
// member's buf holds the same bytes, the reduction of all members' inputs
// with op in the order the package documentation gives. Two members
// exchange their buffers (allreduce_exchange.go), more run the pipelined ring
// (allreduce_ring.go); over shared memory, when every member's buffer is
// shared, the members reduce straight from each other's buffers instead
// (allreduce_direct.go). Algorithm names the one the call ran.
func (c *Comm) AllReduce(ctx context.Context, buf []byte, dt reduce.DType, op reduce.Op, p *Progress) error {
	a := args{kind: kAllReduce, desc: fmt.Sprintf("%s %s, %s", dt, op, fmtBytes(len(buf))), n: len(buf), dt: dt, op: op}
	if err := a.checkReduce("length", len(buf)); err != nil {
		return err
	}
	a.chunk = c.chunkFor(dt.Size())
	return c.collect(ctx, a, p, func() error { return reduce.Finish(op, dt, buf, 1) }, func(cl *call) error {
		descs, err := c.describe(cl, buf)
		switch {
		case err != nil:
			return err
		case descs != nil:
			c.ran(AlgoDirect)
			return c.directAllReduce(cl, buf, dt, op, descs)
		case c.size == 2:
			c.ran(AlgoExchange)
			return c.exchange(cl, buf, dt, op, a.chunk)
		}
		c.ran(AlgoRing)
		return c.ringAllReduce(cl, buf, dt, op, a.chunk)
	})
}
