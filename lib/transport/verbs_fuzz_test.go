package transport

import (
	"bytes"
	"context"
	"encoding/binary"
	"encoding/json"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/gpubridge/gpubridge/lib/ibverbs"
	"github.com/gpubridge/gpubridge/lib/wire"
)

// What a verbs peer hands a member, decoded with limits and fuzzed: its
// endpoint record (JSON of at most 4 KiB, the rendezvous's limit, then
// checked field by field), its signed queue pair numbers (set-up), and
// what it writes into the member's ring (the immediate values that
// announce records, and the records).

// verbsEndpointSeed is a well-formed record for 2 members.
func verbsEndpointSeed() []byte {
	e := verbsEndpoint{Device: "rxe0", Port: 1, LinkLayer: "Ethernet", MTU: 5, GID: "00000000000000000000ffff0a090001", GIDIndex: 1,
		RingAddr: 0x7f0000000000, RingKey: 0x1234, DataCap: 8<<20 + 4096, CtlCap: 1<<20 + 4096, QPNs: "000000000011"}
	e.Proto, e.Transport, e.Streams, e.P2P = 1, Verbs, 8, DefaultP2PStreams
	b, _ := json.Marshal(e)
	return b
}

// FuzzVerbsEndpoint: any bytes, as a peer's endpoint record, are refused or
// give a record whose fields are within their bounds.
func FuzzVerbsEndpoint(f *testing.F) {
	f.Add(verbsEndpointSeed())
	f.Add([]byte(`{"device":"rxe0","port":1,"link_layer":"InfiniBand","mtu":9,"gid":"zz","qpns":""}`))
	f.Add([]byte(`{"qpns":"ffffffffffff","data_cap":18446744073709551615}`))
	f.Add([]byte(`[]`))
	f.Fuzz(func(t *testing.T, b []byte) {
		if len(b) > 4<<10 {
			return // the rendezvous refuses it before decoding
		}
		var e verbsEndpoint
		if json.Unmarshal(b, &e) != nil {
			return
		}
		for n := 2; n <= 3; n++ {
			if e.check(n) != nil {
				continue
			}
			g := e.gid()
			_ = g.String()
			for i := range n {
				if q := e.qpn(i); q >= 1<<24 {
					t.Fatalf("queue pair number %#x of member %d from %q", q, i, e.QPNs)
				}
			}
			if e.DataCap%4096 != 0 || e.DataCap > maxRingBytes+4096 || e.CtlCap > verbsCtlRing+4096 {
				t.Fatalf("ring sizes %d and %d passed the check", e.DataCap, e.CtlCap)
			}
		}
	})
}

func TestVerbsEndpointCheck(t *testing.T) {
	var e verbsEndpoint
	require.NoError(t, json.Unmarshal(verbsEndpointSeed(), &e))
	require.NoError(t, e.check(2))
	assert.Equal(t, uint32(0x11), e.qpn(1))
	assert.Equal(t, "::ffff:10.9.0.1", e.gid().String())
	for _, tc := range []struct {
		mod  func(e *verbsEndpoint)
		want string
	}{
		{func(e *verbsEndpoint) { e.Device = "rxe 0" }, "device name"},
		{func(e *verbsEndpoint) { e.Port = 0 }, "port 0"},
		{func(e *verbsEndpoint) { e.LinkLayer = "Carrier pigeon" }, "link layer"},
		{func(e *verbsEndpoint) { e.MTU = 6 }, "MTU code 6"},
		{func(e *verbsEndpoint) { e.GID = "zz" }, "GID of 2 hex digits"},
		{func(e *verbsEndpoint) { e.GID = "zz000000000000000000ffff0a090001" }, "is not hex"},
		{func(e *verbsEndpoint) { e.LID = 1 << 16 }, "LID"},
		{func(e *verbsEndpoint) { e.DataCap = 4097 }, "data ring"},
		{func(e *verbsEndpoint) { e.CtlCap = 1 << 30 }, "control ring"},
		{func(e *verbsEndpoint) { e.QPNs = "0000000000" }, "10 hex digits of queue pair numbers for 2 members"},
		{func(e *verbsEndpoint) { e.QPNs = "00000000001g" }, "not hex"},
	} {
		c := e
		tc.mod(&c)
		assert.ErrorContains(t, c.check(2), tc.want)
	}
}

// fuzzVerbsStream is a receiving stream whose ring holds ring and whose
// peer announced the records of lens (in 64-byte units).
func fuzzVerbsStream(ring []byte, lens []uint16) *verbsStream {
	m := &verbsMesh{meshBase: meshBase[*verbsStream]{self: 0, size: 2, streams: 1, crc: true,
		peers: []string{"member 0", "member 1"}, procs: []string{"p0", "p1"}}, done: make(chan struct{}), peersState: make([]verbsPeer, 2),
		regs: &verbsRegs{}}
	s := newVerbsStream(m, 1, 0, nullQP{}, ring)
	for _, l := range lens {
		a, arrived, err := arrive(uint64(l)*64, s.arrived, s.released, s.cap, s.maxRec)
		if err != nil {
			s.rbroken = err
			break
		}
		s.arrivals, s.arrived = append(s.arrivals, a), arrived
	}
	return s
}

