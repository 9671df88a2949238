//go:build amd64 && !purego

#include "textflag.h"

// func streamBody(dst, src unsafe.Pointer, n int)
TEXT ·streamBody(SB), NOSPLIT, $0-24
	MOVQ dst+0(FP), DI
	MOVQ src+8(FP), SI
	MOVQ n+16(FP), CX
	TESTQ CX, CX
	JEQ done

loop:
	VMOVDQU 0(SI), Y0
	VMOVDQU 32(SI), Y1
	VMOVDQU 64(SI), Y2
	VMOVDQU 96(SI), Y3
	VMOVNTDQ Y0, 0(DI)
	VMOVNTDQ Y1, 32(DI)
	VMOVNTDQ Y2, 64(DI)
	VMOVNTDQ Y3, 96(DI)
	ADDQ $128, SI
	ADDQ $128, DI
	SUBQ $128, CX
	JNE loop
	// Streaming stores are weakly ordered: fence them before whatever
	// tells another core the bytes are there.
	SFENCE
	VZEROUPPER

done:
	RET
