package codec

import (
	"encoding/binary"
	"math"
	"math/rand/v2"
	"testing"

	"github.com/gpubridge/gpubridge/lib/reduce"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

func bfWith(t testing.TB, asm bool, w []uint32) []byte {
	t.Helper()
	defer func(saved bool) { useAsm = saved }(useAsm)
	useAsm = asm && useAsm
	out := make([]byte, BF16Len(len(w)))
	require.NoError(t, EncodeBF16(out, reduce.Float32, f32Bytes(w)))
	return out
}

// TestBF16Encode: the codec is lib/reduce's F32ToBF16, value by value, with
// the assembly kernel and the Go one; a strided sample of all float32
// values (every one with GPUBRIDGE_EXHAUSTIVE=1), the specials, and every
// bfloat16 widened (which must come back unchanged).
func TestBF16Encode(t *testing.T) {
	stride := uint64(251)
	if raceOn {
		stride = 1021
	}
	if exhaustive() {
		stride = 1
	}
	w := make([]uint32, 0, 1<<16)
	check := func() {
		a, g := bfWith(t, true, w), bfWith(t, false, w)
		for i, x := range w {
			want := reduce.F32ToBF16(math.Float32frombits(x))
			if got := binary.LittleEndian.Uint16(g[2*i:]); got != want {
				require.Equal(t, want, got, "Go kernel, %#08x", x)
			}
		}
		if string(a) != string(g) {
			require.Equal(t, g, a, "assembly against Go from %#08x", w[0])
		}
		w = w[:0]
	}
	for x := uint64(0); x < 1<<32; x += stride {
		if w = append(w, uint32(x)); len(w) == cap(w) {
			check()
		}
	}
	w = append(w, special...)
	check()
	all := allBF16()
	packed := bfWith(t, true, all)
	for i := range all {
		h := uint16(i)
		if h&0x7fff > 0x7f80 { // a NaN comes back quiet
			h |= 0x40
		}
		require.Equal(t, h, binary.LittleEndian.Uint16(packed[2*i:]), "bfloat16 %#04x", i)
	}
}

func TestBF16DecodeAndAdd(t *testing.T) {
	r := rand.New(rand.NewPCG(11, 12))
	packed := make([]byte, 2*3001)
	for i := range packed {
		packed[i] = byte(r.Uint32())
	}
	for _, asm := range []bool{true, false} {
		func() {
			defer func(saved bool) { useAsm = saved }(useAsm)
			useAsm = asm && useAsm
			dec := make([]byte, 4*3001)
			require.NoError(t, DecodeBF16(dec, reduce.Float32, packed))
			for i := range 3001 {
				require.Equal(t, uint32(binary.LittleEndian.Uint16(packed[2*i:]))<<16, binary.LittleEndian.Uint32(dec[4*i:]))
			}
			acc := f32Bytes(flat(randBlocks(r, 100))[:3001])
			want := append([]byte(nil), acc...)
			require.NoError(t, reduce.Combine(reduce.Sum, reduce.Float32, want, want, dec))
			require.NoError(t, DecodeAddBF16(acc, packed))
			require.Equal(t, want, acc)
		}()
	}
	// bfloat16 in, bfloat16 out: the bytes as they are.
	same := make([]byte, len(packed))
	require.NoError(t, EncodeBF16(same, reduce.BFloat16, packed))
	assert.Equal(t, packed, same)
	require.NoError(t, DecodeBF16(same, reduce.BFloat16, packed))
	assert.Equal(t, packed, same)
}

func TestBF16Feedback(t *testing.T) {
	r := rand.New(rand.NewPCG(13, 14))
	w := flat(randBlocks(r, 40))[:1250]
	res := make([]byte, 4*len(w))
	got := make([]byte, BF16Len(len(w)))
	require.NoError(t, EncodeFeedbackBF16(got, reduce.Float32, f32Bytes(w), res))
	assert.Equal(t, bfWith(t, false, w), got, "zero residual: plain encoding")
	for i, x := range w {
		q := uint32(binary.LittleEndian.Uint16(got[2*i:])) << 16
		want := uint32(0)
		if !isNonFinite(x) && !isNonFinite(q) {
			want = math.Float32bits(math.Float32frombits(x) - math.Float32frombits(q))
		}
		require.Equal(t, want, binary.LittleEndian.Uint32(res[4*i:]), "value %d %#08x", i, x)
	}
	// The next step adds the residual: u = x + r.
	got2 := make([]byte, len(got))
	res2 := append([]byte(nil), res...)
	require.NoError(t, EncodeFeedbackBF16(got2, reduce.Float32, f32Bytes(w), res2))
	for i, x := range w {
		u := math.Float32bits(math.Float32frombits(x) + math.Float32frombits(binary.LittleEndian.Uint32(res[4*i:])))
		require.Equal(t, reduce.F32ToBF16(math.Float32frombits(u)), binary.LittleEndian.Uint16(got2[2*i:]), "value %d", i)
	}
}

func TestBF16Errors(t *testing.T) {
	err := EncodeBF16(make([]byte, 2), reduce.Float16, make([]byte, 2))
	require.ErrorIs(t, err, ErrDType)
	assert.Equal(t, "bf16/v1 encode: float16: bf16 takes float32 or bfloat16 (float16 is already 2 bytes a value: use fp8 or zstd)", err.Error())
	err = DecodeBF16(make([]byte, 8), reduce.Float32, make([]byte, 2))
	require.ErrorIs(t, err, ErrLength)
	assert.Equal(t, "bf16/v1 decode: 2 packed bytes for 2 values (want 4)", err.Error())
	err = DecodeAddBF16(make([]byte, 8), make([]byte, 6))
	require.ErrorIs(t, err, ErrLength)
	err = EncodeFeedbackBF16(make([]byte, 4), reduce.Float32, make([]byte, 8), make([]byte, 4))
	require.ErrorIs(t, err, ErrLength)
}
