package feed

import (
	"encoding/binary"
	"errors"
	"fmt"
	"unicode/utf8"

	"github.com/gpubridge/gpubridge/lib/reduce"
)

// Version is the newest feed protocol version this package speaks; MinVersion
// the oldest. HELLO offers a range, WELCOME picks one.
const (
	Version    = 1
	MinVersion = 1
)

// Magic opens every HELLO body: "GBFD" in little-endian order.
const Magic uint32 = 0x44464247

// Limits of the protocol (version 1).
const (
	// HeaderSize is the size of a message header.
	HeaderSize = 8
	// MaxMessage bounds one control message, header included.
	MaxMessage = 64 << 10
	// MaxText bounds a string field (error text, names) in bytes.
	MaxText = 4 << 10
	// RequestSize is the size of a request's fixed body.
	RequestSize = 64
)

// MsgType is a control message's type.
type MsgType uint16

// Message types of version 1. Types below 16 are session messages; 16 and up
// are requests, which all share the Request body.
const (
	MsgHello    MsgType = 1 // client → server: magic, version range, pid, name
	MsgWelcome  MsgType = 2 // server → client: chosen version, member, members, limits, transport
	MsgError    MsgType = 3 // server → client: fatal protocol error; the server closes the feed
	MsgBye      MsgType = 4 // both ways: orderly close
	MsgRegion   MsgType = 5 // client → server, with one fd (SCM_RIGHTS): map a shared-memory region
	MsgRelease  MsgType = 6 // client → server: unmap a region once no request uses it
	MsgReady    MsgType = 7 // client → server: input bytes [0,end) of a streamed request are ready
	MsgProgress MsgType = 8 // server → client: result bytes [off,off+n) of a streamed request are final
	MsgDone     MsgType = 9 // server → client: a request finished (status, seq, timings, error)

	MsgAllReduce     MsgType = 16
	MsgBroadcast     MsgType = 17
	MsgAllGather     MsgType = 18
	MsgReduceScatter MsgType = 19
	MsgBarrier       MsgType = 20
	MsgSend          MsgType = 21
	MsgRecv          MsgType = 22

	firstOp = MsgAllReduce
	lastOp  = MsgRecv
)

var msgNames = map[MsgType]string{
	MsgHello: "hello", MsgWelcome: "welcome", MsgError: "error", MsgBye: "bye",
	MsgRegion: "region", MsgRelease: "release", MsgReady: "ready", MsgProgress: "progress", MsgDone: "done",
	MsgAllReduce: "all_reduce", MsgBroadcast: "broadcast", MsgAllGather: "all_gather",
	MsgReduceScatter: "reduce_scatter", MsgBarrier: "barrier", MsgSend: "send", MsgRecv: "recv",
}

func (t MsgType) String() string {
	if s, ok := msgNames[t]; ok {
		return s
	}
	return fmt.Sprintf("type(%d)", uint16(t))
}

// IsRequest reports whether t is one of the operation requests.
func (t MsgType) IsRequest() bool { return t >= firstOp && t <= lastOp }

// Request flags.
const (
	// FlagStreamed: the client sends READY as its input becomes ready, and
	// the server sends PROGRESS as result ranges become final.
	FlagStreamed uint32 = 1 << 0
	knownFlags          = FlagStreamed
)

// Codecs of a request's bridge step. Only CodecRaw exists in version 1; the
// field is there so compression can be asked for per request later.
const CodecRaw uint8 = 0

// Status of a DONE.
type Status uint32

// DONE statuses.
const (
	// StatusOK: the request completed.
	StatusOK Status = 0
	// StatusBadRequest: the request was refused before anything ran; the
	// bridge is fine and the server keeps serving.
	StatusBadRequest Status = 1
	// StatusBridgeError: the bridge failed during this request; the bridge
	// is broken from now on.
	StatusBridgeError Status = 2
	// StatusBroken: refused at once because the bridge broke earlier; the
	// error text is the original cause.
	StatusBroken Status = 3
	// StatusAborted: the server is shutting down (signal, lost feed).
	StatusAborted Status = 4
)

func (s Status) String() string {
	switch s {
	case StatusOK:
		return "ok"
	case StatusBadRequest:
		return "bad request"
	case StatusBridgeError:
		return "bridge error"
	case StatusBroken:
		return "bridge broken"
	case StatusAborted:
		return "aborted"
	}
	return fmt.Sprintf("status(%d)", uint32(s))
}

