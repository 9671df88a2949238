//go:build !amd64 || purego

package reduce

// useAsm is false: there are no assembly kernels on this platform.
var useAsm = false

func asmBlocks(op Op, dt DType, d, a, b []byte) int { return -1 }

func asmDivBlocks(dt DType, d []byte, n int) int { return -1 }
