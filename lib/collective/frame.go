package collective

import (
	"encoding/binary"
	"errors"
	"fmt"
	"hash/crc32"
	"strings"
	"time"
	"unsafe"

	"github.com/gpubridge/gpubridge/lib/codec"
	"github.com/gpubridge/gpubridge/lib/reduce"
	"github.com/gpubridge/gpubridge/lib/wire"
)

// kind is a collective, as encoded in the high bits of a frame's Step.
type kind uint8

const (
	kAllReduce kind = iota + 1
	kBroadcast
	kAllGather
	kReduceScatter
	kBarrier
)

var kindNames = [...]string{
	kAllReduce:     "all_reduce",
	kBroadcast:     "broadcast",
	kAllGather:     "all_gather",
	kReduceScatter: "reduce_scatter",
	kBarrier:       "barrier",
}

func (k kind) String() string {
	if k >= kAllReduce && k <= kBarrier {
		return kindNames[k]
	}
	return fmt.Sprintf("an unknown collective (%d)", uint8(k))
}

// Step layout of collective frames: bits 31..27 the collective, 26..16 the
// algorithm step, 15..0 a fingerprint of the call's arguments.
const (
	stepShift = 16
	stepBits  = 11
	kindShift = stepShift + stepBits
	maxStep   = 1<<stepBits - 1
)

func encodeStep(k kind, step int, fp uint16) uint32 {
	return uint32(k)<<kindShift | uint32(step)<<stepShift | uint32(fp)
}

func decodeStep(s uint32) (k kind, step int, fp uint16) {
	return kind(s >> kindShift), int(s>>stepShift) & maxStep, uint16(s)
}

// fingerprint digests what every member must pass identically to a
// collective: the sizes, dtype, op, root, the chunk size, the codec and,
// for an all_reduce that may run recursive doubling, the resolved
// Options.SmallBytes (0: not used; then the digest is the one of the
// fields before it alone).
func fingerprint(k kind, n int, dt reduce.DType, op reduce.Op, root, chunk int, cd codec.ID, small int) uint16 {
	var b [35]byte
	b[0] = byte(k)
	binary.LittleEndian.PutUint64(b[1:], uint64(n))
	b[9] = byte(dt)
	b[10] = byte(op)
	binary.LittleEndian.PutUint64(b[11:], uint64(root))
	binary.LittleEndian.PutUint64(b[18:], uint64(chunk))
	b[26] = byte(cd)
	m := 27
	if small != 0 {
		binary.LittleEndian.PutUint64(b[27:], uint64(small))
		m = 35
	}
	s := crc32.ChecksumIEEE(b[:m])
	return uint16(s) ^ uint16(s>>16)
}

// check validates the header of a data frame from peer against what this
// member expects at (step, chunk): n bytes of values, as many payload bytes
// for a raw call, their packing for a compressed one (exactly its length
// for a lossy codec, at most codec.LosslessMaxLen for zstd). The codec
// comes first: a member that compresses otherwise sends other lengths and
// another fingerprint, and the codec is what it must be told.
func (cl *call) check(peer int, h wire.Header, step, chunk, n int) error {
	c := cl.c
	who := c.mesh.Peer(peer)
	if h.Kind != wire.KindData {
		return fmt.Errorf("%s sent a %s frame on a data stream during %s #%d: protocol error", who, h.Kind, cl.kind, cl.seq)
	}
	k, st, fp := decodeStep(h.Step)
	if got := codec.ID(h.Codec); got != cl.codec {
		if err := codec.Check(got); err != nil {
			return fmt.Errorf("%s: %w", who, err)
		}
		return fmt.Errorf("%s sent %s frames in %s #%d, this member's call uses %s: every member must compress alike", who, got.Versioned(), k, h.Seq, cl.codec.Versioned())
	}
	if k != cl.kind || h.Seq != cl.seq {
		return fmt.Errorf("%s sent %s #%d, this member is in %s #%d: members called collectives in different orders", who, k, h.Seq, cl.kind, cl.seq)
	}
	if fp != cl.fp {
		opts, same := "", "ChunkBytes"
		if cl.small != 0 {
			name := c.thresholdName()
			opts, same = ", "+name+" "+fmtSmall(cl.small), "ChunkBytes and "+name
		}
		return fmt.Errorf("%s called %s #%d with other arguments than this member's (%s, %s chunks%s): every member must pass the same sizes, dtype, op and root, and use the same %s", who, cl.kind, cl.seq, cl.desc, fmtBytes(c.chunk), opts, same)
	}
	want, most := cl.frameLen(n)
	if st != step || int(h.Chunk) != chunk || int(h.Len) != want && (most == 0 || int(h.Len) > most) {
		expect := fmt.Sprintf("%d bytes", want)
		if most > 0 {
			expect = fmt.Sprintf("at most %d bytes", most)
		}
		return fmt.Errorf("%s sent %s #%d step %d chunk %d (%d bytes), this member expected step %d chunk %d (%s): protocol error", who, cl.kind, cl.seq, st, h.Chunk, h.Len, step, chunk, expect)
	}
	return nil
}

