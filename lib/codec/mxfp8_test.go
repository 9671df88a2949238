package codec

import (
	"encoding/binary"
	"fmt"
	"math"
	"math/rand/v2"
	"sort"
	"testing"

	"github.com/gpubridge/gpubridge/lib/reduce"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

// refEncodeBlock is the format's definition in float64 arithmetic,
// independent of the kernels' integer and float tricks: the scale is the
// smallest 2^e >= 2^-127 with max|finite x| <= 448*2^e, each element the
// nearest E4M3 value of x/2^e (ties to the even code), NaN and ±Inf the NaN
// code.
func refEncodeBlock(w []uint32) (byte, []byte) {
	amax := 0.0
	for _, x := range w {
		f := float64(math.Float32frombits(x))
		if !math.IsNaN(f) && !math.IsInf(f, 0) {
			amax = math.Max(amax, math.Abs(f))
		}
	}
	e := -127
	for amax > math.Ldexp(448, e) {
		e++
	}
	codes := make([]byte, len(w))
	for i, x := range w {
		f := float64(math.Float32frombits(x))
		sign := byte(x>>24) & 0x80
		if math.IsNaN(f) || math.IsInf(f, 0) {
			codes[i] = sign | 0x7f
			continue
		}
		v := math.Abs(f) / math.Ldexp(1, e) // exact
		// The codes 0 ... 0x7e are the values in increasing order: take the
		// first at or above v and its predecessor, the nearer one, on a tie
		// the even code.
		hi := byte(sort.Search(0x7f, func(c int) bool { return e4m3Value(byte(c)) >= v }))
		best := hi
		if hi > 0 {
			lo := hi - 1
			dl, dh := v-e4m3Value(lo), e4m3Value(hi)-v
			if hi == 0x7f || dl < dh || dl == dh && lo&1 == 0 {
				best = lo
			}
		}
		if v > 448 {
			panic(fmt.Sprintf("element %g over 448 at scale 2^%d", v, e))
		}
		codes[i] = sign | best
	}
	return byte(e + 127), codes
}

// refDecode is the value of code c at scale s, exactly, rounded to float32
// (so ±Inf past its range).
func refDecode(c, s byte) uint32 {
	if s == 0xff || c&0x7f == 0x7f {
		return uint32(c&0x80)<<24 | 0x7fc00000
	}
	v := e4m3Value(c) * math.Ldexp(1, int(s)-127)
	w := math.Float32bits(float32(v))
	if v == 0 && c&0x80 != 0 {
		w = 0x80000000
	}
	return w
}

// packWith is EncodeMXFP8 of float32 bits, with the assembly kernels
// (where there are some) or the Go ones.
func packWith(t testing.TB, asm bool, w []uint32) []byte {
	t.Helper()
	defer func(saved bool) { useAsm = saved }(useAsm)
	useAsm = asm && useAsm
	out := make([]byte, MXFP8Len(len(w)))
	require.NoError(t, EncodeMXFP8(out, reduce.Float32, f32Bytes(w)))
	return out
}

func unpackWith(t testing.TB, asm bool, packed []byte, n int) []uint32 {
	t.Helper()
	defer func(saved bool) { useAsm = saved }(useAsm)
	useAsm = asm && useAsm
	out := make([]byte, 4*n)
	require.NoError(t, DecodeMXFP8(out, reduce.Float32, packed))
	return u32s(out)
}

// refPack packs float32 bits with refEncodeBlock in the group layout.
func refPack(w []uint32) []byte {
	out := make([]byte, MXFP8Len(len(w)))
	mxGroups(out, len(w), func(first, m int, scales, codes []byte) {
		for b := 0; b*BlockElems < m; b++ {
			hi := min(m, (b+1)*BlockElems)
			s, c := refEncodeBlock(w[first+b*BlockElems : first+hi])
			scales[b] = s
			copy(codes[b*BlockElems:], c)
		}
	})
	return out
}

func TestMXFP8Len(t *testing.T) {
	for _, tc := range []struct{ n, want int }{{0, 0}, {1, 2}, {32, 33}, {33, 35}, {1024, 1056}, {1025, 1058}, {2048, 2112}} {
		assert.Equal(t, tc.want, MXFP8Len(tc.n), "n=%d", tc.n)
	}
	assert.Equal(t, 2*GroupBytes, MXFP8Offset(2*GroupElems))
}

// TestScaleRule checks mxScale against its definition on every exponent
// and the mantissas around the 1.75 threshold.
func TestScaleRule(t *testing.T) {
	for ex := uint32(0); ex < 255; ex++ {
		for _, m := range []uint32{0, 1, 0x400000, 0x5fffff, 0x600000, 0x600001, 0x7fffff} {
			amax := ex<<23 | m
			s, _ := refEncodeBlock([]uint32{amax})
			assert.Equal(t, s, mxScale(amax), "amax %#08x", amax)
		}
	}
}

// TestDecodeAllCodes decodes every code at every scale byte with the Go
// kernels, the assembly ones and the exact reference.
func TestDecodeAllCodes(t *testing.T) {
	for s := range 256 {
		packed := make([]byte, 0, 8*33)
		for b := range 8 {
			packed = append(packed, byte(s))
			for i := range 32 {
				packed = append(packed, byte(32*b+i))
			}
		}
		// 8 blocks of 32 codes: reorder into the group layout.
		grp := make([]byte, MXFP8Len(256))
		for b := range 8 {
			grp[b] = packed[33*b]
			copy(grp[8+32*b:], packed[33*b+1:33*b+33])
		}
		got := unpackWith(t, false, grp, 256)
		for c := range 256 {
			require.Equal(t, refDecode(byte(c), byte(s)), got[c], "code %#02x scale %d", c, s)
		}
		require.Equal(t, got, unpackWith(t, true, grp, 256), "scale %d: assembly", s)
	}
}

// checkEncode encodes w with the Go and the assembly kernels and checks
// both against the reference, and the decoded values against the error
// bound.
func checkEncode(t *testing.T, name string, w []uint32) {
	t.Helper()
	want := refPack(w)
	got := packWith(t, false, w)
	require.Equal(t, want, got, "%s: Go kernels against the reference", name)
	require.Equal(t, want, packWith(t, true, w), "%s: assembly against the reference", name)
	dec := unpackWith(t, true, got, len(w))
	require.Equal(t, unpackWith(t, false, got, len(w)), dec, "%s: decode, assembly against Go", name)
	checkBound(t, name, w, got, dec)
}

// checkBound checks what docs/COMPRESSION.md promises of a round trip:
// finite values within max(|x|/16, 2^(e-10)) (or ±Inf when x rounds past
// float32), signs kept (zeros too), NaN and ±Inf decoded as NaN.
func checkBound(t *testing.T, name string, w []uint32, packed []byte, dec []uint32) {
	t.Helper()
	mxGroups(packed, len(w), func(first, m int, scales, _ []byte) {
		for i := range m {
			x, d := w[first+i], dec[first+i]
			xf, df := float64(math.Float32frombits(x)), float64(math.Float32frombits(d))
			if math.IsNaN(xf) || math.IsInf(xf, 0) {
				require.True(t, math.IsNaN(df) && x>>31 == d>>31, "%s[%d]: %#08x decoded %#08x, want NaN of the same sign", name, first+i, x, d)
				continue
			}
			require.Equal(t, x>>31, d>>31, "%s[%d]: sign of %#08x lost (%#08x)", name, first+i, x, d)
			if math.IsInf(df, 0) {
				require.Greater(t, math.Abs(xf), 0.9*math.MaxFloat32, "%s[%d]: %#08x decoded ±Inf", name, first+i, x)
				continue
			}
			e := int(scales[i/BlockElems]) - 127
			bound := math.Max(math.Abs(xf)/16, math.Ldexp(1, e-10))
			require.LessOrEqual(t, math.Abs(xf-df), bound, "%s[%d]: %#08x decoded %#08x at scale 2^%d", name, first+i, x, d, e)
		}
	})
}

func TestEncodeEdgeBlocks(t *testing.T) {
	r := rand.New(rand.NewPCG(1, 2))
	for i, b := range edgeBlocks(r) {
		checkEncode(t, fmt.Sprintf("edge block %d", i), b)
	}
	checkEncode(t, "edge blocks together", flat(edgeBlocks(r)[:40]))
}

func TestEncodeRandomBlocks(t *testing.T) {
	r := rand.New(rand.NewPCG(3, 4))
	w := flat(randBlocks(r, 4000))
	checkEncode(t, "random blocks", w)
	// Lengths that end in every kind of partial group and block.
	for _, n := range []int{1, 31, 32, 33, 1023, 1024, 1025, 1057, 3000} {
		checkEncode(t, fmt.Sprintf("%d values", n), w[:n])
	}
}

// TestEncodeAllBF16 encodes every bfloat16 value (widened), in order (a
// block shares its exponent range) and shuffled.
func TestEncodeAllBF16(t *testing.T) {
	checkEncode(t, "every bfloat16, in order", allBF16())
	checkEncode(t, "every bfloat16, shuffled", shuffled(allBF16(), 1))
}

// TestEncode16BitInputs: a 16-bit input encodes as its exact float32
// widening, every bit pattern; decoding to 16 bits rounds the float32
// decoding.
func TestEncode16BitInputs(t *testing.T) {
	for _, dt := range []reduce.DType{reduce.BFloat16, reduce.Float16} {
		raw := make([]byte, 2<<16)
		wide := make([]uint32, 1<<16)
		perm := shuffled(allBF16(), 2)
		for i, p := range perm {
			h := uint16(p >> 16)
			binary.LittleEndian.PutUint16(raw[2*i:], h)
			if dt == reduce.BFloat16 {
				wide[i] = uint32(h) << 16
			} else {
				wide[i] = math.Float32bits(reduce.F16ToF32(h))
			}
		}
		got := make([]byte, MXFP8Len(1<<16))
		require.NoError(t, EncodeMXFP8(got, dt, raw))
		require.Equal(t, packWith(t, true, wide), got, "%v", dt)

		dec := make([]byte, 2<<16)
		require.NoError(t, DecodeMXFP8(dec, dt, got))
		dec32 := unpackWith(t, true, got, 1<<16)
		for i := range 1 << 16 {
			f := math.Float32frombits(dec32[i])
			want := reduce.F32ToBF16(f)
			if dt == reduce.Float16 {
				want = reduce.F32ToF16(f)
			}
			require.Equal(t, want, binary.LittleEndian.Uint16(dec[2*i:]), "%v value %d", dt, i)
		}
	}
}

// TestEncodeManyFloat32 puts a strided sample of all float32 values (every
// one with GPUBRIDGE_EXHAUSTIVE=1) through the assembly and Go kernels, each
// value in a block of a varying amax.
func TestEncodeManyFloat32(t *testing.T) {
	if !useAsm {
		t.Skip("no assembly kernels on this machine: nothing to compare the Go kernels with")
	}
	stride := uint64(509)
	if raceOn {
		stride = 2039
	}
	if exhaustive() {
		stride = 1
	}
	const n = 1 << 16
	w := make([]uint32, 0, n)
	flush := func() {
		a, g := packWith(t, true, w), packWith(t, false, w)
		if string(a) != string(g) {
			require.Equal(t, g, a, "block starting %#08x", w[0])
		}
		w = w[:0]
	}
	for x := uint64(0); x < 1<<32; x += stride {
		w = append(w, uint32(x))
		if len(w)%BlockElems == 1 {
			// The block's first value sets its scale: vary it.
			w[len(w)-1] = uint32(x*2654435761) &^ 0x80000000
		}
		if len(w) == n {
			flush()
		}
	}
	if len(w) > 0 {
		flush()
	}
}

// TestChunks: packing a buffer in chunks of whole groups gives the whole
// packing, piece by piece.
func TestChunks(t *testing.T) {
	r := rand.New(rand.NewPCG(5, 6))
	w := flat(randBlocks(r, 200))[:6000]
	whole := packWith(t, true, w)
	for _, chunk := range []int{GroupElems, 2 * GroupElems, 5 * GroupElems} {
		var got []byte
		for first := 0; first < len(w); first += chunk {
			part := w[first:min(len(w), first+chunk)]
			require.Equal(t, len(got), MXFP8Offset(first))
			got = append(got, packWith(t, true, part)...)
		}
		require.Equal(t, whole, got, "chunks of %d", chunk)
	}
}

func TestDecodeAdd(t *testing.T) {
	r := rand.New(rand.NewPCG(7, 8))
	w := flat(randBlocks(r, 100))[:3100]
	acc0 := flat(randBlocks(r, 100))[:3100]
	packed := packWith(t, true, w)
	dec := f32Bytes(unpackWith(t, true, packed, len(w)))
	want := f32Bytes(acc0)
	require.NoError(t, reduce.Combine(reduce.Sum, reduce.Float32, want, want, dec))
	got := f32Bytes(acc0)
	require.NoError(t, DecodeAddMXFP8(got, packed))
	require.Equal(t, want, got)
}

func TestFeedback(t *testing.T) {
	r := rand.New(rand.NewPCG(9, 10))
	w := flat(randBlocks(r, 64))[:2040]
	res0 := make([]uint32, len(w))
	for i := range res0 {
		if i%3 != 0 {
			res0[i] = math.Float32bits(float32(r.NormFloat64() * 1e-3))
		}
	}
	res := f32Bytes(res0)
	got := make([]byte, MXFP8Len(len(w)))
	require.NoError(t, EncodeFeedbackMXFP8(got, reduce.Float32, f32Bytes(w), res))

	u := make([]uint32, len(w))
	for i := range w {
		u[i] = math.Float32bits(math.Float32frombits(w[i]) + math.Float32frombits(res0[i]))
	}
	want := packWith(t, false, u)
	require.Equal(t, want, got)
	dec := unpackWith(t, false, want, len(w))
	for i, r := range u32s(res) {
		uf, df := math.Float32frombits(u[i]), math.Float32frombits(dec[i])
		wantR := uint32(0)
		if !isNonFinite(u[i]) && !isNonFinite(dec[i]) {
			wantR = math.Float32bits(uf - df)
		}
		require.Equal(t, wantR, r, "residual %d (u %#08x, decoded %#08x)", i, u[i], dec[i])
	}
}

func isNonFinite(w uint32) bool { return w&0x7f800000 == 0x7f800000 }

func TestMXFP8Errors(t *testing.T) {
	buf := make([]byte, 4096)
	for _, tc := range []struct {
		name string
		err  error
		kind error
		msg  string
	}{
		{"dtype", EncodeMXFP8(make([]byte, 2), reduce.Int32, buf[:4]), ErrDType, "fp8/v1 encode: int32: fp8 takes float32, bfloat16 or float16"},
		{"not whole values", EncodeMXFP8(make([]byte, 2), reduce.Float32, buf[:5]), ErrLength, "fp8/v1 encode: 5 bytes are not whole float32 values"},
		{"short packed", EncodeMXFP8(make([]byte, 32), reduce.Float32, buf[:128]), ErrLength, "fp8/v1 encode: 32 packed bytes for 32 values (want 33)"},
		{"long packed", DecodeMXFP8(buf[:128], reduce.Float32, make([]byte, 34)), ErrLength, "fp8/v1 decode: 34 packed bytes for 32 values (want 33)"},
		{"overlap", EncodeMXFP8(buf[100:133], reduce.Float32, buf[:128]), ErrOverlap, "fp8/v1 encode: the packed buffer overlaps the values"},
		{"decode-add dtype", DecodeAddMXFP8(buf[:6], make([]byte, 3)), ErrLength, "fp8/v1 decode-add: 6 bytes are not whole float32 values"},
		{"residual", EncodeFeedbackMXFP8(make([]byte, 33), reduce.Float32, buf[:128], make([]byte, 64)), ErrLength, "fp8/v1 encode-feedback: residual of 64 bytes for 32 values (want 128)"},
		{"residual overlap", EncodeFeedbackMXFP8(make([]byte, 33), reduce.Float32, buf[:128], buf[64:192]), ErrOverlap, "fp8/v1 encode-feedback: residual overlaps the input or the output"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			require.Error(t, tc.err)
			assert.ErrorIs(t, tc.err, tc.kind)
			var e *Error
			require.ErrorAs(t, tc.err, &e)
			assert.Equal(t, tc.msg, tc.err.Error())
		})
	}
	// Empty buffers are fine.
	require.NoError(t, EncodeMXFP8(nil, reduce.Float32, nil))
	require.NoError(t, DecodeMXFP8(nil, reduce.BFloat16, nil))
}