// ringInput splits a fuzz input: the announced lengths, then the ring.
func ringInput(data []byte) ([]byte, []uint16) {
	if len(data) < 1 {
		return nil, nil
	}
	k := min(int(data[0]), 32, (len(data)-1)/2)
	lens := make([]uint16, k)
	for i := range lens {
		lens[i] = binary.LittleEndian.Uint16(data[1+2*i:])
	}
	ring := make([]byte, 8192)
	copy(ring, data[1+2*k:])
	return ring, lens
}

// nullQP takes posts and completes nothing: the fuzzed stream's credits go
// nowhere.
type nullQP struct{}

func (nullQP) num() uint32                                                     { return 1 }
func (nullQP) readyToReceive(vRemote, uint32) error                            { return nil }
func (nullQP) readyToSend(uint32) error                                        { return nil }
func (nullQP) state() (ibverbs.QPState, error)                                 { return ibverbs.QPReadyToSend, nil }
func (nullQP) write(uint64, []ibverbs.SGE, uint64, uint32, uint32, bool) error { return nil }
func (nullQP) sendImm(uint64, uint32) error                                    { return nil }
func (nullQP) postRecv(uint64) error                                           { return nil }
func (nullQP) poll([]ibverbs.WC) (int, error)                                  { return 0, nil }
func (nullQP) fail() error                                                     { return nil }
func (nullQP) close() error                                                    { return nil }

// verbsRingSeed is a fuzz input: a count of announcements, their lengths
// (uint16 little-endian, in 64-byte units), then the ring's bytes.
func verbsRingSeed(recs ...[]byte) []byte {
	out := []byte{byte(len(recs))}
	var ring []byte
	for _, r := range recs {
		out = binary.LittleEndian.AppendUint16(out, uint16(len(r)/64))
		ring = append(ring, r...)
	}
	return append(out, ring...)
}

func verbsRec(seq uint32, flags uint32, h wire.Header, seg []byte) []byte {
	b := make([]byte, verbsRecHdr+int(align64(uint64(len(seg)))))
	putVerbsRecord(b, verbsRecord{length: uint32(len(b)), flags: flags, seg: uint32(len(seg)), seq: seq, hdr: h})
	copy(b[verbsRecHdr:], seg)
	return b
}

// FuzzVerbsRing: whatever a peer announces and writes, the receiver never
// panics, never reads outside its ring or past what was announced, and
// hands over only frames whose payload matches their header and CRC.
func FuzzVerbsRing(f *testing.F) {
	h := wire.Header{Kind: wire.KindData, Seq: 1}
	p := []byte("hello, verbs ring")
	h.Seal(p, true)
	big := make([]byte, 3000)
	hb := wire.Header{Kind: wire.KindData, Seq: 2}
	hb.Seal(big, true)
	f.Add(verbsRingSeed(verbsRec(0, verbsRecFirst|verbsRecLast, h, p)))
	f.Add(verbsRingSeed(verbsRec(0, verbsRecFirst, hb, big[:2000]), verbsRec(1, verbsRecLast, hb, big[2000:])))
	f.Add(verbsRingSeed(verbsRec(1, verbsRecFirst|verbsRecLast, h, p)))
	f.Add(verbsRingSeed(verbsRec(0, verbsRecLast, h, p)))
	f.Add([]byte{3, 0xff, 0xff, 1, 0, 0, 0})
	f.Fuzz(func(t *testing.T, data []byte) {
		ring, lens := ringInput(data)
		if ring == nil {
			return
		}
		k := len(lens)
		s := fuzzVerbsStream(ring, lens)
		announced := s.arrived
		ctx, cancel := context.WithCancel(context.Background())
		cancel()
		for range k + 1 {
			err := s.Recv(ctx, func(h wire.Header, p []byte) error {
				if int(h.Len) != len(p) || h.Flags&wire.FlagCRC != 0 && wire.Checksum(p) != h.CRC {
					t.Fatalf("a frame of %d bytes (header %d) with a wrong CRC handed over", len(p), h.Len)
				}
				return nil
			})
			if s.rd > announced || s.released > s.rd {
				t.Fatalf("read %d, released %d of %d announced", s.rd, s.released, announced)
			}
			if err != nil {
				return
			}
		}
	})
}

