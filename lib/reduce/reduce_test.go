package reduce

import (
	"fmt"
	"math"
	"math/rand/v2"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

// specials are the interesting raw element values of each dtype.
var specials = map[DType][]uint64{
	Float16: {
		0x0000, 0x8000, 0x0001, 0x8001, 0x03ff, 0x83ff, 0x0400, 0x8400, 0x0200, // zeros, denormals, least normal
		0x3c00, 0xbc00, 0x3c01, 0x3c03, 0x1000, 0x9000, 0x3800, 0x4000, 0xc000, // 1, 1+ulp, 2⁻¹¹ (ties with 1), 0.5, 2
		0x7bff, 0xfbff, 0x4c00, 0x4800, 0x5bff, 0x1400, 0x0c00, // max finite, 16, 8 (overflow ties), small
		0x7c00, 0xfc00, 0x7e00, 0xfe00, 0x7d00, 0x7c01, 0xffff, 0x7e55, // Inf, quiet and signalling NaNs
	},
	BFloat16: {
		0x0000, 0x8000, 0x0001, 0x8001, 0x007f, 0x807f, 0x0080, 0x8080, // zeros, denormals, least normal
		0x3f80, 0xbf80, 0x3f81, 0x3b80, 0xbb80, 0x3f00, 0x4000, 0xc000, 0x3b00, // 1, 1+ulp, 2⁻⁸ (ties with 1)
		0x7f7f, 0xff7f, 0x7f7e, 0x7300, 0x4b00, 0x0100, // max finite, near it, 2²³
		0x7f80, 0xff80, 0x7fc0, 0xffc0, 0x7f81, 0x7fa5, 0xffff, // Inf, NaNs
	},
	Float32: {
		0, 0x80000000, 1, 0x80000001, 0x007fffff, 0x00800000, 0x80800000, 0x00400000,
		0x3f800000, 0xbf800000, 0x3f800001, 0x33800000, 0x33000000, 0x4b800000, 0x40000000, 0x3f000000,
		0x7f7fffff, 0xff7fffff, 0x7f000000, 0x5f800000, 0x1f800000,
		0x7f800000, 0xff800000, 0x7fc00000, 0xffc00000, 0x7f800001, 0x7fa5a5a5, 0xffffffff,
	},
	Float64: {
		0, 1 << 63, 1, 1<<63 | 1, 0x000fffffffffffff, 0x0010000000000000, 0x8010000000000000,
		0x3ff0000000000000, 0xbff0000000000000, 0x3ff0000000000001, 0x3ca0000000000000, 0x3c90000000000000,
		0x4340000000000000, 0x4000000000000000, 0x7fefffffffffffff, 0xffefffffffffffff, 0x7fe0000000000000,
		0x5ff0000000000000, 0x1ff0000000000000,
		0x7ff0000000000000, 0xfff0000000000000, 0x7ff8000000000000, 0xfff8000000000000,
		0x7ff0000000000001, 0x7ff4a5a5a5a5a5a5, 0xffffffffffffffff,
	},
	Int8:  {0, 1, 0xff, 0x7f, 0x80, 0x7e, 0x81, 2, 0xfe, 0x10, 0x0f, 0x55, 0xaa},
	Uint8: {0, 1, 0xff, 0x7f, 0x80, 0x7e, 0x81, 2, 0xfe, 0x10, 0x0f, 0x55, 0xaa},
	Int32: {0, 1, 0xffffffff, 0x7fffffff, 0x80000000, 0x7ffffffe, 0x80000001, 2, 0xfffffffe, 0x10000, 0xffff, 0x55555555},
	Int64: {0, 1, 1<<64 - 1, 1<<63 - 1, 1 << 63, 1<<63 - 2, 1<<63 + 1, 2, 1<<64 - 2, 1 << 32, 1<<32 - 1, 0x5555555555555555},
}

// impls runs f with the Go kernels and, where this machine has them, with
// the assembly kernels.
func impls(t *testing.T, f func(t *testing.T)) {
	t.Helper()
	saved := useAsm
	defer func() { useAsm = saved }()
	useAsm = false
	t.Run("go", f)
	if saved {
		useAsm = true
		t.Run("asm", f)
	}
}

// randElems returns n random raw elements of dt: a mix of specials, random
// bit patterns (every class of value, NaN payloads included) and
// gradient-like values.
func randElems(r *rand.Rand, dt DType, n int) []uint64 {
	out := make([]uint64, n)
	bits := uint(dt.Size() * 8)
	for i := range out {
		switch r.IntN(4) {
		case 0:
			sp := specials[dt]
			out[i] = sp[r.IntN(len(sp))]
		case 1:
			out[i] = r.Uint64() & (1<<bits - 1)
			if bits == 64 {
				out[i] = r.Uint64()
			}
		default:
			out[i] = normalElem(r, dt, 0, 1)
			if bits < 64 {
				out[i] &= 1<<bits - 1
			}
		}
	}
	return out
}

func pack(dt DType, xs []uint64) []byte {
	s := dt.Size()
	b := make([]byte, len(xs)*s)
	for i, x := range xs {
		putElem(b[i*s:], s, x)
	}
	return b
}

func unpack(dt DType, b []byte) []uint64 {
	s := dt.Size()
	out := make([]uint64, len(b)/s)
	for i := range out {
		out[i] = getElem(b[i*s:], s)
	}
	return out
}

// checkCombine compares got (the result of a op b) with the reference,
// element by element.
func checkCombine(t *testing.T, op Op, dt DType, a, b, got []uint64) {
	t.Helper()
	bad := 0
	for i := range got {
		if want := refElem(op, dt, a[i], b[i]); got[i] != want {
			t.Errorf("%s %s [%d]: %#x op %#x = %#x, want %#x", dt, op, i, a[i], b[i], got[i], want)
			if bad++; bad >= 10 {
				t.FailNow()
			}
		}
	}
}

func eachCase(t *testing.T, f func(t *testing.T, op Op, dt DType)) {
	eachCaseOf(t, func(DType) bool { return true }, f)
}

// eachCaseOf is eachCase for the dtypes keep accepts: cases that do not
// apply are not made, rather than made and skipped.
func eachCaseOf(t *testing.T, keep func(DType) bool, f func(t *testing.T, op Op, dt DType)) {
	for _, dt := range AllDTypes() {
		if !keep(dt) {
			continue
		}
		for _, op := range AllOps() {
			if Supported(op, dt) != nil {
				continue
			}
			t.Run(fmt.Sprintf("%s/%s", dt, op), func(t *testing.T) { f(t, op, dt) })
		}
	}
}

// TestCombineSpecials combines every pair of special values.
func TestCombineSpecials(t *testing.T) {
	impls(t, func(t *testing.T) {
		eachCase(t, func(t *testing.T, op Op, dt DType) {
			sp := specials[dt]
			var xa, xb []uint64
			for _, x := range sp {
				for _, y := range sp {
					xa, xb = append(xa, x), append(xb, y)
				}
			}
			dst := make([]byte, len(xa)*dt.Size())
			require.NoError(t, Combine(op, dt, dst, pack(dt, xa), pack(dt, xb)))
			checkCombine(t, op, dt, xa, xb, unpack(dt, dst))
		})
	})
}

// TestCombineRandom combines random data of many lengths, in place and not.
func TestCombineRandom(t *testing.T) {
	impls(t, func(t *testing.T) {
		eachCase(t, func(t *testing.T, op Op, dt DType) {
			r := rand.New(rand.NewPCG(uint64(op), uint64(dt)))
			for _, n := range []int{0, 1, 3, 7, 31, 32, 33, 63, 64, 65, 100, 257, 1000, 4099} {
				xa, xb := randElems(r, dt, n), randElems(r, dt, n)
				a, b := pack(dt, xa), pack(dt, xb)
				dst := make([]byte, len(a))
				require.NoError(t, Combine(op, dt, dst, a, b))
				checkCombine(t, op, dt, xa, xb, unpack(dt, dst))
				// in place: dst == a, then dst == b
				require.NoError(t, Combine(op, dt, a, a, b))
				require.Equal(t, dst, a, "dst == a, n=%d", n)
				a = pack(dt, xa)
				require.NoError(t, Combine(op, dt, b, a, b))
				require.Equal(t, dst, b, "dst == b, n=%d", n)
			}
		})
	})
}

// TestCombineAliasAll combines a buffer with itself into itself.
func TestCombineAliasAll(t *testing.T) {
	impls(t, func(t *testing.T) {
		eachCase(t, func(t *testing.T, op Op, dt DType) {
			r := rand.New(rand.NewPCG(3, uint64(dt)))
			xa := randElems(r, dt, 777)
			a := pack(dt, xa)
			require.NoError(t, Combine(op, dt, a, a, a))
			checkCombine(t, op, dt, xa, xa, unpack(dt, a))
		})
	})
}

// TestCombineUnaligned runs buffers at every misalignment (the bounce path)
// and compares with aligned ones.
func TestCombineUnaligned(t *testing.T) {
	impls(t, func(t *testing.T) {
		eachCase(t, func(t *testing.T, op Op, dt DType) {
			r := rand.New(rand.NewPCG(5, uint64(dt)))
			n := 3000 // more than one bounce chunk for every size
			xa, xb := randElems(r, dt, n), randElems(r, dt, n)
			want := make([]byte, n*dt.Size())
			require.NoError(t, Combine(op, dt, want, pack(dt, xa), pack(dt, xb)))
			for off := 1; off < 8; off++ {
				a := append(make([]byte, off), pack(dt, xa)...)[off:]
				b := append(make([]byte, 8-off), pack(dt, xb)...)[8-off:]
				d := make([]byte, len(want)+3)[3:]
				require.NoError(t, Combine(op, dt, d, a, b))
				require.Equal(t, want, d, "offset %d", off)
				require.NoError(t, Combine(op, dt, a, a, b))
				require.Equal(t, want, a, "in place, offset %d", off)
			}
		})
	})
}

// TestCombineNaNBlocks puts NaNs at every position of a few 64-byte blocks
// so the assembly kernels hand blocks back to Go at every offset.
func TestCombineNaNBlocks(t *testing.T) {
	impls(t, func(t *testing.T) {
		// Integer dtypes have no NaN.
		eachCaseOf(t, DType.IsFloat, func(t *testing.T, op Op, dt DType) {
			nan := specials[dt][len(specials[dt])-1] // a NaN in every list
			r := rand.New(rand.NewPCG(9, uint64(dt)))
			per := 64 / dt.Size()
			for pos := 0; pos < 3*per; pos += 1 + per/5 {
				n := 5*per + 3
				xa, xb := randElems(r, dt, n), randElems(r, dt, n)
				for i := range xa { // no other NaNs
					xa[i], xb[i] = tame(dt, xa[i]), tame(dt, xb[i])
				}
				xb[pos] = nan
				dst := make([]byte, n*dt.Size())
				require.NoError(t, Combine(op, dt, dst, pack(dt, xa), pack(dt, xb)))
				checkCombine(t, op, dt, xa, xb, unpack(dt, dst))
			}
		})
	})
}

// tame replaces a NaN or Inf with 1.
func tame(dt DType, x uint64) uint64 {
	one := map[DType]uint64{Float16: 0x3c00, BFloat16: 0x3f80, Float32: 0x3f800000, Float64: 0x3ff0000000000000}[dt]
	switch dt {
	case Float16:
		if x&0x7c00 == 0x7c00 {
			return one
		}
	case BFloat16:
		if x&0x7f80 == 0x7f80 {
			return one
		}
	case Float32:
		if x&0x7f800000 == 0x7f800000 {
			return one
		}
	case Float64:
		if x&0x7ff0000000000000 == 0x7ff0000000000000 {
			return one
		}
	}
	return x
}

// TestNaNRule spells out the NaN rule on a few cases.
func TestNaNRule(t *testing.T) {
	f32 := func(op Op, x, y uint32) uint32 {
		d := make([]byte, 4*20)
		a, b := pack(Float32, rep(uint64(x), 20)), pack(Float32, rep(uint64(y), 20))
		require.NoError(t, Combine(op, Float32, d, a, b))
		got := unpack(Float32, d)
		for _, g := range got {
			require.Equal(t, got[0], g)
		}
		return uint32(got[0])
	}
	impls(t, func(t *testing.T) {
		const qa, qb, sb = 0xffc00001, 0x7fc00002, 0x7f800003
		for _, op := range []Op{Sum, Prod, Max, Min, Avg} {
			assert.Equal(t, uint32(qa), f32(op, qa, qb), "%s: a's NaN wins", op)
			assert.Equal(t, uint32(qb), f32(op, qb, qa), "%s: a's NaN wins", op)
			assert.Equal(t, uint32(sb|1<<22), f32(op, 0x3f800000, sb), "%s: b's NaN, quieted", op)
			assert.Equal(t, uint32(sb|1<<22), f32(op, sb, 0x3f800000), "%s: a's NaN, quieted", op)
		}
		assert.Equal(t, uint32(0x7fc00000), f32(Sum, 0x7f800000, 0xff800000), "Inf-Inf: default NaN")
		assert.Equal(t, uint32(0x7fc00000), f32(Prod, 0, 0xff800000), "0·Inf: default NaN")
		assert.Equal(t, uint32(0), f32(Max, 0x80000000, 0), "max(-0, +0)")
		assert.Equal(t, uint32(0), f32(Max, 0, 0x80000000), "max(+0, -0)")
		assert.Equal(t, uint32(0x80000000), f32(Min, 0x80000000, 0), "min(-0, +0)")
		assert.Equal(t, uint32(0x80000000), f32(Min, 0, 0x80000000), "min(+0, -0)")
	})
}

func rep(x uint64, n int) []uint64 {
	out := make([]uint64, n)
	for i := range out {
		out[i] = x
	}
	return out
}

// TestHalfRoundingInCombine checks the per-step rounding of the 16-bit types.
func TestHalfRoundingInCombine(t *testing.T) {
	impls(t, func(t *testing.T) {
		for _, tc := range []struct {
			dt      DType
			op      Op
			a, b, r uint64
		}{
			{Float16, Sum, 0x3c00, 0x1000, 0x3c00},  // 1 + 2⁻¹¹: tie, even (1)
			{Float16, Sum, 0x3c01, 0x1000, 0x3c02},  // tie, even (up)
			{Float16, Sum, 0x7bff, 0x4c00, 0x7c00},  // 65504 + 16 = 65520: tie, even (Inf)
			{Float16, Sum, 0x7bff, 0x4800, 0x7bff},  // 65504 + 8 rounds back
			{Float16, Sum, 0x7bff, 0x7bff, 0x7c00},  // overflow
			{Float16, Prod, 0x0400, 0x3800, 0x0200}, // least normal / 2: exact denormal
			{Float16, Prod, 0x0001, 0x3800, 0x0000}, // least denormal / 2: tie, even (0)
			{Float16, Prod, 0x8001, 0x3800, 0x8000}, // -0
			{BFloat16, Sum, 0x3f80, 0x3b80, 0x3f80}, // 1 + 2⁻⁸: tie, even
			{BFloat16, Sum, 0x3f81, 0x3b80, 0x3f82}, // tie, even (up)
			{BFloat16, Sum, 0x7f7f, 0x7f7f, 0x7f80}, // overflow
			{BFloat16, Sum, 0x0001, 0x0001, 0x0002}, // denormals kept
		} {
			d := make([]byte, 2)
			require.NoError(t, Combine(tc.op, tc.dt, d, pack(tc.dt, []uint64{tc.a}), pack(tc.dt, []uint64{tc.b})))
			assert.Equal(t, tc.r, unpack(tc.dt, d)[0], "%s %#x %s %#x", tc.dt, tc.a, tc.op, tc.b)
		}
	})
}

func TestCombineIntegers(t *testing.T) {
	for _, tc := range []struct {
		dt      DType
		op      Op
		a, b, r uint64
	}{
		{Int8, Sum, 0x7f, 1, 0x80}, // wraps
		{Int8, Prod, 0x80, 0xff, 0x80},
		{Int8, Max, 0x80, 0x7f, 0x7f},
		{Uint8, Max, 0x80, 0x7f, 0x80},
		{Int8, Min, 0xff, 1, 0xff},
		{Uint8, Min, 0xff, 1, 1},
		{Uint8, Prod, 16, 16, 0},
		{Int32, Sum, 0x7fffffff, 1, 0x80000000},
		{Int32, Prod, 0x10000, 0x10000, 0},
		{Int64, Sum, 1<<63 - 1, 1, 1 << 63},
		{Int64, Prod, 1 << 32, 1 << 32, 0},
		{Int64, Prod, 1<<64 - 1, 1<<64 - 1, 1},
		{Int64, Min, 1 << 63, 1<<63 - 1, 1 << 63},
	} {
		impls(t, func(t *testing.T) {
			a, b := pack(tc.dt, rep(tc.a, 70)), pack(tc.dt, rep(tc.b, 70))
			require.NoError(t, Combine(tc.op, tc.dt, a, a, b))
			for _, g := range unpack(tc.dt, a) {
				require.Equal(t, tc.r, g, "%s %#x %s %#x", tc.dt, tc.a, tc.op, tc.b)
			}
		})
	}
}

func TestCombineErrors(t *testing.T) {
	buf := make([]byte, 64)
	for _, tc := range []struct {
		name     string
		op       Op
		dt       DType
		d, a, b  []byte
		contains string
	}{
		{"a shorter", Sum, Float32, buf[:8], make([]byte, 4), make([]byte, 8), "lengths differ: dst 8, a 4, b 8 bytes"},
		{"b longer", Sum, Float32, buf[:8], make([]byte, 8), make([]byte, 12), "lengths differ"},
		{"dst shorter", Sum, Int8, buf[:3], make([]byte, 4), make([]byte, 4), "lengths differ"},
		{"odd f32", Sum, Float32, buf[:6], make([]byte, 6), make([]byte, 6), "length 6 is not a multiple of the element size 4"},
		{"odd f16", Max, Float16, buf[:3], make([]byte, 3), make([]byte, 3), "not a multiple of the element size 2"},
		{"odd i64", Sum, Int64, buf[:12], make([]byte, 12), make([]byte, 12), "not a multiple of the element size 8"},
		{"avg int", Avg, Int32, buf[:8], make([]byte, 8), make([]byte, 8), "avg is defined for floating dtypes only; use sum"},
		{"bad op", 0, Float32, buf[:8], make([]byte, 8), make([]byte, 8), "invalid op"},
		{"bad dtype", Sum, 42, buf[:8], make([]byte, 8), make([]byte, 8), "invalid dtype"},
		{"overlap a", Sum, Float32, buf[4:12], buf[0:8], make([]byte, 8), "dst overlaps a"},
		{"overlap b", Sum, Float32, buf[0:8], make([]byte, 8), buf[4:12], "dst overlaps b"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			err := Combine(tc.op, tc.dt, tc.d, tc.a, tc.b)
			require.Error(t, err)
			assert.Contains(t, err.Error(), tc.contains)
			err = CombineParallel(tc.op, tc.dt, tc.d, tc.a, tc.b, 4)
			require.Error(t, err)
			assert.Contains(t, err.Error(), tc.contains)
		})
	}
	// Allowed: exact aliases, a overlapping b, empty buffers.
	require.NoError(t, Combine(Sum, Float32, buf[:8], buf[:8], buf[:8]))
	require.NoError(t, Combine(Sum, Float32, buf[16:24], buf[0:8], buf[4:12]))
	require.NoError(t, Combine(Sum, Float32, buf[40:48], buf[24:32], buf[40:48]))
	require.NoError(t, Combine(Sum, Float32, nil, nil, nil))
	require.NoError(t, CombineParallel(Sum, Float32, nil, nil, nil, 8))
}

