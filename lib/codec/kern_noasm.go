//go:build !amd64 || purego

package codec

// useAsm is false: there are no assembly kernels on this platform.
var useAsm = false

func encBlocks(scales, codes, src []byte, nb int) { encBlocksGo(scales, codes, src, nb) }

func decBlocks(dst, scales, codes []byte, nb int) { decGo(dst, scales, codes, 0, nb*BlockElems) }

func decAdd(acc, scales, codes []byte) { decAddGo(acc, scales, codes, 0, len(codes)) }

func fbMX(scales, codes, x, r []byte) { fbMXGo(scales, codes, x, r) }

func fbBF16(dst, x, r []byte) { fbBF16Go(dst, x, r) }

func bfEncodeAsm(dst, src []byte) int { return 0 }

func bfDecodeAsm(dst, src []byte) int { return 0 }
