package codec

import (
	"bytes"
	"fmt"
	"math"
	"math/rand/v2"
	"os"
	"path/filepath"
	"runtime"
	"sort"
	"testing"

	"github.com/gpubridge/gpubridge/lib/npy"
	"github.com/gpubridge/gpubridge/lib/reduce"
	"github.com/klauspost/compress/zstd"
)

// The benchmarks (bench/codec.sh turns their output into docs/bench rows).
// Each reports MB/s of wall time, as usual, and cpu-MB/s: bytes per second
// of the benchmark thread's own CPU time, the per-core speed, which other
// work on a shared machine does not dilute. Bytes are float32 (raw) bytes.

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

// touched returns a buffer whose pages are mapped already, so that no
// iteration pays for the first touch.
func touched(n int) []byte {
	b := make([]byte, n)
	for i := range b {
		b[i] = 1
	}
	return b
}

// measure runs f in b.Loop on a locked thread and reports its CPU speed.
func measure(b *testing.B, bytes int, f func()) {
	runtime.LockOSThread()
	defer runtime.UnlockOSThread()
	b.SetBytes(int64(bytes))
	t0 := threadCPU()
	n := 0
	for b.Loop() {
		f()
		n++
	}
	if cpu := threadCPU() - t0; cpu > 0 {
		b.ReportMetric(float64(bytes)*float64(n)/cpu.Seconds()/1e6, "cpu-MB/s")
	}
}

// kernels runs each case with the AVX2 kernels (where there are some) and
// the Go ones.
func kernels(b *testing.B, cases []struct {
	name string
	f    func()
}, bytes int) {
	for _, asm := range []bool{true, false} {
		if asm && !useAsm {
			continue
		}
		kern := map[bool]string{true: "avx2", false: "go"}[asm]
		for _, c := range cases {
			b.Run(c.name+"/"+kern, func(b *testing.B) {
				defer func(saved bool) { useAsm = saved }(useAsm)
				useAsm = asm
				measure(b, bytes, c.f)
			})
		}
	}
}

type benchCase = struct {
	name string
	f    func()
}

// BenchmarkMXFP8 measures fp8 encode, decode, decode-add and encode with
// error feedback of float32 on
// one goroutine, and memcpy of the same bytes, the anchor of the run.
func BenchmarkMXFP8(b *testing.B) {
	src := gradients(benchValues, 1)
	packed := touched(MXFP8Len(benchValues))
	dst := touched(len(src))
	res := touched(len(src))
	clear(res)
	kernels(b, []benchCase{
		{"encode", func() { must(EncodeMXFP8(packed, reduce.Float32, src)) }},
		{"decode", func() { must(DecodeMXFP8(dst, reduce.Float32, packed)) }},
		{"decode-add", func() { must(DecodeAddMXFP8(dst, packed)) }},
		{"encode-feedback", func() { must(EncodeFeedbackMXFP8(packed, reduce.Float32, src, res)) }},
	}, len(src))
	b.Run("memcpy", func(b *testing.B) { measure(b, len(src), func() { copy(dst, src) }) })
}

// BenchmarkBF16 is BenchmarkMXFP8 for bf16/v1.
func BenchmarkBF16(b *testing.B) {
	src := gradients(benchValues, 2)
	packed := touched(BF16Len(benchValues))
	dst := touched(len(src))
	res := touched(len(src))
	clear(res)
	kernels(b, []benchCase{
		{"encode", func() { must(EncodeBF16(packed, reduce.Float32, src)) }},
		{"decode", func() { must(DecodeBF16(dst, reduce.Float32, packed)) }},
		{"decode-add", func() { must(DecodeAddBF16(dst, packed)) }},
		{"encode-feedback", func() { must(EncodeFeedbackBF16(packed, reduce.Float32, src, res)) }},
	}, len(src))
}

