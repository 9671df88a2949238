package reduce

// Straightforward, independent references for the tests: exact arithmetic
// (math/big, or float64 where that is provably exact or correctly rounded)
// and rounding by search in a table of every representable value.

import (
	"math"
	"math/big"
	"sort"
)

// halfFmt describes a 16-bit float format for the references.
type halfFmt struct {
	expBits, mantBits int
	inf, qbit, qnan   uint16
	pos               []float64 // value of every finite non-negative pattern, ascending (index = bits)
	infValue          float64   // the value one ulp past the largest finite: what "rounds to Inf" means
}

func newHalfFmt(expBits, mantBits int) *halfFmt {
	f := &halfFmt{expBits: expBits, mantBits: mantBits}
	f.inf = uint16((1<<expBits - 1) << mantBits)
	f.qbit = 1 << (mantBits - 1)
	f.qnan = f.inf | f.qbit
	for h := uint16(0); h < f.inf; h++ {
		f.pos = append(f.pos, f.decode(h))
	}
	bias := 1<<(expBits-1) - 1
	f.infValue = math.Ldexp(1, bias+1)
	return f
}

var (
	refF16  = newHalfFmt(5, 10)
	refBF16 = newHalfFmt(8, 7)
)

// decode returns the value of bits h as a float64 by the textbook formula.
func (f *halfFmt) decode(h uint16) float64 {
	sign := 1.0
	if h&0x8000 != 0 {
		sign = -1
	}
	bias := 1<<(f.expBits-1) - 1
	e := int(h>>f.mantBits) & (1<<f.expBits - 1)
	m := float64(h & (1<<f.mantBits - 1))
	switch e {
	case 1<<f.expBits - 1:
		if m == 0 {
			return math.Inf(int(sign))
		}
		return math.NaN()
	case 0:
		return sign * math.Ldexp(m, 1-bias-f.mantBits)
	}
	return sign * math.Ldexp(m+float64(uint64(1)<<f.mantBits), e-bias-f.mantBits)
}

func (f *halfFmt) isNaN(h uint16) bool { return h&0x7fff > f.inf }

// round rounds the non-NaN v to the nearest pattern, ties to the even one;
// halfway between the largest finite value and infValue rounds to even
// too, which is Inf.
func (f *halfFmt) round(v float64) uint16 {
	var sign uint16
	if math.Signbit(v) {
		sign = 0x8000
		v = -v
	}
	if v >= f.infValue {
		return sign | f.inf
	}
	i := sort.SearchFloat64s(f.pos, v) // first >= v
	if i < len(f.pos) && f.pos[i] == v {
		return sign | uint16(i)
	}
	lo := i - 1
	hiV := f.infValue
	if i < len(f.pos) {
		hiV = f.pos[i]
	}
	mid := (f.pos[lo] + hiV) / 2
	switch {
	case v < mid:
		return sign | uint16(lo)
	case v > mid:
		return sign | uint16(i)
	case lo%2 == 0:
		return sign | uint16(lo)
	}
	return sign | uint16(i)
}

// refNaN is the NaN rule on raw bits: a quieted if a NaN, else b quieted if
// a NaN, else the default NaN.
func refNaN(aNaN, bNaN bool, a, b, qbit, def uint64) uint64 {
	switch {
	case aNaN:
		return a | qbit
	case bNaN:
		return b | qbit
	}
	return def
}

// refMaxMin is max or min of non-NaN float64 values, +0 above -0.
func refMaxMin(op Op, x, y float64) float64 {
	if x == y && x == 0 {
		neg := math.Signbit(x) && math.Signbit(y) // max: -0 only if both are
		if op == Min {
			neg = math.Signbit(x) || math.Signbit(y)
		}
		if neg {
			return math.Copysign(0, -1)
		}
		return 0
	}
	if (op == Max) == (x > y) {
		return x
	}
	return y
}

// refF32 is one float32 operation: float64 computes the sum or product of
// two float32 exactly or with so many more bits that rounding the result to
// float32 is correct (double rounding is innocuous when 53 >= 2·24+2).
func refF32(op Op, x, y float32) uint32 {
	xb, yb := math.Float32bits(x), math.Float32bits(y)
	xn, yn := x != x, y != y
	if xn || yn {
		return uint32(refNaN(xn, yn, uint64(xb), uint64(yb), 1<<22, 0x7fc00000))
	}
	var r float64
	switch op {
	case Sum, Avg:
		r = float64(x) + float64(y)
	case Prod:
		r = float64(x) * float64(y)
	default:
		return math.Float32bits(float32(refMaxMin(op, float64(x), float64(y))))
	}
	if r != r { // Inf-Inf, 0·Inf
		return 0x7fc00000
	}
	return math.Float32bits(float32(r))
}

