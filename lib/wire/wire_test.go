package wire

import (
	"errors"
	"fmt"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

func TestRoundTrip(t *testing.T) {
	payload := []byte("some chunk of floats")
	h := Header{Kind: KindData, Codec: 2, Seq: 1 << 40, Step: 3, Chunk: 17}
	h.Seal(payload, true)
	var b [HeaderSize]byte
	h.Put(b[:])
	assert.Equal(t, byte(2), b[5], "the codec byte is at offset 5")
	got, err := Parse(b[:])
	require.NoError(t, err)
	assert.Equal(t, h, got)
	require.NoError(t, got.Verify(payload))

	payload[0] ^= 1
	err = got.Verify(payload)
	assert.True(t, errors.Is(err, ErrCorrupt))
	var ce *CorruptError
	require.ErrorAs(t, err, &ce)
	assert.Equal(t, h, ce.Header)
	assert.Equal(t, Checksum(payload), ce.Got)
	assert.Equal(t, fmt.Sprintf("corrupt frame: CRC32C mismatch: the 20-byte payload has CRC32C %#08x, its header says %#08x (header as received: data frame, seq 1099511627776, step field 0x00000003, chunk 17)", ce.Got, h.CRC), err.Error())
	assert.ErrorContains(t, got.Verify(payload[:3]), "header says")

	h.Seal(payload, false)
	assert.Zero(t, h.Flags&FlagCRC)
	assert.NoError(t, h.Verify(payload))
}

func TestParseRejects(t *testing.T) {
	valid := func() []byte {
		h := Header{Kind: KindP2P, Len: 8}
		b := make([]byte, HeaderSize)
		h.Put(b)
		return b
	}
	tests := []struct {
		name   string
		mutate func([]byte) []byte
		want   string
	}{
		{"short", func(b []byte) []byte { return b[:31] }, "31 bytes, need 32"},
		{"magic", func(b []byte) []byte { b[0] = 'X'; return b }, "bad magic"},
		{"version", func(b []byte) []byte { b[2] = 9; return b }, fmt.Sprintf("protocol version 9, this gbbridge speaks %d", ProtocolVersion)},
		{"kind", func(b []byte) []byte { b[3] = 0; return b }, "unknown kind 0"},
		{"kind high", func(b []byte) []byte { b[3] = 99; return b }, "unknown kind 99"},
		{"flags", func(b []byte) []byte { b[4] = 0x80; return b }, "unknown flags"},
		{"reserved", func(b []byte) []byte { b[7] = 1; return b }, "reserved bytes"},
		{"too long", func(b []byte) []byte { b[27] = 0xff; return b }, "over the 67108864-byte limit"},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			_, err := Parse(tc.mutate(valid()))
			assert.ErrorContains(t, err, tc.want)
		})
	}
}

func FuzzParse(f *testing.F) {
	h := Header{Kind: KindData, Flags: FlagCRC, Seq: 7, Step: 1, Chunk: 2, Len: 4, CRC: 0xdeadbeef}
	b := make([]byte, HeaderSize)
	h.Put(b)
	f.Add(b)
	f.Add(make([]byte, HeaderSize))
	f.Add([]byte("GB"))
	f.Fuzz(func(t *testing.T, data []byte) {
		h, err := Parse(data)
		if err != nil {
			return
		}
		// Whatever parses re-encodes to the same bytes.
		out := make([]byte, HeaderSize)
		h.Put(out)
		assert.Equal(t, data[:HeaderSize], out)
		assert.LessOrEqual(t, h.Len, uint32(MaxPayload))
	})
}

func BenchmarkChecksum(b *testing.B) {
	p := make([]byte, 4<<20)
	b.SetBytes(int64(len(p)))
	for b.Loop() {
		Checksum(p)
	}
}
