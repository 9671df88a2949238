package collective

import (
	"context"

	"github.com/gpubridge/gpubridge/lib/reduce"
)

// AllReduce reduces buf over every member, in place: afterwards every
// member's buf holds the same bytes, the reduction of all members' inputs
// with op in the order the package documentation gives. Two members
// exchange their buffers (allreduce_exchange.go), more run the pipelined ring
// (allreduce_ring.go); over shared memory, when every member's buffer is
// shared, the members reduce straight from each other's buffers instead
// (allreduce_direct.go). Algorithm names the one the call ran.
// AllReduceCodec (codec.go) is the same with compressed frames.
func (c *Comm) AllReduce(ctx context.Context, buf []byte, dt reduce.DType, op reduce.Op, p *Progress) error {
	return c.AllReduceCodec(ctx, buf, dt, op, Codec{}, p)
}
