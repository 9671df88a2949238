package transport

import (
	"encoding/binary"
	"fmt"

	"github.com/gpubridge/gpubridge/lib/wire"
)

// What travels on a verbs stream besides the payload bytes: the 32-bit
// immediate values that announce records and return credit, and the
// 64-byte header in front of every record in a receive ring (verbs.go
// describes the protocol). Both come from the peer and are checked here
// before anything is read from the ring.

// Immediate values: the top two bits say what the rest is.
const (
	immData   = 0 << 30 // a record was written: its length in 64-byte units
	immCredit = 1 << 30 // the peer released its ring up to this position, in 64-byte units modulo 2^30
	immPing   = 2 << 30 // keep-alive (control streams): answer with a pong; the rest is zero
	immPong   = 3 << 30 // the answer to a ping; the rest is zero
	immKind   = 3 << 30
	immValue  = 1<<30 - 1
)

// Record header layout (little-endian), in front of each record's segment:
//
//	0   4   record length (header and segment, padded to 64)
//	4   4   flags: recFirst, recLast
//	8   4   segment length
//	12  4   record number on the stream (low 32 bits): a record out of
//	        place is an error, not a frame
//	16  16  zero
//	32  32  the frame's wire header
const (
	verbsRecHdr   = 64
	verbsRecFirst = 1
	verbsRecLast  = 2
)

// verbsRecord is a record header as parsed.
type verbsRecord struct {
	length, flags, seg uint32
	seq                uint32
	hdr                wire.Header
}

// putVerbsRecord writes a record header into b (64 bytes).
func putVerbsRecord(b []byte, r verbsRecord) {
	_ = b[verbsRecHdr-1]
	le := binary.LittleEndian
	le.PutUint32(b[0:], r.length)
	le.PutUint32(b[4:], r.flags)
	le.PutUint32(b[8:], r.seg)
	le.PutUint32(b[12:], r.seq)
	clear(b[16:32])
	r.hdr.Put(b[32:64])
}

// parseVerbsRecord checks the record header at the start of rec, which
// the immediate value announced as len(rec) bytes long, and parses it.
// wantSeq is the record number expected next.
func parseVerbsRecord(rec []byte, wantSeq uint32) (verbsRecord, error) {
	if len(rec) < verbsRecHdr || len(rec)%64 != 0 {
		return verbsRecord{}, fmt.Errorf("a record of %d bytes (a multiple of 64, at least %d, expected)", len(rec), verbsRecHdr)
	}
	le := binary.LittleEndian
	r := verbsRecord{length: le.Uint32(rec[0:]), flags: le.Uint32(rec[4:]), seg: le.Uint32(rec[8:]), seq: le.Uint32(rec[12:])}
	switch {
	case int(r.length) != len(rec):
		return r, fmt.Errorf("record %d says %d bytes, its announcement %d", wantSeq, r.length, len(rec))
	case r.seq != wantSeq:
		return r, fmt.Errorf("record %d found where record %d belongs: the ring is out of step", r.seq, wantSeq)
	case r.flags&^(verbsRecFirst|verbsRecLast) != 0:
		return r, fmt.Errorf("record %d has unknown flags %#x", r.seq, r.flags)
	case uint64(r.seg) > uint64(len(rec)-verbsRecHdr) || uint64(verbsRecHdr)+align64(uint64(r.seg)) != uint64(len(rec)):
		return r, fmt.Errorf("record %d of %d bytes holds a segment of %d", r.seq, len(rec), r.seg)
	}
	for _, b := range rec[16:32] {
		if b != 0 {
			return r, fmt.Errorf("record %d: reserved header bytes are not zero", r.seq)
		}
	}
	h, err := wire.Parse(rec[32:64])
	if err != nil {
		return r, fmt.Errorf("record %d: %w", r.seq, err)
	}
	r.hdr = h
	return r, nil
}

// creditImm is the immediate value that releases a ring up to pos.
func creditImm(pos uint64) uint32 { return immCredit | uint32(pos/64)&immValue }

// creditPos turns a credit's 30-bit position into the full position: the
// first one at or after tail (positions only grow, by less than 2^30
// units between credits since a ring holds less). ok is false when it
// lands beyond head, which a peer can only send by breaking the protocol.
func creditPos(imm uint32, tail, head uint64) (uint64, bool) {
	u := uint64(imm & immValue)
	t := tail / 64
	full := t&^uint64(immValue) | u
	if full < t {
		full += immValue + 1
	}
	pos := full * 64
	return pos, pos <= head
}

// arrival is a record announced by the peer: where it lies in the ring
// (as a position) and its length.
type arrival struct {
	pos, n uint64
}

// arrive accounts for a data record of n bytes announced when arrived
// bytes had been published into a ring of capacity cp, of which released
// are free again: a record that does not fit before the end of the ring
// starts at its beginning (the sender skips the rest). It returns where
// the record lies and the new published count, or an error when the peer
// wrote more than it had credit for or an impossible length.
func arrive(n, arrived, released, cp, maxRec uint64) (arrival, uint64, error) {
	if n < verbsRecHdr || n > maxRec || n%64 != 0 {
		return arrival{}, arrived, fmt.Errorf("a record of %d bytes announced (at most %d, a multiple of 64)", n, maxRec)
	}
	pos := arrived
	if room := cp - pos%cp; room < n {
		pos += room
	}
	if pos+n-released > cp {
		return arrival{}, arrived, fmt.Errorf("a record of %d bytes written beyond its credit (%d of %d ring bytes in use)", n, pos-released, cp)
	}
	return arrival{pos: pos, n: n}, pos + n, nil
}

// place is where a sender puts a record of n bytes into a ring of
// capacity cp whose head is at head: the position (after the skip, when
// the rest of the ring is too short) and the bytes it takes from head.
func place(n, head, cp uint64) (pos, used uint64) {
	pos = head
	if room := cp - head%cp; room < n {
		pos += room
	}
	return pos, pos + n - head
}
