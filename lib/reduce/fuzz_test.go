package reduce

import (
	"bytes"
	"testing"
)

// FuzzCombine combines arbitrary bytes with an arbitrary op and dtype and
// checks: no panic; an error exactly when the pair is unsupported; Combine,
// in-place Combine, unaligned Combine, CombineParallel (split into 64-byte
// ranges), and the Go kernels (against the assembly ones) all agree; and
// every element matches the reference.
func FuzzCombine(f *testing.F) {
	f.Add(uint8(Sum), uint8(Float32), uint8(2), []byte("\x00\x00\x80\x3f\x00\x00\xc0\x7f"), []byte("\x00\x00\x80\xff\x01\x00\x80\x7f"))
	f.Add(uint8(Max), uint8(Float16), uint8(3), []byte("\x00\x80\x00\x7e\x01\x7c\xff\x7b"), []byte("\x00\x00\x00\xfc\x00\x3c\xff\x7b"))
	f.Add(uint8(Avg), uint8(Int8), uint8(1), []byte("ab"), []byte("cd"))
	f.Fuzz(func(t *testing.T, opB, dtB, workers uint8, a, b []byte) {
		op, dt := Op(opB%6), DType(dtB%9) // 0 is invalid in both
		n := min(len(a), len(b))
		if s := dt.Size(); s > 0 {
			n -= n % s
		}
		a, b = a[:n], b[:n]
		d1 := make([]byte, n)
		err := Combine(op, dt, d1, a, b)
		if Supported(op, dt) != nil {
			if err == nil {
				t.Fatalf("%s %s: no error", op, dt)
			}
			return
		}
		if err != nil {
			t.Fatal(err)
		}
		checkCombine(t, op, dt, unpack(dt, a), unpack(dt, b), unpack(dt, d1))

		in := append([]byte(nil), a...)
		if err := Combine(op, dt, in, in, b); err != nil || !bytes.Equal(in, d1) {
			t.Fatalf("in place: %v %x != %x", err, in, d1)
		}
		ua := append([]byte{0}, a...)[1:]
		ud := make([]byte, n+1)[1:]
		if err := Combine(op, dt, ud, ua, b); err != nil || !bytes.Equal(ud, d1) {
			t.Fatalf("unaligned: %v %x != %x", err, ud, d1)
		}
		defer func(th, c int) { parallelThreshold, parallelChunkMin = th, c }(parallelThreshold, parallelChunkMin)
		parallelThreshold, parallelChunkMin = 0, 64
		d2 := make([]byte, n)
		if err := CombineParallel(op, dt, d2, a, b, int(workers%9)); err != nil || !bytes.Equal(d2, d1) {
			t.Fatalf("parallel (%d workers): %v %x != %x", workers%9, err, d2, d1)
		}
		if useAsm {
			useAsm = false
			d3 := make([]byte, n)
			err := Combine(op, dt, d3, a, b)
			useAsm = true
			if err != nil || !bytes.Equal(d3, d1) {
				t.Fatalf("go kernels: %v %x != asm %x", err, d3, d1)
			}
		}
	})
}
