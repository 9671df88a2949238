package codec

import (
	"encoding/binary"
	"math"
	"math/bits"

	"github.com/gpubridge/gpubridge/lib/reduce"
)

// The Go kernels of MXFP8: the definition the assembly is tested against,
// and the kernels on machines without AVX2. They work on float32 bits in
// integers only, so they say exactly what docs/COMPRESSION.md says.

// mxScale is the E8M0 scale byte of a block whose largest finite magnitude
// has the float32 bits amax: the smallest s >= 0 with amax <= 448 * 2^(s-127).
// 448 = 1.75 * 2^8, so s = E - 8 for a significand up to 1.75 and E - 7 above
// (E: amax's biased exponent).
func mxScale(amax uint32) uint8 {
	s := int(amax>>23) - 8
	if amax&0x7fffff > 0x600000 {
		s++
	}
	return uint8(max(s, 0))
}

// e4m3 is the E4M3 code of the float32 bits w in a block of scale s:
// w / 2^(s-127) rounded to nearest even, the sign kept; NaN and ±Inf become
// S.1111.111. Every finite result is at most 448 (the scale sees to it).
func e4m3(w uint32, s uint8) byte {
	sign := byte(w>>24) & 0x80
	a := w & 0x7fffffff
	if a >= 0x7f800000 {
		return sign | 0x7f
	}
	if a == 0 {
		return sign
	}
	// a = m * 2^(ea-150) with m normalized (bit 23 set; a float32 denormal
	// gets an exponent below 1); the element is m * 2^(ea-150-e), with
	// e = s-127, and its E4M3 biased exponent is t.
	ea, m := int(a>>23), a&0x7fffff
	if ea != 0 {
		m |= 1 << 23
	} else {
		sh := bits.LeadingZeros32(m) - 8
		m <<= sh
		ea = 1 - sh
	}
	t := ea - int(s) + 7
	// Normal (t >= 1): keep 4 significant bits, the exponent counted in
	// base; a carry out of the significand moves into the exponent. E4M3
	// subnormal (t <= 0): the element is a multiple of 2^-9, shift further.
	sh, base := 20, 0
	if t >= 1 {
		base = (t - 1) << 3
	} else {
		sh = min(21-t, 31)
	}
	q := (m + (1<<(sh-1) - 1) + (m>>sh)&1) >> sh
	return sign | byte(base+int(q))
}

// e4m3Bits holds the float32 bits of every E4M3 code at scale 2^0 (NaN codes:
// the quiet NaN 0x7fc00000 with the code's sign).
var e4m3Bits [256]uint32

// mxPow holds 2^(s-127) for every scale byte s < 255 (2^-127 is a float32
// denormal); mxPow[255] is unused (the NaN scale).
var mxPow [256]float32

func init() {
	for c := range 256 {
		sign := uint32(c&0x80) << 24
		e, m := c>>3&0xf, c&7
		switch {
		case c&0x7f == 0x7f:
			e4m3Bits[c] = sign | 0x7fc00000
		case e == 0: // m * 2^-9
			e4m3Bits[c] = sign | math.Float32bits(float32(m)/512)
		default: // (1 + m/8) * 2^(e-7)
			e4m3Bits[c] = sign | uint32(e+120)<<23 | uint32(m)<<20
		}
	}
	for s := range 255 {
		if s >= 1 {
			mxPow[s] = math.Float32frombits(uint32(s) << 23)
		} else {
			mxPow[s] = math.Float32frombits(1 << 22) // 2^-127
		}
	}
}

// mxDecode is the float32 bits of code c in a block of scale s: the exact
// product (±Inf past float32's range); a NaN code, or the NaN scale 255,
// gives the quiet NaN 0x7fc00000 with the code's sign.
func mxDecode(c, s byte) uint32 {
	if s == 0xff || c&0x7f == 0x7f {
		return uint32(c&0x80)<<24 | 0x7fc00000
	}
	// One float32 multiplication by a power of two: exact, or ±Inf.
	return math.Float32bits(math.Float32frombits(e4m3Bits[c]) * mxPow[s])
}

// encBlockGo encodes one block of float32 bits (1 to 32 values).
func encBlockGo(scale *byte, codes []byte, w []uint32) {
	var amax uint32
	for _, x := range w {
		if a := x & 0x7fffffff; a < 0x7f800000 {
			amax = max(amax, a)
		}
	}
	s := mxScale(amax)
	*scale = s
	for i, x := range w {
		codes[i] = e4m3(x, s)
	}
}

// encBlocksGo encodes nb whole blocks of little-endian float32 src.
func encBlocksGo(scales, codes, src []byte, nb int) {
	var w [BlockElems]uint32
	for b := range nb {
		for i := range w {
			w[i] = binary.LittleEndian.Uint32(src[4*(b*BlockElems+i):])
		}
		encBlockGo(&scales[b], codes[b*BlockElems:], w[:])
	}
}

// decGo decodes the n codes from start on of a group (code i has scale
// scales[i/32]) into little-endian float32 dst.
func decGo(dst, scales, codes []byte, start, n int) {
	for i := range n {
		j := start + i
		binary.LittleEndian.PutUint32(dst[4*i:], mxDecode(codes[j], scales[j/BlockElems]))
	}
}

// decAddGo adds the decoded codes start ... start+n-1 of a group (n <=
// GroupElems) to float32 acc (the group's), with lib/reduce's float32 sum.
func decAddGo(acc, scales, codes []byte, start, n int) {
	var w [4 * GroupElems]byte
	decGo(w[:4*n], scales, codes, start, n)
	a := acc[4*start : 4*(start+n)]
	if err := reduce.Combine(reduce.Sum, reduce.Float32, a, a, w[:4*n]); err != nil {
		panic(err) // the lengths are equal
	}
}