// Codes of a fatal ERROR message.
const (
	ErrCodeProtocol uint32 = 1 // malformed message, bad framing, message out of place
	ErrCodeVersion  uint32 = 2 // no common protocol version
	ErrCodeInternal uint32 = 3 // the server failed
)

// ExtCritical marks an extension tag the receiver must understand: a message
// carrying an unknown critical extension is refused; unknown non-critical
// extensions are skipped.
const ExtCritical uint16 = 0x8000

// Ext is one extension record (TLV) at the end of a message body.
type Ext struct {
	Tag   uint16
	Value []byte
}

// Header is a control message's header:
//
//	off size field
//	 0   4   size: bytes of the whole message, header included (8 .. MaxMessage)
//	 4   2   type (MsgType)
//	 6   2   flags: zero in version 1
type Header struct {
	Size uint32
	Type MsgType
}

// ErrMalformed marks a message that does not follow the protocol.
var ErrMalformed = errors.New("malformed feed message")

func malformed(format string, args ...any) error {
	return fmt.Errorf("%w: %s", ErrMalformed, fmt.Sprintf(format, args...))
}

// ParseHeader decodes a header from the first HeaderSize bytes of b and
// checks its size against max (at most MaxMessage).
func ParseHeader(b []byte, max int) (Header, error) {
	if len(b) < HeaderSize {
		return Header{}, malformed("header of %d bytes, need %d", len(b), HeaderSize)
	}
	h := Header{Size: binary.LittleEndian.Uint32(b), Type: MsgType(binary.LittleEndian.Uint16(b[4:]))}
	if f := binary.LittleEndian.Uint16(b[6:]); f != 0 {
		return Header{}, malformed("%s: header flags %#x are not zero", h.Type, f)
	}
	if h.Size < HeaderSize || int64(h.Size) > int64(max) {
		return Header{}, malformed("%s: size %d is outside %d..%d", h.Type, h.Size, HeaderSize, max)
	}
	return h, nil
}

// ---- encoding ----

// enc appends to a byte slice; the message size is patched in by end.
type enc struct{ b []byte }

func begin(b []byte, t MsgType) enc {
	b = append(b, 0, 0, 0, 0, byte(t), byte(t>>8), 0, 0)
	return enc{b}
}

func (e *enc) u8(v uint8)   { e.b = append(e.b, v) }
func (e *enc) u16(v uint16) { e.b = binary.LittleEndian.AppendUint16(e.b, v) }
func (e *enc) u32(v uint32) { e.b = binary.LittleEndian.AppendUint32(e.b, v) }
func (e *enc) u64(v uint64) { e.b = binary.LittleEndian.AppendUint64(e.b, v) }
func (e *enc) str(s string) {
	s = clip(s, MaxText)
	e.u16(uint16(len(s)))
	e.b = append(e.b, s...)
}
func (e *enc) exts(x []Ext) {
	for _, t := range x {
		e.u16(t.Tag)
		e.u16(uint16(len(t.Value)))
		e.b = append(e.b, t.Value...)
	}
}

