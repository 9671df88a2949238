package feed

import (
	"bytes"
	"encoding/binary"
	"strings"
	"testing"

	"github.com/gpubridge/gpubridge/lib/reduce"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

// The JOIN body byte by byte (docs/FEED.md §3b).
func TestJoinLayout(t *testing.T) {
	b := (&JoinMsg{ID: 0x0102030405060708, Bridge: 9, Name: "pair/1-2", Members: []uint32{2, 1}}).Append(nil)
	le := binary.LittleEndian
	require.Len(t, b, HeaderSize+8+4+4+2+8+2+2*4)
	assert.Equal(t, uint16(10), le.Uint16(b[4:]))
	body := b[HeaderSize:]
	assert.Equal(t, uint64(0x0102030405060708), le.Uint64(body[0:]))
	assert.Equal(t, uint32(9), le.Uint32(body[8:]))
	assert.Equal(t, uint32(0), le.Uint32(body[12:]))
	assert.Equal(t, uint16(8), le.Uint16(body[16:]))
	assert.Equal(t, "pair/1-2", string(body[18:26]))
	assert.Equal(t, uint16(2), le.Uint16(body[26:]))
	assert.Equal(t, uint32(2), le.Uint32(body[28:]))
	assert.Equal(t, uint32(1), le.Uint32(body[32:]))
}

// A JOIN's limits are the decoder's: id, flags, name, member count,
// distinct members, nothing after them.
func TestJoinLimits(t *testing.T) {
	ranks := func(n int) []uint32 {
		r := make([]uint32, n)
		for i := range r {
			r[i] = uint32(i)
		}
		return r
	}
	ok := JoinMsg{ID: 1, Bridge: 1, Name: "b", Members: ranks(2)}
	cases := []struct {
		name string
		edit func(m *JoinMsg)
		want string // "" accepted
	}{
		{"ok", func(*JoinMsg) {}, ""},
		{"largest id", func(m *JoinMsg) { m.Bridge = MaxBridgeID }, ""},
		{"1024 members", func(m *JoinMsg) { m.Members = ranks(MaxBridgeMembers) }, ""},
		{"128-byte name", func(m *JoinMsg) { m.Name = strings.Repeat("a/_-Z9", 22)[:MaxBridgeName] }, ""},
		{"id 0", func(m *JoinMsg) { m.Bridge = 0 }, "bridge id 0 is outside 1 .. 2147483648"},
		{"id over 2^31", func(m *JoinMsg) { m.Bridge = MaxBridgeID + 1 }, "bridge id 2147483649 is outside"},
		{"empty name", func(m *JoinMsg) { m.Name = "" }, "bridge name of 0 bytes, want 1 .. 128"},
		{"long name", func(m *JoinMsg) { m.Name = strings.Repeat("a", MaxBridgeName+1) }, "bridge name of 129 bytes"},
		{"dot in name", func(m *JoinMsg) { m.Name = "a/../b" }, `has "." at byte 2`},
		{"space in name", func(m *JoinMsg) { m.Name = "a b" }, `has " " at byte 1`},
		{"non-ASCII name", func(m *JoinMsg) { m.Name = "é" }, "at byte 0"},
		{"1 member", func(m *JoinMsg) { m.Members = ranks(1) }, "1 members, want 2 .. 1024"},
		{"1025 members", func(m *JoinMsg) { m.Members = ranks(MaxBridgeMembers + 1) }, "1025 members"},
		{"duplicate", func(m *JoinMsg) { m.Members = []uint32{4, 5, 4} }, "rank 4 is member 0 and member 2"},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			m := ok
			tc.edit(&m)
			got, n, err := Decode(m.Append(nil))
			if tc.want == "" {
				require.NoError(t, err)
				assert.Equal(t, &m, got)
				assert.Equal(t, len(m.Append(nil)), n)
				return
			}
			assert.ErrorIs(t, err, ErrMalformed)
			assert.ErrorContains(t, err, tc.want)
			assert.ErrorIs(t, CheckJoin(&m), ErrMalformed)
		})
	}
	t.Run("flags", func(t *testing.T) {
		b := ok.Append(nil)
		b[HeaderSize+12] = 1
		_, _, err := Decode(b)
		assert.ErrorContains(t, err, "join: flags 0x1 are not zero")
	})
	t.Run("trailing bytes", func(t *testing.T) {
		b := append(ok.Append(nil), 1, 0, 0, 0)
		binary.LittleEndian.PutUint32(b, uint32(len(b)))
		_, _, err := Decode(b)
		assert.ErrorContains(t, err, "4 trailing bytes")
	})
	t.Run("members cut short", func(t *testing.T) {
		b := ok.Append(nil)
		b = b[:len(b)-2]
		binary.LittleEndian.PutUint32(b, uint32(len(b)))
		_, _, err := Decode(b)
		assert.ErrorContains(t, err, "too short")
	})
}

