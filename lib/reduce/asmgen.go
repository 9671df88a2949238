//go:build ignore

// asmgen writes kern_amd64.s and kern_amd64_decl.go, the AVX2 kernels:
//
//	go run asmgen.go
//
// Every kernel has the Go signature
//
//	func(d, a, b unsafe.Pointer, n int) int
//
// and combines whole 64-byte blocks of a and b into d, in order, for as long
// as at least 64 bytes remain. It returns the number of bytes done: less
// than n&^63 when a floating block produced a NaN, which it does not store;
// the Go kernels then do that block (they own the NaN rules) and the rest.
package main

import (
	"bytes"
	"fmt"
	"go/format"
	"os"
	"strings"
)

type kern struct {
	name  string // Go function name
	dt    string // DType constant
	op    string // Op constant
	setup string // before the loop: constants
	body  string // one 64-byte block at offset AX; may JNZ done before storing
}

// Loads, stores and the NaN test of two YMM registers of floats.
const (
	nanTest2PS = `
	VCMPPS $3, Y1, Y0, Y8
	VPTEST Y8, Y8
	JNZ done`
	nanTest4PS = `
	VCMPPS $3, Y1, Y0, Y8
	VCMPPS $3, Y3, Y2, Y9
	VPOR Y9, Y8, Y8
	VPTEST Y8, Y8
	JNZ done`
	nanTest2PD = `
	VCMPPD $3, Y1, Y0, Y8
	VPTEST Y8, Y8
	JNZ done`
	store2 = `
	VMOVDQU Y0, 0(DI)(AX*1)
	VMOVDQU Y1, 32(DI)(AX*1)`
)

// binop2 is a 64-byte block of an elementwise instruction on 2 YMM
// registers: d = a OP b.
func binop2(instr string) string {
	return fmt.Sprintf(`
	VMOVDQU 0(SI)(AX*1), Y0
	VMOVDQU 32(SI)(AX*1), Y1
	%[1]s 0(DX)(AX*1), Y0, Y0
	%[1]s 32(DX)(AX*1), Y1, Y1`, instr)
}

// maxmin2 is IEEE max/min with +0 > -0: VMAXPS/VMINPS return their second
// source when both are zeros (or either is a NaN, caught by the NaN test),
// so take both orders and AND (max) or OR (min) the bits, which only
// differ on a pair of zeros of opposite signs.
func maxmin2(instr, combine, unord string) string {
	return fmt.Sprintf(`
	VMOVDQU 0(SI)(AX*1), Y2
	VMOVDQU 32(SI)(AX*1), Y3
	VMOVDQU 0(DX)(AX*1), Y4
	VMOVDQU 32(DX)(AX*1), Y5
	%[1]s Y4, Y2, Y0
	%[1]s Y2, Y4, Y6
	%[1]s Y5, Y3, Y1
	%[1]s Y3, Y5, Y7
	%[2]s Y6, Y0, Y0
	%[2]s Y7, Y1, Y1
	%[3]s $3, Y4, Y2, Y8
	%[3]s $3, Y5, Y3, Y9
	VPOR Y9, Y8, Y8
	VPTEST Y8, Y8
	JNZ done`, instr, combine, unord)
}

// f16 widens 32 float16 per operand with F16C, operates in float32 and
// rounds back (VCVTPS2PH, immediate 0: round to nearest even).
//
// With div, the kernel divides d in place by the float32 in Y13.
func f16(instr string, div bool) string {
	var s strings.Builder
	for i := 0; i < 4; i++ {
		if div {
			fmt.Fprintf(&s, "\n\tVCVTPH2PS %d(DI)(AX*1), Y%d", 16*i, i)
			continue
		}
		fmt.Fprintf(&s, "\n\tVCVTPH2PS %d(SI)(AX*1), Y%d", 16*i, i)
		fmt.Fprintf(&s, "\n\tVCVTPH2PS %d(DX)(AX*1), Y%d", 16*i, i+4)
	}
	for i := 0; i < 4; i++ {
		if div {
			fmt.Fprintf(&s, "\n\t%s Y13, Y%d, Y%d", instr, i, i)
			continue
		}
		fmt.Fprintf(&s, "\n\t%s Y%d, Y%d, Y%d", instr, i+4, i, i)
	}
	s.WriteString(nanTest4PS)
	for i := 0; i < 4; i++ {
		fmt.Fprintf(&s, "\n\tVCVTPS2PH $0, Y%d, %d(DI)(AX*1)", i, 16*i)
	}
	return s.String()
}

