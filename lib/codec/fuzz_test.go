package codec

import (
	"bytes"
	"encoding/binary"
	"fmt"
	"math"
	"testing"

	"github.com/gpubridge/gpubridge/lib/reduce"
)

// FuzzMXFP8 takes arbitrary bytes as float32 values and as a packed
// buffer: encoding and decoding never panic, the assembly and the Go
// kernels agree, and a round trip keeps the error bound.
func FuzzMXFP8(f *testing.F) {
	f.Add(f32Bytes(special))
	f.Add(f32Bytes(allBF16()[0x3f00:0x3f80]))
	f.Add(bytes.Repeat([]byte{0x7f}, 33))
	f.Fuzz(func(t *testing.T, data []byte) {
		w := u32s(data)
		packed := packWith(t, true, w)
		if !bytes.Equal(packed, packWith(t, false, w)) {
			t.Fatalf("assembly and Go encodings differ")
		}
		dec := unpackWith(t, true, packed, len(w))
		checkBound(t, "fuzz", w, packed, dec)

		n := 0
		for MXFP8Len(n+1) <= len(data) {
			n++
		}
		raw := data[:MXFP8Len(n)]
		a, g := unpackWith(t, true, raw, n), unpackWith(t, false, raw, n)
		for i := range a {
			if a[i] != g[i] {
				t.Fatalf("value %d: assembly %#08x, Go %#08x", i, a[i], g[i])
			}
		}
		acc := f32Bytes(w[:min(len(w), n)])
		if len(acc) == 4*n {
			want := append([]byte(nil), acc...)
			if err := reduce.Combine(reduce.Sum, reduce.Float32, want, want, f32Bytes(g)); err != nil {
				t.Fatal(err)
			}
			if err := DecodeAddMXFP8(acc, raw); err != nil {
				t.Fatal(err)
			}
			if !bytes.Equal(acc, want) {
				t.Fatalf("decode-add differs from decode and reduce.Combine")
			}
		}
	})
}

// FuzzBF16 checks the assembly encoder against the Go one on arbitrary
// float32 values.
func FuzzBF16(f *testing.F) {
	f.Add(f32Bytes(special))
	f.Fuzz(func(t *testing.T, data []byte) {
		w := u32s(data)
		if !bytes.Equal(bfWith(t, true, w), bfWith(t, false, w)) {
			t.Fatalf("assembly and Go encodings differ")
		}
	})
}

// FuzzLossless decodes arbitrary bytes as a zstd/v1 chunk of any dtype:
// never a panic; what decodes, encodes and decodes back to the same bytes.
func FuzzLossless(f *testing.F) {
	grads := gradients(300, 9)
	for _, dt := range []reduce.DType{0, reduce.Float32, reduce.BFloat16, reduce.Int64} {
		for _, s2 := range []bool{false, true} {
			src := grads[:len(grads)/8*8]
			dst := make([]byte, LosslessMaxLen(dt, len(src)))
			n, err := EncodeLossless(dst, dt, src, LosslessOptions{Method: map[bool]Method{true: S2Plane}[s2]})
			if err != nil {
				f.Fatal(err)
			}
			f.Add(uint8(dt), uint32(len(src)), dst[:n])
		}
	}
	f.Fuzz(func(t *testing.T, dtB uint8, n uint32, packed []byte) {
		dt := reduce.DType(dtB % 9)
		out := make([]byte, n%(1<<20))
		if err := DecodeLossless(out, dt, packed); err != nil {
			return
		}
		again := make([]byte, LosslessMaxLen(dt, len(out)))
		m, err := EncodeLossless(again, dt, out, LosslessOptions{})
		if err != nil {
			t.Fatal(err)
		}
		back := make([]byte, len(out))
		if err := DecodeLossless(back, dt, again[:m]); err != nil || !bytes.Equal(back, out) {
			t.Fatalf("round trip of a decoded chunk: %v", err)
		}
	})
}

// FuzzFeedback takes arbitrary bytes as values (float32, bfloat16 or
// float16 by dtB) and float32 residuals: error feedback with the assembly
// kernels and the Go ones gives the definition's packing and residual, for
// fp8 and bf16.
func FuzzFeedback(f *testing.F) {
	f.Add(uint8(0), append(f32Bytes(special), f32Bytes(shuffled(special, 1))...))
	f.Add(uint8(1), append(f32Bytes(allBF16()[0x7f70:0x7f90]), f32Bytes(special[:16])...))
	f.Add(uint8(2), bytes.Repeat([]byte{0x7c, 0x00, 0x00, 0xfc}, 48))
	f.Fuzz(func(t *testing.T, dtB uint8, data []byte) {
		dt := []reduce.DType{reduce.Float32, reduce.BFloat16, reduce.Float16}[dtB%3]
		n := len(data) / (dt.Size() + 4)
		raw, res := data[:n*dt.Size()], u32s(data[n*dt.Size():n*(dt.Size()+4)])
		x := make([]uint32, n)
		for i := range x {
			switch dt {
			case reduce.Float32:
				x[i] = binary.LittleEndian.Uint32(raw[4*i:])
			case reduce.BFloat16:
				x[i] = uint32(binary.LittleEndian.Uint16(raw[2*i:])) << 16
			default:
				x[i] = math.Float32bits(reduce.F16ToF32(binary.LittleEndian.Uint16(raw[2*i:])))
			}
		}
		for _, id := range lossy {
			if id == BF16 && dt == reduce.Float16 {
				continue
			}
			wantP, wantR := refFeedback(t, id, x, res)
			for _, asm := range []bool{false, true} {
				gotP, gotR := feedbackWith(t, asm, id, dt, raw, res)
				sameFeedback(t, fmt.Sprintf("%v input, asm %v", dt, asm), id, x, res, wantP, gotP, wantR, gotR)
			}
		}
	})
}
