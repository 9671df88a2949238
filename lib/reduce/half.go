package reduce

import "math"

// f16Bits holds the float32 bits of every float16 bit pattern; the kernels
// index it with the raw uint16, which needs no bounds check.
var f16Bits [1 << 16]uint32

func init() {
	for i := range f16Bits {
		f16Bits[i] = f16ToF32Bits(uint16(i))
	}
}

// f16ToF32Bits widens a float16 bit pattern to float32 bits exactly. NaN
// payloads are kept as they are (shifted into the top of the float32 payload),
// signalling NaNs included: widening loses nothing.
func f16ToF32Bits(h uint16) uint32 {
	sign := uint32(h&0x8000) << 16
	exp := uint32(h>>10) & 0x1f
	mant := uint32(h & 0x3ff)
	switch {
	case exp == 0x1f: // Inf, NaN
		return sign | 0x7f800000 | mant<<13
	case exp != 0: // normal: rebias 15 -> 127
		return sign | (exp+112)<<23 | mant<<13
	case mant == 0: // ±0
		return sign
	default: // denormal mant·2⁻²⁴: normalize
		e := uint32(113) // biased exponent of 2⁻¹⁴
		for mant&0x400 == 0 {
			mant <<= 1
			e--
		}
		return sign | e<<23 | (mant&0x3ff)<<13
	}
}

// F16ToF32 converts IEEE binary16 bits to float32. The conversion is exact
// (every float16 is a float32); NaNs keep sign and payload.
func F16ToF32(h uint16) float32 { return math.Float32frombits(f16Bits[h]) }

// F32ToF16 converts a float32 to IEEE binary16 bits, rounding to nearest,
// ties to even. Values of magnitude 65520 and above (and ±Inf) become ±Inf,
// results below 2⁻¹⁴ in magnitude become denormals or ±0 (with the sign
// kept), and a NaN becomes a quiet NaN with the same sign and the top 10 bits
// of its payload.
func F32ToF16(f float32) uint16 { return f32BitsToF16(math.Float32bits(f)) }

// f32BitsToF16 is F32ToF16 on bits; the common (normal-range) case is a few
// integer instructions and inlines into the kernels.
func f32BitsToF16(w uint32) uint16 {
	a := w & 0x7fffffff
	if a-0x38800000 < 0x477ff000-0x38800000 { // 2⁻¹⁴ <= |f| < 65520: normal result
		return uint16(w>>16)&0x8000 | uint16((a-0x38000000+0xfff+(a>>13)&1)>>13)
	}
	return f32BitsToF16Slow(w)
}

func f32BitsToF16Slow(w uint32) uint16 {
	sign := uint16(w>>16) & 0x8000
	a := w & 0x7fffffff
	switch {
	case a > 0x7f800000: // NaN: quiet, keep the top of the payload
		return sign | 0x7e00 | uint16(a>>13)&0x3ff
	case a >= 0x477ff000: // ±Inf, or rounds to it (65520 is a tie that rounds to even: Inf)
		return sign | 0x7c00
	case a >= 0x38800000: // normal (not reached through f32BitsToF16)
		return sign | uint16((a-0x38000000+0xfff+(a>>13)&1)>>13)
	case a >= 0x33000000: // 2⁻²⁵ <= |f| < 2⁻¹⁴: denormal m·2⁻²⁴ (m may round up to 1024, the least normal)
		s := 126 - a>>23 // 14..24
		m := a&0x7fffff | 0x800000
		q, rem, half := m>>s, m&(1<<s-1), uint32(1)<<(s-1)
		if rem > half || rem == half && q&1 == 1 {
			q++
		}
		return sign | uint16(q)
	default: // below 2⁻²⁵ (or exactly it, a tie to even 0): ±0
		return sign
	}
}

// BF16ToF32 converts bfloat16 bits to float32 exactly (the bits are the top
// half of a float32).
func BF16ToF32(h uint16) float32 { return math.Float32frombits(uint32(h) << 16) }

// F32ToBF16 converts a float32 to bfloat16 bits, rounding to nearest, ties to
// even; finite values that round past the largest bfloat16 become ±Inf,
// denormals stay denormals, and a NaN becomes a quiet NaN with the same sign
// and the top 7 bits of its payload.
func F32ToBF16(f float32) uint16 { return f32BitsToBF16(math.Float32bits(f)) }

func f32BitsToBF16(w uint32) uint16 {
	if w&0x7fffffff > 0x7f800000 {
		return uint16(w>>16) | 0x0040
	}
	return uint16((w + 0x7fff + (w>>16)&1) >> 16)
}
