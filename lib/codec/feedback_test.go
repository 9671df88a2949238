package codec

import (
	"encoding/binary"
	"fmt"
	"math"
	"math/rand/v2"
	"testing"

	"github.com/gpubridge/gpubridge/lib/reduce"
	"github.com/stretchr/testify/require"
)

// The error-feedback kernels (fused: u = x + r, encode, decode, r = u - d in
// one pass) against the definition, built here from the plain encoders and
// decoders.

var lossy = []ID{MXFP8, BF16}

// refFeedback is error feedback by its definition (docs/COMPRESSION.md),
// with the Go kernels: u = x + r (lib/reduce's float32 sum); packed =
// encode(u); r' = u - decode(packed) where both are finite, else +0.
func refFeedback(t testing.TB, id ID, x, res []uint32) ([]byte, []uint32) {
	t.Helper()
	defer func(saved bool) { useAsm = saved }(useAsm)
	useAsm = false
	u := f32Bytes(x)
	require.NoError(t, reduce.Combine(reduce.Sum, reduce.Float32, u, u, f32Bytes(res)))
	var packed []byte
	dec := make([]byte, len(u))
	if id == MXFP8 {
		packed = make([]byte, MXFP8Len(len(x)))
		require.NoError(t, EncodeMXFP8(packed, reduce.Float32, u))
		require.NoError(t, DecodeMXFP8(dec, reduce.Float32, packed))
	} else {
		packed = make([]byte, BF16Len(len(x)))
		require.NoError(t, EncodeBF16(packed, reduce.Float32, u))
		require.NoError(t, DecodeBF16(dec, reduce.Float32, packed))
	}
	uw, dw := u32s(u), u32s(dec)
	out := make([]uint32, len(x))
	for i := range out {
		if !isNonFinite(uw[i]) && !isNonFinite(dw[i]) {
			out[i] = math.Float32bits(math.Float32frombits(uw[i]) - math.Float32frombits(dw[i]))
		}
	}
	return packed, out
}

// feedbackWith runs id's EncodeFeedback on raw (values of dt) and a copy
// of res, with the assembly kernels (where there are some) or the Go ones.
func feedbackWith(t testing.TB, asm bool, id ID, dt reduce.DType, raw []byte, res []uint32) ([]byte, []uint32) {
	t.Helper()
	defer func(saved bool) { useAsm = saved }(useAsm)
	useAsm = asm && useAsm
	n := len(raw) / dt.Size()
	r := f32Bytes(res)
	var packed []byte
	if id == MXFP8 {
		packed = make([]byte, MXFP8Len(n))
		require.NoError(t, EncodeFeedbackMXFP8(packed, dt, raw, r))
	} else {
		packed = make([]byte, BF16Len(n))
		require.NoError(t, EncodeFeedbackBF16(packed, dt, raw, r))
	}
	return packed, u32s(r)
}

// sameFeedback fails at the first value whose packing or residual differs,
// naming its inputs.
func sameFeedback(t testing.TB, what string, id ID, x, res []uint32, wantP, gotP []byte, wantR, gotR []uint32) {
	t.Helper()
	if string(wantP) != string(gotP) {
		for i := range wantP {
			if wantP[i] != gotP[i] {
				t.Fatalf("%s: %v packed byte %d is %#02x, want %#02x (%d values)", what, id, i, gotP[i], wantP[i], len(x))
			}
		}
	}
	for i := range wantR {
		if wantR[i] != gotR[i] {
			t.Fatalf("%s: %v residual %d is %#08x, want %#08x (x %#08x, r %#08x)", what, id, i, gotR[i], wantR[i], x[i], res[i])
		}
	}
}

// checkFeedback runs both codecs' error feedback on float32 x with
// residual res, with the assembly and the Go kernels, against the
// definition.
func checkFeedback(t testing.TB, name string, x, res []uint32) {
	t.Helper()
	for _, id := range lossy {
		wantP, wantR := refFeedback(t, id, x, res)
		for _, asm := range []bool{false, true} {
			gotP, gotR := feedbackWith(t, asm, id, reduce.Float32, f32Bytes(x), res)
			sameFeedback(t, fmt.Sprintf("%s, %s kernels", name, map[bool]string{true: "assembly", false: "Go"}[asm]), id, x, res, wantP, gotP, wantR, gotR)
		}
	}
}

