package collective

import (
	"context"
	"fmt"

	"github.com/gpubridge/gpubridge/lib/codec"
	"github.com/gpubridge/gpubridge/lib/reduce"
	"github.com/gpubridge/gpubridge/lib/wire"
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
	// own dtype and ignore it.
	DType reduce.DType
	// Residual is a lossy codec's error-feedback state for this buffer:
	// float32, 4 bytes per value of the all_reduce's buffer, updated in
	// place by the call; nil: no error feedback. It must not overlap the
	// buffer. A call that fails may have updated part of it.
	Residual []byte
}

// AllReduceCodec is AllReduce with what it sends packed by cd. Lossy
// codecs (bf16, fp8) take floating sum and avg of a dtype the codec takes
// (codec.Supports) and run the compressed exchange (2 members) or the
// low-precision ring (3 or more) of docs/COMPRESSION.md: every member ends
// with the same bits, ReferenceAllReduceCodec's. With one member nothing
// travels and nothing is quantized (the residual is left as it is). zstd
// gives AllReduce's bits, by the same algorithm (recursive doubling up to
// Options.SmallBytes included); lossy codecs never take recursive
// doubling. Compressed calls never take the direct path:
// they go through the transport's streams on every transport.
func (c *Comm) AllReduceCodec(ctx context.Context, buf []byte, dt reduce.DType, op reduce.Op, cd Codec, p *Progress) error {
	a := args{kind: kAllReduce, desc: fmt.Sprintf("%s %s, %s%s", dt, op, fmtBytes(len(buf)), codecDesc(cd.ID)), n: len(buf), dt: dt, op: op, codec: cd.ID, cdt: dt}
	if err := a.checkReduce("length", len(buf)); err != nil {
		return err
	}
	if err := a.checkCodec(cd, len(buf)/dt.Size(), buf); err != nil {
		return err
	}
	a.chunk = c.codecChunk(dt.Size(), cd.ID, dt)
	a.small = c.smallFor(cd.ID)
	return c.collect(ctx, a, p, func() error { return reduce.Finish(op, dt, buf, 1) }, func(cl *call) error {
		if cd.ID.Lossy() {
			lz := c.newLossy(cl, cd, dt, op, buf)
			if c.size == 2 {
				c.ran(AlgoExchange)
				return lz.exchange(a.chunk)
			}
			c.ran(AlgoRing)
			return lz.ring(a.chunk)
		}
		if exactAlgo(c.size, len(buf), c.small) == AlgoRecursiveDoubling {
			c.ran(AlgoRecursiveDoubling)
			return c.recursiveDoubling(cl, buf, dt, op, a.chunk)
		}
		var descs []desc
		if cd.ID == codec.Raw {
			var err error
			if descs, err = c.describe(cl, buf); err != nil {
				return err
			}
		}
		switch {
		case descs != nil && writable(descs):
			c.ran(AlgoDirectWrite)
			return c.directAllReduce(cl, buf, dt, op, descs, true)
		case descs != nil:
			c.ran(AlgoDirect)
			return c.directAllReduce(cl, buf, dt, op, descs, false)
		case c.size == 2 && !c.splits(len(buf)):
			c.ran(AlgoExchange)
			return c.exchange(cl, buf, dt, op, a.chunk)
		}
		c.ran(AlgoRing)
		return c.ringAllReduce(cl, buf, dt, op, a.chunk)
	})
}

// BroadcastCodec is Broadcast with what it sends packed by cd (lossless
// codecs only; cd.DType, when set, must divide the buffer into whole
// elements).
func (c *Comm) BroadcastCodec(ctx context.Context, buf []byte, root int, cd Codec, p *Progress) error {
	a := args{kind: kBroadcast, desc: fmt.Sprintf("%s from member %d%s", fmtBytes(len(buf)), root, codecDesc(cd.ID)), n: len(buf), root: root, codec: cd.ID}
	if root < 0 || root >= c.size {
		return a.refuse("root %d is not a member (0..%d)", root, c.size-1)
	}
	if err := a.checkBytesCodec(cd, len(buf)); err != nil {
		return err
	}
	a.dt, a.cdt = a.planes(cd), a.planes(cd)
	a.chunk = c.codecChunk(max(a.cdt.Size(), 1), cd.ID, a.cdt)
	return c.collect(ctx, a, p, func() error { return nil }, func(cl *call) error {
		return c.broadcast(cl, buf, root, a.chunk)
	})
}

