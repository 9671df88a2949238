package collective

import (
	"encoding/binary"
	"fmt"
	"math"
	"slices"

	"github.com/gpubridge/gpubridge/lib/codec"
	"github.com/gpubridge/gpubridge/lib/reduce"
)

// ReferenceAllReduceCodec returns the bytes AllReduceCodec with codec id
// leaves on every member of a bridge of members members whose inputs are
// inputs, and each member's residual after the call (res[m] is a new
// slice, nil where residuals[m] is nil; residuals nil: no member keeps
// one). It works a whole buffer or segment at a time, as
// docs/COMPRESSION.md writes the algorithms, so it does not depend on how
// the collective cuts them into chunks:
//
//   - raw and zstd: ReferenceAllReduce (no residuals);
//   - 1 member: nothing travels, nothing is quantized: Finish;
//   - 2 members: q_m = Q(x_m + r_m) of the whole buffer, then dec(q_0) +
//     dec(q_1) in float32, Finish, the dtype;
//   - 3 or more: segments of ceil(E/members) values rounded up to a
//     multiple of 1024 (the last ones shorter or empty); segment j is
//     packed by member j+1 from its input, then each member j+k (k = 2 ...
//     members-1) packs dec(q) + x in float32, and the owner j packs
//     Finish(dec(q) + x) once more; every member's result is that packing's
//     decoding, in the dtype.
//
// Q(u) with a residual r is the codec's error feedback (u = x + r,
// r' = u - dec(Q(u)), or +0 where either is not finite). It panics on
// arguments AllReduceCodec would refuse (it is meant for tests and
// selftests).
func ReferenceAllReduceCodec(id codec.ID, op reduce.Op, dt reduce.DType, inputs, residuals [][]byte, members int) (out []byte, res [][]byte) {
	checkRef(op, dt, inputs, members)
	if err := codec.Check(id); err != nil {
		panic(err)
	}
	E := len(inputs[0]) / dt.Size()
	res = make([][]byte, members)
	if residuals != nil {
		if len(residuals) != members {
			panic(fmt.Sprintf("collective: reference: %d residuals for %d members", len(residuals), members))
		}
		for m, r := range residuals {
			if r != nil && (!id.Lossy() || len(r) != 4*E) {
				panic(fmt.Sprintf("collective: reference: residual %d of %d bytes for %d values of codec %s", m, len(r), E, id))
			}
			res[m] = slices.Clone(r)
		}
	}
	if !id.Lossy() {
		return ReferenceAllReduce(op, dt, inputs, members), res
	}
	if op != reduce.Sum && op != reduce.Avg {
		panic(fmt.Sprintf("collective: reference: codec %s takes sum and avg, not %s", id, op))
	}
	if err := codec.Supports(id, dt); err != nil {
		panic(err)
	}
	if members == 1 {
		return ReferenceAllReduce(op, dt, inputs, members), res
	}
	rf := refCodec{id: id, dt: dt, res: res}
	out = make([]byte, len(inputs[0]))
	if members == 2 {
		acc := rf.dec(rf.q(0, dt, inputs[0], 0, E), E)
		mustCombine(acc, rf.dec(rf.q(1, dt, inputs[1], 0, E), E))
		mustFinish(op, acc, 2)
		refNarrow(out, dt, acc)
		return out, res
	}
	es := dt.Size()
	segOff, segLen := ringSegmentsAligned(len(out), es, members, codec.GroupElems)
	for j := range members {
		lo, hi := segOff(j)/es, (segOff(j)+segLen(j))/es
		if lo == hi {
			continue
		}
		m := mod(j+1, members)
		q := rf.q(m, dt, inputs[m][lo*es:hi*es], lo, hi)
		for k := 2; k <= members; k++ {
			m = mod(j+k, members)
			acc := rf.dec(q, hi-lo)
			mustCombine(acc, refWiden(dt, inputs[m][lo*es:hi*es]))
			if k == members {
				mustFinish(op, acc, members)
			}
			q = rf.q(m, reduce.Float32, acc, lo, hi)
		}
		refNarrow(out[lo*es:hi*es], dt, rf.dec(q, hi-lo))
	}
	return out, res
}

// refCodec is the reference's quantizer: codec id, the members' residuals.
type refCodec struct {
	id  codec.ID
	dt  reduce.DType
	res [][]byte
}

// q returns member m's packing of src (values [lo, hi) of the buffer, as
// dt), with its residual's error feedback when it keeps one.
func (rf refCodec) q(m int, dt reduce.DType, src []byte, lo, hi int) []byte {
	n, err := codec.MaxPackedLen(rf.id, dt, hi-lo)
	if err != nil {
		panic(err)
	}
	dst := make([]byte, n)
	switch r := rf.res[m]; {
	case r == nil:
		_, err = codec.EncodeChunk(rf.id, dst, dt, src, codec.LosslessOptions{})
	case rf.id == codec.MXFP8:
		err = codec.EncodeFeedbackMXFP8(dst, dt, src, r[4*lo:4*hi])
	default:
		err = codec.EncodeFeedbackBF16(dst, dt, src, r[4*lo:4*hi])
	}
	if err != nil {
		panic(err)
	}
	return dst
}

// dec returns the float32 decoding of q, n values.
func (rf refCodec) dec(q []byte, n int) []byte {
	out := make([]byte, 4*n)
	if err := codec.DecodeChunk(rf.id, out, reduce.Float32, q); err != nil {
		panic(err)
	}
	return out
}

// refWiden returns the values src of dt as float32, one value at a time.
func refWiden(dt reduce.DType, src []byte) []byte {
	if dt == reduce.Float32 {
		return src
	}
	out := make([]byte, 2*len(src))
	for i := range len(src) / 2 {
		h := binary.LittleEndian.Uint16(src[2*i:])
		f := reduce.BF16ToF32(h)
		if dt == reduce.Float16 {
			f = reduce.F16ToF32(h)
		}
		binary.LittleEndian.PutUint32(out[4*i:], math.Float32bits(f))
	}
	return out
}

// refNarrow sets dst, values of dt, to the float32 values src, one value
// at a time (round to nearest even).
func refNarrow(dst []byte, dt reduce.DType, src []byte) {
	if dt == reduce.Float32 {
		copy(dst, src)
		return
	}
	for i := range len(dst) / 2 {
		f := math.Float32frombits(binary.LittleEndian.Uint32(src[4*i:]))
		h := reduce.F32ToBF16(f)
		if dt == reduce.Float16 {
			h = reduce.F32ToF16(f)
		}
		binary.LittleEndian.PutUint16(dst[2*i:], h)
	}
}

func mustCombine(acc, b []byte) {
	if err := reduce.Combine(reduce.Sum, reduce.Float32, acc, acc, b); err != nil {
		panic(err)
	}
}

func mustFinish(op reduce.Op, acc []byte, n int) {
	if err := reduce.Finish(op, reduce.Float32, acc, n); err != nil {
		panic(err)
	}
}
