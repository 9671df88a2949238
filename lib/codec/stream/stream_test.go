package stream

import (
	"bytes"
	"encoding/binary"
	"hash/crc32"
	"io"
	"math"
	"math/rand/v2"
	"testing"

	"github.com/gpubridge/gpubridge/lib/codec"
	"github.com/gpubridge/gpubridge/lib/reduce"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

func values(n int, seed uint64) []byte {
	r := rand.New(rand.NewPCG(seed, 3))
	b := make([]byte, 4*n)
	for i := 0; i < n; i++ {
		binary.LittleEndian.PutUint32(b[4*i:], math.Float32bits(float32(r.NormFloat64()*1e-3)))
	}
	return b
}

func write(t testing.TB, h Header, raw []byte, pieces int) []byte {
	t.Helper()
	var out bytes.Buffer
	w, err := NewWriter(&out, h, Options{})
	require.NoError(t, err)
	step := max(1, len(raw)/pieces)
	for i := 0; i < len(raw); i += step {
		_, err := w.Write(raw[i:min(len(raw), i+step)])
		require.NoError(t, err)
	}
	require.NoError(t, w.Close())
	return out.Bytes()
}

func read(t testing.TB, stream []byte, opt ReaderOptions) ([]byte, Header, error) {
	t.Helper()
	r, err := NewReader(bytes.NewReader(stream), opt)
	if err != nil {
		return nil, Header{}, err
	}
	out, err := io.ReadAll(r)
	return out, r.Header(), err
}

// TestRoundTrip: every codec, chunks of several sizes, values written in
// odd pieces; what comes back is the codec's decoding of each chunk.
func TestRoundTrip(t *testing.T) {
	raw := values(5000, 1)
	for _, id := range []codec.ID{codec.Raw, codec.BF16, codec.MXFP8, codec.Zstd} {
		for _, chunk := range []int{1024, 4096, 8192} {
			h := Header{Codec: id, DType: reduce.Float32, ChunkValues: chunk, Shape: []int64{50, 100}}
			s := write(t, h, raw, 7)
			got, gh, err := read(t, s, ReaderOptions{})
			require.NoError(t, err, "%s chunk %d", id, chunk)
			assert.Equal(t, h, gh)
			want := make([]byte, len(raw))
			packed := make([]byte, 2*len(raw)+1000)
			k, err := codec.EncodeChunk(id, packed, reduce.Float32, raw, codec.LosslessOptions{})
			require.NoError(t, err)
			require.NoError(t, codec.DecodeChunk(id, want, reduce.Float32, packed[:k]))
			assert.Equal(t, want, got, "%s chunk %d", id, chunk)
			if !id.Lossy() {
				assert.Equal(t, raw, got)
			}
		}
	}
	// Decoding to another dtype.
	s := write(t, Header{Codec: codec.MXFP8, DType: reduce.Float32, ChunkValues: 2048}, raw, 1)
	got, _, err := read(t, s, ReaderOptions{OutDType: reduce.BFloat16})
	require.NoError(t, err)
	assert.Len(t, got, 2*5000)
	_, _, err = read(t, write(t, Header{Codec: codec.Zstd, DType: reduce.Float32}, raw, 1), ReaderOptions{OutDType: reduce.BFloat16})
	assert.EqualError(t, err, "a zstd stream of float32 decodes to float32 only")
}

func TestEmptyStream(t *testing.T) {
	s := write(t, Header{Codec: codec.MXFP8, DType: reduce.Float16}, nil, 1)
	assert.Len(t, s, headerSize+recordSize+endPayload)
	got, _, err := read(t, s, ReaderOptions{})
	require.NoError(t, err)
	assert.Empty(t, got)
}

func TestWriterRefuses(t *testing.T) {
	_, err := NewWriter(io.Discard, Header{Codec: codec.MXFP8, DType: reduce.Float32, ChunkValues: 1000}, Options{})
	assert.EqualError(t, err, "chunk of 1000 values: it must be a multiple of 1024, at most 16777216")
	_, err = NewWriter(io.Discard, Header{Codec: codec.BF16, DType: reduce.Float16}, Options{})
	assert.ErrorIs(t, err, codec.ErrDType)
	w, err := NewWriter(io.Discard, Header{Codec: codec.BF16, DType: reduce.Float32}, Options{})
	require.NoError(t, err)
	_, err = w.Write([]byte{1, 2, 3, 4, 5})
	require.NoError(t, err)
	assert.EqualError(t, w.Close(), "the input ends in the middle of a float32 value (1 bytes left over)")
	w, err = NewWriter(io.Discard, Header{Codec: codec.Raw, DType: reduce.Float32, Shape: []int64{3}}, Options{})
	require.NoError(t, err)
	_, _ = w.Write(make([]byte, 8))
	assert.EqualError(t, w.Close(), "2 values written for shape [3] (3 values)")
}

func TestReaderRefuses(t *testing.T) {
	good := write(t, Header{Codec: codec.MXFP8, DType: reduce.Float32, ChunkValues: 1024}, values(2000, 2), 1)
	edit := func(f func(b []byte) []byte) []byte { return f(append([]byte(nil), good...)) }
	second := headerSize + recordSize + codec.MXFP8Len(1024) // the second record
	for _, tc := range []struct {
		name string
		in   []byte
		msg  string
	}{
		{"empty", nil, "gbcompress stream: input ends in the header"},
		{"magic", edit(func(b []byte) []byte { b[0] = 'X'; return b }), `gbcompress stream: does not begin with "GBCZ"`},
		{"version", edit(func(b []byte) []byte { b[4] = 9; return b }), "gbcompress stream: version 9 (this gbcompress reads 1)"},
		{"unknown codec", edit(func(b []byte) []byte { b[5] = 77; return b }), "codec 77 is unknown to this gpubridge (it knows 0 raw, 1 bf16/v1, 2 fp8/v1, 3 zstd/v1): every member must run a gpubridge that knows the job's codec"},
		{"dtype", edit(func(b []byte) []byte { b[6] = byte(reduce.Int32); return b }), "gbcompress stream: codec fp8 with dtype 7: fp8/v1 encode: int32: fp8 takes float32, bfloat16 or float16"},
		{"flags", edit(func(b []byte) []byte { b[7] = 4; return b }), "gbcompress stream: unknown flags 0x04"},
		{"reserved", edit(func(b []byte) []byte { b[13] = 1; return b }), "gbcompress stream: reserved header bytes are not zero"},
		{"chunk", edit(func(b []byte) []byte { binary.LittleEndian.PutUint32(b[8:], 1000); return b }), "gbcompress stream: chunks of 1000 values: fp8 needs a multiple of 1024"},
		{"huge chunk", edit(func(b []byte) []byte { binary.LittleEndian.PutUint32(b[8:], 1<<30); return b }), "gbcompress stream: chunks of 1073741824 values (1 to 16777216)"},
		{"truncated", good[:len(good)-3], "gbcompress stream: input ends in the end record"},
		{"no end", good[:second], "gbcompress stream: input ends in a record (no end record: truncated?)"},
		{"crc", edit(func(b []byte) []byte { b[headerSize+recordSize+5] ^= 1; return b }), "gbcompress stream: record 0 (values from 0): CRC32C does not match"},
		{"big record", edit(func(b []byte) []byte { binary.LittleEndian.PutUint32(b[headerSize:], 2048); return b }), "gbcompress stream: a record of 2048 values in chunks of 1024"},
		{"packed length", edit(func(b []byte) []byte { binary.LittleEndian.PutUint32(b[headerSize+4:], 5000); return b }), "gbcompress stream: a record of 5000 packed bytes for 1024 values (at most 1056)"},
		{"trailing", append(append([]byte(nil), good...), 0), "gbcompress stream: bytes after the end record"},
		{"total", edit(func(b []byte) []byte {
			end := b[len(b)-endPayload:]
			binary.LittleEndian.PutUint64(end, 7)
			binary.LittleEndian.PutUint32(b[len(b)-endPayload-4:], crc32.Checksum(end, castagnoli))
			return b
		}), "gbcompress stream: the end record says 7 values, the records hold 2000"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			_, _, err := read(t, tc.in, ReaderOptions{})
			require.Error(t, err)
			assert.Equal(t, tc.msg, err.Error())
		})
	}
}

// FuzzReader: no panic on any input; what reads writes back to a stream
// that reads the same values.
func FuzzReader(f *testing.F) {
	raw := values(1500, 4)
	for _, id := range []codec.ID{codec.Raw, codec.BF16, codec.MXFP8, codec.Zstd} {
		f.Add(write(f, Header{Codec: id, DType: reduce.Float32, ChunkValues: 1024, Shape: []int64{1500}}, raw, 1))
	}
	f.Fuzz(func(t *testing.T, data []byte) {
		got, h, err := read(t, data, ReaderOptions{})
		if err != nil {
			return
		}
		if !h.Codec.Lossy() {
			again, _, err := read(t, write(t, h, got, 1), ReaderOptions{})
			if err != nil || !bytes.Equal(again, got) {
				t.Fatalf("round trip: %v", err)
			}
		}
	})
}
