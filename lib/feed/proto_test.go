package feed

import (
	"bytes"
	"encoding/binary"
	"reflect"
	"strings"
	"testing"

	"github.com/gpubridge/gpubridge/lib/reduce"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

// sampleMessages holds one message of every type, with extensions where the
// type has them.
func sampleMessages() []Message {
	ext := []Ext{{Tag: 1, Value: []byte("trace")}, {Tag: 0x7fff}}
	msgs := []Message{
		&HelloMsg{MinVersion: 1, MaxVersion: 3, PID: 4242, Name: "torchplugin/0.1", Ext: ext},
		&WelcomeMsg{Version: 1, Member: 1, Members: 2, MaxMessage: MaxMessage, MaxRegions: 256, MaxInflight: 1024, MaxRegionBytes: 1 << 36, Transport: "tcp, 4 streams per peer, crc32c"},
		&ErrorMsg{Code: ErrCodeProtocol, Text: "bad framing"},
		&ByeMsg{},
		&RegionMsg{ID: 7, Region: 3, Size: 1 << 30, Ext: ext},
		&ReleaseMsg{ID: 8, Region: 3},
		&ReadyMsg{ID: 9, End: 4 << 20},
		&ProgressMsg{ID: 9, Off: 4 << 20, N: 1 << 20},
		&DoneMsg{ID: 9, Status: StatusBridgeError, Seq: 17, Bytes: 64, QueueUS: 3, TotalUS: 1234, Error: "member 1 (rank 2 on host-b): connection reset", Ext: ext},
		&DoneMsg{ID: 10},
		&DoneMsg{ID: 11, Seq: 5, Bytes: 4 << 20, Ext: []Ext{{Tag: ExtBridgeStats, Value: AppendBridgeStats(nil, sampleBridgeStats(), MaxBridgeStatsValue)}}},
	}
	for k := firstOp; k <= lastOp; k++ {
		msgs = append(msgs, &Request{
			Kind: k, ID: uint64(100 + k), DType: reduce.BFloat16, Op: reduce.Max, Codec: 0, Flags: FlagStreamed,
			Buf: Span{Region: 1, Off: 8, Len: 1 << 20}, Out: Span{Region: 2, Off: 0, Len: 2 << 20},
			Peer: -1, Tag: 77,
		})
	}
	msgs = append(msgs, &Request{Kind: MsgSend, ID: 1, Peer: 1, Tag: 0xffffffff, Buf: Span{Region: 1, Len: 4}, Ext: ext})
	// Version 3: a codec, and the feedback key (before other extensions).
	msgs = append(msgs,
		&Request{Kind: MsgAllReduce, ID: 200, DType: reduce.Float32, Op: reduce.Avg, Codec: 2, Buf: Span{Region: 1, Len: 4096}, Peer: -1,
			FeedbackKey: 0x0102030405060708, HasFeedbackKey: true},
		&Request{Kind: MsgAllReduce, ID: 201, DType: reduce.BFloat16, Op: reduce.Sum, Codec: 1, Buf: Span{Region: 1, Len: 4096}, Peer: -1,
			HasFeedbackKey: true, Ext: ext},
		&Request{Kind: MsgAllGather, ID: 202, DType: reduce.Int64, Codec: 3, Buf: Span{Region: 1, Len: 8}, Out: Span{Region: 2, Len: 16}, Peer: -1})
	// Version 4: JOIN, and the bridge id (after the feedback key).
	msgs = append(msgs,
		&JoinMsg{ID: 300, Bridge: 1, Name: "pair/0-5", Members: []uint32{0, 5}},
		&JoinMsg{ID: 301, Bridge: MaxBridgeID, Name: "shard_3/All-ranks", Members: []uint32{7, 3, 11, 1 << 20}},
		&Request{Kind: MsgSend, ID: 302, Peer: 1, Tag: 4, Buf: Span{Region: 1, Len: 4}, Bridge: 1, HasBridge: true},
		&Request{Kind: MsgAllReduce, ID: 303, DType: reduce.Float32, Op: reduce.Sum, Codec: 2, Buf: Span{Region: 1, Len: 4096}, Peer: -1,
			FeedbackKey: 9, HasFeedbackKey: true, Bridge: 0x7fffffff, HasBridge: true, Ext: ext})
	return msgs
}

func TestRoundTripEveryMessage(t *testing.T) {
	seen := map[MsgType]bool{}
	var stream []byte
	for _, m := range sampleMessages() {
		b := m.Append(nil)
		require.GreaterOrEqual(t, len(b), HeaderSize)
		assert.Equal(t, uint32(len(b)), binary.LittleEndian.Uint32(b), "size field of %s", m.Type())
		got, n, err := Decode(b)
		require.NoError(t, err, "%s", m.Type())
		assert.Equal(t, len(b), n)
		assert.Equal(t, m, got, "%s", m.Type())
		// Encoding appends: a message after another decodes the same.
		assert.Equal(t, b, got.Append(nil))
		seen[m.Type()] = true
		stream = m.Append(stream)
	}
	for t2 := range msgNames {
		assert.True(t, seen[t2], "no round trip for %s", t2)
	}
	// A stream of messages decodes message by message.
	for _, m := range sampleMessages() {
		got, n, err := Decode(stream)
		require.NoError(t, err)
		assert.Equal(t, m, got)
		stream = stream[n:]
	}
	assert.Empty(t, stream)
}

func TestRequestLayout(t *testing.T) {
	r := &Request{Kind: MsgAllReduce, ID: 0x0102030405060708, DType: reduce.Float32, Op: reduce.Sum, Codec: 0, Flags: FlagStreamed,
		Buf: Span{Region: 5, Off: 16, Len: 32}, Out: Span{Region: 6, Off: 48, Len: 64}, Peer: -1, Tag: 9}
	b := r.Append(nil)
	require.Len(t, b, HeaderSize+RequestSize)
	body := b[HeaderSize:]
	le := binary.LittleEndian
	assert.Equal(t, uint16(MsgAllReduce), le.Uint16(b[4:]))
	assert.Equal(t, uint64(0x0102030405060708), le.Uint64(body[0:]))
	assert.Equal(t, byte(reduce.Float32), body[8])
	assert.Equal(t, byte(reduce.Sum), body[9])
	assert.Equal(t, byte(0), body[10])
	assert.Equal(t, FlagStreamed, le.Uint32(body[12:]))
	assert.Equal(t, uint32(5), le.Uint32(body[16:]))
	assert.Equal(t, uint32(6), le.Uint32(body[20:]))
	assert.Equal(t, uint64(16), le.Uint64(body[24:]))
	assert.Equal(t, uint64(32), le.Uint64(body[32:]))
	assert.Equal(t, uint64(48), le.Uint64(body[40:]))
	assert.Equal(t, uint64(64), le.Uint64(body[48:]))
	assert.Equal(t, uint32(0xffffffff), le.Uint32(body[56:]))
	assert.Equal(t, uint32(9), le.Uint32(body[60:]))

	// Version 3: the codec byte, and FEEDBACK_KEY as the first extension.
	r.Codec, r.HasFeedbackKey, r.FeedbackKey = 2, true, 0x1122334455667788
	r.Ext = []Ext{{Tag: 0x7f00, Value: []byte{9}}}
	b = r.Append(nil)
	require.Len(t, b, HeaderSize+RequestSize+4+8+4+1)
	body = b[HeaderSize:]
	assert.Equal(t, byte(2), body[10])
	assert.Equal(t, uint16(0x8002), le.Uint16(body[64:]), "tag 2, critical")
	assert.Equal(t, uint16(8), le.Uint16(body[66:]))
	assert.Equal(t, uint64(0x1122334455667788), le.Uint64(body[68:]))
	assert.Equal(t, uint16(0x7f00), le.Uint16(body[76:]))
}

// The feedback key is found wherever it is among the extensions; it is
// exactly 8 bytes, critical, and at most one.
func TestRequestFeedbackKey(t *testing.T) {
	le := binary.LittleEndian
	base := (&Request{Kind: MsgAllReduce, ID: 3, DType: reduce.Float32, Op: reduce.Sum, Codec: 2, Peer: -1}).Append(nil)
	with := func(exts ...[]byte) []byte {
		b := bytes.Clone(base)
		for _, x := range exts {
			b = append(b, x...)
		}
		le.PutUint32(b, uint32(len(b)))
		return b
	}
	ext := func(tag uint16, v []byte) []byte {
		return append(le.AppendUint16(le.AppendUint16(nil, tag), uint16(len(v))), v...)
	}
	key := func(k uint64) []byte { return ext(0x8002, AppendFeedbackKey(nil, k)) }
	other := ext(9, []byte("x"))

	for name, b := range map[string][]byte{"alone": with(key(42)), "after another": with(other, key(42)), "before another": with(key(42), other)} {
		t.Run(name, func(t *testing.T) {
			var r Request
			require.NoError(t, DecodeRequest(MsgAllReduce, b[HeaderSize:], &r))
			assert.True(t, r.HasFeedbackKey)
			assert.Equal(t, uint64(42), r.FeedbackKey)
			m, _, err := Decode(b)
			require.NoError(t, err)
			got := m.(*Request)
			assert.Equal(t, uint64(42), got.FeedbackKey)
			assert.True(t, got.HasFeedbackKey)
			if name == "alone" {
				assert.Empty(t, got.Ext, "the key is not an Ext")
			} else {
				assert.Equal(t, []Ext{{Tag: 9, Value: []byte("x")}}, got.Ext)
			}
		})
	}
	var r Request
	require.NoError(t, DecodeRequest(MsgAllReduce, base[HeaderSize:], &r))
	assert.False(t, r.HasFeedbackKey)

	bad := []struct {
		name string
		b    []byte
		want string
	}{
		{"short value", with(ext(0x8002, make([]byte, 7))), "feedback key: value of 7 bytes, want 8"},
		{"long value", with(ext(0x8002, make([]byte, 9))), "value of 9 bytes, want 8"},
		{"not critical", with(ext(0x0002, make([]byte, 8))), "without the critical bit (0x0002, want 0x8002)"},
		{"twice", with(key(1), key(2)), "two feedback key extensions"},
		{"cut", with(key(1))[:HeaderSize+RequestSize+4+5], "too short"},
	}
	for _, tc := range bad {
		t.Run(tc.name, func(t *testing.T) {
			b := tc.b
			le.PutUint32(b, uint32(len(b)))
			var r Request
			err := DecodeRequest(MsgAllReduce, b[HeaderSize:], &r)
			assert.ErrorIs(t, err, ErrMalformed)
			assert.ErrorContains(t, err, tc.want)
			assert.Equal(t, uint64(3), r.ID, "the id is there for the refusal")
			_, _, err = Decode(b)
			assert.ErrorContains(t, err, tc.want)
		})
	}
	// Other messages do not know it: it is an unknown critical extension.
	b := (&RegionMsg{ID: 1, Region: 1, Size: 8}).Append(nil)
	b = append(b, key(1)...)
	le.PutUint32(b, uint32(len(b)))
	_, _, err := Decode(b)
	assert.ErrorContains(t, err, "unknown critical extension 0x8002")

	v, err := DecodeFeedbackKey(AppendFeedbackKey(nil, 7))
	require.NoError(t, err)
	assert.Equal(t, uint64(7), v)
	_, err = DecodeFeedbackKey(nil)
	assert.ErrorIs(t, err, ErrMalformed)
	assert.Equal(t, uint16(3), ExtVersion(ExtFeedbackKey))
	assert.Equal(t, uint16(1), ExtVersion(ExtBridgeStats))
}

func TestDecodeLimits(t *testing.T) {
	le := binary.LittleEndian
	hdr := func(size uint32, typ MsgType, flags uint16) []byte {
		b := make([]byte, HeaderSize)
		le.PutUint32(b, size)
		le.PutUint16(b[4:], uint16(typ))
		le.PutUint16(b[6:], flags)
		return b
	}
	cases := []struct {
		name string
		b    []byte
		want string
	}{
		{"short header", []byte{1, 2, 3}, "header of 3 bytes"},
		{"size below header", hdr(4, MsgBye, 0), "outside"},
		{"size over limit", hdr(MaxMessage+1, MsgBye, 0), "outside"},
		{"header flags", hdr(8, MsgBye, 1), "header flags"},
		{"truncated", append(hdr(16, MsgReady, 0), 1, 2), "of 16 bytes"},
		{"unknown type", hdr(8, 99, 0), "unknown message type 99"},
		{"bye with body", append(hdr(9, MsgBye, 0), 0), "trailing"},
		{"ready short", append(hdr(12, MsgReady, 0), 0, 0, 0, 0), "too short"},
		{"request short", append(hdr(8+63, MsgAllReduce, 0), make([]byte, 63)...), "too short"},
		{"hello bad magic", append(hdr(8+14, MsgHello, 0), make([]byte, 14)...), "bad magic"},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			_, _, err := Decode(tc.b)
			require.Error(t, err)
			assert.ErrorIs(t, err, ErrMalformed)
			assert.Contains(t, err.Error(), tc.want)
		})
	}

	t.Run("request reserved byte", func(t *testing.T) {
		b := (&Request{Kind: MsgBarrier, ID: 1, Peer: -1}).Append(nil)
		b[HeaderSize+11] = 1
		_, _, err := Decode(b)
		assert.ErrorContains(t, err, "reserved byte 11")
	})
	t.Run("string over limit", func(t *testing.T) {
		b := (&ErrorMsg{Code: 1}).Append(nil)
		b = b[:len(b)-2]
		b = binary.LittleEndian.AppendUint16(b, MaxText+1)
		b = append(b, bytes.Repeat([]byte("x"), MaxText+1)...)
		binary.LittleEndian.PutUint32(b, uint32(len(b)))
		_, _, err := Decode(b)
		assert.ErrorContains(t, err, "over 4096")
	})
	t.Run("long text is clipped on encode", func(t *testing.T) {
		long := strings.Repeat("é", MaxText) // 2 bytes each
		b := (&DoneMsg{ID: 1, Status: StatusBridgeError, Error: long}).Append(nil)
		m, _, err := Decode(b)
		require.NoError(t, err)
		e := m.(*DoneMsg).Error
		assert.LessOrEqual(t, len(e), MaxText)
		assert.True(t, strings.HasPrefix(long, e))
		assert.Equal(t, 0, len(e)%2, "a UTF-8 sequence was split")
	})
	t.Run("critical extension refused", func(t *testing.T) {
		b := (&Request{Kind: MsgAllReduce, ID: 1, Peer: -1, Ext: []Ext{{Tag: ExtCritical | 5, Value: []byte{1}}}}).Append(nil)
		_, _, err := Decode(b)
		assert.ErrorContains(t, err, "unknown critical extension 0x8005")
		var r Request
		assert.Error(t, DecodeRequest(MsgAllReduce, b[HeaderSize:], &r))
	})
	t.Run("unknown extension skipped", func(t *testing.T) {
		b := (&Request{Kind: MsgAllReduce, ID: 1, Peer: -1, Ext: []Ext{{Tag: 5, Value: []byte{1, 2}}}}).Append(nil)
		var r Request
		require.NoError(t, DecodeRequest(MsgAllReduce, b[HeaderSize:], &r))
		assert.Nil(t, r.Ext, "the hot-path decoder keeps no extensions")
		assert.Equal(t, uint64(1), r.ID)
	})
	t.Run("extension overrun", func(t *testing.T) {
		b := (&ReleaseMsg{ID: 1, Region: 1}).Append(nil)
		b = append(b, 1, 0, 9, 0, 1) // tag 1, len 9, 1 byte
		binary.LittleEndian.PutUint32(b, uint32(len(b)))
		_, _, err := Decode(b)
		assert.Error(t, err, "release has no extension area: trailing bytes")
		b = (&ReadyMsg{ID: 1}).Append(nil)
		b2 := (&RegionMsg{ID: 1, Region: 1, Size: 1}).Append(nil)
		b2 = append(b2, 1, 0, 9, 0, 1)
		binary.LittleEndian.PutUint32(b2, uint32(len(b2)))
		_, _, err = Decode(b2)
		assert.ErrorContains(t, err, "too short")
		_ = b
	})
	t.Run("hello empty version range", func(t *testing.T) {
		_, _, err := Decode((&HelloMsg{MinVersion: 2, MaxVersion: 1}).Append(nil))
		assert.ErrorContains(t, err, "empty")
	})
}

