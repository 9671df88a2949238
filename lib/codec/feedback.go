package codec

import (
	"encoding/binary"
	"math"

	"github.com/gpubridge/gpubridge/lib/reduce"
)

// Error feedback (docs/COMPRESSION.md): the lossy codecs' EncodeFeedback
// functions share this loop and its rules.

// withFeedback checks residual (n float32 values) and runs id's error
// feedback over the n values of src (dt) in groups of GroupElems: a
// group's float32 values x (16-bit ones widened exactly) and its residual
// r go to the kernel, which sets u = x + r, packs u into the group's place
// in dst, and sets r = u - decoded u, or +0 where either is not finite.
func withFeedback(id ID, dt reduce.DType, src, dst, residual []byte, n int) error {
	if len(residual) != 4*n {
		return errorf(id, "encode-feedback", ErrLength, "residual of %d bytes for %d values (want %d)", len(residual), n, 4*n)
	}
	if overlap(residual, src) || overlap(residual, dst) {
		return errorf(id, "encode-feedback", ErrOverlap, "residual overlaps the input or the output")
	}
	var w [4 * GroupElems]byte
	for first := 0; first < n; first += GroupElems {
		m := min(GroupElems, n-first)
		r := residual[4*first : 4*(first+m)]
		var x []byte
		if dt == reduce.Float32 {
			x = src[4*first : 4*(first+m)]
		} else {
			x = w[:4*m]
			widen(x, dt, src[2*first:2*(first+m)])
		}
		if id == MXFP8 {
			scales, codes := mxGroup(dst, n, first)
			fbMX(scales, codes, x, r)
		} else {
			fbBF16(dst[2*first:2*(first+m)], x, r)
		}
	}
	return nil
}

// The Go kernels of error feedback: the definition the assembly is tested
// against, and the kernels on machines without AVX2. Each works in place:
// r holds u until its value's residual replaces it.

// fbMXGo is fp8 error feedback over float32 values x of a group from a
// block's start on (at most a group), with the group's scales and codes
// from that block on.
func fbMXGo(scales, codes, x, r []byte) {
	m := len(x) / 4
	addF32(r, x, r)
	var w [BlockElems]uint32
	for b := 0; b*BlockElems < m; b++ {
		lo, hi := b*BlockElems, min(m, (b+1)*BlockElems)
		for i := lo; i < hi; i++ {
			w[i-lo] = binary.LittleEndian.Uint32(r[4*i:])
		}
		encBlockGo(&scales[b], codes[lo:hi], w[:hi-lo])
		for i := lo; i < hi; i++ {
			binary.LittleEndian.PutUint32(r[4*i:], residual(w[i-lo], mxDecode(codes[i], scales[b])))
		}
	}
}

// fbBF16Go is bf16 error feedback over float32 values x into dst.
func fbBF16Go(dst, x, r []byte) {
	addF32(r, x, r)
	for i := range len(dst) / 2 {
		u := binary.LittleEndian.Uint32(r[4*i:])
		h := reduce.F32ToBF16(math.Float32frombits(u))
		binary.LittleEndian.PutUint16(dst[2*i:], h)
		binary.LittleEndian.PutUint32(r[4*i:], residual(u, uint32(h)<<16))
	}
}

// addF32 sets dst = a + r elementwise in float32; a NaN keeps its bits
// (quieted), so the quantizer sees the input's NaN.
func addF32(dst, a, r []byte) {
	if err := reduce.Combine(reduce.Sum, reduce.Float32, dst, a, r); err != nil {
		panic(err) // lengths were checked
	}
}

// residual is the float32 bits of u - d where both are finite, +0
// elsewhere.
func residual(u, d uint32) uint32 {
	if u&0x7f800000 == 0x7f800000 || d&0x7f800000 == 0x7f800000 {
		return 0
	}
	return math.Float32bits(math.Float32frombits(u) - math.Float32frombits(d))
}
