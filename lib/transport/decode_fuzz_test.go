package transport

import (
	"bytes"
	"context"
	"encoding/binary"
	"os"
	"sync/atomic"
	"testing"

	"github.com/gpubridge/gpubridge/lib/wire"
	"github.com/stretchr/testify/assert"
)

// The decoders of what a peer or the store hands a member, besides the
// handshake (FuzzHandshake) and the frame header (lib/wire FuzzParse):
// the records of a shared-memory ring and a ring file's header (endpoint
// records: lib/rendezvous FuzzRecord). Each has a size limit and a fuzz target; the seeds run with
// every go test.

// fuzzRingCap is the data capacity of the ring FuzzSHMRing reads.
const fuzzRingCap = 8192

// ringRecord encodes one ring record: the record header, the frame's wire
// header, the segment.
func ringRecord(flags uint32, h wire.Header, seg []byte) []byte {
	n := recHdr + int(align64(uint64(len(seg))))
	b := make([]byte, n)
	binary.LittleEndian.PutUint32(b[0:], uint32(n))
	binary.LittleEndian.PutUint32(b[4:], flags)
	binary.LittleEndian.PutUint32(b[8:], uint32(len(seg)))
	h.Put(b[32:64])
	copy(b[recHdr:], seg)
	return b
}

// ringSeeds are ring contents: frames as a producer writes them, and
// broken ones.
func ringSeeds() [][]byte {
	payload := []byte("hello, ring")
	one := wire.Header{Kind: wire.KindData, Seq: 3, Step: 1, Chunk: 2}
	one.Seal(payload, true)
	big := bytes.Repeat([]byte{0xab}, 5000) // over half the ring: split
	split := wire.Header{Kind: wire.KindData, Seq: 4}
	split.Seal(big, true)
	abort := wire.Header{Kind: wire.KindAbort}
	abort.Seal([]byte("reduce failed"), false)
	var splitRecs []byte
	splitRecs = append(splitRecs, ringRecord(recFirst, split, big[:3000])...)
	splitRecs = append(splitRecs, ringRecord(recLast, split, big[3000:])...)
	wrap := make([]byte, 64)
	binary.LittleEndian.PutUint32(wrap, wrapMark)
	corrupt := ringRecord(recFirst|recLast, one, payload)
	corrupt[recHdr] ^= 1
	return [][]byte{
		ringRecord(recFirst|recLast, one, payload),
		append(ringRecord(recFirst|recLast, one, payload), ringRecord(recFirst|recLast, abort, []byte("reduce failed"))...),
		splitRecs,
		wrap,
		corrupt,
		ringRecord(recLast, one, payload),  // continuation outside a split frame
		ringRecord(recFirst, one, payload), // a split frame that never ends
		append(ringRecord(recFirst, split, big[:10]), ringRecord(recFirst, split, big[:10])...),
		{0xff, 0xff, 0xff, 0x7f, 3, 0, 0, 0}, // a record longer than the ring
		bytes.Repeat([]byte{0}, 128),
	}
}

// fuzzSHMStream returns a receiving stream over one ring whose data area
// holds data, published up to its length (at most the ring's capacity),
// from a peer that is alive (this process) and never closes.
func fuzzSHMStream(data []byte) (*shmStream, *ring) {
	m := &shmMesh{
		meshBase: meshBase[*shmStream]{self: 0, size: 2, streams: 1, crc: true,
			peers: []string{"member 0", "member 1"}, procs: []string{"p0", "p1"}},
		pids: []int{os.Getpid(), os.Getpid()}, pidfds: []int{-1, -1}, dead: make([]atomic.Bool, 2),
		died: make([]ProcessDiedError, 2), done: make(chan struct{}),
	}
	mem := make([]byte, shmCtlSize+fuzzRingCap)
	in := newRing(mem, fuzzRingCap)
	n := copy(in.data, data)
	in.head.Store(uint64(n))
	out := newRing(make([]byte, shmCtlSize+fuzzRingCap), fuzzRingCap)
	return newSHMStream(m, 1, 0, out, in), in
}