func TestTypedDecodersDoNotAllocate(t *testing.T) {
	req := (&Request{Kind: MsgAllReduce, ID: 5, DType: reduce.Float32, Op: reduce.Sum, Codec: 2, Buf: Span{Region: 1, Len: 4}, Peer: -1,
		FeedbackKey: 9, HasFeedbackKey: true, Bridge: 3, HasBridge: true, Ext: []Ext{{Tag: 5, Value: []byte{1}}}}).Append(nil)
	done := (&DoneMsg{ID: 5, Seq: 3}).Append(nil)
	ready := (&ReadyMsg{ID: 5, End: 4}).Append(nil)
	var r Request
	var d DoneMsg
	buf := make([]byte, 0, 256)
	allocs := testing.AllocsPerRun(100, func() {
		if err := DecodeRequest(MsgAllReduce, req[HeaderSize:], &r); err != nil {
			t.Fatal(err)
		}
		if err := DecodeDone(done[HeaderSize:], &d); err != nil {
			t.Fatal(err)
		}
		if _, err := DecodeReady(ready[HeaderSize:]); err != nil {
			t.Fatal(err)
		}
		if !r.HasFeedbackKey || r.FeedbackKey != 9 {
			t.Fatal("feedback key lost")
		}
		buf = r.Append(buf[:0])
		buf = d.Append(buf[:0])
	})
	assert.Zero(t, allocs)
}