// AllGatherCodec is AllGather with what it sends packed by cd: lossless
// codecs (cd.DType, when set, must divide in into whole elements), or a
// lossy id marking bytes the caller packed already (the GPU leaders'
// caller-reduces exchange, docs/FEED.md §3a): then the frames carry the id,
// so members that packed differently fail naming it, and nothing is
// packed or decoded here.
func (c *Comm) AllGatherCodec(ctx context.Context, out, in []byte, cd Codec, p *Progress) error {
	L := len(in)
	a := args{kind: kAllGather, desc: fmt.Sprintf("%s per member%s", fmtBytes(L), codecDesc(cd.ID)), n: L, codec: cd.ID}
	if len(out) != c.size*L {
		return a.refuse("output of %d bytes, want %d members × %d bytes = %d", len(out), c.size, L, c.size*L)
	}
	slot := out[c.self*L : (c.self+1)*L]
	alias := sameSlice(in, slot)
	if !alias && overlap(in, out) {
		return a.refuse("the input overlaps the output other than as this member's own slot")
	}
	if cd.ID.Lossy() {
		if cd.Residual != nil {
			return a.refuse("a residual (error feedback) is for a lossy all_reduce, not all_gather")
		}
		a.chunk, a.packed = c.chunkFor(1), true
	} else {
		if err := a.checkBytesCodec(cd, L); err != nil {
			return err
		}
		a.dt, a.cdt = a.planes(cd), a.planes(cd)
		a.chunk = c.codecChunk(max(a.cdt.Size(), 1), cd.ID, a.cdt)
	}
	return c.collect(ctx, a, p, func() error { copy(slot, in); return nil }, func(cl *call) error {
		if cd.ID == codec.Raw {
			descs, err := c.describe(cl, in)
			if err != nil {
				return err
			}
			if descs != nil {
				c.ran(AlgoDirect)
				return c.directAllGather(cl, out, in, descs)
			}
		}
		c.ran(AlgoRing)
		return c.ringAllGather(cl, out, in, alias, a.chunk)
	})
}

// ReduceScatterCodec is ReduceScatter with what it sends packed by cd
// (lossless codecs only).
func (c *Comm) ReduceScatterCodec(ctx context.Context, out, in []byte, dt reduce.DType, op reduce.Op, cd Codec, p *Progress) error {
	L := len(out)
	a := args{kind: kReduceScatter, desc: fmt.Sprintf("%s %s, %s per member%s", dt, op, fmtBytes(L), codecDesc(cd.ID)), n: L, dt: dt, op: op, codec: cd.ID, cdt: dt}
	if err := a.checkReduce("output length", L); err != nil {
		return err
	}
	if len(in) != c.size*L {
		return a.refuse("input of %d bytes, want %d members × %d bytes = %d", len(in), c.size, L, c.size*L)
	}
	own := in[c.self*L : (c.self+1)*L]
	if !sameSlice(out, own) && overlap(out, in) {
		return a.refuse("the output overlaps the input other than as this member's own segment")
	}
	if err := a.checkExactCodec(cd); err != nil {
		return err
	}
	a.chunk = c.codecChunk(dt.Size(), cd.ID, dt)
	return c.collect(ctx, a, p, func() error { copy(out, in); return reduce.Finish(op, dt, out, 1) }, func(cl *call) error {
		c.ran(AlgoRing)
		return c.ringReduceScatter(cl, out, in, dt, op, a.chunk)
	})
}

