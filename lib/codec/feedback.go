package codec

import (
	"encoding/binary"
	"math"

	"github.com/gpubridge/gpubridge/lib/reduce"
)

// Error feedback (docs/COMPRESSION.md): the lossy codecs' EncodeFeedback
// functions share this loop and its rules.

// withFeedback checks residual (n float32 values) and runs error feedback
// over the n values of src (dt) in groups of GroupElems: u = x + r, then
// code packs u into the group's place in the output and decodes that back
// into d, then r = u - d, or +0 where u or d is not finite.
func withFeedback(id ID, dt reduce.DType, src, dst, residual []byte, n int, code func(first, m int, u, d []byte)) error {
	if len(residual) != 4*n {
		return errorf(id, "encode-feedback", ErrLength, "residual of %d bytes for %d values (want %d)", len(residual), n, 4*n)
	}
	if overlap(residual, src) || overlap(residual, dst) {
		return errorf(id, "encode-feedback", ErrOverlap, "residual overlaps the input or the output")
	}
	var u, d [4 * GroupElems]byte
	for first := 0; first < n; first += GroupElems {
		m := min(GroupElems, n-first)
		r := residual[4*first : 4*(first+m)]
		if dt == reduce.Float32 {
			addF32(u[:4*m], src[4*first:4*(first+m)], r)
		} else {
			widen(u[:4*m], dt, src[2*first:2*(first+m)])
			addF32(u[:4*m], u[:4*m], r)
		}
		code(first, m, u[:4*m], d[:4*m])
		feedback(r, u[:4*m], d[:4*m])
	}
	return nil
}

// addF32 sets dst = a + r elementwise in float32; a NaN keeps its bits
// (quieted), so the quantizer sees the input's NaN.
func addF32(dst, a, r []byte) {
	if err := reduce.Combine(reduce.Sum, reduce.Float32, dst, a, r); err != nil {
		panic(err) // lengths were checked
	}
}

// feedback sets r = u - d where both are finite, +0 elsewhere.
func feedback(r, u, d []byte) {
	for i := range len(r) / 4 {
		uw := binary.LittleEndian.Uint32(u[4*i:])
		dw := binary.LittleEndian.Uint32(d[4*i:])
		var out uint32
		if uw&0x7f800000 != 0x7f800000 && dw&0x7f800000 != 0x7f800000 {
			out = math.Float32bits(math.Float32frombits(uw) - math.Float32frombits(dw))
		}
		binary.LittleEndian.PutUint32(r[4*i:], out)
	}
}
