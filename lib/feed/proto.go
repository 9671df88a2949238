package feed

import (
	"encoding/binary"
	"errors"
	"fmt"
	"time"
)

// Version is the newest feed protocol version this package speaks; MinVersion
// the oldest. HELLO offers a range, WELCOME picks one. Version 2 adds
// FlagCallerReduces; version 3 the request's codec byte (CodecVersion) and
// the FEEDBACK_KEY extension (ExtFeedbackKey); version 4 JOIN (MsgJoin) and
// the BRIDGE extension (ExtBridge): more bridges on one feed
// (BridgesVersion); version 5 the promise that SENDs and RECVs are matched
// in request order (P2POrderVersion).
const (
	Version    = 5
	MinVersion = 1
)

// P2POrderVersion is the feed protocol version from which the server
// promises that the SENDs of one (bridge, peer, tag) are sent, and its
// RECVs matched, in the order the server read the requests, however many
// are in flight (docs/FEED.md §4). Nothing on the wire changed: a server
// of this version keeps the promise in every session; the version tells a
// client that it may rely on it.
const P2POrderVersion uint16 = 5

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

// HandshakeTimeout is how long a server waits for HELLO, and the reference
// client for the whole handshake, unless told otherwise.
const HandshakeTimeout = 10 * time.Second

// MsgType is a control message's type.
type MsgType uint16

// Message types of version 1. Types below 16 are session messages; 16 and up
// are requests, which all share the Request body.
const (
	MsgHello    MsgType = 1  // client → server: magic, version range, pid, name
	MsgWelcome  MsgType = 2  // server → client: chosen version, member, members, limits, transport
	MsgError    MsgType = 3  // server → client: fatal protocol error; the server closes the feed
	MsgBye      MsgType = 4  // both ways: orderly close
	MsgRegion   MsgType = 5  // client → server, with one fd (SCM_RIGHTS): map a shared-memory region
	MsgRelease  MsgType = 6  // client → server: unmap a region once no request uses it
	MsgReady    MsgType = 7  // client → server: input bytes [0,end) of a streamed request are ready
	MsgProgress MsgType = 8  // server → client: result bytes [off,off+n) of a streamed request are final
	MsgDone     MsgType = 9  // server → client: a request finished (status, seq, timings, error)
	MsgJoin     MsgType = 10 // client → server (version 4): join a named bridge; answered by DONE

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
	MsgRegion: "region", MsgRelease: "release", MsgReady: "ready", MsgProgress: "progress", MsgDone: "done", MsgJoin: "join",
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
	// FlagCallerReduces (version 2, ALL_REDUCE only): the bridge exchanges
	// the members' inputs (buf) without reducing them: out, members ×
	// len(buf) bytes, receives member m's input in slot m (this member's
	// slot may be buf itself), and the caller reduces them in the
	// documented order (docs/FEED.md §3).
	FlagCallerReduces uint32 = 1 << 1
	// KnownFlags are the flags of the newest version; a request with
	// another, or with one its session's version lacks, is refused.
	KnownFlags = FlagStreamed | FlagCallerReduces
)

// FlagVersion is the feed protocol version that introduced a flag.
func FlagVersion(f uint32) uint16 {
	if f == FlagCallerReduces {
		return 2
	}
	return 1
}

// CodecRaw is the request codec byte of versions 1 and 2: the bridge moves
// the bytes as they are. From CodecVersion on the byte is a lib/codec id
// (docs/FEED.md §3a), which the server checks: this package only carries it.
const CodecRaw uint8 = 0

// CodecVersion is the feed protocol version that gave the request's codec
// byte its meaning; an older session refuses any codec but CodecRaw.
const CodecVersion uint16 = 3

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

var statusNames = [...]string{
	StatusOK: "ok", StatusBadRequest: "bad request", StatusBridgeError: "bridge error",
	StatusBroken: "bridge broken", StatusAborted: "aborted",
}

func (s Status) String() string {
	if int(s) < len(statusNames) {
		return statusNames[s]
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
