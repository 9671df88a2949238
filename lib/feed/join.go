package feed

import (
	"encoding/binary"
	"strings"
)

// BridgesVersion is the feed protocol version that added JOIN and the
// BRIDGE extension: more bridges on one feed (docs/FEED.md §3b).
const BridgesVersion uint16 = 4

// Limits of JOIN (docs/FEED.md §3b).
const (
	// MaxBridgeName bounds a bridge's name in bytes.
	MaxBridgeName = 128
	// MinBridgeMembers and MaxBridgeMembers bound a JOIN's member list.
	MinBridgeMembers = 2
	MaxBridgeMembers = 1024
	// MaxBridgeID is the largest bridge id a JOIN may give (2^31); bridge
	// 0 is the leaders' bridge serve joined at start.
	MaxBridgeID = 1 << 31
)

// JoinMsg asks the server to join a named bridge (client → server, version
// 4); the server answers with DONE once the mesh is set up.
//
//	u64 request id, u32 bridge id (1 .. 2^31), u32 flags (zero),
//	str name (letters, digits, '/', '-', '_'; 1 .. 128 bytes),
//	u16 member count m (2 .. 1024), m × u32 global ranks in member
//	order (distinct)
//
// The decoder checks these limits; whether this rank is among the members
// and every member is a rank of the job is the server's business.
type JoinMsg struct {
	ID      uint64
	Bridge  uint32
	Name    string
	Members []uint32
}

func (*JoinMsg) Type() MsgType { return MsgJoin }
func (m *JoinMsg) Append(b []byte) []byte {
	return appendMsg(b, MsgJoin, func(e *enc) {
		e.u64(m.ID).u32(m.Bridge).u32(0).str(m.Name).u16(uint16(len(m.Members)))
		for _, r := range m.Members {
			e.u32(r)
		}
	})
}

// decodeJoin decodes and checks a JOIN body.
func decodeJoin(d *dec) (*JoinMsg, error) {
	m := &JoinMsg{ID: d.u64(), Bridge: d.u32()}
	if f := d.u32(); f != 0 && d.err == nil {
		d.err = malformed("join: flags %#x are not zero", f)
	}
	m.Name = d.str()
	n := int(d.u16())
	if d.err == nil && (n < MinBridgeMembers || n > MaxBridgeMembers) {
		d.err = malformed("join: %d members, want %d .. %d", n, MinBridgeMembers, MaxBridgeMembers)
	}
	if d.err == nil && d.need(4*n) {
		m.Members = make([]uint32, n)
		for i := range m.Members {
			m.Members[i] = d.u32()
		}
	}
	if err := d.done(); err != nil {
		return nil, err
	}
	if err := CheckJoin(m); err != nil {
		return nil, err
	}
	return m, nil
}

// CheckJoin checks what a JOIN's fields may hold, as the decoder does: the
// bridge id, the name's bytes and length, the member count, distinct
// members. Errors are ErrMalformed.
func CheckJoin(m *JoinMsg) error {
	if m.Bridge == 0 || m.Bridge > MaxBridgeID {
		return malformed("join: bridge id %d is outside 1 .. %d (0 is the leaders' bridge)", m.Bridge, uint32(MaxBridgeID))
	}
	if err := CheckBridgeName(m.Name); err != nil {
		return err
	}
	if n := len(m.Members); n < MinBridgeMembers || n > MaxBridgeMembers {
		return malformed("join: %d members, want %d .. %d", n, MinBridgeMembers, MaxBridgeMembers)
	}
	seen := make(map[uint32]int, len(m.Members))
	for i, r := range m.Members {
		if j, dup := seen[r]; dup {
			return malformed("join: rank %d is member %d and member %d (members are distinct)", r, j, i)
		}
		seen[r] = i
	}
	return nil
}

// CheckBridgeName checks a bridge's name: 1 .. MaxBridgeName bytes of
// ASCII letters, digits, '/', '-' and '_' (it is part of the store keys the
// members meet under). Errors are ErrMalformed.
func CheckBridgeName(name string) error {
	if name == "" || len(name) > MaxBridgeName {
		return malformed("join: bridge name of %d bytes, want 1 .. %d", len(name), MaxBridgeName)
	}
	if i := strings.IndexFunc(name, func(c rune) bool {
		return !(c >= 'a' && c <= 'z' || c >= 'A' && c <= 'Z' || c >= '0' && c <= '9' || c == '/' || c == '-' || c == '_')
	}); i >= 0 {
		return malformed("join: bridge name %q has %q at byte %d (letters, digits, '/', '-' and '_' only)", name, name[i:i+1], i)
	}
	return nil
}

// ExtBridge is the request extension BRIDGE (version 4): tag 3, critical,
// so 0x8003 on the wire; its value is exactly BridgeIDSize bytes, the
// bridge id as a little-endian u32: the bridge the request runs on
// (without it: bridge 0). Like ExtFeedbackKey it is decoded into the
// request (Request.Bridge), and the tag without the critical bit is
// malformed.
const ExtBridge uint16 = ExtCritical | 3

// BridgeIDSize is the size of ExtBridge's value.
const BridgeIDSize = 4

// bridgeID decodes a request's extension whose tag number is ExtBridge's
// into r.
func (d *dec) bridgeID(tag uint16, v []byte, r *Request) {
	switch {
	case tag != ExtBridge:
		d.err = malformed("%s: bridge extension (tag %d) without the critical bit (%#04x, want %#04x)", d.t, ExtBridge&^ExtCritical, tag, ExtBridge)
	case r.HasBridge:
		d.err = malformed("%s: two bridge extensions", d.t)
	case len(v) != BridgeIDSize:
		d.err = malformed("%s: bridge: value of %d bytes, want %d", d.t, len(v), BridgeIDSize)
	default:
		r.Bridge, r.HasBridge = binary.LittleEndian.Uint32(v), true
	}
}

func (e *enc) bridgeID(has bool, id uint32) *enc {
	if has {
		e.u16(ExtBridge).u16(BridgeIDSize).u32(id)
	}
	return e
}
