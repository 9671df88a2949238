package collective

import (
	"context"

	"github.com/gpubridge/gpubridge/lib/codec"
	"github.com/gpubridge/gpubridge/lib/reduce"
)

// Codec says how a collective packs what it sends over the transport
// (docs/COMPRESSION.md). The zero value sends the bytes as they are.
type Codec struct {
	// ID is the codec: codec.Raw, the lossless codec.Zstd (any
	// collective, exact results), or a lossy codec.BF16 / codec.MXFP8
	// (floating sum and avg all_reduce only).
	ID codec.ID
	// DType is the element type whose byte planes a lossless codec packs,
	// for collectives that have no dtype of their own (broadcast,
	// all_gather); 0: plain bytes. All-reduce and reduce-scatter use their
	// own dtype.
	DType reduce.DType
	// Residual is a lossy codec's error-feedback state for this buffer:
	// float32, 4 bytes per value of the all_reduce's buffer, updated in
	// place by the call; nil: no error feedback.
	Residual []byte
}

// AllReduceCodec is AllReduce with what it sends packed by cd.
func (c *Comm) AllReduceCodec(ctx context.Context, buf []byte, dt reduce.DType, op reduce.Op, cd Codec, p *Progress) error {
	if cd.ID == codec.Raw && cd.Residual == nil {
		return c.AllReduce(ctx, buf, dt, op, p)
	}
	return &Error{Op: kAllReduce.String(), Err: invalid("codec %s: not built yet", cd.ID.Versioned())}
}

// BroadcastCodec is Broadcast with what it sends packed by cd (lossless
// codecs only).
func (c *Comm) BroadcastCodec(ctx context.Context, buf []byte, root int, cd Codec, p *Progress) error {
	if cd.ID == codec.Raw {
		return c.Broadcast(ctx, buf, root, p)
	}
	return &Error{Op: kBroadcast.String(), Err: invalid("codec %s: not built yet", cd.ID.Versioned())}
}

// AllGatherCodec is AllGather with what it sends packed by cd (lossless
// codecs only).
func (c *Comm) AllGatherCodec(ctx context.Context, out, in []byte, cd Codec, p *Progress) error {
	if cd.ID == codec.Raw {
		return c.AllGather(ctx, out, in, p)
	}
	return &Error{Op: kAllGather.String(), Err: invalid("codec %s: not built yet", cd.ID.Versioned())}
}

// ReduceScatterCodec is ReduceScatter with what it sends packed by cd
// (lossless codecs only).
func (c *Comm) ReduceScatterCodec(ctx context.Context, out, in []byte, dt reduce.DType, op reduce.Op, cd Codec, p *Progress) error {
	if cd.ID == codec.Raw {
		return c.ReduceScatter(ctx, out, in, dt, op, p)
	}
	return &Error{Op: kReduceScatter.String(), Err: invalid("codec %s: not built yet", cd.ID.Versioned())}
}
