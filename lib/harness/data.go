package harness

import (
	"encoding/binary"
	"math"

	"github.com/gpubridge/gpubridge/lib/reduce"
)

// rng is splitmix64: fast and deterministic, so every member can generate
// every other member's input and compute the expected result locally.
type rng uint64

func (r *rng) next() uint64 {
	*r += 0x9e3779b97f4a7c15
	z := uint64(*r)
	z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9
	z = (z ^ (z >> 27)) * 0x94d049bb133111eb
	return z ^ (z >> 31)
}

func seedFor(parts ...uint64) rng {
	r := rng(0x6770756272696467) // "gpubridg"
	for _, p := range parts {
		r ^= rng(p)
		r.next()
	}
	return r
}

// fillRandom fills b with dt values: random bits for integers; for floats
// mostly values in [-8, 8) with, one in 64, a special value (NaN with a
// payload, ±Inf, -0, a denormal, the largest finite value), so that
// bit-exactness is checked on them too.
func fillRandom(b []byte, dt reduce.DType, r rng) {
	sz := dt.Size()
	for i := 0; i+sz <= len(b); i += sz {
		x := r.next()
		if !dt.IsFloat() {
			putBits(b[i:], dt, x)
			continue
		}
		var f float64
		switch x % 64 {
		case 0:
			f = math.NaN()
		case 1:
			f = math.Inf(1)
		case 2:
			f = math.Inf(-1)
		case 3:
			f = math.Copysign(0, -1)
		case 4:
			f = math.SmallestNonzeroFloat64 * float64(x>>40) // a denormal of the wider types
		default:
			f = float64(int64(x>>11)-(1<<52)) / (1 << 49)
		}
		putFloat(b[i:], dt, f, x)
	}
}

// fillValues fills b with dt values for a bench: random bits for
// integers; for floats random values in [-8, 8), no special ones (a NaN in
// every other block of a bench's buffers would time the kernels' rare
// paths, which gradients do not take).
func fillValues(b []byte, dt reduce.DType, r rng) {
	sz := dt.Size()
	for i := 0; i+sz <= len(b); i += sz {
		x := r.next()
		if !dt.IsFloat() {
			putBits(b[i:], dt, x)
			continue
		}
		putBits(b[i:], dt, floatBits(dt, float64(int64(x>>11)-(1<<52))/(1<<49)))
	}
}

// putFloat stores f as dt. For a NaN it uses bits of payload, so NaN
// payloads differ between members.
func putFloat(b []byte, dt reduce.DType, f float64, payload uint64) {
	bits := floatBits(dt, f)
	if math.IsNaN(f) {
		bits |= payload & nanPayload[dt]
	}
	putBits(b, dt, bits)
}

// nanPayload are a NaN's mantissa bits below the quiet bit, by dtype.
var nanPayload = map[reduce.DType]uint64{
	reduce.Float64: 0x0007ffffffffffff, reduce.Float32: 0x003fffff, reduce.Float16: 0x01ff, reduce.BFloat16: 0x003f,
}

// floatBits is f rounded to the floating dtype dt, as its bits.
func floatBits(dt reduce.DType, f float64) uint64 {
	switch dt {
	case reduce.Float64:
		return math.Float64bits(f)
	case reduce.Float32:
		return uint64(math.Float32bits(float32(f)))
	case reduce.Float16:
		return uint64(reduce.F32ToF16(float32(f)))
	case reduce.BFloat16:
		return uint64(reduce.F32ToBF16(float32(f)))
	}
	return 0
}

// putBits stores the low dt.Size() bytes of bits, little-endian. (A copy
// of a variable length out of an 8-byte word made filling a bench buffer
// twice as slow.)
func putBits(b []byte, dt reduce.DType, bits uint64) {
	switch dt.Size() {
	case 1:
		b[0] = byte(bits)
	case 2:
		binary.LittleEndian.PutUint16(b, uint16(bits))
	case 4:
		binary.LittleEndian.PutUint32(b, uint32(bits))
	case 8:
		binary.LittleEndian.PutUint64(b, bits)
	}
}

// patternValue is member m's element i in a bench: a small integer, so that
// sums, maxima and products over many members are exact in every dtype and
// the expected result can be computed per element without the inputs.
func patternValue(m, i int, op reduce.Op) int64 {
	if op == reduce.Prod {
		return int64(1 + (i+m)%2) // products of 1s and 2s stay exact
	}
	return int64((i*7 + m*3) % 13)
}

func fillPattern(b []byte, dt reduce.DType, m int, op reduce.Op) {
	sz := dt.Size()
	// patternValue's values are 0..12: encode each once, not per element.
	var enc [13][8]byte
	for v := range enc {
		putInt(enc[v][:], dt, int64(v))
	}
	for i := 0; i*sz+sz <= len(b); i++ {
		copy(b[i*sz:i*sz+sz], enc[patternValue(m, i, op)][:sz])
	}
}

func putInt(b []byte, dt reduce.DType, v int64) {
	if dt.IsFloat() {
		putBits(b, dt, floatBits(dt, float64(v)))
	} else {
		putBits(b, dt, uint64(v))
	}
}

// countPatternWrong counts the elements of an all-reduced pattern buffer
// that differ from the exact result over n members; b's first element is
// element first of the pattern.
func countPatternWrong(b []byte, dt reduce.DType, op reduce.Op, n, first int) (int, error) {
	sz := dt.Size()
	want := make([]byte, sz)
	wrong := 0
	for i := 0; i*sz+sz <= len(b); i++ {
		var v int64
		for m := 0; m < n; m++ {
			x := patternValue(m, first+i, op)
			switch {
			case m == 0:
				v = x
			case op == reduce.Max:
				v = max(v, x)
			case op == reduce.Min:
				v = min(v, x)
			case op == reduce.Prod:
				v *= x
			default:
				v += x
			}
		}
		putInt(want, dt, v)
		if err := reduce.Finish(op, dt, want, n); err != nil {
			return 0, err
		}
		if string(want) != string(b[i*sz:i*sz+sz]) {
			wrong++
		}
	}
	return wrong, nil
}

// countWrong counts the elements where got and want differ bit for bit.
func countWrong(got, want []byte, size int) int {
	wrong := 0
	for i := 0; i+size <= len(got) && i+size <= len(want); i += size {
		if string(got[i:i+size]) != string(want[i:i+size]) {
			wrong++
		}
	}
	if len(got) != len(want) {
		wrong += abs(len(got)-len(want)) / size
	}
	return wrong
}

func abs(x int) int {
	if x < 0 {
		return -x
	}
	return x
}
