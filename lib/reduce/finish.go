package reduce

import (
	"math"
	"math/bits"
	"unsafe"
)

// finishAvg divides every element of buf (of a floating dtype) by n >= 2.
func finishAvg(dt DType, buf []byte, n int) {
	s := dt.Size()
	if hostLittle && aligned(buf, s) {
		divKernel(dt, buf, n)
		return
	}
	var sc [bounceBytes / 8]uint64
	x := unsafe.Slice((*byte)(unsafe.Pointer(&sc)), bounceBytes)
	for len(buf) > 0 {
		m := min(len(buf), bounceBytes)
		c := x[:m]
		copy(c, buf[:m])
		if !hostLittle {
			swapBytes(c, s)
		}
		divKernel(dt, c, n)
		if !hostLittle {
			swapBytes(c, s)
		}
		copy(buf[:m], c)
		buf = buf[m:]
	}
}

// divKernel divides aligned native elements by n: the assembly kernels do
// whole 64-byte blocks up to one with a NaN, Go that block, the tail and
// everything on other machines.
func divKernel(dt DType, buf []byte, n int) {
	for {
		k := asmDivBlocks(dt, buf, n)
		if k < 0 {
			goDiv(dt, buf, n)
			return
		}
		buf = buf[k:]
		m := min(len(buf), 64)
		goDiv(dt, buf[:m], n)
		buf = buf[m:]
		if len(buf) == 0 {
			return
		}
	}
}

// goDiv is divKernel in Go. Where n is a power of two it multiplies by 1/n
// instead, which is exact and gives the same bits: both round the same
// exact quotient once.
func goDiv(dt DType, buf []byte, n int) {
	pow2 := bits.OnesCount(uint(n)) == 1
	switch dt {
	case Float32:
		divFloat(view[float32](buf), float32(n), pow2)
	case Float64:
		divFloat(view[float64](buf), float64(n), pow2)
	case Float16:
		d, t := view[uint16](buf), float32(n)
		for i, h := range d {
			w := math.Float32bits(math.Float32frombits(f16Bits[h]) / t)
			if m := w & 0x7fffffff; m-0x38800000 < 0x477ff000-0x38800000 {
				d[i] = uint16(w>>16)&0x8000 | uint16((m-0x38000000+0xfff+(m>>13)&1)>>13)
			} else {
				d[i] = f16Round(w, h, h)
			}
		}
	case BFloat16:
		d, t := view[uint16](buf), float32(n)
		for i, h := range d {
			if h&0x7fff > 0x7f80 {
				d[i] = h | 0x0040
				continue
			}
			w := math.Float32bits(math.Float32frombits(uint32(h)<<16) / t)
			d[i] = uint16((w + 0x7fff + (w>>16)&1) >> 16)
		}
	}
}

func divFloat[T float](d []T, t T, pow2 bool) {
	if pow2 {
		inv := 1 / t
		for i, x := range d {
			r := x * inv
			if r != r {
				r = quiet(x)
			}
			d[i] = r
		}
		return
	}
	for i, x := range d {
		r := x / t
		if r != r {
			r = quiet(x)
		}
		d[i] = r
	}
}