// residuals returns n residuals of a kind: zeros, small ones (a trained
// residual: below the values' quantization step), every kind of float32
// (NaN, ±Inf, denormals, huge), or the negated values of x (u = ±0).
func residuals(r *rand.Rand, kind string, x []uint32) []uint32 {
	out := make([]uint32, len(x))
	for i := range out {
		switch kind {
		case "zero":
		case "small":
			f := float64(math.Float32frombits(x[i]))
			if math.IsNaN(f) || math.IsInf(f, 0) || f == 0 {
				f = 1
			}
			out[i] = math.Float32bits(float32(f * r.NormFloat64() / 64))
		case "any":
			out[i] = randF32(r)
		case "negated":
			out[i] = x[i] ^ 0x80000000
		}
	}
	return out
}

var residualKinds = []string{"zero", "small", "any", "negated"}

// TestFeedbackEdgeBlocks: the edge-case blocks as x with every kind of
// residual, and as u itself (x = 0, r = the block, so u = r).
func TestFeedbackEdgeBlocks(t *testing.T) {
	r := rand.New(rand.NewPCG(21, 22))
	blocks := edgeBlocks(r)
	for i, b := range blocks {
		for _, kind := range residualKinds {
			checkFeedback(t, fmt.Sprintf("edge block %d, %s residual", i, kind), b, residuals(r, kind, b))
		}
		checkFeedback(t, fmt.Sprintf("edge block %d as u", i), make([]uint32, len(b)), b)
	}
	all := flat(blocks)
	for _, kind := range residualKinds {
		checkFeedback(t, "edge blocks together, "+kind+" residual", all, residuals(r, kind, all))
	}
}

// TestFeedbackResidualRules pins the rules at the non-finite values: u's
// NaN is x's (quieted), else r's, else the positive default NaN; the
// residual is +0 wherever u or its decoded value is not finite.
func TestFeedbackResidualRules(t *testing.T) {
	const (
		inf, ninf = 0x7f800000, 0xff800000
		maxF      = 0x7f7fffff
	)
	for _, tc := range []struct {
		name       string
		x, r       uint32
		fp8, bf16  uint16 // the values' code
		residualIs uint32
	}{
		{"Inf - Inf: the default NaN, positive", inf, ninf, 0x7f, 0x7fc0, 0},
		{"-Inf + Inf", ninf, inf, 0x7f, 0x7fc0, 0},
		{"x's NaN wins over r's", 0xff812345, 0x7fc00001, 0xff, 0xffc1, 0},
		{"r's NaN", 0x3f800000, 0xff800001, 0xff, 0xffc0, 0},
		{"Inf", ninf, 0x3f800000, 0xff, 0xff80, 0},
		{"overflow to Inf", maxF, maxF, 0x7f, 0x7f80, 0},
		{"decodes past float32", maxF, 0, 0x78, 0x7f80, 0}, // fp8: 256 * 2^120; bf16: rounds up
		{"denormal u, quantized to 0", 0x00000003, 0x80000001, 0x00, 0x0000, 0x00000002},
		{"denormal u at scale 2^-127", 0x00400000, 0x00000001, 0x38, 0x0040, 0x00000001},
	} {
		t.Run(tc.name, func(t *testing.T) {
			x := make([]uint32, 64)
			res := make([]uint32, 64)
			for i := range x {
				x[i], res[i] = tc.x, tc.r
			}
			checkFeedback(t, tc.name, x, res)
			for _, asm := range []bool{false, true} {
				p, got := feedbackWith(t, asm, MXFP8, reduce.Float32, f32Bytes(x), res)
				require.Equal(t, byte(tc.fp8), p[len(x)/BlockElems], "fp8 code")
				require.Equal(t, tc.residualIs, got[0], "fp8 residual")
				p, got = feedbackWith(t, asm, BF16, reduce.Float32, f32Bytes(x), res)
				require.Equal(t, tc.bf16, binary.LittleEndian.Uint16(p), "bf16 code")
				require.Equal(t, tc.residualIs, got[0], "bf16 residual")
			}
		})
	}
}

// TestFeedbackRandom: gradient-like and arbitrary blocks with every kind
// of residual, at every length up to a group and some blocks (every short
// last block and 16-value run), and over consecutive steps.
func TestFeedbackRandom(t *testing.T) {
	r := rand.New(rand.NewPCG(23, 24))
	x := flat(randBlocks(r, 300))
	for _, kind := range residualKinds {
		checkFeedback(t, kind+" residual", x, residuals(r, kind, x))
	}
	res := residuals(r, "small", x)
	step := GroupElems + 3*BlockElems
	if raceOn {
		step = 3 * BlockElems
	}
	for n := 0; n <= step; n++ {
		checkFeedback(t, fmt.Sprintf("%d values", n), x[:n], res[:n])
	}
	for _, n := range []int{2*GroupElems - 1, 2 * GroupElems, 2*GroupElems + 17, 5000} {
		checkFeedback(t, fmt.Sprintf("%d values", n), x[:n], res[:n])
	}
	// Steps: each feeds its residual to the next.
	for _, id := range lossy {
		want, got := res, res
		for s := range 4 {
			var wantP, gotP []byte
			wantP, want = refFeedback(t, id, x, want)
			gotP, got = feedbackWith(t, true, id, reduce.Float32, f32Bytes(x), got)
			sameFeedback(t, fmt.Sprintf("step %d", s), id, x, res, wantP, gotP, want, got)
		}
	}
}