// bf16 widens 32 bfloat16 per operand (zero-extend, shift into the top
// half), operates in float32 and rounds to nearest even in integers:
// (w + 0x7fff + (w>>16 & 1)) >> 16, which cannot overflow for a non-NaN w.
// Y15 holds 1 in every dword, Y14 0x7fff. With div, the kernel divides d
// in place by the float32 in Y13.
func bf16(instr string, div bool) string {
	var s strings.Builder
	for i := 0; i < 4; i++ {
		if div {
			fmt.Fprintf(&s, "\n\tVPMOVZXWD %d(DI)(AX*1), Y%d", 16*i, i)
			fmt.Fprintf(&s, "\n\tVPSLLD $16, Y%d, Y%d", i, i)
			continue
		}
		fmt.Fprintf(&s, "\n\tVPMOVZXWD %d(SI)(AX*1), Y%d", 16*i, i)
		fmt.Fprintf(&s, "\n\tVPMOVZXWD %d(DX)(AX*1), Y%d", 16*i, i+4)
		fmt.Fprintf(&s, "\n\tVPSLLD $16, Y%d, Y%d", i, i)
		fmt.Fprintf(&s, "\n\tVPSLLD $16, Y%d, Y%d", i+4, i+4)
	}
	for i := 0; i < 4; i++ {
		if div {
			fmt.Fprintf(&s, "\n\t%s Y13, Y%d, Y%d", instr, i, i)
			continue
		}
		fmt.Fprintf(&s, "\n\t%s Y%d, Y%d, Y%d", instr, i+4, i, i)
	}
	s.WriteString(nanTest4PS)
	for i := 0; i < 4; i++ {
		fmt.Fprintf(&s, "\n\tVPSRLD $16, Y%d, Y%d", i, i+4)
		fmt.Fprintf(&s, "\n\tVPAND Y15, Y%d, Y%d", i+4, i+4)
		fmt.Fprintf(&s, "\n\tVPADDD Y14, Y%d, Y%d", i, i)
		fmt.Fprintf(&s, "\n\tVPADDD Y%d, Y%d, Y%d", i+4, i, i)
		fmt.Fprintf(&s, "\n\tVPSRLD $16, Y%d, Y%d", i, i)
	}
	// VPACKUSDW packs within 128-bit lanes; VPERMQ puts the qwords back in order.
	s.WriteString(`
	VPACKUSDW Y1, Y0, Y0
	VPACKUSDW Y3, Y2, Y2
	VPERMQ $0xd8, Y0, Y0
	VPERMQ $0xd8, Y2, Y2
	VMOVDQU Y0, 0(DI)(AX*1)
	VMOVDQU Y2, 32(DI)(AX*1)`)
	return s.String()
}

const (
	bf16Setup = `
	VPCMPEQD Y15, Y15, Y15
	VPSRLD $17, Y15, Y14
	VPSRLD $31, Y15, Y15`
	// Y15: 0x00ff in every word, Y14: 0xff00.
	byteMaskSetup = `
	VPCMPEQD Y15, Y15, Y15
	VPSLLW $8, Y15, Y14
	VPSRLW $8, Y15, Y15`
)

// mulBytes multiplies bytes with VPMULLW: the low byte of the product of
// two words is the product of their low bytes; for the high bytes, multiply
// the high byte of a (shifted down) by b with its low byte cleared.
func mulBytes() string {
	var s strings.Builder
	for i := 0; i < 2; i++ {
		fmt.Fprintf(&s, `
	VMOVDQU %[1]d(SI)(AX*1), Y%[2]d
	VMOVDQU %[1]d(DX)(AX*1), Y2
	VPMULLW Y2, Y%[2]d, Y3
	VPSRLW $8, Y%[2]d, Y4
	VPAND Y14, Y2, Y2
	VPMULLW Y2, Y4, Y4
	VPAND Y15, Y3, Y3
	VPOR Y4, Y3, Y%[2]d`, 32*i, i)
	}
	return s.String()
}

