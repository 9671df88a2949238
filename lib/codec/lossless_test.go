package codec

import (
	"encoding/binary"
	"fmt"
	"math/rand/v2"
	"testing"

	"github.com/gpubridge/gpubridge/lib/reduce"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

func packLossless(t testing.TB, dt reduce.DType, src []byte, opt LosslessOptions) []byte {
	t.Helper()
	dst := make([]byte, LosslessMaxLen(dt, len(src)))
	n, err := EncodeLossless(dst, dt, src, opt)
	require.NoError(t, err)
	return dst[:n]
}

func TestLosslessRoundTrip(t *testing.T) {
	r := rand.New(rand.NewPCG(21, 22))
	grads := gradients(50000, 3)
	random := make([]byte, 40000)
	for i := range random {
		random[i] = byte(r.Uint32())
	}
	bf := make([]byte, 2*50000)
	narrow(bf, reduce.BFloat16, grads)
	for _, tc := range []struct {
		name string
		dt   reduce.DType
		src  []byte
	}{
		{"empty", reduce.Float32, []byte{}},
		{"one float32", reduce.Float32, grads[:4]},
		{"float32 gradients", reduce.Float32, grads},
		{"bfloat16 gradients", reduce.BFloat16, bf},
		{"float16", reduce.Float16, random},
		{"float64", reduce.Float64, random},
		{"int32", reduce.Int32, random},
		{"bytes", 0, random[:12345]},
		{"zeros", reduce.Float32, make([]byte, 1<<20)},
	} {
		for _, opt := range []LosslessOptions{{}, {Method: S2Plane}, {Method: ZstdPlane}, {Method: Huff0Plane}} {
			t.Run(fmt.Sprintf("%s/method=%d", tc.name, opt.Method), func(t *testing.T) {
				packed := packLossless(t, tc.dt, tc.src, opt)
				out := make([]byte, len(tc.src))
				require.NoError(t, DecodeLossless(out, tc.dt, packed))
				require.Equal(t, tc.src, out)
				if tc.name == "zeros" {
					assert.Less(t, len(packed), 1000)
				}
			})
		}
	}
	// Gradients compress, and the exponent plane is what shrinks.
	packed := packLossless(t, reduce.Float32, grads, LosslessOptions{})
	assert.Less(t, len(packed), len(grads)*9/10, "float32 gradients")
	assert.Equal(t, byte(Huff0Plane), packed[losslessHeader+5*3], "the exponent plane")
	assert.Equal(t, byte(Stored), packed[losslessHeader], "the lowest mantissa plane")
}

// TestLosslessRotation: the top plane of a float32 is its exponent byte.
func TestLosslessRotation(t *testing.T) {
	src := f32Bytes([]uint32{0xbf800000, 0x3f800000, 0x40490fdb})
	planes := make([]byte, 12)
	splitPlanes(planes, src, 4, true)
	assert.Equal(t, []byte{0x7f, 0x7f, 0x80}, planes[9:], "the exponents")
	assert.Equal(t, []byte{0x01, 0x00, 0xb6}, planes[:3], "the signs in bit 0")
	back := make([]byte, 12)
	joinPlanes(back, planes, 4, true)
	assert.Equal(t, src, back)
}

func TestLosslessCorrupt(t *testing.T) {
	src := gradients(4096, 5)
	good := packLossless(t, reduce.Float32, src, LosslessOptions{})
	edit := func(f func(b []byte) []byte) []byte { return f(append([]byte(nil), good...)) }
	put32 := func(b []byte, off int, v uint32) []byte { binary.LittleEndian.PutUint32(b[off:], v); return b }
	for _, tc := range []struct {
		name string
		in   []byte
		kind error
		msg  string
	}{
		{"short", good[:5], ErrCorrupt, "5 bytes, shorter than the 8-byte header"},
		{"version", edit(func(b []byte) []byte { b[0] = 2; return b }), ErrCorrupt, "format version 2 (this build reads 1)"},
		{"element size", edit(func(b []byte) []byte { b[1] = 2; return b }), ErrCorrupt, "element size 2, want 4 (float32)"},
		{"transform", edit(func(b []byte) []byte { b[2] = 0; return b }), ErrCorrupt, "transform bytes 0 0, want 1 0"},
		{"raw length", edit(func(b []byte) []byte { return put32(b, 4, 100) }), ErrLength, "the chunk holds 100 bytes, want 16384"},
		{"no table", good[:10], ErrCorrupt, "10 bytes, shorter than the header and plane table (28)"},
		{"truncated", good[:len(good)-1], ErrCorrupt, fmt.Sprintf("the planes say %d packed bytes, the chunk has %d", len(good)-28, len(good)-29)},
		{"method", edit(func(b []byte) []byte { b[8+15] = 9; return b }), ErrCorrupt, "plane 3: zstd/v1 decode: unknown method 9"},
		{"stored length", edit(func(b []byte) []byte {
			b = put32(b, 9, 4095)
			return put32(b, 9+15, binary.LittleEndian.Uint32(b[9+15:])+1)
		}), ErrCorrupt, "plane 0: zstd/v1 decode: stored plane of 4095 bytes, want 4096"},
		{"zstd garbage", edit(func(b []byte) []byte { b[len(b)-3] ^= 0xff; return b }), ErrCorrupt, ""},
	} {
		t.Run(tc.name, func(t *testing.T) {
			out := make([]byte, len(src))
			err := DecodeLossless(out, reduce.Float32, tc.in)
			require.Error(t, err)
			assert.ErrorIs(t, err, tc.kind)
			if tc.msg != "" {
				assert.Equal(t, "zstd/v1 decode: "+tc.msg, err.Error())
			}
		})
	}
	// A frame that says it holds more than its plane is refused before it
	// is decoded.
	big := packLossless(t, reduce.Float32, make([]byte, 8192), LosslessOptions{})
	err := DecodeLossless(make([]byte, 4096), reduce.Float32, big)
	require.ErrorIs(t, err, ErrLength)
}

func TestLosslessLimits(t *testing.T) {
	_, err := EncodeLossless(make([]byte, 30), reduce.Float32, make([]byte, 8), LosslessOptions{})
	require.ErrorIs(t, err, ErrLength) // room
	_, err = EncodeLossless(make([]byte, 100), reduce.Float32, make([]byte, 7), LosslessOptions{})
	require.ErrorIs(t, err, ErrLength)
	err = DecodeLossless(make([]byte, MaxLosslessChunk+4), reduce.Float32, make([]byte, 64))
	require.ErrorIs(t, err, ErrLimit)
	_, err = EncodeLossless(make([]byte, 100), reduce.DType(77), make([]byte, 8), LosslessOptions{})
	require.ErrorIs(t, err, ErrDType)
}
