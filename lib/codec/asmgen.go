//go:build ignore

// asmgen writes kern_amd64.s and kern_amd64_decl.go, the AVX2 kernels of
// the codecs:
//
//	go run asmgen.go
//
// Each kernel does the same as a Go kernel of mxfp8_ref.go, bf16.go or
// feedback.go, bit for bit (the tests check it exhaustively and on random
// blocks), only faster: MXFP8 computes the element codes with float
// arithmetic where the Go kernels use integers, which gives the same bits
// (COMPRESSION.md says why). The error-feedback kernels leave the values
// whose sum u = x + r is a NaN (and, for fp8, whole blocks that are not all
// finite or whose decoding could overflow) to the Go kernels.
package main

import (
	"bytes"
	"fmt"
	"go/format"
	"math"
	"os"
	"strings"
)

// consts are the 32-byte constants (8 equal dwords) the kernels read.
var consts = []struct {
	name string
	v    uint32
}{
	{"cAbs", 0x7fffffff},
	{"cMaxFin", 0x7f7fffff},
	{"cInf", 0x7f800000},
	{"cRnd20", (0x0007ffff - 960<<20) & 0xffffffff}, // the normal path's rounding bias, less E4M3's exponent rebias (mod 2^32)
	{"cRnd16", 0x00007fff},
	{"cOne", 1},
	{"c7", 7},
	{"c8", 8},
	{"c7f", 0x7f},
	{"c80", 0x80},
	{"c254", 254},
	{"c512", math.Float32bits(512)},
	{"cTiny", math.Float32bits(1.0 / 64)}, // 2^-6, the least normal E4M3
	{"cNaN", 0x7fc00000},
	{"cQuiet16", 0x40},
	{"cExp20", 20 << 23},    // 2^20 as a factor of a float's exponent bits
	{"c1128", 141 << 3},     // the exponent bits >> 20 of 2^14 = 2^-6 * 2^20
	{"cTopFin", 0x7f600000}, // the largest amax whose block decodes finite (1.75 * 2^127)
	{"cSign", 0x80000000},
	{"cHi16", 0xffff0000},
}

// pow136 is 2^(s-136) for every scale byte s (denormal below s = 10), and
// the quiet NaN for s = 255: the decoder multiplies an element's integer
// significand, a multiple of 2^-9 at scale 2^0, by it.
func pow136(s int) uint32 {
	switch {
	case s == 255:
		return 0x7fc00000
	case s >= 10:
		return uint32(s-9) << 23
	default:
		return 1 << (s + 13)
	}
}

// encElem turns the float32 magnitudes in Y(4+i), times 2^-e in Y10, into
// E4M3 codes with the signs of Y(i), left in Y(i). Normal results round the
// float32 bits of y = |x|*2^-e to 3 fraction bits (y is exact: a product by
// a power of two that stays normal) and rebias the exponent; E4M3
// subnormals are y*2^9 rounded to an integer by VCVTPS2DQ (to nearest even:
// Go leaves MXCSR's default). A y too small for a float32 normal rounds to
// code 0 either way. With nonFinite, NaN and ±Inf lanes become 0x7f.
// Constants: Y8 the rounding bias, Y9 512.0, Y14 ones.
func encElem(i int, nonFinite bool) string {
	s := fmt.Sprintf(`
	VMULPS Y10, Y%[2]d, Y11
	VPSRLD $20, Y11, Y12
	VPAND Y14, Y12, Y12
	VPADDD Y8, Y12, Y12
	VPADDD Y11, Y12, Y12
	VPSRLD $20, Y12, Y12
	VMULPS Y9, Y11, Y13
	VCVTPS2DQ Y13, Y13
	VCMPPS $1, cTiny<>(SB), Y11, Y11
	VPBLENDVB Y11, Y13, Y12, Y12`, i, 4+i)
	if nonFinite {
		s += fmt.Sprintf(`
	VPCMPGTD cMaxFin<>(SB), Y%d, Y13
	VPBLENDVB Y13, c7f<>(SB), Y12, Y12`, 4+i)
	}
	return s + fmt.Sprintf(`
	VPSRLD $24, Y%[1]d, Y13
	VPAND c80<>(SB), Y13, Y13
	VPOR Y13, Y12, Y%[1]d`, i)
}

