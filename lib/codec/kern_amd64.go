//go:build amd64 && !purego

package codec

import (
	"unsafe"

	"golang.org/x/sys/cpu"
)

//go:generate go run asmgen.go

// useAsm selects the AVX2 kernels; the tests turn it off to check the Go
// kernels against them.
var useAsm = cpu.X86.HasAVX2

// encBlocks encodes nb whole blocks of float32 src.
func encBlocks(scales, codes, src []byte, nb int) {
	if !useAsm || nb == 0 {
		encBlocksGo(scales, codes, src, nb)
		return
	}
	_ = scales[nb-1]
	_ = codes[nb*BlockElems-1]
	_ = src[4*nb*BlockElems-1]
	asmEncF32(unsafe.Pointer(&scales[0]), unsafe.Pointer(&codes[0]), unsafe.Pointer(&src[0]), nb)
}

// decBlocks decodes nb whole blocks into float32 dst.
func decBlocks(dst, scales, codes []byte, nb int) {
	if !useAsm || nb == 0 {
		decGo(dst, scales, codes, 0, nb*BlockElems)
		return
	}
	_ = scales[nb-1]
	_ = codes[nb*BlockElems-1]
	_ = dst[4*nb*BlockElems-1]
	asmDecF32(unsafe.Pointer(&dst[0]), unsafe.Pointer(&scales[0]), unsafe.Pointer(&codes[0]), nb)
}

// decAdd adds a group's decoded codes to its float32 acc: 8 values at a
// time in assembly, and in Go the 8 whose sums hold a NaN and the tail.
func decAdd(acc, scales, codes []byte) {
	m := len(codes)
	k := 0
	if useAsm && m >= 8 {
		_ = acc[4*m-1]
		for k < m&^7 {
			k = asmDecAddF32(unsafe.Pointer(&acc[0]), unsafe.Pointer(&scales[0]), unsafe.Pointer(&codes[0]), k, m)
			if k < m&^7 {
				decAddGo(acc, scales, codes, k, 8)
				k += 8
			}
		}
	}
	if k < m {
		decAddGo(acc, scales, codes, k, m-k)
	}
}

// fbMX runs fp8 error feedback over a group's float32 values x with
// residual r: whole blocks in assembly up to one whose u = x + r is not
// all finite or reaches past 1.75 * 2^127, that block in Go (the Go kernel
// owns the NaN and +0 rules), and so on; a short last block in Go.
func fbMX(scales, codes, x, r []byte) {
	if !useAsm {
		fbMXGo(scales, codes, x, r)
		return
	}
	m := len(x) / 4
	nb := (m + BlockElems - 1) / BlockElems
	for b := 0; b < nb; b++ {
		lo := b * BlockElems
		if whole := m/BlockElems - b; whole > 0 {
			_ = scales[b+whole-1]
			_ = codes[lo+whole*BlockElems-1]
			_ = x[4*(lo+whole*BlockElems)-1]
			_ = r[4*(lo+whole*BlockElems)-1]
			b += asmFbMXF32(unsafe.Pointer(&scales[b]), unsafe.Pointer(&codes[lo]), unsafe.Pointer(&x[4*lo]), unsafe.Pointer(&r[4*lo]), whole)
			lo = b * BlockElems
		}
		if b < nb {
			hi := min(m, lo+BlockElems)
			fbMXGo(scales[b:b+1], codes[lo:hi], x[4*lo:4*hi], r[4*lo:4*hi])
		}
	}
}

// fbBF16 runs bf16 error feedback over float32 values x with residual r
// into dst: runs of 16 values in assembly up to one whose u = x + r holds
// a NaN, that run in Go, and so on; the last values, fewer than 16, in Go.
func fbBF16(dst, x, r []byte) {
	if !useAsm {
		fbBF16Go(dst, x, r)
		return
	}
	n := len(x) / 4
	for k := 0; k < n; {
		if n-k >= 16 {
			_ = dst[2*n-1]
			_ = r[4*n-1]
			k += asmFbBF16(unsafe.Pointer(&dst[2*k]), unsafe.Pointer(&x[4*k]), unsafe.Pointer(&r[4*k]), n-k)
		}
		if k < n {
			hi := min(n, k+16)
			fbBF16Go(dst[2*k:2*hi], x[4*k:4*hi], r[4*k:4*hi])
			k = hi
		}
	}
}

// bfEncodeAsm rounds a prefix of float32 src to bfloat16 dst and returns
// the number of values done (0 without AVX2).
func bfEncodeAsm(dst, src []byte) int {
	n := len(dst) / 2
	if !useAsm || n < 16 {
		return 0
	}
	_ = src[4*n-1]
	return asmBF16Enc(unsafe.Pointer(&dst[0]), unsafe.Pointer(&src[0]), n)
}

// bfDecodeAsm widens a prefix of bfloat16 src to float32 dst and returns
// the number of values done (0 without AVX2).
func bfDecodeAsm(dst, src []byte) int {
	n := len(src) / 2
	if !useAsm || n < 16 {
		return 0
	}
	_ = dst[4*n-1]
	return asmBF16Dec(unsafe.Pointer(&dst[0]), unsafe.Pointer(&src[0]), n)
}
