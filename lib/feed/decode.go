package feed

import "github.com/gpubridge/gpubridge/lib/reduce"

// DecodeRequest decodes a request body (after the header) into r without
// allocating: ExtFeedbackKey goes into r.FeedbackKey, ExtBridge into
// r.Bridge, other extensions are
// checked but not kept. It fails only when the body is malformed; whether
// the request makes sense is checked elsewhere.
// On failure r.ID holds the request id when the body had one.
func DecodeRequest(t MsgType, body []byte, r *Request) error {
	return decodeRequest(t, body, r, false)
}

func decodeRequest(t MsgType, body []byte, r *Request, keep bool) error {
	*r = Request{Kind: t}
	d := dec{b: body, t: t}
	r.ID = d.u64()
	r.DType = reduce.DType(d.u8())
	r.Op = reduce.Op(d.u8())
	r.Codec = d.u8()
	if z := d.u8(); z != 0 && d.err == nil {
		d.err = malformed("%s: reserved byte 11 is not zero", t)
	}
	r.Flags = d.u32()
	r.Buf.Region = d.u32()
	r.Out.Region = d.u32()
	r.Buf.Off = d.u64()
	r.Buf.Len = d.u64()
	r.Out.Off = d.u64()
	r.Out.Len = d.u64()
	r.Peer = int32(d.u32())
	r.Tag = d.u32()
	r.Ext = d.exts(keep, r)
	return d.done()
}

// DecodeReady decodes a READY body without allocating.
func DecodeReady(body []byte) (ReadyMsg, error) {
	d := dec{b: body, t: MsgReady}
	m := ReadyMsg{ID: d.u64(), End: d.u64()}
	return m, d.done()
}

// DecodeProgress decodes a PROGRESS body without allocating.
func DecodeProgress(body []byte) (ProgressMsg, error) {
	d := dec{b: body, t: MsgProgress}
	m := ProgressMsg{ID: d.u64(), Off: d.u64(), N: d.u64()}
	return m, d.done()
}

// DecodeDone decodes a DONE body into m; it allocates only for a non-empty
// error text and for extensions.
func DecodeDone(body []byte, m *DoneMsg) error {
	d := dec{b: body, t: MsgDone}
	*m = DoneMsg{}
	m.ID = d.u64()
	m.Status = Status(d.u32())
	if z := d.u32(); z != 0 && d.err == nil {
		d.err = malformed("done: reserved field is not zero")
	}
	m.Seq = d.u64()
	m.Bytes = d.u64()
	m.QueueUS = d.u64()
	m.TotalUS = d.u64()
	m.Error = d.str()
	m.Ext = d.exts(true, nil)
	return d.done()
}

// Decode decodes one whole message (header included) from the front of b and
// returns it with the number of bytes it took. It allocates; the server and
// client use the typed decoders on their hot paths.
func Decode(b []byte) (Message, int, error) {
	h, err := ParseHeader(b, MaxMessage)
	if err != nil {
		return nil, 0, err
	}
	if len(b) < int(h.Size) {
		return nil, 0, malformed("%s: %d of %d bytes", h.Type, len(b), h.Size)
	}
	m, err := DecodeBody(h.Type, b[HeaderSize:h.Size])
	if err != nil {
		return nil, 0, err
	}
	return m, int(h.Size), nil
}

// DecodeBody decodes the body of a message of type t.
func DecodeBody(t MsgType, body []byte) (Message, error) {
	d := dec{b: body, t: t}
	switch t {
	case MsgHello:
		if magic := d.u32(); magic != Magic && d.err == nil {
			return nil, malformed("hello: bad magic %#08x (not a gpubridge feed client)", magic)
		}
		m := &HelloMsg{MinVersion: d.u16(), MaxVersion: d.u16(), PID: d.u32(), Name: d.str()}
		m.Ext = d.exts(true, nil)
		if d.err == nil && m.MinVersion > m.MaxVersion {
			d.err = malformed("hello: version range %d..%d is empty", m.MinVersion, m.MaxVersion)
		}
		return m, d.done()
	case MsgWelcome:
		m := &WelcomeMsg{Version: d.u16()}
		if z := d.u16(); z != 0 && d.err == nil {
			d.err = malformed("welcome: reserved field is not zero")
		}
		m.Member, m.Members = d.u32(), d.u32()
		m.MaxMessage, m.MaxRegions, m.MaxInflight = d.u32(), d.u32(), d.u32()
		m.MaxRegionBytes = d.u64()
		m.Transport = d.str()
		m.Ext = d.exts(true, nil)
		return m, d.done()
	case MsgError:
		m := &ErrorMsg{Code: d.u32(), Text: d.str()}
		return m, d.done()
	case MsgBye:
		return &ByeMsg{}, d.done()
	case MsgRegion:
		m := &RegionMsg{ID: d.u64(), Region: d.u32()}
		if f := d.u32(); f != 0 && d.err == nil {
			d.err = malformed("region: flags %#x are not zero", f)
		}
		m.Size = d.u64()
		m.Ext = d.exts(true, nil)
		return m, d.done()
	case MsgRelease:
		m := &ReleaseMsg{ID: d.u64(), Region: d.u32()}
		return m, d.done()
	case MsgReady:
		m, err := DecodeReady(body)
		return &m, err
	case MsgProgress:
		m, err := DecodeProgress(body)
		return &m, err
	case MsgDone:
		m := &DoneMsg{}
		return m, DecodeDone(body, m)
	case MsgJoin:
		return decodeJoin(&d)
	}
	if t.IsRequest() {
		r := &Request{}
		if err := decodeRequest(t, body, r, true); err != nil {
			return nil, err
		}
		return r, nil
	}
	return nil, malformed("unknown message type %d", uint16(t))
}
