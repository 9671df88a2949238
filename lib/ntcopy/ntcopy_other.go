//go:build !amd64 || purego

package ntcopy

import "unsafe"

// useAsm is false: there is no streaming body on this platform.
var useAsm = false

func streamBody(dst, src unsafe.Pointer, n int) { panic("ntcopy: no streaming body on this platform") }
