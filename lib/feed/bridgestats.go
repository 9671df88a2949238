package feed

import (
	"encoding/binary"
	"errors"
	"fmt"
)

// ExtBridgeStats is DONE's extension tag 1 (not critical): what the bridge
// measured of one collective on this member, in the layout below
// (docs/TRACING.md §7). Times are CLOCK_MONOTONIC ns of the serve host.
//
//	off size field
//	 0   2   layout version (BridgeStatsVersion)
//	 2   2   p: peers in the value
//	 4   2   s: streams per peer (1 .. MaxBridgeStreams)
//	 6   2   flags (BridgeStatsPeersCut)
//	 8   8   start ns        16  8  all arrived ns   24  8  end ns
//	32   8   bytes sent      40  8  bytes received
//	48   8   codec ns        56  8  reduce ns
//	64   …   p × (u32 member, u32 0, i64 arrival − start, s × u64 blocked ns)
const ExtBridgeStats uint16 = 1

const (
	// BridgeStatsVersion is the layout version this package writes and reads.
	BridgeStatsVersion = 1
	// BridgeStatsPeersCut (flags bit 0): the value holds fewer peers than
	// the bridge has, so that the DONE fits in MaxMessage.
	BridgeStatsPeersCut uint16 = 1 << 0
	// MaxBridgeStreams bounds s (transport.MaxStreams).
	MaxBridgeStreams = 64
	// MaxBridgeStatsValue is the largest value that fits in a DONE with
	// an empty error text: MaxMessage less the header, DONE's fixed body,
	// the empty string and the extension's tag and length.
	MaxBridgeStatsValue = MaxMessage - HeaderSize - doneFixed - 2 - 4

	bridgeStatsFixed = 64
	doneFixed        = 48
)

// BridgeNotHeard is a peer's arrival skew when no frame of the collective
// came from it (a ring member hears only from its predecessor).
const BridgeNotHeard = -1 << 63

// ErrBridgeStatsVersion marks a tag-1 value of a layout version this
// package does not know: a reader skips it (a newer bridge), unlike a
// malformed value (ErrMalformed).
var ErrBridgeStatsVersion = errors.New("unknown bridge stats layout version")

// BridgeStats is the value of ExtBridgeStats.
type BridgeStats struct {
	Flags         uint16
	Streams       int
	StartNS       uint64
	AllArrivedNS  uint64
	EndNS         uint64
	BytesSent     uint64
	BytesReceived uint64
	CodecNS       uint64
	ReduceNS      uint64
	Peers         []BridgePeer
}

// BridgePeer is one peer's part: its member index, when its first frame
// of the collective arrived relative to start (negative: it was ahead),
// and per stream how long this member waited on it.
type BridgePeer struct {
	Member        uint32
	ArrivalSkewNS int64
	BlockedNS     []uint64
}

func bridgePeerSize(s int) int { return 16 + 8*s }

// AppendBridgeStats appends b's value to dst, at most limit bytes (at least
// the fixed part): peers that do not fit are left out and the value says
// so (BridgeStatsPeersCut). Every peer must have Streams entries.
func AppendBridgeStats(dst []byte, b *BridgeStats, limit int) []byte {
	s := b.Streams
	p := len(b.Peers)
	flags := b.Flags
	if fit := (limit - bridgeStatsFixed) / bridgePeerSize(s); p > fit {
		p, flags = max(fit, 0), flags|BridgeStatsPeersCut
	}
	le := binary.LittleEndian
	dst = le.AppendUint16(dst, BridgeStatsVersion)
	dst = le.AppendUint16(dst, uint16(p))
	dst = le.AppendUint16(dst, uint16(s))
	dst = le.AppendUint16(dst, flags)
	for _, v := range [...]uint64{b.StartNS, b.AllArrivedNS, b.EndNS, b.BytesSent, b.BytesReceived, b.CodecNS, b.ReduceNS} {
		dst = le.AppendUint64(dst, v)
	}
	for _, pr := range b.Peers[:p] {
		dst = le.AppendUint32(dst, pr.Member)
		dst = le.AppendUint32(dst, 0)
		dst = le.AppendUint64(dst, uint64(pr.ArrivalSkewNS))
		for i := range s {
			dst = le.AppendUint64(dst, pr.BlockedNS[i])
		}
	}
	return dst
}

// DecodeBridgeStats decodes a tag-1 value into b, reusing b.Peers. It
// checks the layout version (ErrBridgeStatsVersion), s, the flags, the
// reserved words and that the value is exactly as long as p and s say
// (ErrMalformed).
func DecodeBridgeStats(v []byte, b *BridgeStats) error {
	if len(v) < 2 {
		return malformed("bridge stats: %d bytes, need %d", len(v), bridgeStatsFixed)
	}
	le := binary.LittleEndian
	if ver := le.Uint16(v); ver != BridgeStatsVersion {
		return fmt.Errorf("%w %d (this reader knows %d)", ErrBridgeStatsVersion, ver, BridgeStatsVersion)
	}
	if len(v) < bridgeStatsFixed {
		return malformed("bridge stats: %d bytes, need %d", len(v), bridgeStatsFixed)
	}
	p, s, flags := int(le.Uint16(v[2:])), int(le.Uint16(v[4:])), le.Uint16(v[6:])
	if s < 1 || s > MaxBridgeStreams {
		return malformed("bridge stats: %d streams per peer, 1..%d allowed", s, MaxBridgeStreams)
	}
	if flags&^BridgeStatsPeersCut != 0 {
		return malformed("bridge stats: unknown flags %#x", flags)
	}
	if want := bridgeStatsFixed + p*bridgePeerSize(s); len(v) != want {
		return malformed("bridge stats: %d bytes, %d peers of %d streams take %d", len(v), p, s, want)
	}
	blocked := make([]uint64, p*s)
	peers := b.Peers[:0]
	*b = BridgeStats{Flags: flags, Streams: s}
	f := v[8:]
	for _, dst := range [...]*uint64{&b.StartNS, &b.AllArrivedNS, &b.EndNS, &b.BytesSent, &b.BytesReceived, &b.CodecNS, &b.ReduceNS} {
		*dst, f = le.Uint64(f), f[8:]
	}
	f = v[bridgeStatsFixed:]
	for i := range p {
		if z := le.Uint32(f[4:]); z != 0 {
			return malformed("bridge stats: peer %d: reserved word is not zero", i)
		}
		pr := BridgePeer{Member: le.Uint32(f), ArrivalSkewNS: int64(le.Uint64(f[8:])), BlockedNS: blocked[i*s : (i+1)*s : (i+1)*s]}
		f = f[16:]
		for k := range s {
			pr.BlockedNS[k], f = le.Uint64(f), f[8:]
		}
		peers = append(peers, pr)
	}
	b.Peers = peers
	return nil
}