// TestCombineParallel checks CombineParallel against Combine bit for bit,
// at the real threshold and with the threshold lowered so small buffers
// split at every 64-byte boundary.
func TestCombineParallel(t *testing.T) {
	impls(t, func(t *testing.T) {
		eachCase(t, func(t *testing.T, op Op, dt DType) {
			r := rand.New(rand.NewPCG(11, uint64(dt)))
			s := dt.Size()
			for _, n := range []int{ParallelThreshold/s - 1, ParallelThreshold/s + 1, 2*ParallelThreshold/s + 13} {
				xa, xb := randElems(r, dt, n), randElems(r, dt, n)
				a, b := pack(dt, xa), pack(dt, xb)
				want := make([]byte, len(a))
				require.NoError(t, Combine(op, dt, want, a, b))
				for _, w := range []int{-1, 0, 1, 2, 3, 7, 1000} {
					got := make([]byte, len(a))
					require.NoError(t, CombineParallel(op, dt, got, a, b, w))
					require.Equal(t, want, got, "n=%d workers=%d", n, w)
				}
				// in place
				require.NoError(t, CombineParallel(op, dt, a, a, b, 3))
				require.Equal(t, want, a, "in place n=%d", n)
			}
		})
	})
	defer func(th, c int) { parallelThreshold, parallelChunkMin = th, c }(parallelThreshold, parallelChunkMin)
	parallelThreshold, parallelChunkMin = 0, 64
	impls(t, func(t *testing.T) {
		eachCase(t, func(t *testing.T, op Op, dt DType) {
			r := rand.New(rand.NewPCG(13, uint64(dt)))
			for _, n := range []int{1, 31, 33, 64, 129, 1001} {
				xa, xb := randElems(r, dt, n), randElems(r, dt, n)
				a, b := pack(dt, xa), pack(dt, xb)
				want := make([]byte, len(a))
				require.NoError(t, Combine(op, dt, want, a, b))
				for w := 1; w <= 9; w++ {
					got := make([]byte, len(a))
					require.NoError(t, CombineParallel(op, dt, got, a, b, w))
					require.Equal(t, want, got, "n=%d workers=%d", n, w)
				}
			}
		})
	})
}