// mulQ multiplies int64 lanes from 32-bit halves: lo·lo + (lo·hi + hi·lo)<<32.
func mulQ() string {
	var s strings.Builder
	for i := 0; i < 2; i++ {
		fmt.Fprintf(&s, `
	VMOVDQU %[1]d(SI)(AX*1), Y2
	VMOVDQU %[1]d(DX)(AX*1), Y3
	VPMULUDQ Y3, Y2, Y%[2]d
	VPSRLQ $32, Y2, Y4
	VPMULUDQ Y3, Y4, Y4
	VPSRLQ $32, Y3, Y5
	VPMULUDQ Y5, Y2, Y5
	VPADDQ Y5, Y4, Y4
	VPSLLQ $32, Y4, Y4
	VPADDQ Y4, Y%[2]d, Y%[2]d`, 32*i, i)
	}
	return s.String()
}

// maxminQ selects int64 lanes with a signed compare: max takes a where a > b.
func maxminQ(isMax bool) string {
	var s strings.Builder
	for i := 0; i < 2; i++ {
		fmt.Fprintf(&s, `
	VMOVDQU %[1]d(SI)(AX*1), Y2
	VMOVDQU %[1]d(DX)(AX*1), Y3
	VPCMPGTQ Y3, Y2, Y4`, 32*i)
		if isMax { // mask ? a : b
			fmt.Fprintf(&s, "\n\tVPBLENDVB Y4, Y2, Y3, Y%d", i)
		} else { // mask ? b : a
			fmt.Fprintf(&s, "\n\tVPBLENDVB Y4, Y3, Y2, Y%d", i)
		}
	}
	return s.String()
}

// halfMaxMin is max/min of 16-bit floats on their bits: flipping the
// magnitude bits of negative values (x ^ (x>>15 & 0x7fff), an involution)
// turns sign-magnitude order into signed-integer order, -0 just below +0;
// VPMAXSW/VPMINSW pick, and the same flip maps back. A block with a NaN
// operand (magnitude bits above those of Inf) is left to Go. Y15 holds
// 0x7fff in every word, Y14 the Inf bits.
func halfMaxMin(instr string) string {
	var s strings.Builder
	for i := 0; i < 2; i++ {
		fmt.Fprintf(&s, `
	VMOVDQU %[1]d(SI)(AX*1), Y2
	VMOVDQU %[1]d(DX)(AX*1), Y3
	VPAND Y15, Y2, Y4
	VPAND Y15, Y3, Y5
	VPCMPGTW Y14, Y4, Y4
	VPCMPGTW Y14, Y5, Y5
	VPOR Y5, Y4, Y%[2]d
	VPSRAW $15, Y2, Y6
	VPSRAW $15, Y3, Y7
	VPAND Y15, Y6, Y6
	VPAND Y15, Y7, Y7
	VPXOR Y6, Y2, Y2
	VPXOR Y7, Y3, Y3
	%[3]s Y3, Y2, Y%[4]d
	VPSRAW $15, Y%[4]d, Y6
	VPAND Y15, Y6, Y6
	VPXOR Y6, Y%[4]d, Y%[4]d`, 32*i, 8+i, instr, i)
	}
	s.WriteString(`
	VPOR Y9, Y8, Y8
	VPTEST Y8, Y8
	JNZ done`)
	return s.String()
}

// halfSetup loads the constants of halfMaxMin for Inf bits inf.
func halfSetup(inf int) string {
	return fmt.Sprintf(`
	VPCMPEQD Y15, Y15, Y15
	VPSRLW $1, Y15, Y15
	MOVL $%#x, R8
	VMOVD R8, X14
	VPBROADCASTW X14, Y14`, inf)
}

