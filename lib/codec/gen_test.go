package codec

import (
	"encoding/binary"
	"math"
	"math/rand/v2"
)

// Test inputs shared by the tests and the vectors for the torch side.

// f32Bytes packs float32 bits little-endian.
func f32Bytes(w []uint32) []byte {
	b := make([]byte, 4*len(w))
	for i, x := range w {
		binary.LittleEndian.PutUint32(b[4*i:], x)
	}
	return b
}

// u32s unpacks little-endian float32 bits.
func u32s(b []byte) []uint32 {
	w := make([]uint32, len(b)/4)
	for i := range w {
		w[i] = binary.LittleEndian.Uint32(b[4*i:])
	}
	return w
}

// e4m3Value is the value of a finite E4M3 code at scale 2^0, in float64.
func e4m3Value(c byte) float64 {
	e, m := int(c>>3&0xf), float64(c&7)
	v := m / 512
	if e > 0 {
		v = (1 + m/8) * math.Ldexp(1, e-7)
	}
	if c&0x80 != 0 {
		v = -v
	}
	return v
}

// special float32 bit patterns every edge-case block draws from.
var special = []uint32{
	0x00000000, 0x80000000, // ±0
	0x00000001, 0x80000001, 0x007fffff, 0x00400000, 0x00000fff, // denormals
	0x00800000, 0x80800000, // least normals
	0x7f7fffff, 0xff7fffff, 0x7f700000, 0x7f780000, 0x7f7c0000, // largest, near the top (rounding up past float32)
	0x7f800000, 0xff800000, // ±Inf
	0x7fc00000, 0xffc00000, 0x7f800001, 0x7fbfffff, 0xffffffff, 0x7fd23456, // NaNs, quiet and signalling, with payloads
	0x3f800000, 0xbf800000, 0x43e00000, 0x43e00001, 0x43dfffff, // 1, 448, around it
	0x3fe00000, 0x3fe00001, 0x3fdfffff, // 1.75 (the scale's threshold) and its neighbours
	0x3c800000, 0x3c7fffff, 0x3b000000, 0x3a800000, 0x3a000000, // 2^-6, 2^-9, 2^-10 (subnormal E4M3 at scale 1)
}

// edgeBlocks returns blocks of 32 float32 values built to hit the rules of
// the format: all-zero and all-NaN blocks, specials mixed with ordinary
// values, amax at the scale thresholds, ties between E4M3 values at many
// scales, the extremes of the scale range, and short blocks (fewer than 32
// values, as at the end of a buffer).
func edgeBlocks(r *rand.Rand) [][]uint32 {
	var out [][]uint32
	block := func(f func(i int) uint32) []uint32 {
		b := make([]uint32, BlockElems)
		for i := range b {
			b[i] = f(i)
		}
		return b
	}
	out = append(out, block(func(int) uint32 { return 0 }), block(func(int) uint32 { return 0x80000000 }))
	out = append(out, block(func(int) uint32 { return 0x7fc00000 }), block(func(i int) uint32 { return 0x7f800000 | uint32(i&1)<<31 }))
	for _, s := range special {
		out = append(out, block(func(int) uint32 { return s }))
		out = append(out, block(func(i int) uint32 {
			if i%5 == 0 {
				return s
			}
			return math.Float32bits(float32(r.NormFloat64()))
		}))
	}
	out = append(out, block(func(i int) uint32 { return special[i%len(special)] }))
	// Ties: halfway between consecutive E4M3 values at scale 2^e, and one
	// float32 step to either side; amax pinned at 448*2^e so that e is
	// the scale.
	for _, e := range []int{-127, -126, -120, -100, -9, -1, 0, 3, 60, 119, 120} {
		out = append(out, block(func(i int) uint32 {
			if i == 0 {
				return math.Float32bits(float32(math.Ldexp(448, e)))
			}
			c := byte(r.IntN(0x7e))
			mid := float32(math.Ldexp((e4m3Value(c)+e4m3Value(c+1))/2, e))
			w := math.Float32bits(mid)
			switch i % 3 {
			case 1:
				w++
			case 2:
				if w&0x7fffffff != 0 {
					w--
				}
			}
			return w | uint32(r.IntN(2))<<31
		}))
	}
	// amax at the thresholds of the scale rule, everywhere in the range.
	for _, ex := range []uint32{0, 1, 2, 7, 8, 9, 10, 100, 127, 200, 246, 247, 253, 254} {
		for _, m := range []uint32{0, 0x5fffff, 0x600000, 0x600001, 0x7fffff} {
			amax := ex<<23 | m
			out = append(out, block(func(i int) uint32 {
				if i == 7 {
					return amax
				}
				return amax>>uint(1+i%24) | uint32(i&1)<<31
			}))
		}
	}
	// Short blocks.
	for _, n := range []int{1, 2, 7, 31} {
		b := make([]uint32, n)
		for i := range b {
			b[i] = randF32(r)
		}
		out = append(out, b)
	}
	return out
}

// randF32 is a random float32 of one of several kinds: uniform bits
// (every exponent, NaNs and Infs), normal values, tiny and huge ones.
func randF32(r *rand.Rand) uint32 {
	switch r.IntN(6) {
	case 0:
		return r.Uint32()
	case 1:
		return special[r.IntN(len(special))]
	case 2:
		return math.Float32bits(float32(math.Ldexp(r.NormFloat64(), -r.IntN(150))))
	case 3:
		return math.Float32bits(float32(math.Ldexp(r.NormFloat64(), r.IntN(128))))
	default:
		return math.Float32bits(float32(r.NormFloat64()))
	}
}

// randBlocks returns n blocks of 32 values: a fifth uniform bits, the rest
// gradient-like (normal values with a block-wide magnitude and a few
// outliers, zeros and specials).
func randBlocks(r *rand.Rand, n int) [][]uint32 {
	out := make([][]uint32, n)
	for b := range out {
		w := make([]uint32, BlockElems)
		kind := r.IntN(5)
		mag := r.IntN(80) - 60
		for i := range w {
			switch {
			case kind == 0:
				w[i] = randF32(r)
			case r.IntN(40) == 0:
				w[i] = special[r.IntN(len(special))]
			case r.IntN(20) == 0:
				w[i] = math.Float32bits(float32(math.Ldexp(r.NormFloat64(), mag+r.IntN(20))))
			default:
				w[i] = math.Float32bits(float32(math.Ldexp(r.NormFloat64(), mag)))
			}
		}
		out[b] = w
	}
	return out
}

// flat concatenates blocks.
func flat(blocks [][]uint32) []uint32 {
	var w []uint32
	for _, b := range blocks {
		w = append(w, b...)
	}
	return w
}

// allBF16 is every bfloat16 bit pattern widened to float32, in order.
func allBF16() []uint32 {
	w := make([]uint32, 1<<16)
	for i := range w {
		w[i] = uint32(i) << 16
	}
	return w
}

// shuffled returns a fixed permutation of w.
func shuffled(w []uint32, seed uint64) []uint32 {
	out := append([]uint32(nil), w...)
	r := rand.New(rand.NewPCG(seed, 7))
	r.Shuffle(len(out), func(i, j int) { out[i], out[j] = out[j], out[i] })
	return out
}
