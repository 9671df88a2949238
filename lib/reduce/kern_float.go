package reduce

import (
	"math"
	"unsafe"
)

type float interface{ ~float32 | ~float64 }

// floatKernel combines float32 or float64 elements, each result one IEEE
// operation in the type's precision, NaN results made deterministic by
// fixNaN. It works four elements at a time and tests the four results for
// NaN at once through their sum, which is a NaN if any of them is (or, a
// false alarm, if two are opposite infinities); such a group goes through
// floatEach, before anything is stored, so dst == a and dst == b are safe.
func floatKernel[T float](op Op, d, a, b []T) {
	a, b = a[:len(d)], b[:len(d)]
	n := len(d) &^ 3
	switch op {
	case Sum:
		for i := 0; i < n; i += 4 {
			dd, aa, bb := (*[4]T)(d[i:i+4]), (*[4]T)(a[i:i+4]), (*[4]T)(b[i:i+4])
			r0, r1, r2, r3 := aa[0]+bb[0], aa[1]+bb[1], aa[2]+bb[2], aa[3]+bb[3]
			if s := (r0 + r1) + (r2 + r3); s != s {
				floatEach(op, dd[:], aa[:], bb[:])
				continue
			}
			dd[0], dd[1], dd[2], dd[3] = r0, r1, r2, r3
		}
	case Prod:
		for i := 0; i < n; i += 4 {
			dd, aa, bb := (*[4]T)(d[i:i+4]), (*[4]T)(a[i:i+4]), (*[4]T)(b[i:i+4])
			r0, r1, r2, r3 := aa[0]*bb[0], aa[1]*bb[1], aa[2]*bb[2], aa[3]*bb[3]
			if s := (r0 + r1) + (r2 + r3); s != s {
				floatEach(op, dd[:], aa[:], bb[:])
				continue
			}
			dd[0], dd[1], dd[2], dd[3] = r0, r1, r2, r3
		}
	case Max:
		for i := 0; i < n; i += 4 {
			dd, aa, bb := (*[4]T)(d[i:i+4]), (*[4]T)(a[i:i+4]), (*[4]T)(b[i:i+4])
			r0, r1, r2, r3 := max(aa[0], bb[0]), max(aa[1], bb[1]), max(aa[2], bb[2]), max(aa[3], bb[3])
			if s := (r0 + r1) + (r2 + r3); s != s {
				floatEach(op, dd[:], aa[:], bb[:])
				continue
			}
			dd[0], dd[1], dd[2], dd[3] = r0, r1, r2, r3
		}
	case Min:
		for i := 0; i < n; i += 4 {
			dd, aa, bb := (*[4]T)(d[i:i+4]), (*[4]T)(a[i:i+4]), (*[4]T)(b[i:i+4])
			r0, r1, r2, r3 := min(aa[0], bb[0]), min(aa[1], bb[1]), min(aa[2], bb[2]), min(aa[3], bb[3])
			if s := (r0 + r1) + (r2 + r3); s != s {
				floatEach(op, dd[:], aa[:], bb[:])
				continue
			}
			dd[0], dd[1], dd[2], dd[3] = r0, r1, r2, r3
		}
	}
	floatEach(op, d[n:], a[n:], b[n:])
}

// floatEach is floatKernel one element at a time. Go's + and * are single
// IEEE operations and its max and min propagate NaNs and order -0 below
// +0; only the choice of NaN is left to the hardware, so fixNaN makes it.
func floatEach[T float](op Op, d, a, b []T) {
	a, b = a[:len(d)], b[:len(d)]
	for i := range d {
		x, y := a[i], b[i]
		var r T
		switch op {
		case Sum:
			r = x + y
		case Prod:
			r = x * y
		case Max:
			r = max(x, y)
		case Min:
			r = min(x, y)
		}
		if r != r {
			r = fixNaN(x, y)
		}
		d[i] = r
	}
}

// fixNaN is the NaN result of an operation on x and y: x quieted if x is a
// NaN, else y quieted if y is a NaN, else (an invalid operation such as
// Inf-Inf or 0*Inf) the positive quiet NaN with an empty payload.
//
//go:noinline
func fixNaN[T float](x, y T) T {
	switch {
	case x != x:
		return quiet(x)
	case y != y:
		return quiet(y)
	}
	if unsafe.Sizeof(x) == 4 {
		return T(math.Float32frombits(qNaN32))
	}
	return T(math.Float64frombits(qNaN64))
}

// quiet sets the quiet bit of the NaN x, keeping its sign and payload.
func quiet[T float](x T) T {
	if unsafe.Sizeof(x) == 4 {
		u := *(*uint32)(unsafe.Pointer(&x)) | 1<<22
		return *(*T)(unsafe.Pointer(&u))
	}
	u := *(*uint64)(unsafe.Pointer(&x)) | 1<<51
	return *(*T)(unsafe.Pointer(&u))
}

// The positive quiet NaNs with empty payloads: the results of invalid
// operations on non-NaN operands.
const (
	qNaN16   = 0x7e00
	qNaNBF16 = 0x7fc0
	qNaN32   = 0x7fc00000
	qNaN64   = 0x7ff8000000000000
)
