// Package wire is the bridge's frame format: a fixed 32-byte header in front
// of every payload that crosses a bridge transport (TCP streams, shared
// memory rings, later RDMA verbs).
//
// Layout (little-endian):
//
//	off size field
//	 0   2   magic 0x4247 ("GB")
//	 2   1   version (ProtocolVersion)
//	 3   1   kind (Data, P2P, Barrier, Close, Abort)
//	 4   1   flags (FlagCRC: crc holds CRC32C of the payload; FlagLast,
//	         FlagStripe: lib/collective's point-to-point messages)
//	 5   1   codec: how the payload is packed, a lib/codec ID (0 raw, 1
//	         bf16/v1, 2 fp8/v1, 3 zstd/v1; lib/collective sets it on every
//	         data frame of a call and refuses frames of another codec)
//	 6   2   reserved, zero
//	 8   8   seq: the collective's sequence number, or the P2P message number
//	16   4   step: the algorithm step, or the P2P tag
//	20   4   chunk: the chunk index within the step
//	24   4   len: payload bytes that follow (at most MaxPayload)
//	28   4   crc: CRC32C (Castagnoli) of the payload when FlagCRC is set
package wire

import (
	"encoding/binary"
	"errors"
	"fmt"
	"hash/crc32"
)

// ProtocolVersion is the bridge wire protocol version. Peers refuse a
// different one in their handshake. 2: a two-member all_reduce's argument
// fingerprint carries collective.Options.SplitBytes, and from it on such
// a call runs as two halves (a member of version 1 would answer every one
// with a mismatch).
const ProtocolVersion = 2

// HeaderSize is the size of an encoded Header.
const HeaderSize = 32

// MaxPayload bounds one frame's payload.
const MaxPayload = 64 << 20

const magic = 0x4247

// Kind is what a frame carries.
type Kind uint8

// Frame kinds.
const (
	KindData    Kind = 1 // a chunk of a collective
	KindP2P     Kind = 2 // a point-to-point message (step = tag)
	KindBarrier Kind = 3 // a barrier token
	KindClose   Kind = 4 // orderly close of a stream
	KindAbort   Kind = 5 // the sender failed; the payload is its error text
)

func (k Kind) String() string {
	switch k {
	case KindData:
		return "data"
	case KindP2P:
		return "p2p"
	case KindBarrier:
		return "barrier"
	case KindClose:
		return "close"
	case KindAbort:
		return "abort"
	}
	return fmt.Sprintf("kind(%d)", uint8(k))
}

// Flags of a frame.
const (
	FlagCRC uint8 = 1 << 0
	// FlagLast marks the last frame of a message split over several frames.
	FlagLast uint8 = 1 << 1
	// FlagStripe marks the frame that announces a striped point-to-point
	// message (lib/collective): its payload gives the message's length and
	// frame size; the frames follow on the point-to-point streams.
	FlagStripe uint8 = 1 << 2
	knownFlags       = FlagCRC | FlagLast | FlagStripe
)

// Header is one frame's header.
type Header struct {
	Kind  Kind
	Flags uint8
	Codec uint8 // a lib/codec ID; not checked here (this layer knows no codecs)
	Seq   uint64
	Step  uint32
	Chunk uint32
	Len   uint32
	CRC   uint32
}

// ErrCorrupt marks a frame whose payload does not match its CRC.
var ErrCorrupt = errors.New("corrupt frame: CRC32C mismatch")

// CorruptError is a frame whose payload does not match its CRC32C. The CRC
// covers the payload only, so the header came as received and may be
// damaged too; its fields are reported raw, by name: Step in particular is
// whatever the layer above packs into it (lib/collective: the collective,
// its algorithm step and a fingerprint), not a step number. It matches
// ErrCorrupt with errors.Is.
type CorruptError struct {
	Header Header // as received
	Got    uint32 // CRC32C of the payload received
}