// fbElem is encElem for error feedback, in its own way: y = |u| * 2^-e
// (Y10) is rounded to its E4M3 value ry by adding and taking away C, a
// power of two 2^20 times y's binade (at least 2^-6's, the E4M3 subnormal
// step's), whose ulp is the step of E4M3 values there; the sum rounds to
// nearest even, as the codes do. The code is the steps in the sum past C,
// plus 8 per binade past 2^-6; d = ry * 2^e (Y14: the product mxDecode
// takes, finite as the block's amax is at most cTopFin) with u's sign (u in
// Y(i)); r = u - d is stored at 32i(BX) and the code left in Y(4+i).
// Constants: Y8 cInf, Y9 cTiny (2^-6), Y15 cExp20.
func fbElem(i int) string {
	return fmt.Sprintf(`
	VMULPS Y10, Y%[2]d, Y11
	VPAND Y8, Y11, Y12
	VPMAXSD Y9, Y12, Y12
	VPADDD Y15, Y12, Y12
	VADDPS Y12, Y11, Y13
	VSUBPS Y12, Y13, Y11
	VMULPS Y14, Y11, Y11
	VPSUBD Y12, Y13, Y13
	VPSRLD $20, Y12, Y12
	VPADDD Y12, Y13, Y13
	VPSUBD c1128<>(SB), Y13, Y13
	VPAND cSign<>(SB), Y%[1]d, Y12
	VPOR Y12, Y11, Y11
	VSUBPS Y11, Y%[1]d, Y11
	VMOVDQU Y11, %[3]d(BX)
	VPSRLD $24, Y12, Y12
	VPOR Y12, Y13, Y%[2]d`, i, 4+i, 32*i)
}

// amaxAll leaves the largest magnitude of Y4..Y7 in R8, NaN and Inf
// included (then it is over 0x7f7fffff and the block takes the slow path).
const amaxAll = `
	VPMAXSD Y5, Y4, Y11
	VPMAXSD Y7, Y6, Y12
	VPMAXSD Y12, Y11, Y11` + hmax

// amaxFinite leaves the largest finite magnitude of Y4..Y7 in R8.
const amaxFinite = `
	VPCMPGTD cMaxFin<>(SB), Y4, Y11
	VPANDN Y4, Y11, Y11
	VPCMPGTD cMaxFin<>(SB), Y5, Y12
	VPANDN Y5, Y12, Y12
	VPMAXSD Y12, Y11, Y11
	VPCMPGTD cMaxFin<>(SB), Y6, Y12
	VPANDN Y6, Y12, Y12
	VPMAXSD Y12, Y11, Y11
	VPCMPGTD cMaxFin<>(SB), Y7, Y12
	VPANDN Y7, Y12, Y12
	VPMAXSD Y12, Y11, Y11` + hmax

// hmax reduces the dwords of Y11 to their maximum, into R8.
const hmax = `
	VEXTRACTI128 $1, Y11, X12
	VPMAXSD X12, X11, X11
	VPSHUFD $0x4e, X11, X12
	VPMAXSD X12, X11, X11
	VPSHUFD $0xb1, X11, X12
	VPMAXSD X12, X11, X11
	VMOVD X11, R8`

// scale computes s (mxScale) of the amax in R8 with integer instructions,
// stores its byte at (DI), and leaves 2^-e = 2^(127-s) in every lane of
// Y10.
const scale = `
	MOVL R8, R10
	SHRL $23, R10
	ANDL $0x7fffff, R8
	XORL R11, R11
	CMPL R8, $0x600000
	SETHI R11
	LEAL -8(R10)(R11*1), R10
	XORL R11, R11
	TESTL R10, R10
	CMOVLLT R11, R10
	MOVB R10, (DI)
	MOVL $254, R11
	SUBL R10, R11
	SHLL $23, R11
	VMOVD R11, X10
	VPBROADCASTD X10, Y10`

// scaleUp leaves 2^e = 2^(s-127) of the scale s in R10 in every lane of
// Y14 (2^-127, s = 0, is a float32 denormal): mxPow[s].
const scaleUp = `
	MOVL R10, R12
	SHLL $23, R12
	MOVL $0x400000, R13
	TESTL R10, R10
	CMOVLEQ R13, R12
	VMOVD R12, X14
	VPBROADCASTD X14, Y14`

