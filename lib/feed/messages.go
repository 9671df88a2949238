package feed

import "github.com/gpubridge/gpubridge/lib/reduce"

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
	return appendMsg(b, MsgHello, func(e *enc) {
		e.u32(Magic).u16(m.MinVersion).u16(m.MaxVersion).u32(m.PID).str(m.Name).exts(m.Ext)
	})
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
	return appendMsg(b, MsgWelcome, func(e *enc) {
		e.u16(m.Version).u16(0).u32(m.Member).u32(m.Members).
			u32(m.MaxMessage).u32(m.MaxRegions).u32(m.MaxInflight).u64(m.MaxRegionBytes).
			str(m.Transport).exts(m.Ext)
	})
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
	return appendMsg(b, MsgError, func(e *enc) { e.u32(m.Code).str(m.Text) })
}

// ByeMsg closes the feed in order. The client sends it when it has no more
// requests; the server answers with Bye once every request is DONE.
type ByeMsg struct{}

func (*ByeMsg) Type() MsgType          { return MsgBye }
func (*ByeMsg) Append(b []byte) []byte { return appendMsg(b, MsgBye, func(*enc) {}) }

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
	return appendMsg(b, MsgRegion, func(e *enc) { e.u64(m.ID).u32(m.Region).u32(0).u64(m.Size).exts(m.Ext) })
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
	return appendMsg(b, MsgRelease, func(e *enc) { e.u64(m.ID).u32(m.Region) })
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
	return appendMsg(b, MsgReady, func(e *enc) { e.u64(m.ID).u64(m.End) })
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
	return appendMsg(b, MsgProgress, func(e *enc) { e.u64(m.ID).u64(m.Off).u64(m.N) })
}

// DoneMsg finishes a request (server → client).
//
//	u64 request id, u32 status, u32 zero, u64 seq (the bridge's collective
//	sequence number; 0 for requests that are not collectives), u64 bytes
//	(recv: bytes received; else the result's bytes), u64 queue µs (from
//	arrival to start), u64 total µs (from arrival to DONE), str error,
//	extensions (ExtBridgeStats on an ok DONE of a data collective)
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
	return appendMsg(b, MsgDone, func(e *enc) {
		e.u64(m.ID).u32(uint32(m.Status)).u32(0).
			u64(m.Seq).u64(m.Bytes).u64(m.QueueUS).u64(m.TotalUS).
			str(m.Error).exts(m.Ext)
	})
}

// Request asks for one operation; Kind is its message type. The body:
//
//	off size field
//	 0   8   request id: strictly increasing on a feed
//	 8   1   dtype (reduce.DType numbering; 0: bytes, no element type)
//	 9   1   op (reduce.Op numbering; 0: none)
//	10   1   codec (a lib/codec id, version 3; 0: raw)
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
//	64   …   extensions (ExtFeedbackKey first, then ExtBridge, when there are)
type Request struct {
	Kind  MsgType
	ID    uint64
	DType reduce.DType
	Op    reduce.Op
	Codec uint8 // a lib/codec id from CodecVersion on; CodecRaw before
	Flags uint32
	Buf   Span
	Out   Span
	Peer  int32
	Tag   uint32
	// FeedbackKey is the ExtFeedbackKey extension's key, when
	// HasFeedbackKey: encoded before Ext, decoded from wherever it is.
	FeedbackKey    uint64
	HasFeedbackKey bool
	// Bridge is the ExtBridge extension's bridge id (version 4), when
	// HasBridge: encoded after the feedback key, decoded from wherever it
	// is. Without it the request runs on bridge 0.
	Bridge    uint32
	HasBridge bool
	// Ext holds the other extensions (decoded by Decode only).
	Ext []Ext
}

// Span is a byte range of a region.
type Span struct {
	Region uint32
	Off    uint64
	Len    uint64
}

func (m *Request) Type() MsgType { return m.Kind }
func (m *Request) Append(b []byte) []byte {
	return appendMsg(b, m.Kind, func(e *enc) {
		e.u64(m.ID).u8(uint8(m.DType)).u8(uint8(m.Op)).u8(m.Codec).u8(0).u32(m.Flags).
			u32(m.Buf.Region).u32(m.Out.Region).
			u64(m.Buf.Off).u64(m.Buf.Len).u64(m.Out.Off).u64(m.Out.Len).
			u32(uint32(m.Peer)).u32(m.Tag).feedbackKey(m.HasFeedbackKey, m.FeedbackKey).bridgeID(m.HasBridge, m.Bridge).exts(m.Ext)
	})
}