func (e *CorruptError) Error() string {
	h := &e.Header
	return fmt.Sprintf("%v: the %d-byte payload has CRC32C %#08x, its header says %#08x (header as received: %s frame, seq %d, step field %#08x, chunk %d)",
		ErrCorrupt, h.Len, e.Got, h.CRC, h.Kind, h.Seq, h.Step, h.Chunk)
}

// Is makes errors.Is(err, ErrCorrupt) true.
func (e *CorruptError) Is(target error) bool { return target == ErrCorrupt }

var castagnoli = crc32.MakeTable(crc32.Castagnoli)

// Checksum returns the CRC32C of p.
func Checksum(p []byte) uint32 { return crc32.Checksum(p, castagnoli) }

// Put encodes h into b, which must hold HeaderSize bytes.
func (h *Header) Put(b []byte) {
	_ = b[HeaderSize-1]
	binary.LittleEndian.PutUint16(b[0:], magic)
	b[2] = ProtocolVersion
	b[3] = byte(h.Kind)
	b[4] = h.Flags
	b[5] = h.Codec
	b[6], b[7] = 0, 0
	binary.LittleEndian.PutUint64(b[8:], h.Seq)
	binary.LittleEndian.PutUint32(b[16:], h.Step)
	binary.LittleEndian.PutUint32(b[20:], h.Chunk)
	binary.LittleEndian.PutUint32(b[24:], h.Len)
	binary.LittleEndian.PutUint32(b[28:], h.CRC)
}

// Parse decodes and validates a header. It never allocates.
func Parse(b []byte) (Header, error) {
	if len(b) < HeaderSize {
		return Header{}, fmt.Errorf("frame header: %d bytes, need %d", len(b), HeaderSize)
	}
	if m := binary.LittleEndian.Uint16(b[0:]); m != magic {
		return Header{}, fmt.Errorf("frame header: bad magic %#04x (not a gpubridge peer, or a desynchronised stream)", m)
	}
	if v := b[2]; v != ProtocolVersion {
		return Header{}, fmt.Errorf("frame header: protocol version %d, this gbbridge speaks %d", v, ProtocolVersion)
	}
	h := Header{
		Kind: Kind(b[3]), Flags: b[4], Codec: b[5],
		Seq:   binary.LittleEndian.Uint64(b[8:]),
		Step:  binary.LittleEndian.Uint32(b[16:]),
		Chunk: binary.LittleEndian.Uint32(b[20:]),
		Len:   binary.LittleEndian.Uint32(b[24:]),
		CRC:   binary.LittleEndian.Uint32(b[28:]),
	}
	if h.Kind < KindData || h.Kind > KindAbort {
		return Header{}, fmt.Errorf("frame header: unknown kind %d", b[3])
	}
	if h.Flags&^knownFlags != 0 {
		return Header{}, fmt.Errorf("frame header: unknown flags %#02x", h.Flags)
	}
	if b[6] != 0 || b[7] != 0 {
		return Header{}, errors.New("frame header: reserved bytes are not zero")
	}
	if h.Len > MaxPayload {
		return Header{}, fmt.Errorf("frame header: payload of %d bytes is over the %d-byte limit", h.Len, MaxPayload)
	}
	return h, nil
}

// Verify checks payload against the header's CRC when the frame carries one.
func (h *Header) Verify(payload []byte) error {
	if int(h.Len) != len(payload) {
		return fmt.Errorf("frame payload: %d bytes, header says %d", len(payload), h.Len)
	}
	if h.Flags&FlagCRC != 0 {
		if got := Checksum(payload); got != h.CRC {
			return &CorruptError{Header: *h, Got: got}
		}
	}
	return nil
}

// Seal sets Len, and CRC when crc is true, for payload.
func (h *Header) Seal(payload []byte, crc bool) {
	h.Len = uint32(len(payload))
	if crc {
		h.Flags |= FlagCRC
		h.CRC = Checksum(payload)
	} else {
		h.Flags &^= FlagCRC
		h.CRC = 0
	}
}