// decode8 decodes the 8 codes at (DX)(AX*1) with the scale factor in Y14
// into Y3: the significand q (m, or (8+m) << (e-1)) as a float, times
// 2^(s-136) (exact, or ±Inf); NaN codes the quiet NaN; then the sign.
// Constants: Y8 0x7f, Y9 7, Y10 8, Y11 ones, Y12 the quiet NaN, Y13 0x80,
// Y15 zero.
const decode8 = `
	VPMOVZXBD (DX)(AX*1), Y0
	VPAND Y8, Y0, Y1
	VPSRLD $3, Y1, Y2
	VPAND Y9, Y1, Y3
	VPCMPEQD Y15, Y2, Y4
	VPANDN Y10, Y4, Y5
	VPOR Y5, Y3, Y3
	VPSUBD Y11, Y2, Y2
	VPMAXSD Y15, Y2, Y2
	VPSLLVD Y2, Y3, Y3
	VCVTDQ2PS Y3, Y3
	VMULPS Y14, Y3, Y3
	VPCMPEQD Y8, Y1, Y4
	VPBLENDVB Y4, Y12, Y3, Y3
	VPAND Y13, Y0, Y5
	VPSLLD $24, Y5, Y5
	VPOR Y5, Y3, Y3`

// decSetup loads decode8's constants and the scale table's address (R9).
const decSetup = `
	VMOVDQU c7f<>(SB), Y8
	VMOVDQU c7<>(SB), Y9
	VMOVDQU c8<>(SB), Y10
	VMOVDQU cOne<>(SB), Y11
	VMOVDQU cNaN<>(SB), Y12
	VMOVDQU c80<>(SB), Y13
	VPXOR Y15, Y15, Y15
	LEAQ pow136<>(SB), R9`

// decScale loads the factor of the block of value AX (scale byte at
// (SI)(AX>>5)) into Y14.
const decScale = `
	MOVQ AX, R10
	SHRQ $5, R10
	MOVBLZX (SI)(R10*1), R8
	VBROADCASTSS (R9)(R8*4), Y14`

// bfRound rounds the float32 bits in Y(i) to bfloat16 in the low half of
// each dword of Y(i): (w + 0x7fff + (w>>16 & 1)) >> 16, a NaN (w>>16) | 0x40
// (lib/reduce's F32ToBF16).
func bfRound(i int) string {
	return fmt.Sprintf(`
	VPAND cAbs<>(SB), Y%[1]d, Y2
	VPCMPGTD cInf<>(SB), Y2, Y2
	VPSRLD $16, Y%[1]d, Y3
	VPOR cQuiet16<>(SB), Y3, Y4
	VPAND cOne<>(SB), Y3, Y3
	VPADDD cRnd16<>(SB), Y3, Y3
	VPADDD Y%[1]d, Y3, Y3
	VPSRLD $16, Y3, Y3
	VPBLENDVB Y2, Y4, Y3, Y%[1]d`, i)
}

// bfFeedback rounds u, finite or ±Inf, in Y(i) to bfloat16 in the low half
// of each dword of Y(i) (bfRound without the NaN case), and stores r = u -
// d at 32i(BX), d the bfloat16 widened back, or +0 where d is ±Inf.
// Constants: Y8 0x7fff, Y9 ones, Y10 0xffff0000, Y11 cAbs, Y12 cMaxFin.
func bfFeedback(i int) string {
	return fmt.Sprintf(`
	VPSRLD $16, Y%[1]d, Y2
	VPAND Y9, Y2, Y2
	VPADDD Y8, Y2, Y2
	VPADDD Y%[1]d, Y2, Y2
	VPAND Y10, Y2, Y3
	VSUBPS Y3, Y%[1]d, Y4
	VPAND Y11, Y3, Y3
	VPCMPGTD Y12, Y3, Y3
	VPANDN Y4, Y3, Y4
	VMOVDQU Y4, %[2]d(BX)
	VPSRLD $16, Y2, Y%[1]d`, i, 32*i)
}