// FuzzSHMRing reads arbitrary ring contents as a member reads its inbound
// ring: it must never panic or read outside the ring, never consume past
// what was published, and hand over only frames whose payload matches
// their header (and CRC).
func FuzzSHMRing(f *testing.F) {
	for _, s := range ringSeeds() {
		f.Add(s)
	}
	f.Fuzz(func(t *testing.T, data []byte) {
		s, in := fuzzSHMStream(data)
		// A cancelled context: Recv returns at once when nothing more was
		// published, instead of waiting for it.
		ctx, cancel := context.WithCancel(context.Background())
		cancel()
		for range fuzzRingCap/recHdr + 2 {
			err := s.Recv(ctx, func(h wire.Header, p []byte) error {
				if int(h.Len) != len(p) {
					t.Fatalf("frame of %d bytes, header says %d", len(p), h.Len)
				}
				if h.Flags&wire.FlagCRC != 0 && wire.Checksum(p) != h.CRC {
					t.Fatalf("frame with a bad CRC handed over")
				}
				return nil
			})
			if s.rd > in.head.Load() {
				t.Fatalf("read %d bytes of %d published", s.rd, in.head.Load())
			}
			if in.tail.Load() > s.rd {
				t.Fatalf("released %d bytes, read %d", in.tail.Load(), s.rd)
			}
			if err != nil {
				return
			}
		}
	})
}

func TestSHMRingSeeds(t *testing.T) {
	seeds := ringSeeds()
	recv := func(data []byte) ([]string, error) {
		s, _ := fuzzSHMStream(data)
		ctx, cancel := context.WithCancel(context.Background())
		cancel()
		var got []string
		for {
			err := s.Recv(ctx, func(h wire.Header, p []byte) error {
				got = append(got, string(p[:min(len(p), 11)]))
				return nil
			})
			if err != nil {
				return got, err
			}
		}
	}
	got, err := recv(seeds[0])
	assert.Equal(t, []string{"hello, ring"}, got)
	assert.ErrorIs(t, err, context.Canceled, "then nothing more was published")
	got, err = recv(seeds[1])
	assert.Equal(t, []string{"hello, ring"}, got)
	assert.ErrorContains(t, err, "member 1: failed: reduce failed")
	got, err = recv(seeds[2])
	assert.Len(t, got, 1, "the split frame, reassembled")
	assert.ErrorIs(t, err, context.Canceled)
	_, err = recv(seeds[3])
	assert.ErrorContains(t, err, "corrupt ring: a wrap marker at 0 with 64 bytes published after it")
	_, err = recv(seeds[4])
	assert.ErrorIs(t, err, wire.ErrCorrupt)
	_, err = recv(seeds[5])
	assert.ErrorContains(t, err, "a continuation record outside a split frame")
	_, err = recv(seeds[7])
	assert.ErrorContains(t, err, "a new frame began inside a split frame")
	_, err = recv(seeds[8])
	assert.ErrorContains(t, err, "corrupt ring record")
}

// FuzzSHMHeader: a ring file's header, signed or not, never makes the
// parser panic, and one that parses was signed with the secret.
func FuzzSHMHeader(f *testing.F) {
	good := make([]byte, shmHdrSize)
	(&shmHeader{proto: 1, member: 1, pid: 1234, size: 2, streams: 8, dataCap: 8<<20 + 4096, ctlCap: 1<<20 + 4096,
		job: jobTag(testSecret)}).put(good, testSecret)
	f.Add(good)
	f.Add([]byte(shmMagic))
	f.Add(make([]byte, shmHdrSize))
	f.Fuzz(func(t *testing.T, b []byte) {
		h, err := parseSHMHeader(b, testSecret)
		if err != nil {
			return
		}
		again := make([]byte, shmHdrSize)
		h.put(again, testSecret)
		if !bytes.Equal(again[:64], b[:64]) {
			t.Fatalf("header %x re-encodes to %x", b[:64], again[:64])
		}
	})
}
