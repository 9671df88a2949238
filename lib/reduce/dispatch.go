package reduce

import "unsafe"

// hostLittle reports whether the host stores integers little-endian, like
// the wire format: only then may the kernels view the bytes in place.
var hostLittle = func() bool {
	x := uint16(1)
	return *(*byte)(unsafe.Pointer(&x)) == 1
}()

// view reinterprets b as a slice of T; the caller has checked alignment and
// that len(b) is a multiple of T's size.
func view[T any](b []byte) []T {
	if len(b) == 0 {
		return nil
	}
	var z T
	return unsafe.Slice((*T)(unsafe.Pointer(unsafe.SliceData(b))), len(b)/int(unsafe.Sizeof(z)))
}

// aligned reports whether b's data is aligned to size bytes.
func aligned(b []byte, size int) bool {
	return uintptr(unsafe.Pointer(unsafe.SliceData(b)))&uintptr(size-1) == 0
}

// combine is Combine after validation: the in-place kernels when the three
// buffers are aligned for dt on a little-endian host, otherwise the kernels
// on aligned native copies.
func combine(op Op, dt DType, dst, a, b []byte) {
	if len(dst) == 0 {
		return
	}
	if op == Avg {
		op = Sum
	}
	s := dt.Size()
	if hostLittle && aligned(dst, s) && aligned(a, s) && aligned(b, s) {
		kernel(op, dt, dst, a, b)
		return
	}
	bounce(op, dt, dst, a, b)
}

// bounceBytes is the size of the scratch buffers of bounce.
const bounceBytes = 4096

// bounce runs the kernel over aligned scratch copies of a and b, chunk by
// chunk, swapping bytes on a big-endian host. Writing each chunk of dst only
// after reading the same chunk of a and b keeps dst == a and dst == b right.
func bounce(op Op, dt DType, dst, a, b []byte) {
	var sa, sb [bounceBytes / 8]uint64
	xa := unsafe.Slice((*byte)(unsafe.Pointer(&sa)), bounceBytes)
	xb := unsafe.Slice((*byte)(unsafe.Pointer(&sb)), bounceBytes)
	s := dt.Size()
	for len(dst) > 0 {
		m := min(len(dst), bounceBytes)
		ca, cb := xa[:m], xb[:m]
		copy(ca, a[:m])
		copy(cb, b[:m])
		if !hostLittle {
			swapBytes(ca, s)
			swapBytes(cb, s)
		}
		kernel(op, dt, ca, ca, cb)
		if !hostLittle {
			swapBytes(ca, s)
		}
		copy(dst[:m], ca)
		dst, a, b = dst[m:], a[m:], b[m:]
	}
}

// swapBytes reverses the bytes of every size-byte element of b.
func swapBytes(b []byte, size int) {
	for i := 0; i+size <= len(b); i += size {
		e := b[i : i+size]
		for j, k := 0, size-1; j < k; j, k = j+1, k-1 {
			e[j], e[k] = e[k], e[j]
		}
	}
}

// kernel combines aligned native elements of equal length; op is not Avg.
// The assembly kernels, where there are some, do whole 64-byte blocks and
// stop before a block with a NaN result; the Go kernels do that block (they
// own the NaN rules), the tail, and everything on other machines.
func kernel(op Op, dt DType, d, a, b []byte) {
	for {
		k := asmBlocks(op, dt, d, a, b)
		if k < 0 {
			goKernel(op, dt, d, a, b)
			return
		}
		d, a, b = d[k:], a[k:], b[k:]
		m := min(len(d), 64)
		goKernel(op, dt, d[:m], a[:m], b[:m])
		d, a, b = d[m:], a[m:], b[m:]
		if len(d) == 0 {
			return
		}
	}
}

// goKernel is kernel in Go.
func goKernel(op Op, dt DType, d, a, b []byte) {
	switch dt {
	case Float16:
		f16Kernel(op, view[uint16](d), view[uint16](a), view[uint16](b))
	case BFloat16:
		bf16Kernel(op, view[uint16](d), view[uint16](a), view[uint16](b))
	case Float32:
		floatKernel(op, view[float32](d), view[float32](a), view[float32](b))
	case Float64:
		floatKernel(op, view[float64](d), view[float64](a), view[float64](b))
	case Int8:
		byteKernel(op, true, d, a, b)
	case Uint8:
		byteKernel(op, false, d, a, b)
	case Int32:
		intKernel(op, view[int32](d), view[int32](a), view[int32](b))
	case Int64:
		intKernel(op, view[int64](d), view[int64](a), view[int64](b))
	}
}
