package reduce

import (
	"fmt"
	"math"
	"math/rand/v2"
	"testing"
)

// benchBytes is the buffer size of the benchmarks: well out of L2 (and of
// most of L3), so they measure the memory-bound steady state.
const benchBytes = 64 << 20

// gradientLike fills buf with values of dt typical of gradients: normally
// distributed floats, uniformly random integers.
func gradientLike(dt DType, buf []byte, seed uint64) { fillFloats(dt, buf, seed, 0, 1) }

// fillFloats fills buf with normally distributed floats of mean mu and
// standard deviation sigma (uniformly random integers for integer dtypes).
func fillFloats(dt DType, buf []byte, seed uint64, mu, sigma float64) {
	r := rand.New(rand.NewPCG(seed, 1))
	s := dt.Size()
	for i := 0; i+s <= len(buf); i += s {
		putElem(buf[i:], s, normalElem(r, dt, mu, sigma))
	}
}

// normalElem returns the raw bits of a normally distributed float of dt
// (a uniformly random integer for integer dtypes).
func normalElem(r *rand.Rand, dt DType, mu, sigma float64) uint64 {
	f := mu + sigma*r.NormFloat64()
	switch dt {
	case Float16:
		return uint64(F32ToF16(float32(f)))
	case BFloat16:
		return uint64(F32ToBF16(float32(f)))
	case Float32:
		return uint64(math.Float32bits(float32(f)))
	case Float64:
		return math.Float64bits(f)
	}
	return r.Uint64()
}

// BenchmarkCombine measures Combine in place (dst == a, the way the bridge
// accumulates a received buffer) on one goroutine; bytes are dst bytes. It
// uses the assembly kernels where the machine has them; BenchmarkCombineGo
// is the same with the pure-Go kernels.
func BenchmarkCombine(b *testing.B) { benchCombine(b, useAsm) }

// BenchmarkCombineGo is BenchmarkCombine with the pure-Go kernels.
func BenchmarkCombineGo(b *testing.B) { benchCombine(b, false) }

func benchCombine(b *testing.B, asm bool) {
	defer func(saved bool) { useAsm = saved }(useAsm)
	useAsm = asm
	a := make([]byte, benchBytes)
	c := make([]byte, benchBytes)
	for _, dt := range AllDTypes() {
		for _, op := range []Op{Sum, Prod, Max, Min} {
			gradientLike(dt, a, 1)
			gradientLike(dt, c, 2)
			if op == Prod { // keep the repeated in-place products in range
				fillFloats(dt, c, 2, 1, 1.0/1024)
			}
			b.Run(fmt.Sprintf("%s/%s", dt, op), func(b *testing.B) {
				b.SetBytes(benchBytes)
				for b.Loop() {
					if err := Combine(op, dt, a, a, c); err != nil {
						b.Fatal(err)
					}
				}
			})
		}
	}
}

// BenchmarkCombineParallel measures CombineParallel sum in place with 2
// workers.
func BenchmarkCombineParallel(b *testing.B) {
	a := make([]byte, benchBytes)
	c := make([]byte, benchBytes)
	for _, dt := range []DType{Float32, BFloat16} {
		gradientLike(dt, a, 1)
		gradientLike(dt, c, 2)
		b.Run(dt.String()+"/sum/2workers", func(b *testing.B) {
			b.SetBytes(benchBytes)
			for b.Loop() {
				if err := CombineParallel(Sum, dt, a, a, c, 2); err != nil {
					b.Fatal(err)
				}
			}
		})
	}
}

// BenchmarkFinish measures Finish(Avg) by 3 (a true division) in place.
func BenchmarkFinish(b *testing.B) { benchFinish(b, useAsm) }

// BenchmarkFinishGo is BenchmarkFinish with the pure-Go kernels.
func BenchmarkFinishGo(b *testing.B) { benchFinish(b, false) }

func benchFinish(b *testing.B, asm bool) {
	defer func(saved bool) { useAsm = saved }(useAsm)
	useAsm = asm
	a := make([]byte, benchBytes)
	src := make([]byte, benchBytes)
	for _, dt := range []DType{Float16, BFloat16, Float32, Float64} {
		gradientLike(dt, src, 1)
		b.Run(dt.String()+"/avg", func(b *testing.B) {
			b.SetBytes(benchBytes)
			for b.Loop() {
				b.StopTimer()
				copy(a, src) // keep the values gradient-like, not ever smaller
				b.StartTimer()
				if err := Finish(Avg, dt, a, 3); err != nil {
					b.Fatal(err)
				}
			}
		})
	}
}

// BenchmarkMemcpy is the anchor: copy() of the same size.
func BenchmarkMemcpy(b *testing.B) {
	a := make([]byte, benchBytes)
	c := make([]byte, benchBytes)
	b.SetBytes(benchBytes)
	for b.Loop() {
		copy(a, c)
	}
}