func TestFinish(t *testing.T) {
	impls(t, func(t *testing.T) {
		for _, dt := range []DType{Float16, BFloat16, Float32, Float64} {
			t.Run(dt.String(), func(t *testing.T) {
				r := rand.New(rand.NewPCG(17, uint64(dt)))
				xs := append(randElems(r, dt, 3000), specials[dt]...)
				for _, n := range []int{2, 3, 4, 7, 8, 10, 1000, 1024, 1<<20 + 1} {
					buf := pack(dt, xs)
					require.NoError(t, Finish(Avg, dt, buf, n))
					got := unpack(dt, buf)
					for i, x := range xs {
						require.Equal(t, refDiv(dt, x, n), got[i], "%#x / %d", x, n)
					}
					// unaligned
					ub := append([]byte{0}, pack(dt, xs)...)[1:]
					require.NoError(t, Finish(Avg, dt, ub, n))
					require.Equal(t, buf, ub)
				}
				buf := pack(dt, xs)
				require.NoError(t, Finish(Avg, dt, buf, 1))
				require.Equal(t, pack(dt, xs), buf, "n == 1 leaves the buffer alone")
				for _, op := range []Op{Sum, Prod, Max, Min} {
					require.NoError(t, Finish(op, dt, buf, 5))
					require.Equal(t, pack(dt, xs), buf, "%s: no post-step", op)
				}
			})
		}
	})
	assert.ErrorContains(t, Finish(Avg, Float32, make([]byte, 8), 0), "member count 0")
	assert.ErrorContains(t, Finish(Avg, Float32, make([]byte, 6), 2), "not a multiple of the element size 4")
	assert.ErrorContains(t, Finish(Avg, Int32, make([]byte, 8), 2), "avg is defined for floating dtypes only; use sum")
	assert.NoError(t, Finish(Sum, Int32, make([]byte, 8), 2))
}

