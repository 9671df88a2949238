//go:build amd64 && !purego

package ntcopy

import (
	"unsafe"

	"golang.org/x/sys/cpu"
)

// useAsm selects the streaming body; the tests turn it off to compare.
var useAsm = cpu.X86.HasAVX

// streamBody copies n bytes (a multiple of 128) from src to dst (32-byte
// aligned) with non-temporal stores and fences them.
//
//go:noescape
func streamBody(dst, src unsafe.Pointer, n int)
