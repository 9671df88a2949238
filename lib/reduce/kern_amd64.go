//go:build amd64 && !purego

package reduce

import "unsafe"

//go:generate go run asmgen.go

func cpuid(leaf, sub uint32) (eax, ebx, ecx, edx uint32)
func xgetbv0() (eax uint32)

// hasAVX2 reports whether the CPU has AVX2 and F16C and the OS saves the
// YMM registers.
func hasAVX2() bool {
	maxLeaf, _, _, _ := cpuid(0, 0)
	if maxLeaf < 7 {
		return false
	}
	_, _, ecx1, _ := cpuid(1, 0)
	const osxsave, avx, f16c = 1 << 27, 1 << 28, 1 << 29
	if ecx1&(osxsave|avx|f16c) != osxsave|avx|f16c {
		return false
	}
	if xgetbv0()&6 != 6 { // XMM and YMM state enabled
		return false
	}
	_, ebx7, _, _ := cpuid(7, 0)
	return ebx7&(1<<5) != 0
}

// useAsm selects the AVX2 kernels; the tests turn it off to check the Go
// kernels against them.
var useAsm = hasAVX2()

// asmBlocks runs the AVX2 kernel for op and dt over the longest prefix of
// whole 64-byte blocks it can do and returns its length in bytes, or -1 if
// there is no such kernel.
func asmBlocks(op Op, dt DType, d, a, b []byte) int {
	if !useAsm || len(d) < 64 {
		return -1
	}
	if dt == Uint8 && (op == Sum || op == Prod) { // the same bits as int8
		dt = Int8
	}
	return asmKernel(op, dt, unsafe.Pointer(unsafe.SliceData(d)), unsafe.Pointer(unsafe.SliceData(a)), unsafe.Pointer(unsafe.SliceData(b)), len(d))
}

// asmDivBlocks divides the longest prefix of whole 64-byte blocks of d it
// can (see asmBlocks) by n with the AVX2 kernel of dt; it returns the bytes
// done, or -1.
func asmDivBlocks(dt DType, d []byte, n int) int {
	if !useAsm || len(d) < 64 {
		return -1
	}
	p := unsafe.Pointer(unsafe.SliceData(d))
	switch dt {
	case Float32:
		return asmF32Div(p, len(d), float32(n))
	case Float64:
		return asmF64Div(p, len(d), float64(n))
	case Float16:
		return asmF16Div(p, len(d), float32(n))
	case BFloat16:
		return asmBF16Div(p, len(d), float32(n))
	}
	return -1
}