func kernels() []kern {
	return []kern{
		{"asmF32Sum", "Float32", "Sum", "", binop2("VADDPS") + nanTest2PS + store2},
		{"asmF32Prod", "Float32", "Prod", "", binop2("VMULPS") + nanTest2PS + store2},
		{"asmF32Max", "Float32", "Max", "", maxmin2("VMAXPS", "VANDPS", "VCMPPS") + store2},
		{"asmF32Min", "Float32", "Min", "", maxmin2("VMINPS", "VORPS", "VCMPPS") + store2},
		{"asmF64Sum", "Float64", "Sum", "", binop2("VADDPD") + nanTest2PD + store2},
		{"asmF64Prod", "Float64", "Prod", "", binop2("VMULPD") + nanTest2PD + store2},
		{"asmF64Max", "Float64", "Max", "", maxmin2("VMAXPD", "VANDPD", "VCMPPD") + store2},
		{"asmF64Min", "Float64", "Min", "", maxmin2("VMINPD", "VORPD", "VCMPPD") + store2},
		{"asmF16Sum", "Float16", "Sum", "", f16("VADDPS", false)},
		{"asmF16Prod", "Float16", "Prod", "", f16("VMULPS", false)},
		{"asmF16Max", "Float16", "Max", halfSetup(0x7c00), halfMaxMin("VPMAXSW") + store2},
		{"asmF16Min", "Float16", "Min", halfSetup(0x7c00), halfMaxMin("VPMINSW") + store2},
		{"asmBF16Max", "BFloat16", "Max", halfSetup(0x7f80), halfMaxMin("VPMAXSW") + store2},
		{"asmBF16Min", "BFloat16", "Min", halfSetup(0x7f80), halfMaxMin("VPMINSW") + store2},
		{"asmBF16Sum", "BFloat16", "Sum", bf16Setup, bf16("VADDPS", false)},
		{"asmBF16Prod", "BFloat16", "Prod", bf16Setup, bf16("VMULPS", false)},
		{"asmI8Sum", "Int8", "Sum", "", binop2("VPADDB") + store2},
		{"asmI8Prod", "Int8", "Prod", byteMaskSetup, mulBytes() + store2},
		{"asmI8Max", "Int8", "Max", "", binop2("VPMAXSB") + store2},
		{"asmI8Min", "Int8", "Min", "", binop2("VPMINSB") + store2},
		{"asmU8Max", "Uint8", "Max", "", binop2("VPMAXUB") + store2},
		{"asmU8Min", "Uint8", "Min", "", binop2("VPMINUB") + store2},
		{"asmI32Sum", "Int32", "Sum", "", binop2("VPADDD") + store2},
		{"asmI32Prod", "Int32", "Prod", "", binop2("VPMULLD") + store2},
		{"asmI32Max", "Int32", "Max", "", binop2("VPMAXSD") + store2},
		{"asmI32Min", "Int32", "Min", "", binop2("VPMINSD") + store2},
		{"asmI64Sum", "Int64", "Sum", "", binop2("VPADDQ") + store2},
		{"asmI64Prod", "Int64", "Prod", "", mulQ() + store2},
		{"asmI64Max", "Int64", "Max", "", maxminQ(true) + store2},
		{"asmI64Min", "Int64", "Min", "", maxminQ(false) + store2},
	}
}

// divKern is a kernel dividing d in place by t: Go signature
// func(d unsafe.Pointer, n int, t float32) int (float64 for asmF64Div),
// returning the bytes done like the others (it stops before a block with a
// NaN, which Go quiets itself).
type divKern struct {
	name, dt, tType, bcast, setup, body string
}

func divKernels() []divKern {
	div2 := func(instr, unord string) string {
		return fmt.Sprintf(`
	VMOVDQU 0(DI)(AX*1), Y0
	VMOVDQU 32(DI)(AX*1), Y1
	%[1]s Y13, Y0, Y0
	%[1]s Y13, Y1, Y1
	%[2]s $3, Y1, Y0, Y8
	VPTEST Y8, Y8
	JNZ done`, instr, unord) + store2
	}
	return []divKern{
		{"asmF32Div", "Float32", "float32", "VBROADCASTSS", "", div2("VDIVPS", "VCMPPS")},
		{"asmF64Div", "Float64", "float64", "VBROADCASTSD", "", div2("VDIVPD", "VCMPPD")},
		{"asmF16Div", "Float16", "float32", "VBROADCASTSS", "", f16("VDIVPS", true)},
		{"asmBF16Div", "BFloat16", "float32", "VBROADCASTSS", bf16Setup, bf16("VDIVPS", true)},
	}
}

