package feed

import (
	"encoding/binary"
	"unicode/utf8"
)

// ---- encoding ----

// enc appends a message body to a byte slice.
type enc struct{ b []byte }

// appendMsg appends one whole message of type t to b: the header, the body
// that body writes, and the message's size patched into the header. body
// does not escape, so encoding allocates nothing beyond b's growth.
func appendMsg(b []byte, t MsgType, body func(e *enc)) []byte {
	start := len(b)
	e := enc{append(b, 0, 0, 0, 0, byte(t), byte(t>>8), 0, 0)}
	body(&e)
	binary.LittleEndian.PutUint32(e.b[start:], uint32(len(e.b)-start))
	return e.b
}

// The writers return e, so that a body reads as its layout:
// e.u64(m.ID).u64(m.End).

func (e *enc) u8(v uint8) *enc   { e.b = append(e.b, v); return e }
func (e *enc) u16(v uint16) *enc { e.b = binary.LittleEndian.AppendUint16(e.b, v); return e }
func (e *enc) u32(v uint32) *enc { e.b = binary.LittleEndian.AppendUint32(e.b, v); return e }
func (e *enc) u64(v uint64) *enc { e.b = binary.LittleEndian.AppendUint64(e.b, v); return e }
func (e *enc) str(s string) *enc {
	s = clip(s, MaxText)
	e.u16(uint16(len(s)))
	e.b = append(e.b, s...)
	return e
}
func (e *enc) feedbackKey(has bool, key uint64) *enc {
	if has {
		e.u16(ExtFeedbackKey).u16(FeedbackKeySize)
		e.b = AppendFeedbackKey(e.b, key)
	}
	return e
}
func (e *enc) exts(x []Ext) *enc {
	for _, t := range x {
		e.u16(t.Tag).u16(uint16(len(t.Value)))
		e.b = append(e.b, t.Value...)
	}
	return e
}

// clip cuts s to at most n bytes without splitting a UTF-8 sequence.
func clip(s string, n int) string {
	if len(s) <= n {
		return s
	}
	for n > 0 && !utf8.RuneStart(s[n]) {
		n--
	}
	return s[:n]
}

// ---- decoding ----

type dec struct {
	b   []byte
	t   MsgType
	err error
}

func (d *dec) need(n int) bool {
	if d.err != nil {
		return false
	}
	if len(d.b) < n {
		d.err = malformed("%s: body too short", d.t)
		return false
	}
	return true
}

// take consumes n bytes. A body too short gives zeros (n <= 8) and d.err.
func (d *dec) take(n int) []byte {
	if !d.need(n) {
		return zeros[:n]
	}
	p := d.b[:n]
	d.b = d.b[n:]
	return p
}

var zeros [8]byte

func (d *dec) u8() uint8   { return d.take(1)[0] }
func (d *dec) u16() uint16 { return binary.LittleEndian.Uint16(d.take(2)) }
func (d *dec) u32() uint32 { return binary.LittleEndian.Uint32(d.take(4)) }
func (d *dec) u64() uint64 { return binary.LittleEndian.Uint64(d.take(8)) }
func (d *dec) str() string {
	n := int(d.u16())
	if n > MaxText {
		d.err = malformed("%s: string of %d bytes is over %d", d.t, n, MaxText)
		return ""
	}
	if !d.need(n) {
		return ""
	}
	return string(d.take(n))
}

// exts decodes the extension records that fill the rest of the body. With
// keep false nothing is allocated: the records are only checked. With r (a
// request's body) the extensions the request codec knows go into r's
// fields instead of the list.
func (d *dec) exts(keep bool, r *Request) []Ext {
	var out []Ext
	for d.err == nil && len(d.b) > 0 {
		tag := d.u16()
		n := int(d.u16())
		if !d.need(n) {
			return nil
		}
		if r != nil && tag&^ExtCritical == ExtFeedbackKey&^ExtCritical {
			d.feedbackKey(tag, d.take(n), r)
			continue
		}
		if r != nil && tag&^ExtCritical == ExtBridge&^ExtCritical {
			d.bridgeID(tag, d.take(n), r)
			continue
		}
		if tag&ExtCritical != 0 {
			d.err = malformed("%s: unknown critical extension %#04x", d.t, tag)
			return nil
		}
		v := d.take(n)
		if keep {
			out = append(out, Ext{Tag: tag, Value: append([]byte(nil), v...)})
		}
	}
	return out
}

func (d *dec) done() error {
	if d.err == nil && len(d.b) != 0 {
		d.err = malformed("%s: %d trailing bytes", d.t, len(d.b))
	}
	return d.err
}
