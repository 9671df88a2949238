package collective

import (
	"encoding/binary"
	"math"
	"sync"
	"time"

	"github.com/gpubridge/gpubridge/lib/codec"
	"github.com/gpubridge/gpubridge/lib/reduce"
)

// lossy is one lossy all_reduce (docs/COMPRESSION.md, "The compressed
// all_reduce"): its buffer, codec, residual, and the arithmetic its
// algorithms (allreduce_exchange_codec.go, allreduce_ring_codec.go) do on
// ranges of values. Partials and sums are float32 whatever the dtype; a
// value is quantized with error feedback (codec.EncodeFeedback*) when
// there is a residual. Ranges are cut into blocks that stay in cache, and
// large ones spread over up to w goroutines.
type lossy struct {
	c      *Comm
	cl     *call
	id     codec.ID
	dt     reduce.DType // the buffer's
	es     int
	op     reduce.Op
	buf    []byte
	res    []byte // float32 per value, or nil
	packed []byte // the packing of the whole buffer (exchange: this member's; ring: what it sends and forwards)
}

func (c *Comm) newLossy(cl *call, cd Codec, dt reduce.DType, op reduce.Op, buf []byte) *lossy {
	lz := &lossy{c: c, cl: cl, id: cd.ID, dt: dt, es: dt.Size(), op: op, buf: buf, res: cd.Residual}
	lz.packed = grow(&c.packed, lz.plen(len(buf)/lz.es))
	return lz
}

// plen is the packed length of the first v values of a buffer; the bytes
// of values [v0, v1) (v0 a multiple of codec.ChunkAlign) are
// [plen(v0), plen(v1)) of its packing.
func (lz *lossy) plen(v int) int {
	n, _ := codec.MaxPackedLen(lz.id, lz.dt, v)
	return n
}

// packedLen is the packed length of a frame of n bytes of values.
func (cl *call) packedLen(n int) int {
	es := max(cl.cdt.Size(), 1)
	k, _ := codec.MaxPackedLen(cl.codec, cl.cdt, n/es)
	return k
}

// pk returns the packing of values [v0, v1) in p, the packing of the
// whole buffer.
func (lz *lossy) pk(p []byte, v0, v1 int) []byte { return p[lz.plen(v0):lz.plen(v1)] }

// vals returns buf's bytes of values [v0, v1).
func (lz *lossy) vals(v0, v1 int) []byte { return lz.buf[v0*lz.es : v1*lz.es] }

// resid returns the residual of values [v0, v1), nil without one.
func (lz *lossy) resid(v0, v1 int) []byte {
	if lz.res == nil {
		return nil
	}
	return lz.res[4*v0 : 4*v1]
}

// blockVals is how many values the block loops handle at a time: 8 fp8
// groups, 32 KiB of float32, so that a value's decode, add, finish and
// encode run while it is in the first-level cache.
const blockVals = 8 * codec.GroupElems

// blockPool holds the two float32 blocks of a worker: a partial, and an
// input widened to float32.
var blockPool = sync.Pool{New: func() any { b := make([]byte, 2*4*blockVals); return &b }}

// minParVals is the least a goroutine of a range gets: below it the start
// costs more than it saves.
var minParVals = 32 << 10

// par runs f over [v0, v1) on up to w goroutines (this one included), each
// on a range whose bounds are v0 plus multiples of codec.GroupElems, and
// returns the first error. f gets a stream index for the stats (s).
func (lz *lossy) par(s, w, v0, v1 int, f func(k *tally, a, b int) error) error {
	k0 := &tally{}
	defer lz.account(s, k0)
	n := v1 - v0
	w = min(w, n/minParVals)
	if w <= 1 {
		return f(k0, v0, v1)
	}
	per := (n/w + codec.GroupElems - 1) / codec.GroupElems * codec.GroupElems
	errs := make([]error, w)
	var wg sync.WaitGroup
	a := v0
	for i := 1; i < w && a+per < v1; i++ {
		lo, hi := a, a+per
		wg.Go(func() {
			k := &tally{}
			errs[i] = f(k, lo, hi)
			lz.account(s, k)
		})
		a = hi
	}
	errs[0] = f(k0, a, v1)
	wg.Wait()
	for _, err := range errs {
		if err != nil {
			return err
		}
	}
	return nil
}

