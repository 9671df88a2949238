package collective

import (
	"context"

	"github.com/gpubridge/gpubridge/lib/codec"
	"github.com/gpubridge/gpubridge/lib/reduce"
)

// AllReduce reduces buf over every member, in place: afterwards every
// member's buf holds the same bytes, the reduction of all members' inputs
// with op in the order the package documentation gives. Two members
// exchange their buffers (allreduce_exchange.go); more run recursive
// doubling up to Options.SmallBytes (allreduce_rd.go) and the pipelined
// ring above it (allreduce_ring.go); over shared memory, when every
// member's buffer is shared, larger buffers are reduced straight from each
// other's buffers instead (allreduce_direct.go). Algorithm names the one
// the call ran. AllReduceCodec (codec.go) is the same with compressed
// frames.
func (c *Comm) AllReduce(ctx context.Context, buf []byte, dt reduce.DType, op reduce.Op, p *Progress) error {
	return c.AllReduceCodec(ctx, buf, dt, op, Codec{}, p)
}

// resolveThreshold turns an Options byte threshold (SmallBytes,
// SplitBytes) into the one a Comm uses: 0 its default def, negative -1
// (off).
func resolveThreshold(v, def int) int {
	switch {
	case v == 0:
		return def
	case v < 0:
		return -1
	}
	return v
}

// splits says whether an exact all_reduce of L bytes per member that
// goes through the transport runs as two halves (the ring of two members)
// rather than the exchange.
func (c *Comm) splits(L int) bool { return c.size == 2 && c.split >= 0 && L >= c.split }

// exactAlgo is the algorithm an exact (raw or zstd) all_reduce of L bytes
// per member over members members runs through the transport, with small
// the resolved Options.SmallBytes: what decides the order of its sums
// (the direct path keeps the order of the one it replaces).
func exactAlgo(members, L, small int) string {
	switch {
	case members <= 1 || L == 0:
		return AlgoLocal
	case members == 2:
		// Recursive doubling of two members is this exchange: one round.
		return AlgoExchange
	case L <= small:
		return AlgoRecursiveDoubling
	}
	return AlgoRing
}

// smallFor is what an all_reduce with codec id puts into its fingerprint:
// the resolved threshold that decides its algorithm where one may (an
// exact codec): SmallBytes for three or more members, SplitBytes for two;
// else 0.
func (c *Comm) smallFor(id codec.ID) int {
	switch {
	case c.size < 2 || id.Lossy():
		return 0
	case c.size == 2:
		return c.split
	}
	return c.small
}

// thresholdName is the option smallFor puts into the fingerprint, for
// the message that says members differ.
func (c *Comm) thresholdName() string {
	if c.size == 2 {
		return "SplitBytes"
	}
	return "SmallBytes"
}

// AllReduceOrder returns the algorithm whose order of operations an exact
// (raw or zstd) AllReduce of bytes bytes per member follows on this
// Comm — AlgoLocal, AlgoExchange, AlgoRing or AlgoRecursiveDoubling (the
// direct path keeps the order of the one it replaces) — for
// ReferenceAllReduceAlgo.
func (c *Comm) AllReduceOrder(bytes int) string { return exactAlgo(c.size, bytes, c.small) }