// refF64 is one float64 operation, computed exactly with math/big and then
// rounded to float64 (nearest even, denormals included) by big.Float.
func refF64(op Op, x, y float64) uint64 {
	xb, yb := math.Float64bits(x), math.Float64bits(y)
	xn, yn := x != x, y != y
	if xn || yn {
		return refNaN(xn, yn, xb, yb, 1<<51, 0x7ff8000000000000)
	}
	if op == Max || op == Min {
		return math.Float64bits(refMaxMin(op, x, y))
	}
	if math.IsInf(x, 0) || math.IsInf(y, 0) {
		// IEEE on infinities is a table; float64 arithmetic is that table.
		var r float64
		if op == Prod {
			r = x * y
		} else {
			r = x + y
		}
		if r != r {
			return 0x7ff8000000000000
		}
		return math.Float64bits(r)
	}
	bx, by := new(big.Float).SetFloat64(x), new(big.Float).SetFloat64(y)
	z := new(big.Float).SetPrec(4096)
	if op == Prod {
		z.Mul(bx, by)
	} else {
		z.Add(bx, by)
	}
	r, _ := z.Float64()
	if r == 0 { // IEEE signs of zeros: a product's is the XOR of the signs;
		// an exact zero sum is +0 unless both operands are -0
		neg := math.Signbit(x) != math.Signbit(y)
		if op != Prod {
			if z.Sign() != 0 {
				panic("a sum of two float64 cannot underflow")
			}
			neg = math.Signbit(x) && math.Signbit(y)
		} else if z.Sign() != 0 {
			neg = z.Sign() < 0
		}
		if neg {
			return math.Float64bits(math.Copysign(0, -1))
		}
		return 0
	}
	return math.Float64bits(r)
}

// refHalf is one 16-bit float operation: widen, one float32 operation, round.
func refHalf(f *halfFmt, op Op, x, y uint16) uint16 {
	xn, yn := f.isNaN(x), f.isNaN(y)
	if xn || yn {
		return uint16(refNaN(xn, yn, uint64(x), uint64(y), uint64(f.qbit), uint64(f.qnan)))
	}
	fx, fy := float32(f.decode(x)), float32(f.decode(y))
	r := math.Float32frombits(refF32(op, fx, fy))
	if r != r {
		return f.qnan
	}
	return f.round(float64(r))
}

// refInt is one integer operation on sign-extended values of the given bit
// width, wrapped to that width with math/big.
func refInt(op Op, bits uint, x, y int64) int64 {
	switch op {
	case Max:
		return max(x, y)
	case Min:
		return min(x, y)
	}
	bx, by := big.NewInt(x), big.NewInt(y)
	z := new(big.Int)
	if op == Prod {
		z.Mul(bx, by)
	} else {
		z.Add(bx, by)
	}
	mod := new(big.Int).Lsh(big.NewInt(1), bits)
	z.Mod(z, mod) // 0 <= z < 2^bits
	if z.Cmp(new(big.Int).Rsh(mod, 1)) >= 0 {
		z.Sub(z, mod)
	}
	return z.Int64()
}

// refElem is the reference result bits of x op y for raw element bits.
func refElem(op Op, dt DType, x, y uint64) uint64 {
	switch dt {
	case Float16:
		return uint64(refHalf(refF16, op, uint16(x), uint16(y)))
	case BFloat16:
		return uint64(refHalf(refBF16, op, uint16(x), uint16(y)))
	case Float32:
		return uint64(refF32(op, math.Float32frombits(uint32(x)), math.Float32frombits(uint32(y))))
	case Float64:
		return refF64(op, math.Float64frombits(x), math.Float64frombits(y))
	}
	bits := uint(dt.Size() * 8)
	sx := int64(x<<(64-bits)) >> (64 - bits)
	sy := int64(y<<(64-bits)) >> (64 - bits)
	if dt == Uint8 && (op == Max || op == Min) { // unsigned order
		sx, sy = int64(x&0xff), int64(y&0xff)
	}
	return uint64(refInt(op, bits, sx, sy)) & (1<<bits - 1)
}

// refDiv is the reference of Finish(Avg) on one element: the quotient in
// the dtype's precision (float32 for the 16-bit types, then rounded).
func refDiv(dt DType, x uint64, n int) uint64 {
	switch dt {
	case Float16, BFloat16:
		f := refF16
		if dt == BFloat16 {
			f = refBF16
		}
		h := uint16(x)
		if f.isNaN(h) {
			return uint64(h | f.qbit)
		}
		q := float32(float64(float32(f.decode(h))) / float64(float32(n)))
		return uint64(f.round(float64(q)))
	case Float32:
		v := math.Float32frombits(uint32(x))
		if v != v {
			return x | 1<<22
		}
		return uint64(math.Float32bits(float32(float64(v) / float64(float32(n)))))
	case Float64:
		v := math.Float64frombits(x)
		if v != v {
			return x | 1<<51
		}
		if math.IsInf(v, 0) || v == 0 {
			return math.Float64bits(v / float64(n))
		}
		z := new(big.Float).SetPrec(300).Quo(new(big.Float).SetFloat64(v), new(big.Float).SetFloat64(float64(n)))
		r, _ := z.Float64()
		return math.Float64bits(r)
	}
	panic("refDiv: integer dtype")
}