// end patches the size of the message that starts at start.
func (e *enc) end(start int) []byte {
	binary.LittleEndian.PutUint32(e.b[start:], uint32(len(e.b)-start))
	return e.b
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
func (d *dec) u8() uint8 {
	if !d.need(1) {
		return 0
	}
	v := d.b[0]
	d.b = d.b[1:]
	return v
}
func (d *dec) u16() uint16 {
	if !d.need(2) {
		return 0
	}
	v := binary.LittleEndian.Uint16(d.b)
	d.b = d.b[2:]
	return v
}
func (d *dec) u32() uint32 {
	if !d.need(4) {
		return 0
	}
	v := binary.LittleEndian.Uint32(d.b)
	d.b = d.b[4:]
	return v
}
func (d *dec) u64() uint64 {
	if !d.need(8) {
		return 0
	}
	v := binary.LittleEndian.Uint64(d.b)
	d.b = d.b[8:]
	return v
}
func (d *dec) str() string {
	n := int(d.u16())
	if n > MaxText {
		d.err = malformed("%s: string of %d bytes is over %d", d.t, n, MaxText)
		return ""
	}
	if !d.need(n) {
		return ""
	}
	s := string(d.b[:n])
	d.b = d.b[n:]
	return s
}

// exts decodes the extension records that fill the rest of the body. With
// keep false nothing is allocated: the records are only checked.
func (d *dec) exts(keep bool) []Ext {
	var out []Ext
	for d.err == nil && len(d.b) > 0 {
		tag := d.u16()
		n := int(d.u16())
		if !d.need(n) {
			return nil
		}
		if tag&ExtCritical != 0 {
			d.err = malformed("%s: unknown critical extension %#04x", d.t, tag)
			return nil
		}
		if keep {
			out = append(out, Ext{Tag: tag, Value: append([]byte(nil), d.b[:n]...)})
		}
		d.b = d.b[n:]
	}
	return out
}

func (d *dec) done() error {
	if d.err == nil && len(d.b) != 0 {
		d.err = malformed("%s: %d trailing bytes", d.t, len(d.b))
	}
	return d.err
}

// ---- messages ----

// Message is any decoded control message.
type Message interface {
	// Type is the message's type.
	Type() MsgType
	// Append encodes the whole message (header included) onto b.
	Append(b []byte) []byte
}

// HelloMsg opens a feed (client → server).
//
//	u32 magic "GBFD", u16 min version, u16 max version, u32 client pid,
//	str client name, extensions
type HelloMsg struct {
	MinVersion, MaxVersion uint16
	PID                    uint32
	Name                   string
	Ext                    []Ext
}

func (*HelloMsg) Type() MsgType { return MsgHello }
func (m *HelloMsg) Append(b []byte) []byte {
	s := len(b)
	e := begin(b, MsgHello)
	e.u32(Magic)
	e.u16(m.MinVersion)
	e.u16(m.MaxVersion)
	e.u32(m.PID)
	e.str(m.Name)
	e.exts(m.Ext)
	return e.end(s)
}

// WelcomeMsg answers Hello (server → client).
//
//	u16 version, u16 zero, u32 member, u32 members, u32 max message,
//	u32 max regions, u32 max requests in flight, u64 max region bytes,
//	str transport description, extensions
type WelcomeMsg struct {
	Version        uint16
	Member         uint32
	Members        uint32
	MaxMessage     uint32
	MaxRegions     uint32
	MaxInflight    uint32
	MaxRegionBytes uint64
	Transport      string
	Ext            []Ext
}

func (*WelcomeMsg) Type() MsgType { return MsgWelcome }
func (m *WelcomeMsg) Append(b []byte) []byte {
	s := len(b)
	e := begin(b, MsgWelcome)
	e.u16(m.Version)
	e.u16(0)
	e.u32(m.Member)
	e.u32(m.Members)
	e.u32(m.MaxMessage)
	e.u32(m.MaxRegions)
	e.u32(m.MaxInflight)
	e.u64(m.MaxRegionBytes)
	e.str(m.Transport)
	e.exts(m.Ext)
	return e.end(s)
}

// ErrorMsg is a fatal protocol error (server → client); the server closes
// the feed after sending it.
//
//	u32 code, str text
type ErrorMsg struct {
	Code uint32
	Text string
}

func (*ErrorMsg) Type() MsgType { return MsgError }
func (m *ErrorMsg) Append(b []byte) []byte {
	s := len(b)
	e := begin(b, MsgError)
	e.u32(m.Code)
	e.str(m.Text)
	return e.end(s)
}

// ByeMsg closes the feed in order. The client sends it when it has no more
// requests; the server answers with Bye once every request is DONE.
type ByeMsg struct{}

func (*ByeMsg) Type() MsgType { return MsgBye }
func (*ByeMsg) Append(b []byte) []byte {
	s := len(b)
	e := begin(b, MsgBye)
	return e.end(s)
}

// RegionMsg maps a shared-memory region (client → server). Exactly one file
// descriptor travels with it (SCM_RIGHTS): a memfd sealed against shrinking
// (F_SEAL_SHRINK), at least Size bytes long. The server answers with DONE.
//
//	u64 request id, u32 region id (non-zero), u32 flags (zero), u64 size, extensions
type RegionMsg struct {
	ID     uint64
	Region uint32
	Size   uint64
	Ext    []Ext
}

func (*RegionMsg) Type() MsgType { return MsgRegion }
func (m *RegionMsg) Append(b []byte) []byte {
	s := len(b)
	e := begin(b, MsgRegion)
	e.u64(m.ID)
	e.u32(m.Region)
	e.u32(0)
	e.u64(m.Size)
	e.exts(m.Ext)
	return e.end(s)
}

// ReleaseMsg unmaps a region once no request uses it; the server answers with
// DONE when it has unmapped it. Requests sent after it may not name it.
//
//	u64 request id, u32 region id
type ReleaseMsg struct {
	ID     uint64
	Region uint32
}

func (*ReleaseMsg) Type() MsgType { return MsgRelease }
func (m *ReleaseMsg) Append(b []byte) []byte {
	s := len(b)
	e := begin(b, MsgRelease)
	e.u64(m.ID)
	e.u32(m.Region)
	return e.end(s)
}

// ReadyMsg says input bytes [0,End) of streamed request ID are in the region.
// End never goes back; a smaller End than before is ignored.
//
//	u64 request id, u64 end
type ReadyMsg struct {
	ID  uint64
	End uint64
}

func (*ReadyMsg) Type() MsgType { return MsgReady }
func (m *ReadyMsg) Append(b []byte) []byte {
	s := len(b)
	e := begin(b, MsgReady)
	e.u64(m.ID)
	e.u64(m.End)
	return e.end(s)
}

// ProgressMsg says result bytes [Off,Off+N) of streamed request ID are final.
// The ranges of one request are disjoint and cover its result once.
//
//	u64 request id, u64 offset, u64 length
type ProgressMsg struct {
	ID  uint64
	Off uint64
	N   uint64
}

func (*ProgressMsg) Type() MsgType { return MsgProgress }
func (m *ProgressMsg) Append(b []byte) []byte {
	s := len(b)
	e := begin(b, MsgProgress)
	e.u64(m.ID)
	e.u64(m.Off)
	e.u64(m.N)
	return e.end(s)
}

// DoneMsg finishes a request (server → client).
//
//	u64 request id, u32 status, u32 zero, u64 seq (the bridge's collective
//	sequence number; 0 for requests that are not collectives), u64 bytes
//	(recv: bytes received; else the result's bytes), u64 queue µs (from
//	arrival to start), u64 total µs (from arrival to DONE), str error,
//	extensions (reserved for trace records)
type DoneMsg struct {
	ID      uint64
	Status  Status
	Seq     uint64
	Bytes   uint64
	QueueUS uint64
	TotalUS uint64
	Error   string
	Ext     []Ext
}

func (*DoneMsg) Type() MsgType { return MsgDone }
func (m *DoneMsg) Append(b []byte) []byte {
	s := len(b)
	e := begin(b, MsgDone)
	e.u64(m.ID)
	e.u32(uint32(m.Status))
	e.u32(0)
	e.u64(m.Seq)
	e.u64(m.Bytes)
	e.u64(m.QueueUS)
	e.u64(m.TotalUS)
	e.str(m.Error)
	e.exts(m.Ext)
	return e.end(s)
}

// Request asks for one operation; Kind is its message type. The body:
//
//	off size field
//	 0   8   request id: strictly increasing on a feed
//	 8   1   dtype (reduce.DType numbering; 0: bytes, no element type)
//	 9   1   op (reduce.Op numbering; 0: none)
//	10   1   codec (0: raw)
//	11   1   zero
//	12   4   flags (FlagStreamed)
//	16   4   buf region (0: none)
//	20   4   out region (0: none)
//	24   8   buf offset
//	32   8   buf length in bytes
//	40   8   out offset
//	48   8   out length in bytes
//	56   4   root (broadcast) or peer (send, recv) as a member index; -1: none
//	60   4   tag (send, recv)
//	64   …   extensions
type Request struct {
	Kind  MsgType
	ID    uint64
	DType reduce.DType
	Op    reduce.Op
	Codec uint8
	Flags uint32
	Buf   Span
	Out   Span
	Peer  int32
	Tag   uint32
	Ext   []Ext
}

// Span is a byte range of a region.
type Span struct {
	Region uint32
	Off    uint64
	Len    uint64
}

func (m *Request) Type() MsgType { return m.Kind }
func (m *Request) Append(b []byte) []byte {
	s := len(b)
	e := begin(b, m.Kind)
	e.u64(m.ID)
	e.u8(uint8(m.DType))
	e.u8(uint8(m.Op))
	e.u8(m.Codec)
	e.u8(0)
	e.u32(m.Flags)
	e.u32(m.Buf.Region)
	e.u32(m.Out.Region)
	e.u64(m.Buf.Off)
	e.u64(m.Buf.Len)
	e.u64(m.Out.Off)
	e.u64(m.Out.Len)
	e.u32(uint32(m.Peer))
	e.u32(m.Tag)
	e.exts(m.Ext)
	return e.end(s)
}

// DecodeRequest decodes a request body (after the header) into r without
// allocating: extensions are checked but not kept. It fails only when the
// body is malformed; whether the request makes sense is checked elsewhere.
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
	r.Ext = d.exts(keep)
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
	m.Ext = d.exts(true)
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
		m.Ext = d.exts(true)
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
		m.Ext = d.exts(true)
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
		m.Ext = d.exts(true)
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