// dumps returns the gradient dumps of GPUBRIDGE_CODEC_DUMP (a directory of
// .npy files of float32, or of bfloat16 saved as 2-byte void), or one
// synthetic buffer when it is not set.
func dumps(b *testing.B) map[string]struct {
	dt   reduce.DType
	data []byte
} {
	out := map[string]struct {
		dt   reduce.DType
		data []byte
	}{}
	dir := os.Getenv("GPUBRIDGE_CODEC_DUMP")
	if dir == "" {
		out["synthetic"] = struct {
			dt   reduce.DType
			data []byte
		}{reduce.Float32, gradients(4<<20, 5)}
		return out
	}
	names, _ := filepath.Glob(filepath.Join(dir, "*.npy"))
	sort.Strings(names)
	for _, name := range names {
		raw, err := os.ReadFile(name)
		if err != nil {
			b.Fatal(err)
		}
		r := bytes.NewReader(raw)
		h, err := npy.ReadHeader(r, npy.Limits{})
		if err != nil {
			b.Fatal(err)
		}
		dt := map[string]reduce.DType{"<f4": reduce.Float32, "<V2": reduce.BFloat16, "|V2": reduce.BFloat16}[h.Descr]
		if dt == 0 {
			b.Fatalf("%s: dtype %s", name, h.Descr)
		}
		out[filepath.Base(name)] = struct {
			dt   reduce.DType
			data []byte
		}{dt, raw[len(raw)-r.Len():]}
	}
	if len(out) == 0 {
		b.Fatalf("no .npy files in %s", dir)
	}
	return out
}

// BenchmarkLossless compares zstd/v1's plane methods with plain zstd of the
// raw bytes (klauspost/compress, fastest and default levels) on gradient
// dumps, in chunks of 4 MiB as the bridge would send them: ratio (raw /
// packed), and encode and decode speed.
func BenchmarkLossless(b *testing.B) {
	const chunk = 4 << 20
	fastest, _ := zstd.NewWriter(nil, zstd.WithEncoderLevel(zstd.SpeedFastest), zstd.WithEncoderConcurrency(1))
	dflt, _ := zstd.NewWriter(nil, zstd.WithEncoderLevel(zstd.SpeedDefault), zstd.WithEncoderConcurrency(1))
	dec, _ := zstd.NewReader(nil, zstd.WithDecoderConcurrency(1))
	for name, d := range dumps(b) {
		data := d.data
		var chunks [][]byte
		for off := 0; off < len(data); off += chunk {
			chunks = append(chunks, data[off:min(len(data), off+chunk)])
		}
		out := make([][]byte, len(chunks))
		back := touched(chunk)
		for _, m := range []struct {
			name string
			enc  func(i int) int
			dec  func(i int)
		}{
			{"planes-default", planesEnc(chunks, out, d.dt, LosslessOptions{}), unplanes(chunks, out, back, d.dt)},
			{"planes-zstd", planesEnc(chunks, out, d.dt, LosslessOptions{Method: ZstdPlane}), unplanes(chunks, out, back, d.dt)},
			{"planes-s2", planesEnc(chunks, out, d.dt, LosslessOptions{Method: S2Plane}), unplanes(chunks, out, back, d.dt)},
			{"plain-zstd-fastest", plain(chunks, out, fastest), unplain(out, back, dec)},
			{"plain-zstd-default", plain(chunks, out, dflt), unplain(out, back, dec)},
		} {
			packed := 0
			b.Run(fmt.Sprintf("%s/%s/encode", name, m.name), func(b *testing.B) {
				measure(b, len(data), func() {
					packed = 0
					for i := range chunks {
						packed += m.enc(i)
					}
				})
				b.ReportMetric(float64(len(data))/float64(packed), "ratio")
			})
			b.Run(fmt.Sprintf("%s/%s/decode", name, m.name), func(b *testing.B) {
				measure(b, len(data), func() {
					for i := range chunks {
						m.dec(i)
					}
				})
			})
		}
	}
}

func planesEnc(chunks, out [][]byte, dt reduce.DType, opt LosslessOptions) func(int) int {
	return func(i int) int {
		if out[i] == nil || cap(out[i]) < LosslessMaxLen(dt, len(chunks[i])) {
			out[i] = make([]byte, LosslessMaxLen(dt, len(chunks[i])))
		}
		n, err := EncodeLossless(out[i][:cap(out[i])], dt, chunks[i], opt)
		must(err)
		out[i] = out[i][:n]
		return n
	}
}

func unplanes(chunks, out [][]byte, back []byte, dt reduce.DType) func(int) {
	return func(i int) {
		must(DecodeLossless(back[:len(chunks[i])], dt, out[i]))
	}
}

func plain(chunks, out [][]byte, e *zstd.Encoder) func(int) int {
	return func(i int) int {
		out[i] = e.EncodeAll(chunks[i], out[i][:0])
		return len(out[i])
	}
}

func unplain(out [][]byte, back []byte, d *zstd.Decoder) func(int) {
	return func(i int) {
		_, err := d.DecodeAll(out[i], back[:0])
		must(err)
	}
}

func must(err error) {
	if err != nil {
		panic(err)
	}
}