// tally times a worker's codec and reduction work (lap after each part).
type tally struct {
	last          time.Time
	codec, reduce time.Duration
}

func (k *tally) start() { k.last = time.Now() }

func (k *tally) lap(into *time.Duration) {
	now := time.Now()
	*into += now.Sub(k.last)
	k.last = now
}

func (lz *lossy) account(s int, k *tally) {
	st := lz.cl.st
	st.codec[s%len(st.codec)].Add(int64(k.codec))
	st.reduce[s%len(st.reduce)].Add(int64(k.reduce))
}

// encode packs buf's values [v0, v1) (the input, in its dtype) into q:
// Q(x + r), the residual updated.
func (lz *lossy) encode(s, w int, q []byte, v0, v1 int) error {
	return lz.par(s, w, v0, v1, func(k *tally, a, b int) error {
		k.start()
		err := lz.quantize(lz.pk(q, a-v0, b-v0), lz.dt, lz.vals(a, b), a, b)
		k.lap(&k.codec)
		return err
	})
}

// quantize packs src, values [v0, v1) of the buffer held as dt (the
// input's dtype or a float32 partial), into q, with the residual's error
// feedback when there is one.
func (lz *lossy) quantize(q []byte, dt reduce.DType, src []byte, v0, v1 int) error {
	r := lz.resid(v0, v1)
	switch {
	case r == nil:
		_, err := codec.EncodeChunk(lz.id, q, dt, src, codec.LosslessOptions{})
		return err
	case lz.id == codec.MXFP8:
		return codec.EncodeFeedbackMXFP8(q, dt, src, r)
	}
	return codec.EncodeFeedbackBF16(q, dt, src, r)
}

// decodeAdd adds the decoding of q to the float32 values acc (acc first,
// lib/reduce's rules).
func (lz *lossy) decodeAdd(acc, q []byte) error {
	if lz.id == codec.MXFP8 {
		return codec.DecodeAddMXFP8(acc, q)
	}
	return codec.DecodeAddBF16(acc, q)
}

// blocks runs f over [a, b) in blocks of blockVals values with a worker's
// two float32 blocks.
func blocks(a, b int, f func(x, y int, acc, wide []byte) error) error {
	bp := blockPool.Get().(*[]byte)
	defer blockPool.Put(bp)
	for x := a; x < b; x += blockVals {
		y := min(x+blockVals, b)
		m := 4 * (y - x)
		if err := f(x, y, (*bp)[:m], (*bp)[4*blockVals:4*blockVals+m]); err != nil {
			return err
		}
	}
	return nil
}

// sum2 sets buf's values [v0, v1) to the two-member result from the
// packings first and second of those values: dec(first) + dec(second) in
// float32 (first the earlier operand), Finish for 2 members, then the
// dtype.
func (lz *lossy) sum2(s, w int, first, second []byte, v0, v1 int) error {
	return lz.par(s, w, v0, v1, func(k *tally, a, b int) error {
		return blocks(a, b, func(x, y int, acc, _ []byte) error {
			k.start()
			dst := lz.vals(x, y)
			if lz.dt == reduce.Float32 {
				acc = dst
			}
			if err := codec.DecodeChunk(lz.id, acc, reduce.Float32, lz.pk(first, x-v0, y-v0)); err != nil {
				return err
			}
			if err := lz.decodeAdd(acc, lz.pk(second, x-v0, y-v0)); err != nil {
				return err
			}
			k.lap(&k.codec)
			if err := reduce.Finish(lz.op, reduce.Float32, acc, 2); err != nil {
				return err
			}
			k.lap(&k.reduce)
			err := narrow(dst, lz.dt, acc)
			k.lap(&k.codec)
			return err
		})
	})
}

