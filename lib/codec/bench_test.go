package codec

import (
	"fmt"
	"math"
	"math/rand/v2"
	"testing"

	"github.com/gpubridge/gpubridge/lib/reduce"
)

// benchValues is the number of float32 values of the speed benchmarks: 64
// MiB, well out of the caches, so they measure the steady state of a
// stream.
const benchValues = 16 << 20

// gradients returns n float32 values like a gradient bucket: normal values
// whose magnitude drifts across the buffer (layers of different scales).
func gradients(n int, seed uint64) []byte {
	r := rand.New(rand.NewPCG(seed, 1))
	w := make([]uint32, n)
	for i := range w {
		scale := math.Ldexp(1, -4-(i>>16)%12)
		w[i] = math.Float32bits(float32(r.NormFloat64() * scale))
	}
	return f32Bytes(w)
}

// BenchmarkMXFP8 measures the fp8 kernels on one goroutine; bytes are
// float32 input (encode) or output (decode, decode-add) bytes, the side
// that the goal of 4 GB/s per core counts. Memcpy of the same bytes is the
// anchor of the same run.
func BenchmarkMXFP8(b *testing.B) {
	src := gradients(benchValues, 1)
	packed := touched(MXFP8Len(benchValues))
	dst := touched(len(src))
	for _, asm := range []bool{true, false} {
		if asm && !useAsm {
			continue
		}
		kern := map[bool]string{true: "avx2", false: "go"}[asm]
		run := func(name string, f func()) {
			b.Run(fmt.Sprintf("%s/%s", name, kern), func(b *testing.B) {
				defer func(saved bool) { useAsm = saved }(useAsm)
				useAsm = asm
				b.SetBytes(int64(len(src)))
				for b.Loop() {
					f()
				}
			})
		}
		run("encode", func() { must(EncodeMXFP8(packed, reduce.Float32, src)) })
		run("decode", func() { must(DecodeMXFP8(dst, reduce.Float32, packed)) })
		run("decode-add", func() { must(DecodeAddMXFP8(dst, packed)) })
	}
	b.Run("memcpy", func(b *testing.B) {
		b.SetBytes(int64(len(src)))
		for b.Loop() {
			copy(dst, src)
		}
	})
}

// BenchmarkBF16 is BenchmarkMXFP8 for bf16/v1.
func BenchmarkBF16(b *testing.B) {
	src := gradients(benchValues, 2)
	packed := touched(BF16Len(benchValues))
	dst := touched(len(src))
	for _, asm := range []bool{true, false} {
		if asm && !useAsm {
			continue
		}
		kern := map[bool]string{true: "avx2", false: "go"}[asm]
		run := func(name string, f func()) {
			b.Run(fmt.Sprintf("%s/%s", name, kern), func(b *testing.B) {
				defer func(saved bool) { useAsm = saved }(useAsm)
				useAsm = asm
				b.SetBytes(int64(len(src)))
				for b.Loop() {
					f()
				}
			})
		}
		run("encode", func() { must(EncodeBF16(packed, reduce.Float32, src)) })
		run("decode", func() { must(DecodeBF16(dst, reduce.Float32, packed)) })
		run("decode-add", func() { must(DecodeAddBF16(dst, packed)) })
	}
}

func must(err error) {
	if err != nil {
		panic(err)
	}
}

// touched returns a buffer whose pages are mapped already, so that no
// iteration pays for the first touch.
func touched(n int) []byte {
	b := make([]byte, n)
	for i := range b {
		b[i] = 1
	}
	return b
}