// FuzzFeedDecode feeds arbitrary bytes to the decoder: it must never panic,
// and whatever it accepts must encode back to the same bytes.
func FuzzFeedDecode(f *testing.F) {
	for _, m := range sampleMessages() {
		f.Add(m.Append(nil))
	}
	f.Fuzz(func(t *testing.T, b []byte) {
		m, n, err := Decode(b)
		if err != nil {
			return
		}
		if n < HeaderSize || n > len(b) || n > MaxMessage {
			t.Fatalf("consumed %d of %d bytes", n, len(b))
		}
		again := m.Append(nil)
		if !bytes.Equal(again, b[:n]) {
			// A request's feedback key and bridge id are encoded first,
			// wherever they were: the same message, the same length.
			m2, n2, err := Decode(again)
			if r, ok := m.(*Request); !ok || !r.HasFeedbackKey && !r.HasBridge || err != nil || n2 != n || !reflect.DeepEqual(m, m2) {
				t.Fatalf("%s: re-encoded %x, decoded from %x", m.Type(), again, b[:n])
			}
		}
		if r, ok := m.(*Request); ok {
			var r2 Request
			if err := DecodeRequest(r.Kind, b[HeaderSize:n], &r2); err != nil {
				t.Fatalf("typed decoder refused what Decode accepted: %v", err)
			}
		}
	})
}

// FuzzFeedbackKey feeds arbitrary values to the FEEDBACK_KEY decoder: it
// accepts exactly the 8-byte ones, and re-encodes them to the same bytes.
func FuzzFeedbackKey(f *testing.F) {
	f.Add(AppendFeedbackKey(nil, 0))
	f.Add(AppendFeedbackKey(nil, 1<<63|5))
	f.Add([]byte{1, 2, 3})
	f.Fuzz(func(t *testing.T, v []byte) {
		k, err := DecodeFeedbackKey(v)
		if (err == nil) != (len(v) == FeedbackKeySize) {
			t.Fatalf("%d bytes: %v", len(v), err)
		}
		if err == nil && !bytes.Equal(AppendFeedbackKey(nil, k), v) {
			t.Fatalf("re-encoded %x, decoded from %x", AppendFeedbackKey(nil, k), v)
		}
	})
}