const header = "// Code generated by asmgen.go; DO NOT EDIT.\n\n"

func main() {
	var s bytes.Buffer
	s.WriteString(header)
	s.WriteString("//go:build amd64 && !purego\n\n#include \"textflag.h\"\n")
	s.WriteString(`
// func cpuid(leaf, sub uint32) (eax, ebx, ecx, edx uint32)
TEXT ·cpuid(SB), NOSPLIT, $0-24
	MOVL leaf+0(FP), AX
	MOVL sub+4(FP), CX
	CPUID
	MOVL AX, eax+8(FP)
	MOVL BX, ebx+12(FP)
	MOVL CX, ecx+16(FP)
	MOVL DX, edx+20(FP)
	RET

// func xgetbv0() (eax uint32)
TEXT ·xgetbv0(SB), NOSPLIT, $0-4
	MOVL $0, CX
	XGETBV
	MOVL AX, eax+0(FP)
	RET
`)
	for _, k := range kernels() {
		fmt.Fprintf(&s, `
// func %[1]s(d, a, b unsafe.Pointer, n int) int
TEXT ·%[1]s(SB), NOSPLIT, $0-40
	MOVQ d+0(FP), DI
	MOVQ a+8(FP), SI
	MOVQ b+16(FP), DX
	MOVQ n+24(FP), CX%[2]s
	XORQ AX, AX

loop:
	LEAQ 64(AX), BX
	CMPQ BX, CX
	JGT done%[3]s
	MOVQ BX, AX
	JMP loop

done:
	MOVQ AX, ret+32(FP)
	VZEROUPPER
	RET
`, k.name, k.setup, k.body)
	}
	for _, k := range divKernels() {
		fmt.Fprintf(&s, `
// func %[1]s(d unsafe.Pointer, n int, t %[2]s) int
TEXT ·%[1]s(SB), NOSPLIT, $0-32
	MOVQ d+0(FP), DI
	MOVQ n+8(FP), CX
	%[3]s t+16(FP), Y13%[4]s
	XORQ AX, AX

loop:
	LEAQ 64(AX), BX
	CMPQ BX, CX
	JGT done%[5]s
	MOVQ BX, AX
	JMP loop

done:
	MOVQ AX, ret+24(FP)
	VZEROUPPER
	RET
`, k.name, k.tType, k.bcast, k.setup, k.body)
	}
	if err := os.WriteFile("kern_amd64.s", s.Bytes(), 0o644); err != nil {
		panic(err)
	}

	var g bytes.Buffer
	g.WriteString(header)
	g.WriteString("//go:build amd64 && !purego\n\npackage reduce\n\nimport \"unsafe\"\n")
	for _, k := range kernels() {
		fmt.Fprintf(&g, "\n//go:noescape\nfunc %s(d, a, b unsafe.Pointer, n int) int\n", k.name)
	}
	g.WriteString(`
// asmKernel runs the AVX2 kernel of op and dt, if there is one, over whole
// 64-byte blocks of n bytes and returns the bytes done, or -1.
func asmKernel(op Op, dt DType, d, a, b unsafe.Pointer, n int) int {
	switch dt {
`)
	byDT := map[string][]kern{}
	var order []string
	for _, k := range kernels() {
		if byDT[k.dt] == nil {
			order = append(order, k.dt)
		}
		byDT[k.dt] = append(byDT[k.dt], k)
	}
	for _, dt := range order {
		fmt.Fprintf(&g, "case %s:\nswitch op {\n", dt)
		for _, k := range byDT[dt] {
			fmt.Fprintf(&g, "case %s:\nreturn %s(d, a, b, n)\n", k.op, k.name)
		}
		g.WriteString("}\n")
	}
	g.WriteString("}\nreturn -1\n}\n")
	for _, k := range divKernels() {
		fmt.Fprintf(&g, "\n//go:noescape\nfunc %s(d unsafe.Pointer, n int, t %s) int\n", k.name, k.tType)
	}
	src, err := format.Source(g.Bytes())
	if err != nil {
		panic(err)
	}
	if err := os.WriteFile("kern_amd64_decl.go", src, 0o644); err != nil {
		panic(err)
	}
}
