package codec

import (
	"bytes"
	"compress/gzip"
	"encoding/binary"
	"flag"
	"io"
	"math"
	"math/rand/v2"
	"os"
	"path/filepath"
	"sort"
	"testing"

	"github.com/gpubridge/gpubridge/lib/npy"
	"github.com/gpubridge/gpubridge/lib/reduce"
	"github.com/stretchr/testify/require"
)

var update = flag.Bool("update", false, "rewrite testdata/vectors from the current codecs")

// The vectors of testdata/vectors: what the plugin's torch quantizer
// (torchplugin/gpubridge/_codec.py) must reproduce bit for bit, on CPU in
// CI (torchplugin/tests/test_codec.py) and on GPUs (bench/gpu/codec_check.py).
// Each is a gzip'd .npy file of raw bits (uint8, '<u2' or '<u4'). Inputs
// that Python can compute itself are not stored:
//
//	bf16_all      x[i] = i << 16, every bfloat16 widened (i < 65536)
//	bf16_perm     x[i] = (i*40503 mod 65536) << 16, the same values shuffled
//	f16_all       every float16 bit pattern i, as float16 input
//	bits          x[i] = i*2654435761 mod 2^32: every kind of float32 (NaNs, Infs, denormals)
//	decode_all    a packing of 65536 values in which block b has scale b/8
//	              and codes 32*(b%8) ... 32*(b%8)+31: every code at every scale
//
// and the stored ones are the edge-case and random blocks of gen_test.go
// (edge.in, random.in: '<u4'; residual.in: the error-feedback residual
// for random). Outputs: NAME.fp8 (packed bytes), NAME.bf16 ('<u2'),
// decode_all.f32/.bf16/.f16, random.fp8_ef/.bf16_ef with their
// .fp8_residual/.bf16_residual, random.fp8_decode_add/.bf16_decode_add
// (random's values plus the decoded packing of the first 8192 bits
// values), and tail_N.fp8 for the first N values of random (N = 1, 7, 31,
// 33, 1057: short blocks and groups at the end).
type vector struct {
	name  string
	descr string
	data  []byte
}

func vectorSet(t *testing.T) []vector {
	var out []vector
	add := func(name, descr string, data []byte) { out = append(out, vector{name, descr, data}) }
	fp8 := func(dt reduce.DType, raw []byte) []byte {
		n := len(raw) / dt.Size()
		b := make([]byte, MXFP8Len(n))
		require.NoError(t, EncodeMXFP8(b, dt, raw))
		return b
	}
	bf := func(raw []byte) []byte {
		b := make([]byte, BF16Len(len(raw)/4))
		require.NoError(t, EncodeBF16(b, reduce.Float32, raw))
		return b
	}

	all := make([]uint32, 1<<16)
	perm := make([]uint32, 1<<16)
	bits := make([]uint32, 1<<16)
	f16 := make([]byte, 2<<16)
	for i := range all {
		all[i] = uint32(i) << 16
		perm[i] = uint32(i*40503%65536) << 16
		bits[i] = uint32(uint64(i) * 2654435761 % (1 << 32))
		binary.LittleEndian.PutUint16(f16[2*i:], uint16(i))
	}
	add("bf16_all.fp8", "|u1", fp8(reduce.Float32, f32Bytes(all)))
	add("bf16_perm.fp8", "|u1", fp8(reduce.Float32, f32Bytes(perm)))
	add("bits.fp8", "|u1", fp8(reduce.Float32, f32Bytes(bits)))
	add("bits.bf16", "<u2", bf(f32Bytes(bits)))
	add("f16_all.fp8", "|u1", fp8(reduce.Float16, f16))

	dec := make([]byte, MXFP8Len(1<<16))
	mxGroups(dec, 1<<16, func(first, m int, scales, codes []byte) {
		for b := range scales {
			scales[b] = byte((first/BlockElems + b) / 8)
		}
		for i := range codes {
			codes[i] = byte(first + i)
		}
	})
	for _, dt := range []reduce.DType{reduce.Float32, reduce.BFloat16, reduce.Float16} {
		v := make([]byte, dt.Size()<<16)
		require.NoError(t, DecodeMXFP8(v, dt, dec))
		add("decode_all."+map[reduce.DType]string{reduce.Float32: "f32", reduce.BFloat16: "bf16", reduce.Float16: "f16"}[dt],
			map[int]string{2: "<u2", 4: "<u4"}[dt.Size()], v)
	}

	r := rand.New(rand.NewPCG(2026, 12))
	var edge []uint32
	for _, b := range edgeBlocks(r) {
		if len(b) == BlockElems {
			edge = append(edge, b...)
		}
	}
	add("edge.in", "<u4", f32Bytes(edge))
	add("edge.fp8", "|u1", fp8(reduce.Float32, f32Bytes(edge)))
	add("edge.bf16", "<u2", bf(f32Bytes(edge)))

	random := flat(randBlocks(r, 256))
	res := make([]uint32, len(random))
	for i := range res {
		if i%4 != 0 {
			res[i] = math.Float32bits(float32(r.NormFloat64() * math.Ldexp(1, -r.IntN(30))))
		}
	}
	rb := f32Bytes(random)
	add("random.in", "<u4", rb)
	add("residual.in", "<u4", f32Bytes(res))
	add("random.fp8", "|u1", fp8(reduce.Float32, rb))
	add("random.bf16", "<u2", bf(rb))
	for _, n := range []int{1, 7, 31, 33, 1057} {
		add("tail_"+itoa(n)+".fp8", "|u1", fp8(reduce.Float32, rb[:4*n]))
	}
	r8 := f32Bytes(res)
	q8 := make([]byte, MXFP8Len(len(random)))
	require.NoError(t, EncodeFeedbackMXFP8(q8, reduce.Float32, rb, r8))
	add("random.fp8_ef", "|u1", q8)
	add("random.fp8_residual", "<u4", r8)
	r16 := f32Bytes(res)
	q16 := make([]byte, BF16Len(len(random)))
	require.NoError(t, EncodeFeedbackBF16(q16, reduce.Float32, rb, r16))
	add("random.bf16_ef", "<u2", q16)
	add("random.bf16_residual", "<u4", r16)
	// Decode-add into random's values of the first 8192 bits values:
	// sums with NaNs from both sides and Inf - Inf.
	acc := append([]byte(nil), rb...)
	require.NoError(t, DecodeAddMXFP8(acc, fp8(reduce.Float32, f32Bytes(bits[:len(random)]))))
	add("random.fp8_decode_add", "<u4", acc)
	acc = append([]byte(nil), rb...)
	require.NoError(t, DecodeAddBF16(acc, bf(f32Bytes(bits[:len(random)]))))
	add("random.bf16_decode_add", "<u4", acc)
	sort.Slice(out, func(i, j int) bool { return out[i].name < out[j].name })
	return out
}

