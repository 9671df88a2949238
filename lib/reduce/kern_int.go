package reduce

import "encoding/binary"

type wideInt interface{ ~int32 | ~int64 }

// intKernel combines int32 or int64 elements: Sum and Prod wrap around
// (Go's integer arithmetic is two's complement), Max and Min are exact. The
// loops go four elements at a time.
func intKernel[T wideInt](op Op, d, a, b []T) {
	a, b = a[:len(d)], b[:len(d)]
	n := len(d) &^ 3
	switch op {
	case Sum:
		for i := 0; i < n; i += 4 {
			dd, aa, bb := (*[4]T)(d[i:i+4]), (*[4]T)(a[i:i+4]), (*[4]T)(b[i:i+4])
			dd[0], dd[1], dd[2], dd[3] = aa[0]+bb[0], aa[1]+bb[1], aa[2]+bb[2], aa[3]+bb[3]
		}
		for i := n; i < len(d); i++ {
			d[i] = a[i] + b[i]
		}
	case Prod:
		for i := 0; i < n; i += 4 {
			dd, aa, bb := (*[4]T)(d[i:i+4]), (*[4]T)(a[i:i+4]), (*[4]T)(b[i:i+4])
			dd[0], dd[1], dd[2], dd[3] = aa[0]*bb[0], aa[1]*bb[1], aa[2]*bb[2], aa[3]*bb[3]
		}
		for i := n; i < len(d); i++ {
			d[i] = a[i] * b[i]
		}
	case Max:
		for i := 0; i < n; i += 4 {
			dd, aa, bb := (*[4]T)(d[i:i+4]), (*[4]T)(a[i:i+4]), (*[4]T)(b[i:i+4])
			dd[0], dd[1], dd[2], dd[3] = max(aa[0], bb[0]), max(aa[1], bb[1]), max(aa[2], bb[2]), max(aa[3], bb[3])
		}
		for i := n; i < len(d); i++ {
			d[i] = max(a[i], b[i])
		}
	case Min:
		for i := 0; i < n; i += 4 {
			dd, aa, bb := (*[4]T)(d[i:i+4]), (*[4]T)(a[i:i+4]), (*[4]T)(b[i:i+4])
			dd[0], dd[1], dd[2], dd[3] = min(aa[0], bb[0]), min(aa[1], bb[1]), min(aa[2], bb[2]), min(aa[3], bb[3])
		}
		for i := n; i < len(d); i++ {
			d[i] = min(a[i], b[i])
		}
	}
}

// SWAR constants: the low 7 bits and the top bit of every byte of a uint64.
const (
	lanesLo = 0x7f7f7f7f7f7f7f7f
	lanesHi = 0x8080808080808080
)

// byteKernel combines int8 (signed) or uint8 elements in uint64 lanes
// ("SIMD within a register"), 32 bytes per step; byte lanes never interact.
func byteKernel(op Op, signed bool, d, a, b []byte) {
	a, b = a[:len(d)], b[:len(d)]
	n := len(d) &^ 31
	le := binary.LittleEndian
	switch op {
	case Sum:
		for i := 0; i < n; i += 32 {
			dd, aa, bb := (*[32]byte)(d[i:i+32]), (*[32]byte)(a[i:i+32]), (*[32]byte)(b[i:i+32])
			x0, x1, x2, x3 := le.Uint64(aa[0:]), le.Uint64(aa[8:]), le.Uint64(aa[16:]), le.Uint64(aa[24:])
			y0, y1, y2, y3 := le.Uint64(bb[0:]), le.Uint64(bb[8:]), le.Uint64(bb[16:]), le.Uint64(bb[24:])
			le.PutUint64(dd[0:], addBytes(x0, y0))
			le.PutUint64(dd[8:], addBytes(x1, y1))
			le.PutUint64(dd[16:], addBytes(x2, y2))
			le.PutUint64(dd[24:], addBytes(x3, y3))
		}
		for i := n; i < len(d); i++ {
			d[i] = a[i] + b[i]
		}
	case Prod: // the low 8 bits of a product do not depend on signedness
		for i := range d {
			d[i] = a[i] * b[i]
		}
	case Max, Min:
		var flip uint64 // flipping the sign bits maps int8 order onto uint8 order
		if signed {
			flip = lanesHi
		}
		isMax := op == Max
		for i := 0; i < n; i += 32 {
			dd, aa, bb := (*[32]byte)(d[i:i+32]), (*[32]byte)(a[i:i+32]), (*[32]byte)(b[i:i+32])
			for j := 0; j < 32; j += 8 {
				x, y := le.Uint64(aa[j:]), le.Uint64(bb[j:])
				m := geMask(x^flip, y^flip)
				if !isMax {
					x, y = y, x
				}
				le.PutUint64(dd[j:], x&m|y&^m)
			}
		}
		for i := n; i < len(d); i++ {
			x, y := a[i], b[i]
			ge := x >= y
			if signed {
				ge = int8(x) >= int8(y)
			}
			if ge == isMax {
				d[i] = x
			} else {
				d[i] = y
			}
		}
	}
}

// addBytes adds the eight byte lanes of x and y, each modulo 256: the low 7
// bits add without carrying out of the lane, the top bits by XOR.
func addBytes(x, y uint64) uint64 {
	return ((x & lanesLo) + (y & lanesLo)) ^ ((x ^ y) & lanesHi)
}

// geMask returns 0xff in every byte lane where x >= y (unsigned) and 0x00
// elsewhere.
func geMask(x, y uint64) uint64 {
	// Bit 7 of each lane of t is set when the lane's low 7 bits of x are
	// >= those of y: setting bit 7 of x and clearing it in y keeps every
	// lane's subtraction from borrowing from its neighbour.
	t := (x | lanesHi) - (y & lanesLo)
	// Where the top bits differ, x >= y iff x's top bit is set; else t says.
	ge := (x&^y | ^(x^y)&t) & lanesHi
	return (ge >> 7) * 0xff
}