// runs16 is a kernel func(dst, src unsafe.Pointer, n int) int that runs
// body, which advances SI and DI, once per 16 values while 16 remain, and
// returns the values done.
func runs16(name, label, body string) string {
	return fmt.Sprintf(`
// func %[1]s(dst, src unsafe.Pointer, n int) int
TEXT ·%[1]s(SB), NOSPLIT, $0-32
	MOVQ dst+0(FP), DI
	MOVQ src+8(FP), SI
	MOVQ n+16(FP), CX
	SHRQ $4, CX
	MOVQ CX, AX
	SHLQ $4, AX
	MOVQ AX, ret+24(FP)
	TESTQ CX, CX
	JEQ %[2]sdone

%[2]sloop:%[3]s
	DECQ CX
	JNZ %[2]sloop

%[2]sdone:
	VZEROUPPER
	RET
`, name, label, body)
}

const header = "// Code generated by asmgen.go; DO NOT EDIT.\n\n"

func main() {
	var s bytes.Buffer
	s.WriteString(header)
	s.WriteString("//go:build amd64 && !purego\n\n#include \"textflag.h\"\n")
	for _, c := range consts {
		s.WriteString("\n")
		for k := 0; k < 8; k++ {
			fmt.Fprintf(&s, "DATA %s<>+%d(SB)/4, $%#08x\n", c.name, 4*k, c.v)
		}
		fmt.Fprintf(&s, "GLOBL %s<>(SB), RODATA|NOPTR, $32\n", c.name)
	}
	s.WriteString("\n")
	for k := 0; k < 256; k++ {
		fmt.Fprintf(&s, "DATA pow136<>+%d(SB)/4, $%#08x\n", 4*k, pow136(k))
	}
	s.WriteString("GLOBL pow136<>(SB), RODATA|NOPTR, $1024\n")
	// VPACKUSDW and VPACKUSWB pack within 128-bit lanes; this puts the
	// dwords of the packed bytes back in order.
	for k, v := range []uint32{0, 4, 1, 5, 2, 6, 3, 7} {
		fmt.Fprintf(&s, "\nDATA permBytes<>+%d(SB)/4, $%d", 4*k, v)
	}
	s.WriteString("\nGLOBL permBytes<>(SB), RODATA|NOPTR, $32\n")

	var fast, slow, fbElems strings.Builder
	for i := 0; i < 4; i++ {
		fast.WriteString(encElem(i, false))
		slow.WriteString(encElem(i, true))
		fbElems.WriteString(fbElem(i))
	}
	fmt.Fprintf(&s, `
// func asmEncF32(scales, codes, src unsafe.Pointer, nb int)
TEXT ·asmEncF32(SB), NOSPLIT, $0-32
	MOVQ scales+0(FP), DI
	MOVQ codes+8(FP), DX
	MOVQ src+16(FP), SI
	MOVQ nb+24(FP), CX
	TESTQ CX, CX
	JEQ encdone
	VMOVDQU cRnd20<>(SB), Y8
	VMOVDQU c512<>(SB), Y9
	VMOVDQU cOne<>(SB), Y14
	VMOVDQU cAbs<>(SB), Y15

encloop:
	VMOVDQU 0(SI), Y0
	VMOVDQU 32(SI), Y1
	VMOVDQU 64(SI), Y2
	VMOVDQU 96(SI), Y3
	VPAND Y15, Y0, Y4
	VPAND Y15, Y1, Y5
	VPAND Y15, Y2, Y6
	VPAND Y15, Y3, Y7%[1]s
	CMPL R8, $0x7f7fffff
	JHI encslow%[2]s%[3]s

encstore:
	VPACKUSDW Y1, Y0, Y0
	VPACKUSDW Y3, Y2, Y2
	VPACKUSWB Y2, Y0, Y0
	VMOVDQU permBytes<>(SB), Y11
	VPERMD Y0, Y11, Y0
	VMOVDQU Y0, (DX)
	ADDQ $128, SI
	ADDQ $32, DX
	INCQ DI
	DECQ CX
	JNZ encloop

encdone:
	VZEROUPPER
	RET

encslow:%[4]s%[2]s%[5]s
	JMP encstore

// func asmDecF32(dst, scales, codes unsafe.Pointer, nb int)
TEXT ·asmDecF32(SB), NOSPLIT, $0-32
	MOVQ dst+0(FP), DI
	MOVQ scales+8(FP), SI
	MOVQ codes+16(FP), DX
	MOVQ nb+24(FP), CX
	SHLQ $5, CX
	XORQ AX, AX
	TESTQ CX, CX
	JEQ decdone%[6]s

decloop:%[7]s%[8]s
	VMOVDQU Y3, (DI)(AX*4)
	ADDQ $8, AX
	CMPQ AX, CX
	JLT decloop

decdone:
	VZEROUPPER
	RET

// func asmDecAddF32(acc, scales, codes unsafe.Pointer, start, n int) int
TEXT ·asmDecAddF32(SB), NOSPLIT, $0-48
	MOVQ acc+0(FP), DI
	MOVQ scales+8(FP), SI
	MOVQ codes+16(FP), DX
	MOVQ start+24(FP), AX
	MOVQ n+32(FP), CX%[6]s

addloop:
	LEAQ 8(AX), BX
	CMPQ BX, CX
	JGT adddone%[7]s%[8]s
	VADDPS (DI)(AX*4), Y3, Y3
	VCMPPS $3, Y3, Y3, Y7
	VPTEST Y7, Y7
	JNZ adddone
	VMOVDQU Y3, (DI)(AX*4)
	MOVQ BX, AX
	JMP addloop

adddone:
	MOVQ AX, ret+40(FP)
	VZEROUPPER
	RET

// func asmFbMXF32(scales, codes, x, r unsafe.Pointer, nb int) int
TEXT ·asmFbMXF32(SB), NOSPLIT, $0-48
	MOVQ scales+0(FP), DI
	MOVQ codes+8(FP), DX
	MOVQ x+16(FP), SI
	MOVQ r+24(FP), BX
	MOVQ nb+32(FP), CX
	XORQ AX, AX
	VMOVDQU cInf<>(SB), Y8
	VMOVDQU cTiny<>(SB), Y9
	VMOVDQU cExp20<>(SB), Y15

fbmxloop:
	CMPQ AX, CX
	JGE fbmxdone
	VMOVDQU 0(SI), Y0
	VMOVDQU 32(SI), Y1
	VMOVDQU 64(SI), Y2
	VMOVDQU 96(SI), Y3
	VADDPS 0(BX), Y0, Y0
	VADDPS 32(BX), Y1, Y1
	VADDPS 64(BX), Y2, Y2
	VADDPS 96(BX), Y3, Y3
	VPAND cAbs<>(SB), Y0, Y4
	VPAND cAbs<>(SB), Y1, Y5
	VPAND cAbs<>(SB), Y2, Y6
	VPAND cAbs<>(SB), Y3, Y7%[1]s
	CMPL R8, $0x7f600000
	JHI fbmxdone%[2]s%[9]s%[10]s
	VPACKUSDW Y5, Y4, Y4
	VPACKUSDW Y7, Y6, Y6
	VPACKUSWB Y6, Y4, Y4
	VMOVDQU permBytes<>(SB), Y11
	VPERMD Y4, Y11, Y4
	VMOVDQU Y4, (DX)
	ADDQ $128, SI
	ADDQ $128, BX
	ADDQ $32, DX
	INCQ DI
	INCQ AX
	JMP fbmxloop

fbmxdone:
	MOVQ AX, ret+40(FP)
	VZEROUPPER
	RET

// func asmFbBF16(dst, x, r unsafe.Pointer, n int) int
TEXT ·asmFbBF16(SB), NOSPLIT, $0-40
	MOVQ dst+0(FP), DI
	MOVQ x+8(FP), SI
	MOVQ r+16(FP), BX
	MOVQ n+24(FP), CX
	SHRQ $4, CX
	XORQ AX, AX
	VMOVDQU cRnd16<>(SB), Y8
	VMOVDQU cOne<>(SB), Y9
	VMOVDQU cHi16<>(SB), Y10
	VMOVDQU cAbs<>(SB), Y11
	VMOVDQU cMaxFin<>(SB), Y12

fbbfloop:
	CMPQ AX, CX
	JGE fbbfdone
	VMOVDQU 0(SI), Y0
	VMOVDQU 32(SI), Y1
	VADDPS 0(BX), Y0, Y0
	VADDPS 32(BX), Y1, Y1
	VCMPPS $3, Y0, Y0, Y2
	VCMPPS $3, Y1, Y1, Y3
	VPOR Y3, Y2, Y2
	VPTEST Y2, Y2
	JNZ fbbfdone%[11]s
	VPACKUSDW Y1, Y0, Y0
	VPERMQ $0xd8, Y0, Y0
	VMOVDQU Y0, (DI)
	ADDQ $64, SI
	ADDQ $64, BX
	ADDQ $32, DI
	INCQ AX
	JMP fbbfloop

fbbfdone:
	SHLQ $4, AX
	MOVQ AX, ret+32(FP)
	VZEROUPPER
	RET
`, amaxAll, scale, fast.String(), amaxFinite, slow.String(), decSetup, decScale, decode8, scaleUp, fbElems.String(), bfFeedback(0)+bfFeedback(1))
	s.WriteString(runs16("asmBF16Enc", "bfenc", `
	VMOVDQU 0(SI), Y0
	VMOVDQU 32(SI), Y1`+bfRound(0)+bfRound(1)+`
	VPACKUSDW Y1, Y0, Y0
	VPERMQ $0xd8, Y0, Y0
	VMOVDQU Y0, (DI)
	ADDQ $64, SI
	ADDQ $32, DI`))
	s.WriteString(runs16("asmBF16Dec", "bfdec", `
	VPMOVZXWD 0(SI), Y0
	VPMOVZXWD 16(SI), Y1
	VPSLLD $16, Y0, Y0
	VPSLLD $16, Y1, Y1
	VMOVDQU Y0, 0(DI)
	VMOVDQU Y1, 32(DI)
	ADDQ $32, SI
	ADDQ $64, DI`))
	if err := os.WriteFile("kern_amd64.s", s.Bytes(), 0o644); err != nil {
		panic(err)
	}

	src, err := format.Source([]byte(header + `//go:build amd64 && !purego

package codec

import "unsafe"

// asmEncF32 encodes nb whole blocks of float32 src: scale bytes to scales,
// 32 codes per block to codes.
//
//go:noescape
func asmEncF32(scales, codes, src unsafe.Pointer, nb int)

// asmDecF32 decodes nb whole blocks (scales, codes) into float32 dst.
//
//go:noescape
func asmDecF32(dst, scales, codes unsafe.Pointer, nb int)

// asmDecAddF32 adds the decoded values start, start+8, ... (start a
// multiple of 8) to float32 acc, 8 at a time while 8 remain below n, and
// returns where it stopped: n rounded down to a multiple of 8, or the
// first 8 values whose sums hold a NaN, which it leaves untouched (the Go
// kernels own the NaN rule).
//
//go:noescape
func asmDecAddF32(acc, scales, codes unsafe.Pointer, start, n int) int

// asmFbMXF32 runs error feedback over nb whole blocks of float32 x with
// float32 residual r: u = x + r, u's scale bytes to scales and codes to
// codes, r = u - decoded u. It returns the blocks done: nb, or the first
// block whose u holds a NaN, ±Inf or a magnitude over 1.75 * 2^127 (its
// decoded values may be ±Inf), which it leaves untouched (the Go kernel
// owns the NaN and +0 rules).
//
//go:noescape
func asmFbMXF32(scales, codes, x, r unsafe.Pointer, nb int) int

// asmFbBF16 runs error feedback into bfloat16 dst over the first n&^15
// float32 values of x with residual r, 16 at a time: u = x + r, dst =
// bfloat16 of u, r = u - dst widened, or +0 where that is ±Inf. It returns
// the values done: n&^15, or the first 16 whose u holds a NaN, which it
// leaves untouched.
//
//go:noescape
func asmFbBF16(dst, x, r unsafe.Pointer, n int) int

// asmBF16Enc rounds the first n&^15 float32 values of src to bfloat16 dst
// and returns that count.
//
//go:noescape
func asmBF16Enc(dst, src unsafe.Pointer, n int) int

// asmBF16Dec widens the first n&^15 bfloat16 values of src to float32 dst
// and returns that count.
//
//go:noescape
func asmBF16Dec(dst, src unsafe.Pointer, n int) int
`))
	if err != nil {
		panic(err)
	}
	if err := os.WriteFile("kern_amd64_decl.go", src, 0o644); err != nil {
		panic(err)
	}
}