// The bridge id is found wherever it is among a request's extensions; it
// is exactly 4 bytes, critical, and at most one.
func TestRequestBridge(t *testing.T) {
	le := binary.LittleEndian
	base := (&Request{Kind: MsgAllReduce, ID: 3, DType: reduce.Float32, Op: reduce.Sum, Peer: -1}).Append(nil)
	with := func(exts ...[]byte) []byte {
		b := bytes.Clone(base)
		for _, e := range exts {
			b = append(b, e...)
		}
		le.PutUint32(b, uint32(len(b)))
		return b[HeaderSize:]
	}
	ext := func(tag uint16, v ...byte) []byte {
		return append(le.AppendUint16(le.AppendUint16(nil, tag), uint16(len(v))), v...)
	}
	id := func(v uint32) []byte { return le.AppendUint32(nil, v) }
	cases := []struct {
		name string
		body []byte
		want string
		id   uint32
	}{
		{"alone", with(ext(ExtBridge, id(7)...)), "", 7},
		{"after others", with(ext(5, 1, 2), ext(ExtFeedbackKey, make([]byte, 8)...), ext(ExtBridge, id(1<<31)...)), "", 1 << 31},
		{"id 0 (bridge 0 named)", with(ext(ExtBridge, id(0)...)), "", 0},
		{"not critical", with(ext(3, id(7)...)), "without the critical bit (0x0003, want 0x8003)", 0},
		{"3 bytes", with(ext(ExtBridge, 1, 2, 3)), "value of 3 bytes, want 4", 0},
		{"5 bytes", with(ext(ExtBridge, 1, 2, 3, 4, 5)), "value of 5 bytes, want 4", 0},
		{"twice", with(ext(ExtBridge, id(1)...), ext(ExtBridge, id(2)...)), "two bridge extensions", 0},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			var r Request
			err := DecodeRequest(MsgAllReduce, tc.body, &r)
			if tc.want != "" {
				assert.ErrorIs(t, err, ErrMalformed)
				assert.ErrorContains(t, err, tc.want)
				return
			}
			require.NoError(t, err)
			assert.True(t, r.HasBridge)
			assert.Equal(t, tc.id, r.Bridge)
			m, err := DecodeBody(MsgAllReduce, tc.body)
			require.NoError(t, err)
			assert.Equal(t, tc.id, m.(*Request).Bridge)
		})
	}
	// Encoded after the feedback key, before the other extensions.
	b := (&Request{Kind: MsgBarrier, ID: 1, Peer: -1, HasFeedbackKey: true, FeedbackKey: 5, HasBridge: true, Bridge: 0x01020304,
		Ext: []Ext{{Tag: 0x7f00}}}).Append(nil)
	body := b[HeaderSize+RequestSize:]
	assert.Equal(t, ExtFeedbackKey, le.Uint16(body[0:]))
	assert.Equal(t, uint16(0x8003), le.Uint16(body[12:]), "tag 3, critical")
	assert.Equal(t, uint16(4), le.Uint16(body[14:]))
	assert.Equal(t, uint32(0x01020304), le.Uint32(body[16:]))
	assert.Equal(t, uint16(0x7f00), le.Uint16(body[20:]))
	assert.Equal(t, BridgesVersion, ExtVersion(ExtBridge))
}
