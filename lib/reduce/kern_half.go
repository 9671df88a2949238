package reduce

import "math"

// f16Kernel combines float16 elements: widen both operands to float32
// (exactly, through f16Bits), operate once in float32, round to float16.
func f16Kernel(op Op, d, a, b []uint16) {
	a, b = a[:len(d)], b[:len(d)]
	t := &f16Bits
	switch op {
	case Sum:
		for i := range d {
			x, y := a[i], b[i]
			w := math.Float32bits(math.Float32frombits(t[x]) + math.Float32frombits(t[y]))
			if m := w & 0x7fffffff; m-0x38800000 < 0x477ff000-0x38800000 {
				d[i] = uint16(w>>16)&0x8000 | uint16((m-0x38000000+0xfff+(m>>13)&1)>>13)
			} else {
				d[i] = f16Round(w, x, y)
			}
		}
	case Prod:
		for i := range d {
			x, y := a[i], b[i]
			w := math.Float32bits(math.Float32frombits(t[x]) * math.Float32frombits(t[y]))
			if m := w & 0x7fffffff; m-0x38800000 < 0x477ff000-0x38800000 {
				d[i] = uint16(w>>16)&0x8000 | uint16((m-0x38000000+0xfff+(m>>13)&1)>>13)
			} else {
				d[i] = f16Round(w, x, y)
			}
		}
	case Max:
		halfMaxMin(d, a, b, 0x7c00, 0x0200, true)
	case Min:
		halfMaxMin(d, a, b, 0x7c00, 0x0200, false)
	}
}

// f16Round rounds the float32 result bits w of an operation on the float16
// operands x and y, with the NaN rule of fixNaN.
//
//go:noinline
func f16Round(w uint32, x, y uint16) uint16 {
	if w&0x7fffffff > 0x7f800000 {
		return nanPick(x, y, 0x7c00, 0x0200, qNaN16)
	}
	return f32BitsToF16Slow(w)
}

// bf16Kernel combines bfloat16 elements: widen both operands to float32
// (a shift), operate once in float32, round to bfloat16.
func bf16Kernel(op Op, d, a, b []uint16) {
	a, b = a[:len(d)], b[:len(d)]
	switch op {
	case Sum:
		for i := range d {
			x, y := a[i], b[i]
			w := math.Float32bits(math.Float32frombits(uint32(x)<<16) + math.Float32frombits(uint32(y)<<16))
			if w&0x7fffffff > 0x7f800000 {
				d[i] = nanPick(x, y, 0x7f80, 0x0040, qNaNBF16)
				continue
			}
			d[i] = uint16((w + 0x7fff + (w>>16)&1) >> 16)
		}
	case Prod:
		for i := range d {
			x, y := a[i], b[i]
			w := math.Float32bits(math.Float32frombits(uint32(x)<<16) * math.Float32frombits(uint32(y)<<16))
			if w&0x7fffffff > 0x7f800000 {
				d[i] = nanPick(x, y, 0x7f80, 0x0040, qNaNBF16)
				continue
			}
			d[i] = uint16((w + 0x7fff + (w>>16)&1) >> 16)
		}
	case Max:
		halfMaxMin(d, a, b, 0x7f80, 0x0040, true)
	case Min:
		halfMaxMin(d, a, b, 0x7f80, 0x0040, false)
	}
}

// halfMaxMin is Max or Min of 16-bit floats whose infinity has magnitude
// bits inf and whose quiet bit is qbit. The result is always one of the
// operands (max and min are exact), so it is computed on the bits, in the
// order halfKey gives them.
func halfMaxMin(d, a, b []uint16, inf, qbit uint16, isMax bool) {
	a, b = a[:len(d)], b[:len(d)]
	if isMax {
		for i := range d {
			x, y := a[i], b[i]
			if x&0x7fff > inf || y&0x7fff > inf {
				d[i] = nanPick(x, y, inf, qbit, 0)
				continue
			}
			r := y
			if halfKey(x) > halfKey(y) {
				r = x
			}
			d[i] = r
		}
		return
	}
	for i := range d {
		x, y := a[i], b[i]
		if x&0x7fff > inf || y&0x7fff > inf {
			d[i] = nanPick(x, y, inf, qbit, 0)
			continue
		}
		r := y
		if halfKey(x) < halfKey(y) {
			r = x
		}
		d[i] = r
	}
}

// halfKey maps the bits of a non-NaN 16-bit float to an int16 in the
// float's order: flipping the magnitude bits of negative values turns
// sign-magnitude into two's complement, -0 (-1) just below +0 (0). The map
// is one to one, so equal keys are equal bits.
func halfKey(h uint16) int16 {
	k := int16(h)
	return k ^ k>>15&0x7fff
}

// nanPick is fixNaN for 16-bit floats: x quieted if it is a NaN, else y
// quieted if it is, else def.
func nanPick(x, y, inf, qbit, def uint16) uint16 {
	switch {
	case x&0x7fff > inf:
		return x | qbit
	case y&0x7fff > inf:
		return y | qbit
	}
	return def
}