// partial is a ring hop: the received partial's packing in (values [v0,
// v1)) decoded, this member's input added (float32, the received partial
// first), quantized into out: Q(dec(in) + x + r).
func (lz *lossy) partial(s, w int, out, in []byte, v0, v1 int) error {
	return lz.par(s, w, v0, v1, func(k *tally, a, b int) error {
		return blocks(a, b, func(x, y int, acc, wide []byte) error {
			if err := lz.addInput(k, acc, wide, lz.pk(in, x-v0, y-v0), x, y); err != nil {
				return err
			}
			err := lz.quantize(lz.pk(out, x-v0, y-v0), reduce.Float32, acc, x, y)
			k.lap(&k.codec)
			return err
		})
	})
}

// final is the ring's last hop, at the segment's owner: S = dec(in) + x in
// float32, Finish over n members, quantized once more into out (the bytes
// the all-gather carries), and buf's values [v0, v1) set to their
// decoding, in the dtype.
func (lz *lossy) final(s, w, n int, out, in []byte, v0, v1 int) error {
	return lz.par(s, w, v0, v1, func(k *tally, a, b int) error {
		return blocks(a, b, func(x, y int, acc, wide []byte) error {
			if err := lz.addInput(k, acc, wide, lz.pk(in, x-v0, y-v0), x, y); err != nil {
				return err
			}
			if err := reduce.Finish(lz.op, reduce.Float32, acc, n); err != nil {
				return err
			}
			k.lap(&k.reduce)
			q := lz.pk(out, x-v0, y-v0)
			if err := lz.quantize(q, reduce.Float32, acc, x, y); err != nil {
				return err
			}
			err := codec.DecodeChunk(lz.id, lz.vals(x, y), lz.dt, q)
			k.lap(&k.codec)
			return err
		})
	})
}

// addInput sets acc to dec(q) + x for buf's values [x, y) (x widened to
// float32 in wide when it is narrower).
func (lz *lossy) addInput(k *tally, acc, wide, q []byte, x, y int) error {
	k.start()
	if err := codec.DecodeChunk(lz.id, acc, reduce.Float32, q); err != nil {
		return err
	}
	in := lz.vals(x, y)
	if lz.dt != reduce.Float32 {
		if err := widen(wide, lz.dt, in); err != nil {
			return err
		}
		in = wide
	}
	k.lap(&k.codec)
	err := reduce.Combine(reduce.Sum, reduce.Float32, acc, acc, in)
	k.lap(&k.reduce)
	return err
}

// decode sets buf's values [v0, v1) to the decoding of q, in the dtype.
func (lz *lossy) decode(s, w int, q []byte, v0, v1 int) error {
	return lz.par(s, w, v0, v1, func(k *tally, a, b int) error {
		k.start()
		err := codec.DecodeChunk(lz.id, lz.vals(a, b), lz.dt, lz.pk(q, a-v0, b-v0))
		k.lap(&k.codec)
		return err
	})
}

// widen sets the float32 values dst to the values src of dt, exactly.
func widen(dst []byte, dt reduce.DType, src []byte) error {
	switch dt {
	case reduce.Float32:
		copy(dst, src)
	case reduce.BFloat16:
		return codec.DecodeBF16(dst, reduce.Float32, src)
	default:
		for i := range len(src) / 2 {
			f := reduce.F16ToF32(binary.LittleEndian.Uint16(src[2*i:]))
			binary.LittleEndian.PutUint32(dst[4*i:], math.Float32bits(f))
		}
	}
	return nil
}

// narrow sets the values dst of dt to the float32 values src, rounded to
// nearest even (lib/reduce's F32ToBF16 and F32ToF16; bf16/v1's encoder is
// F32ToBF16).
func narrow(dst []byte, dt reduce.DType, src []byte) error {
	switch dt {
	case reduce.Float32:
		if !sameSlice(dst, src) {
			copy(dst, src)
		}
	case reduce.BFloat16:
		return codec.EncodeBF16(dst, reduce.Float32, src)
	default:
		for i := range len(dst) / 2 {
			f := math.Float32frombits(binary.LittleEndian.Uint32(src[4*i:]))
			binary.LittleEndian.PutUint16(dst[2*i:], reduce.F32ToF16(f))
		}
	}
	return nil
}