// codecDesc is the codec's part of a call's description: ", fp8/v1", or
// nothing for raw.
func codecDesc(id codec.ID) string {
	if id == codec.Raw {
		return ""
	}
	return ", " + id.Versioned()
}

// checkCodec refuses a codec an all_reduce of E values of buf cannot use:
// an unknown one, a lossy one for anything but a floating sum or avg of a
// dtype it takes, a residual without a lossy codec, of another length than
// 4 bytes per value, or overlapping buf.
func (a *args) checkCodec(cd Codec, E int, buf []byte) error {
	if err := codec.Check(cd.ID); err != nil {
		return a.refuse("%v", err)
	}
	if cd.ID.Lossy() {
		if a.op != reduce.Sum && a.op != reduce.Avg {
			return a.refuse("codec %s is lossy: it compresses floating sum and avg only, not %s (use raw or zstd)", cd.ID.Versioned(), a.op)
		}
		if err := codec.Supports(cd.ID, a.dt); err != nil {
			return a.refuse("%v", err)
		}
	}
	if cd.Residual == nil {
		return nil
	}
	switch {
	case !cd.ID.Lossy():
		return a.refuse("a residual (error feedback) is for the lossy codecs (bf16, fp8), not %s", cd.ID.Versioned())
	case len(cd.Residual) != 4*E:
		return a.refuse("residual of %d bytes for %d values, want %d (4 bytes of float32 per value)", len(cd.Residual), E, 4*E)
	case overlap(cd.Residual, buf):
		return a.refuse("the residual overlaps the buffer")
	}
	return nil
}

// checkExactCodec refuses what a collective that must stay exact cannot
// use: an unknown codec, a lossy one, a residual.
func (a *args) checkExactCodec(cd Codec) error {
	if err := codec.Check(cd.ID); err != nil {
		return a.refuse("%v", err)
	}
	if cd.ID.Lossy() {
		return a.refuse("codec %s is lossy: %s stays exact (use raw or zstd; only a floating sum or avg all_reduce compresses with %s)", cd.ID.Versioned(), a.kind, cd.ID)
	}
	if cd.Residual != nil {
		return a.refuse("a residual (error feedback) is for a lossy all_reduce, not %s", a.kind)
	}
	return nil
}

// checkBytesCodec is checkExactCodec for a collective of n bytes without a
// dtype of its own (broadcast, all_gather): a zstd call's cd.DType must be
// a dtype that divides n into whole elements.
func (a *args) checkBytesCodec(cd Codec, n int) error {
	if err := a.checkExactCodec(cd); err != nil {
		return err
	}
	if cd.ID != codec.Zstd || cd.DType == 0 {
		return nil
	}
	es := cd.DType.Size()
	if es == 0 {
		return a.refuse("codec dtype %v is not a dtype", cd.DType)
	}
	if n%es != 0 {
		return a.refuse("%d bytes are not whole %s elements (the codec's dtype)", n, cd.DType)
	}
	return nil
}

// planes is the dtype a lossless call of a collective without a dtype of
// its own packs by: cd.DType under zstd, else none (so that a raw call's
// fingerprint does not depend on a field it does not use).
func (a *args) planes(cd Codec) reduce.DType {
	if cd.ID == codec.Zstd {
		return cd.DType
	}
	return 0
}

// codecChunk is the chunk size of a call with codec id over elements of es
// bytes (dtype dt): ChunkBytes in whole elements; for a lossy codec whole
// multiples of codec.ChunkAlign values, so that chunks pack to consecutive
// pieces of the buffer's packing; for zstd small enough that a packed
// chunk fits a frame.
func (c *Comm) codecChunk(es int, id codec.ID, dt reduce.DType) int {
	ch := c.chunkFor(es)
	switch {
	case id.Lossy():
		align := codec.ChunkAlign(id)
		v := max(align, ch/es/align*align)
		return v * es
	case id == codec.Zstd:
		most := wire.MaxPayload - (codec.LosslessMaxLen(dt, 0))
		return min(ch, max(es, most-most%es))
	}
	return ch
}