// frameLen is the payload length of a frame that carries n bytes of
// values in this call: exactly want, or, when most > 0, any length up to
// most (zstd).
func (cl *call) frameLen(n int) (want, most int) {
	switch {
	case cl.packed:
		return n, 0
	case cl.codec.Lossy():
		return cl.packedLen(n), 0
	case cl.codec == codec.Zstd:
		return -1, codec.LosslessMaxLen(cl.cdt, n)
	}
	return n, 0
}

// corruptHint adds to a corrupt frame's error what its header says, read
// the way this package packs it (the wire error can only report the raw
// step field). The header is not covered by the CRC, so this is what the
// frame claims to be.
func corruptHint(err error) error {
	var ce *wire.CorruptError
	if !errors.As(err, &ce) {
		return err
	}
	h := ce.Header
	switch h.Kind {
	case wire.KindData:
		k, st, fp := decodeStep(h.Step)
		return fmt.Errorf("%w; by its header, chunk %d of step %d of %s #%d (argument fingerprint %#04x)", err, h.Chunk, st, k, h.Seq, fp)
	case wire.KindP2P:
		return fmt.Errorf("%w; by its header, frame %d of point-to-point message %d on tag %d", err, h.Chunk, h.Seq, h.Step)
	case wire.KindBarrier:
		return fmt.Errorf("%w; by its header, a token of barrier #%d", err, h.Seq)
	}
	return err
}

// fmtBytes writes a byte count the way people read it: "64 MiB" when exact,
// else "1000 B".
func fmtBytes(n int) string {
	units := []string{"B", "KiB", "MiB", "GiB", "TiB"}
	u := 0
	for n >= 1024 && n%1024 == 0 && u < len(units)-1 {
		n /= 1024
		u++
	}
	return fmt.Sprintf("%d %s", n, units[u])
}

// fmtSmall writes a resolved Options.SmallBytes: "32 KiB", or "off".
func fmtSmall(small int) string {
	if small < 0 {
		return "off"
	}
	return fmtBytes(small)
}

// fmtDuration writes d without trailing zero units: "5m", "1m30s", "300ms".
func fmtDuration(d time.Duration) string {
	s := d.String()
	if strings.HasSuffix(s, "m0s") {
		s = strings.TrimSuffix(s, "0s")
	}
	if strings.HasSuffix(s, "h0m") {
		s = strings.TrimSuffix(s, "0m")
	}
	return s
}

// sameSlice reports whether a and b are the very same bytes.
func sameSlice(a, b []byte) bool {
	return len(a) == len(b) && (len(a) == 0 || unsafe.SliceData(a) == unsafe.SliceData(b))
}

// overlap reports whether a and b share memory.
func overlap(a, b []byte) bool {
	if len(a) == 0 || len(b) == 0 {
		return false
	}
	pa := uintptr(unsafe.Pointer(unsafe.SliceData(a)))
	pb := uintptr(unsafe.Pointer(unsafe.SliceData(b)))
	return pa < pb+uintptr(len(b)) && pb < pa+uintptr(len(a))
}

func mod(a, n int) int { return ((a % n) + n) % n }
