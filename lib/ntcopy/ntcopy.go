package ntcopy

import "unsafe"

// minBytes is the smallest copy that streams: below it the head and tail
// copies and the fence cost more than the reads for ownership they save.
const minBytes = 4 << 10

// Copy copies min(len(dst), len(src)) bytes from src to dst, like copy, and
// returns that count. The bytes of dst it writes are in memory, not in the
// caches, when it returns.
func Copy(dst, src []byte) int {
	n := min(len(dst), len(src))
	if n < minBytes || !useAsm || overlap(dst[:n], src[:n]) {
		return copy(dst, src)
	}
	// The body starts at dst's first 64-byte boundary (VMOVNTDQ needs 32)
	// and is a whole number of 128-byte steps.
	head := int(-uintptr(unsafe.Pointer(unsafe.SliceData(dst))) & 63)
	body := (n - head) &^ 127
	copy(dst[:head], src[:head])
	streamBody(unsafe.Pointer(&dst[head]), unsafe.Pointer(&src[head]), body)
	copy(dst[head+body:n], src[head+body:n])
	return n
}

// overlap reports whether x and y (of equal length) share memory.
func overlap(x, y []byte) bool {
	px := uintptr(unsafe.Pointer(unsafe.SliceData(x)))
	py := uintptr(unsafe.Pointer(unsafe.SliceData(y)))
	n := uintptr(len(x))
	return px < py+n && py < px+n
}