func TestReference(t *testing.T) {
	impls(t, func(t *testing.T) {
		eachCase(t, func(t *testing.T, op Op, dt DType) {
			r := rand.New(rand.NewPCG(19, uint64(dt)))
			for _, members := range []int{1, 2, 3, 5} {
				n := 301
				var ins [][]byte
				var xs [][]uint64
				for range members {
					x := randElems(r, dt, n)
					xs, ins = append(xs, x), append(ins, pack(dt, x))
				}
				keep := make([][]byte, len(ins))
				for i := range ins {
					keep[i] = append([]byte(nil), ins[i]...)
				}
				got, err := Reference(op, dt, ins)
				require.NoError(t, err)
				require.Equal(t, keep, ins, "inputs untouched")
				g := unpack(dt, got)
				for i := range n {
					acc := xs[0][i]
					for m := 1; m < members; m++ {
						acc = refElem(op, dt, acc, xs[m][i])
					}
					if op == Avg && members > 1 {
						acc = refDiv(dt, acc, members)
					}
					require.Equal(t, acc, g[i], "element %d of %d members", i, members)
				}
			}
		})
	})
	_, err := Reference(Sum, Float32, nil)
	assert.ErrorContains(t, err, "no inputs")
	_, err = Reference(Sum, Float32, [][]byte{make([]byte, 8), make([]byte, 4)})
	assert.ErrorContains(t, err, "input 1 has length 4, input 0 has 8")
	_, err = Reference(Sum, Float32, [][]byte{make([]byte, 6)})
	assert.ErrorContains(t, err, "not a multiple")
	_, err = Reference(Avg, Int8, [][]byte{make([]byte, 6)})
	assert.ErrorContains(t, err, "use sum")
}

// TestReferenceOrder shows the order matters and is the documented one.
func TestReferenceOrder(t *testing.T) {
	f := func(v float32) []byte { return pack(Float32, []uint64{uint64(math.Float32bits(v))}) }
	// (1e8 + 1) + -1e8 = 0 in float32 (1e8+1 rounds to 1e8); 1e8 + (1 + -1e8) = 8 would be another order.
	got, err := Reference(Sum, Float32, [][]byte{f(1e8), f(1), f(-1e8)})
	require.NoError(t, err)
	assert.Equal(t, f(0), got)
	got, err = Reference(Sum, Float32, [][]byte{f(1), f(-1e8), f(1e8)})
	require.NoError(t, err)
	assert.Equal(t, f(0), got) // (1 - 1e8) = -1e8 (rounded), + 1e8 = 0
	got, err = Reference(Avg, Float32, [][]byte{f(1), f(2), f(4)})
	require.NoError(t, err)
	assert.Equal(t, f(7.0/3), got)
}
