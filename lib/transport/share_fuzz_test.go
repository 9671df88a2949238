package transport

import (
	"bytes"
	"testing"
)

// The share socket's decoders: the handshake's hello and the messages
// after it. Both take fixed sizes; the seeds (testdata/fuzz) run with
// every go test.

func FuzzShareHello(f *testing.F) {
	var good [shareHelloLen]byte
	(&shareHello{from: 1, to: 0, job: jobTag(testSecret)}).put(good[:])
	f.Add(good[:])
	f.Add([]byte(shareMagic))
	f.Add(make([]byte, shareHelloLen))
	f.Fuzz(func(t *testing.T, b []byte) {
		h, err := parseShareHello(b)
		if err != nil {
			return
		}
		var again [shareHelloLen]byte
		h.put(again[:])
		if !bytes.Equal(again[:], b) {
			t.Fatalf("hello %x re-encodes to %x", b, again)
		}
	})
}

func FuzzShareMsg(f *testing.F) {
	for _, m := range []shareMsg{{typ: shareMsgShare, id: 1, size: 4096}, {typ: shareMsgDrop, id: 7}, {typ: 3, id: 1}, {typ: shareMsgShare, id: 2, size: MaxSharedBytes + 1}} {
		var b [shareMsgSize]byte
		m.put(b[:])
		f.Add(b[:])
	}
	f.Add([]byte{1, 0, 0})
	f.Fuzz(func(t *testing.T, b []byte) {
		m, err := parseShareMsg(b)
		if err != nil {
			return
		}
		if m.id == 0 || m.typ == shareMsgShare && (m.size == 0 || m.size > MaxSharedBytes) {
			t.Fatalf("accepted %+v", m)
		}
		var again [shareMsgSize]byte
		m.put(again[:])
		if !bytes.Equal(again[:], b) {
			t.Fatalf("message %x re-encodes to %x", b, again)
		}
	})
}