func itoa(n int) string {
	b := []byte{}
	for ; n > 0; n /= 10 {
		b = append([]byte{byte('0' + n%10)}, b...)
	}
	return string(b)
}

// npyBytes is data as a .npy file of one dimension.
func npyBytes(t *testing.T, descr string, data []byte) []byte {
	size := map[string]int{"|u1": 1, "<u2": 2, "<u4": 4}[descr]
	var b bytes.Buffer
	require.NoError(t, npy.WriteHeader(&b, npy.Header{Descr: descr, Shape: []int64{int64(len(data) / size)}}))
	b.Write(data)
	return b.Bytes()
}

// TestVectors checks testdata/vectors against the codecs (go test -run
// TestVectors -update rewrites them).
func TestVectors(t *testing.T) {
	dir := filepath.Join("testdata", "vectors")
	set := vectorSet(t)
	if *update {
		require.NoError(t, os.RemoveAll(dir))
		require.NoError(t, os.MkdirAll(dir, 0o755))
		for _, v := range set {
			var z bytes.Buffer
			w, err := gzip.NewWriterLevel(&z, gzip.BestCompression)
			require.NoError(t, err)
			_, err = w.Write(npyBytes(t, v.descr, v.data))
			require.NoError(t, err)
			require.NoError(t, w.Close())
			require.NoError(t, os.WriteFile(filepath.Join(dir, v.name+".npy.gz"), z.Bytes(), 0o644))
		}
	}
	names, err := filepath.Glob(filepath.Join(dir, "*.npy.gz"))
	require.NoError(t, err)
	require.Len(t, names, len(set), "files in %s: run go test -run TestVectors -update", dir)
	for _, v := range set {
		f, err := os.Open(filepath.Join(dir, v.name+".npy.gz"))
		require.NoError(t, err, "run go test -run TestVectors -update")
		z, err := gzip.NewReader(f)
		require.NoError(t, err)
		got, err := io.ReadAll(z)
		f.Close()
		require.NoError(t, err)
		require.True(t, bytes.Equal(npyBytes(t, v.descr, v.data), got), "%s differs from what the codecs give now", v.name)
	}
}