// TestFeedbackChunks: error feedback on chunks of whole groups gives the
// whole buffer's packing and residual, piece by piece (the bridge encodes
// chunk by chunk).
func TestFeedbackChunks(t *testing.T) {
	r := rand.New(rand.NewPCG(25, 26))
	x := flat(randBlocks(r, 200))[:6000]
	res := residuals(r, "small", x)
	for _, id := range lossy {
		wantP, wantR := feedbackWith(t, true, id, reduce.Float32, f32Bytes(x), res)
		for _, chunk := range []int{GroupElems, 3 * GroupElems} {
			var gotP []byte
			var gotR []uint32
			for first := 0; first < len(x); first += chunk {
				hi := min(len(x), first+chunk)
				p, rr := feedbackWith(t, true, id, reduce.Float32, f32Bytes(x[first:hi]), res[first:hi])
				gotP = append(gotP, p...)
				gotR = append(gotR, rr...)
			}
			sameFeedback(t, fmt.Sprintf("chunks of %d", chunk), id, x, res, wantP, gotP, wantR, gotR)
		}
	}
}

// TestFeedback16BitInputs: a 16-bit input's error feedback is that of its
// exact float32 widening, every bit pattern.
func TestFeedback16BitInputs(t *testing.T) {
	r := rand.New(rand.NewPCG(27, 28))
	perm := shuffled(allBF16(), 3)
	for _, dt := range []reduce.DType{reduce.BFloat16, reduce.Float16} {
		raw := make([]byte, 2*len(perm))
		wide := make([]uint32, len(perm))
		for i, p := range perm {
			h := uint16(p >> 16)
			binary.LittleEndian.PutUint16(raw[2*i:], h)
			if dt == reduce.BFloat16 {
				wide[i] = uint32(h) << 16
			} else {
				wide[i] = math.Float32bits(reduce.F16ToF32(h))
			}
		}
		for _, id := range lossy {
			if id == BF16 && dt == reduce.Float16 {
				continue // bf16/v1 takes float32 or bfloat16
			}
			for _, kind := range residualKinds {
				res := residuals(r, kind, wide)
				wantP, wantR := refFeedback(t, id, wide, res)
				for _, asm := range []bool{false, true} {
					gotP, gotR := feedbackWith(t, asm, id, dt, raw, res)
					sameFeedback(t, fmt.Sprintf("%v input, %s residual, asm %v", dt, kind, asm), id, wide, res, wantP, gotP, wantR, gotR)
				}
			}
		}
	}
}

// TestFeedbackManyFloat32 puts a strided sample of all float32 values
// (every one with GPUBRIDGE_EXHAUSTIVE=1) through error feedback as u
// (zero residual), and again beside residuals of every kind, with the
// assembly and the Go kernels against the definition; each value in a
// block of a varying amax.
func TestFeedbackManyFloat32(t *testing.T) {
	stride := uint64(1021)
	if raceOn {
		stride = 8191
	}
	if exhaustive() {
		stride = 1
	}
	r := rand.New(rand.NewPCG(29, 30))
	const n = 1 << 16
	x := make([]uint32, 0, n)
	flush := func() {
		checkFeedback(t, fmt.Sprintf("u from %#08x", x[0]), x, make([]uint32, len(x)))
		kind := residualKinds[1+r.IntN(len(residualKinds)-1)]
		checkFeedback(t, fmt.Sprintf("x from %#08x, %s residual", x[0], kind), x, residuals(r, kind, x))
		x = x[:0]
	}
	for v := uint64(0); v < 1<<32; v += stride {
		x = append(x, uint32(v))
		if len(x)%BlockElems == 1 {
			// The block's first value sets its scale: vary it.
			x[len(x)-1] = uint32(v*2654435761) &^ 0x80000000
		}
		if len(x) == n {
			flush()
		}
	}
	if len(x) > 0 {
		flush()
	}
}
