package codec

import (
	"testing"

	"github.com/gpubridge/gpubridge/lib/reduce"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

func TestIDs(t *testing.T) {
	for _, tc := range []struct {
		id        ID
		name, ver string
		lossy     bool
	}{
		{Raw, "raw", "raw", false}, {BF16, "bf16", "bf16/v1", true}, {MXFP8, "fp8", "fp8/v1", true}, {Zstd, "zstd", "zstd/v1", false},
	} {
		assert.Equal(t, tc.name, tc.id.String())
		assert.Equal(t, tc.ver, tc.id.Versioned())
		assert.Equal(t, tc.lossy, tc.id.Lossy())
		got, err := Parse(tc.ver)
		require.NoError(t, err)
		assert.Equal(t, tc.id, got)
		assert.NoError(t, Check(tc.id))
	}
	for name, want := range map[string]ID{"none": Raw, "MXFP8": MXFP8, " lossless ": Zstd, "bfloat16": BF16} {
		got, err := Parse(name)
		require.NoError(t, err)
		assert.Equal(t, want, got)
	}
	err := Check(4)
	require.ErrorIs(t, err, ErrUnknown)
	assert.Equal(t, "codec 4 is unknown to this gpubridge (it knows 0 raw, 1 bf16/v1, 2 fp8/v1, 3 zstd/v1): every member must run a gpubridge that knows the job's codec", err.Error())
	_, err = Parse("fp4")
	require.ErrorIs(t, err, ErrUnknown)
	assert.Contains(t, err.Error(), `codec "fp4" is unknown`)
	assert.Equal(t, "codec(200)", ID(200).String())
}

func TestChunkAPI(t *testing.T) {
	src := gradients(3000, 8)
	for _, id := range IDs() {
		n, err := MaxPackedLen(id, reduce.Float32, 3000)
		require.NoError(t, err)
		dst := make([]byte, n)
		k, err := EncodeChunk(id, dst, reduce.Float32, src, LosslessOptions{})
		require.NoError(t, err, "%s", id)
		out := make([]byte, len(src))
		require.NoError(t, DecodeChunk(id, out, reduce.Float32, dst[:k]), "%s", id)
		switch id {
		case Raw, Zstd:
			assert.Equal(t, src, out)
		case MXFP8:
			assert.Equal(t, MXFP8Len(3000), k)
		case BF16:
			assert.Equal(t, 6000, k)
		}
		_, err = EncodeChunk(id, dst[:n-1], reduce.Float32, src, LosslessOptions{})
		assert.ErrorIs(t, err, ErrLength, "%s: too little room", id)
	}
	assert.Equal(t, GroupElems, ChunkAlign(MXFP8))
	assert.Equal(t, 1, ChunkAlign(Zstd))
	assert.ErrorIs(t, Supports(MXFP8, reduce.Int8), ErrDType)
	assert.ErrorIs(t, Supports(BF16, reduce.Float16), ErrDType)
	assert.NoError(t, Supports(Zstd, 0))
	assert.NoError(t, Supports(Raw, reduce.Int64))
	assert.ErrorIs(t, Supports(9, reduce.Float32), ErrUnknown)
	err := DecodeChunk(Raw, make([]byte, 4), reduce.Float32, make([]byte, 8))
	assert.EqualError(t, err, "raw decode: 8 packed bytes for 4 bytes")
	err = DecodeChunk(BF16, make([]byte, 4), reduce.Int32, make([]byte, 2))
	assert.EqualError(t, err, "bf16/v1 decode: int32: bf16 takes float32 or bfloat16 (float16 is already 2 bytes a value: use fp8 or zstd)")
}