func TestVerbsRingSeeds(t *testing.T) {
	h := wire.Header{Kind: wire.KindData, Seq: 1}
	p := []byte("hello, verbs ring")
	h.Seal(p, true)
	recv := func(data []byte) ([]string, error) {
		s := fuzzVerbsStream(ringInput(data))
		ctx, cancel := context.WithCancel(context.Background())
		cancel()
		var got []string
		for {
			err := s.Recv(ctx, func(h wire.Header, p []byte) error {
				got = append(got, string(p[:min(len(p), 17)]))
				return nil
			})
			if err != nil {
				return got, err
			}
		}
	}
	got, err := recv(verbsRingSeed(verbsRec(0, verbsRecFirst|verbsRecLast, h, p)))
	assert.Equal(t, []string{"hello, verbs ring"}, got)
	assert.ErrorIs(t, err, context.Canceled)
	_, err = recv(verbsRingSeed(verbsRec(3, verbsRecFirst|verbsRecLast, h, p)))
	assert.ErrorContains(t, err, "member 1: stream 0: record 3 found where record 0 belongs: the ring is out of step")
	_, err = recv(verbsRingSeed(verbsRec(0, verbsRecLast, h, p)))
	assert.ErrorContains(t, err, "a continuation record outside a split frame")
	bad := verbsRec(0, verbsRecFirst|verbsRecLast, h, p)
	bad[verbsRecHdr] ^= 1
	_, err = recv(verbsRingSeed(bad))
	assert.ErrorIs(t, err, wire.ErrCorrupt)
}

// FuzzVerbsQPNs: any bytes, as a peer's signed queue pair numbers for 2
// data and 1 point-to-point stream, are refused or decode to exactly 3
// numbers of 24 bits that seal back to the same bytes.
func FuzzVerbsQPNs(f *testing.F) {
	secret := []byte("fuzz secret")
	f.Add(sealVerbsQPNs(secret, 1, 0, []uint32{0x11, 0x12, 0x13}))
	f.Add(sealVerbsQPNs(secret, 1, 0, []uint32{0x11, 0x12}))
	f.Add(sealVerbsQPNs(secret, 1, 0, []uint32{0x11, 0x12, 1 << 24}))
	f.Add([]byte{})
	f.Fuzz(func(t *testing.T, b []byte) {
		qpns, err := openVerbsQPNs(secret, 1, 0, 2, 1, b)
		if err != nil {
			return
		}
		if len(qpns) != 3 {
			t.Fatalf("%d queue pair numbers for 3 streams", len(qpns))
		}
		for _, q := range qpns {
			if q >= 1<<24 {
				t.Fatalf("queue pair number %#x passed", q)
			}
		}
		if !bytes.Equal(sealVerbsQPNs(secret, 1, 0, qpns), b) {
			t.Fatalf("%x decoded to %x, which seals differently", b, qpns)
		}
	})
}

// The signed queue pair numbers: what the peer sealed for this member
// with this secret, for the agreed stream counts, and nothing else.
func TestVerbsQPNsSealed(t *testing.T) {
	secret := []byte("job secret")
	qpns := []uint32{0x11, 0x12, 0x13, 0xffffff}
	msg := sealVerbsQPNs(secret, 2, 0, qpns)
	got, err := openVerbsQPNs(secret, 2, 0, 3, 1, msg)
	require.NoError(t, err)
	assert.Equal(t, qpns, got)
	for _, tc := range []struct {
		name                  string
		b                     []byte
		secret                []byte
		from, to, streams, p2 int
		want                  string
	}{
		{"fewer point-to-point streams", msg, secret, 2, 0, 3, 0, "sent 48 bytes of queue pair numbers, 44 expected (3 data and 0 point-to-point streams, signed)"},
		{"more point-to-point streams", msg, secret, 2, 0, 3, 2, "sent 48 bytes of queue pair numbers, 52 expected (3 data and 2 point-to-point streams, signed)"},
		{"other secret", msg, []byte("other job"), 2, 0, 3, 1, "sent queue pair numbers not signed with this job's secret"},
		{"for another member", msg, secret, 2, 1, 3, 1, "sent queue pair numbers not signed with this job's secret"},
		{"from another member", msg, secret, 1, 0, 3, 1, "sent queue pair numbers not signed with this job's secret"},
		{"tampered", append([]byte{0x12}, msg[1:]...), secret, 2, 0, 3, 1, "sent queue pair numbers not signed with this job's secret"},
		{"over 24 bits", sealVerbsQPNs(secret, 2, 0, []uint32{0x11, 1 << 24}), secret, 2, 0, 1, 1, "sent queue pair number 0x1000000 (24 bits allowed)"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			_, err := openVerbsQPNs(tc.secret, tc.from, tc.to, tc.streams, tc.p2, tc.b)
			assert.EqualError(t, err, tc.want)
		})
	}
}
