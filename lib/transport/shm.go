package transport

import (
	"context"
	"crypto/hmac"
	"crypto/sha256"
	"encoding/binary"
	"errors"
	"fmt"
	"os"
	"strings"
	"sync"
	"sync/atomic"
	"time"
	"unsafe"

	"github.com/gpubridge/gpubridge/lib/wire"
	"golang.org/x/sys/unix"
)

// Same-host shared memory.
//
// Each member creates one file under /dev/shm holding its outbound rings:
// one single-producer single-consumer ring per (peer, stream), the control
// stream's ring included. The peers map it read-write: the creator is the
// producer of every ring in it, the peer the consumer. The file is named
// from the job tag (a hash of the job's secret) and the member index, has
// mode 0600, is preallocated (a full /dev/shm is a clear error at setup,
// not a SIGBUS later), and is unlinked as soon as every member has mapped
// every file (the setup barrier), or by Close.
//
// File layout:
//
//	0     file header (shmHdrSize bytes): magic, protocol version, member,
//	      pid, members, streams, rings, data and control ring capacities,
//	      job tag; HMAC-SHA256(secret, "shm" | header) in its last 32 bytes
//	...   per peer (in member order, the creator skipped), per stream
//	      (data streams, then control): a ring
//
// Ring: a control page, then cap bytes of data (cap a multiple of 4096).
//
//	ctl+0    head u64     producer: bytes published (monotonic)
//	ctl+8    prodSeq u32  futex word the consumer sleeps on; the producer
//	                      bumps it when consWaiting is set, and on close
//	ctl+12   prodWaiting  the producer sleeps waiting for space
//	ctl+16   prodState    1 once the producer closed its mesh
//	ctl+128  tail u64     consumer: bytes released
//	ctl+136  consSeq u32  futex word the producer sleeps on
//	ctl+140  consWaiting  the consumer sleeps waiting for data
//	ctl+144  consState    1 once the consumer closed its mesh
//	ctl+148  consPid      the consumer's pid
//
// Records in the data area are 64-byte aligned and never wrap: a record
// that does not fit before the end is preceded by a wrap marker that
// fills the rest. A record is a 64-byte record header (length, flags,
// segment length; the frame's wire header in bytes 32..64) and the payload.
// Frames of up to maxRec-64 bytes (half the ring) are one record, and Recv
// hands fn a view of it in place; larger frames are cut into segments and
// reassembled in a per-stream buffer.
//
// Waiting: spin for Config.Spin, then sleep on the futex word (FUTEX_WAIT on
// the shared mapping) with a timeout of shmPoll, after which the waiter
// checks its context, the mesh, the peer's state word and whether the
// peer's process is alive (pidfd, else kill 0), so an idle bridge uses no
// CPU and a dead peer is noticed within about shmPoll.
//
// Authentication: the endpoint records that name the files and pids are
// signed with the job's secret (HMAC), the file header is signed too, and a
// member maps a peer's file only when it is a regular file owned by its
// own uid with mode 0600, of the size its signed header implies, created
// by the pid of the signed record.
const (
	shmHdrSize  = 4096
	shmCtlSize  = 4096
	recHdr      = 64
	wrapMark    = 0xFFFFFFFF
	recFirst    = 1
	recLast     = 2
	shmPoll     = 10 * time.Millisecond
	shmMagic    = "GBSHMv1\x00"
	ctlRingCap  = 1<<20 + 4096
	shmMACLabel = "shm\x00"
	shmMACSize  = sha256.Size
)

// shmDir is where the ring files live.
var shmDir = "/dev/shm"

type ring struct {
	data        []byte
	cap         uint64
	maxRec      uint64
	head, tail  *atomic.Uint64
	prodSeq     *atomic.Uint32
	prodWaiting *atomic.Uint32
	prodState   *atomic.Uint32
	consSeq     *atomic.Uint32
	consWaiting *atomic.Uint32
	consState   *atomic.Uint32
	consPid     *atomic.Uint32
}

func u64at(b []byte, off int) *atomic.Uint64 { return (*atomic.Uint64)(unsafe.Pointer(&b[off])) }
func u32at(b []byte, off int) *atomic.Uint32 { return (*atomic.Uint32)(unsafe.Pointer(&b[off])) }

func newRing(b []byte, cp uint64) *ring {
	ctl := b[:shmCtlSize]
	return &ring{
		data: b[shmCtlSize : shmCtlSize+int(cp)], cap: cp, maxRec: cp / 2 &^ 63,
		head: u64at(ctl, 0), prodSeq: u32at(ctl, 8), prodWaiting: u32at(ctl, 12), prodState: u32at(ctl, 16),
		tail: u64at(ctl, 128), consSeq: u32at(ctl, 136), consWaiting: u32at(ctl, 140), consState: u32at(ctl, 144),
		consPid: u32at(ctl, 148),
	}
}

// publish makes n more bytes visible to the consumer and wakes it when it
// sleeps.
func (r *ring) publish(n uint64) {
	r.head.Store(r.head.Load() + n)
	if r.consWaiting.Load() != 0 {
		r.prodSeq.Add(1)
		futexWake(r.prodSeq)
	}
}

// release frees n bytes for the producer and wakes it when it sleeps.
func (r *ring) release(n uint64) {
	r.tail.Store(r.tail.Load() + n)
	if r.prodWaiting.Load() != 0 {
		r.consSeq.Add(1)
		futexWake(r.consSeq)
	}
}

// wakeAll wakes every sleeper on r, on either side.
func (r *ring) wakeAll() {
	r.prodSeq.Add(1)
	r.consSeq.Add(1)
	futexWake(r.prodSeq)
	futexWake(r.consSeq)
}

// Futex operations on a shared (not process-private) word.
const (
	futexOpWait = 0
	futexOpWake = 1
)

func futexWait(w *atomic.Uint32, val uint32, d time.Duration) {
	ts := unix.NsecToTimespec(int64(d))
	_, _, _ = unix.Syscall6(unix.SYS_FUTEX, uintptr(unsafe.Pointer(w)), futexOpWait, uintptr(val),
		uintptr(unsafe.Pointer(&ts)), 0, 0)
}

func futexWake(w *atomic.Uint32) {
	_, _, _ = unix.Syscall6(unix.SYS_FUTEX, uintptr(unsafe.Pointer(w)), futexOpWake, uintptr(1<<31-1), 0, 0, 0)
}

func align64(n uint64) uint64 { return (n + 63) &^ 63 }

// shmLayout is the geometry of one member's file.
type shmLayout struct {
	size, streams   int
	dataCap, ctlCap uint64
}

func (l shmLayout) peerBlock() uint64 {
	return uint64(l.streams)*(shmCtlSize+l.dataCap) + shmCtlSize + l.ctlCap
}
func (l shmLayout) fileSize() uint64 { return shmHdrSize + uint64(l.size-1)*l.peerBlock() }

// ring returns ring (peer block pi, stream st) of a mapped file.
func (l shmLayout) ring(m []byte, pi, st int) *ring {
	off := shmHdrSize + uint64(pi)*l.peerBlock() + uint64(st)*(shmCtlSize+l.dataCap)
	cp := l.dataCap
	if st == l.streams {
		cp = l.ctlCap
	}
	return newRing(m[off:off+shmCtlSize+cp], cp)
}

// peerIndex is the position of member p in the peer blocks of member owner.
func peerIndex(owner, p int) int {
	if p > owner {
		return p - 1
	}
	return p
}

type shmHeader struct {
	proto, member, pid, size, streams int
	dataCap, ctlCap                   uint64
	job                               [jobTagSize]byte
}

func (h *shmHeader) put(b []byte, secret []byte) {
	copy(b, shmMagic)
	le := binary.LittleEndian
	le.PutUint32(b[8:], uint32(h.proto))
	le.PutUint32(b[12:], uint32(h.member))
	le.PutUint32(b[16:], uint32(h.pid))
	le.PutUint32(b[20:], uint32(h.size))
	le.PutUint32(b[24:], uint32(h.streams))
	le.PutUint64(b[32:], h.dataCap)
	le.PutUint64(b[40:], h.ctlCap)
	copy(b[48:], h.job[:])
	mac := shmMAC(secret, b)
	copy(b[shmHdrSize-shmMACSize:], mac[:])
}

func shmMAC(secret, b []byte) [shmMACSize]byte {
	h := hmac.New(sha256.New, secret)
	h.Write([]byte(shmMACLabel))
	h.Write(b[:shmHdrSize-shmMACSize])
	var out [shmMACSize]byte
	h.Sum(out[:0])
	return out
}

func parseSHMHeader(b []byte, secret []byte) (shmHeader, error) {
	h, err := decodeSHMHeader(b)
	if err != nil {
		return shmHeader{}, err
	}
	mac := shmMAC(secret, b)
	if !hmac.Equal(mac[:], b[shmHdrSize-shmMACSize:shmHdrSize]) {
		return shmHeader{}, errors.New("ring file header is not signed with this job's secret")
	}
	return h, nil
}

// decodeSHMHeader reads a header's fields without checking its signature:
// for parseSHMHeader, and for the sweep of other jobs' files, whose secret
// this member does not have.
func decodeSHMHeader(b []byte) (shmHeader, error) {
	if len(b) < shmHdrSize || string(b[:8]) != shmMagic {
		return shmHeader{}, errors.New("not a gpubridge ring file")
	}
	le := binary.LittleEndian
	h := shmHeader{
		proto: int(le.Uint32(b[8:])), member: int(le.Uint32(b[12:])), pid: int(le.Uint32(b[16:])),
		size: int(le.Uint32(b[20:])), streams: int(le.Uint32(b[24:])),
		dataCap: le.Uint64(b[32:]), ctlCap: le.Uint64(b[40:]),
	}
	copy(h.job[:], b[48:])
	return h, nil
}

type shmMesh struct {
	meshBase[*shmStream]
	pids    []int
	died    []ProcessDiedError // what a peer's death is reported as
	pidfds  []int
	dead    []atomic.Bool
	ownPath string
	maps    [][]byte
	share   *shmShare // memory shared with the peers (shm_share.go)

	spin  time.Duration // Config.Spin
	slept atomic.Uint64 // waits that outlasted their spin and slept

	closing  atomic.Bool
	aborting atomic.Bool

	// beforePeerCheck, set by tests only, runs in a sleeping wait between
	// its look at the ring and its look at the peer's state.
	beforePeerCheck func()

	mu        sync.Mutex
	ops       int
	closed    bool
	unmapped  bool
	closeOnce sync.Once
	done      chan struct{} // closed by Close
}

type shmStream struct {
	m         *shmMesh
	peer, idx int
	out, in   *ring

	smu     sync.Mutex
	sbroken error
	corrupt atomic.Bool // test hook: flip a payload byte of the next frame

	// receive side, used by one receiver at a time
	rbroken error
	asm     []byte // Recv's reassembly buffer
	asmBuf  []byte // the buffer the split frame in progress goes into
	asmHdr  wire.Header
	asmGot  int
	asmOn   bool
	rd      uint64      // bytes read off the inbound ring (>= its tail)
	rdOn    bool        // rd was set from the ring's tail
	held    chan []byte // free RecvHold reassembly buffers (MaxHeld)

	// hmu guards rd's updates and pins: the ring space of frames held in
	// place, in ring order. Space is released up to the first pinned frame.
	hmu  sync.Mutex
	pins []*shmPin
}

// shmPin is a frame held in place in the inbound ring.
type shmPin struct {
	start    uint64 // ring position of its record
	released bool
}

func newSHMStream(m *shmMesh, peer, idx int, out, in *ring) *shmStream {
	s := &shmStream{m: m, peer: peer, idx: idx, out: out, in: in, held: make(chan []byte, MaxHeld)}
	for range MaxHeld {
		s.held <- nil
	}
	return s
}

// enter registers an operation that uses the mappings; false when closed.
func (m *shmMesh) enter() bool {
	m.mu.Lock()
	defer m.mu.Unlock()
	if m.closed {
		return false
	}
	m.ops++
	return true
}

func (m *shmMesh) exit() {
	m.mu.Lock()
	defer m.mu.Unlock()
	m.ops--
	if m.closed && m.ops == 0 {
		m.unmapLocked()
	}
}

func (m *shmMesh) unmapLocked() {
	if m.unmapped {
		return
	}
	m.unmapped = true
	for _, b := range m.maps {
		_ = unix.Munmap(b)
	}
	m.maps = nil
	for i, fd := range m.pidfds {
		if fd >= 0 {
			_ = unix.Close(fd)
			m.pidfds[i] = -1
		}
	}
}

// Close marks every ring closed on this side, wakes every sleeper (the
// peers' and this member's), and unmaps once no call is using the rings.
func (m *shmMesh) Close() error {
	m.closeOnce.Do(func() {
		m.closing.Store(true)
		if m.done != nil {
			close(m.done)
		}
		m.each(func(s *shmStream) {
			s.out.prodState.Store(1)
			s.in.consState.Store(1)
			s.out.wakeAll()
			s.in.wakeAll()
		})
		m.mu.Lock()
		m.closed = true
		if m.ops == 0 {
			m.unmapLocked()
		}
		m.mu.Unlock()
		if m.share != nil {
			m.share.close()
		}
		if m.ownPath != "" {
			_ = os.Remove(m.ownPath)
		}
	})
	return nil
}

// Abort writes a KindAbort frame into every outbound ring that has room
// within abortGrace (sends in flight are stopped first), then closes.
func (m *shmMesh) Abort(err error) {
	if m.closing.Load() || !m.enter() {
		return
	}
	m.aborting.Store(true)
	m.each(func(s *shmStream) { s.out.wakeAll() })
	msg := abortMessage(err)
	until := time.Now().Add(abortGrace)
	ctx, cancel := context.WithDeadline(context.Background(), until)
	var wg sync.WaitGroup
	m.each(func(s *shmStream) {
		wg.Go(func() {
			if !lockUntil(&s.smu, until) {
				return
			}
			defer s.smu.Unlock()
			if s.sbroken == nil {
				h := wire.Header{Kind: wire.KindAbort}
				h.Seal(msg, m.crc)
				_ = s.write(ctx, h, msg, true)
			}
		})
	})
	wg.Wait()
	cancel()
	m.exit()
	_ = m.Close()
}

// peerGone reports whether member p's process has exited.
func (m *shmMesh) peerGone(p int) bool {
	if m.dead[p].Load() {
		return true
	}
	gone := false
	if fd := m.pidfds[p]; fd >= 0 {
		fds := [1]unix.PollFd{{Fd: int32(fd), Events: unix.POLLIN}}
		n, err := unix.Poll(fds[:], 0)
		gone = err == nil && n > 0
	} else {
		gone = !pidAlive(m.pids[p])
	}
	if gone {
		m.dead[p].Store(true)
	}
	return gone
}

// pidAlive is the fallback without pidfd: kill 0, and not a zombie.
func pidAlive(pid int) bool {
	if err := unix.Kill(pid, 0); errors.Is(err, unix.ESRCH) {
		return false
	}
	b, err := os.ReadFile(fmt.Sprintf("/proc/%d/stat", pid))
	if err != nil {
		return true
	}
	s := string(b)
	if i := strings.LastIndexByte(s, ')'); i >= 0 && i+2 < len(s) {
		return s[i+2] != 'Z' && s[i+2] != 'X'
	}
	return true
}

type spinKey struct{}

// WithSpin returns a context under which this process's shm waits spin for
// d (clamped to 0..MaxSpin) instead of their mesh's Config.Spin: a call
// whose time is mostly its waiters waking up can spin long without every
// large call's waiters holding the cores its reduction needs.
func WithSpin(ctx context.Context, d time.Duration) context.Context {
	return context.WithValue(ctx, spinKey{}, min(max(d, 0), MaxSpin))
}

// SpinFrom returns the spin WithSpin set on ctx, if any.
func SpinFrom(ctx context.Context) (time.Duration, bool) {
	d, ok := ctx.Value(spinKey{}).(time.Duration)
	return d, ok
}

// wait blocks until ready returns true. seq and waiting are the futex word
// and the flag of this side; peerState reports the other side's close.
// drain (the receiving side) looks at the ring once more after it saw the
// peer close or die: a peer publishes its frames before it closes, so a
// frame it sent last, published after this side's look, is still read.
// It spins for the mesh's spin (ctx's, when WithSpin set one), then sleeps
// on the futex in slices of shmPoll, checking ctx, the mesh and the peer
// between them.
func (s *shmStream) wait(ctx context.Context, op string, ready func() bool, seq, waiting, peerState *atomic.Uint32, abort, drain bool) error {
	if ready() {
		return nil
	}
	spin, ok := SpinFrom(ctx)
	if !ok {
		spin = s.m.spin
	}
	t0 := time.Now()
	for i := 1; ; i++ {
		if ready() {
			return nil
		}
		if i%16 == 0 && time.Since(t0) > spin {
			break
		}
	}
	defer waiting.Store(0)
	m := s.m
	m.slept.Add(1)
	for {
		v := seq.Load()
		waiting.Store(1)
		if ready() {
			return nil
		}
		if m.closing.Load() || (!abort && m.aborting.Load()) {
			return fmt.Errorf("%s %s: %w", op, m.Peer(s.peer), ErrClosed)
		}
		if err := ctx.Err(); err != nil {
			return fmt.Errorf("%s %s on stream %d: %w", op, m.Peer(s.peer), s.idx, err)
		}
		if m.beforePeerCheck != nil {
			m.beforePeerCheck()
		}
		if peerState.Load() != 0 {
			if drain && ready() {
				return nil
			}
			return &PeerError{Peer: m.Peer(s.peer), Err: ErrPeerClosed}
		}
		if m.peerGone(s.peer) {
			if drain && ready() {
				return nil
			}
			died := m.died[s.peer]
			return &PeerError{Peer: m.Peer(s.peer), Err: &died}
		}
		d := shmPoll
		if dl, ok := ctx.Deadline(); ok {
			if r := time.Until(dl); r < d {
				d = max(r, time.Microsecond)
			}
		}
		futexWait(seq, v, d)
	}
}

func (s *shmStream) Send(ctx context.Context, hdr wire.Header, payload []byte) error {
	if len(payload) > wire.MaxPayload {
		return fmt.Errorf("send to %s: payload of %d bytes is over the %d-byte frame limit", s.m.Peer(s.peer), len(payload), wire.MaxPayload)
	}
	if !s.m.enter() {
		return fmt.Errorf("send to %s: %w", s.m.Peer(s.peer), ErrClosed)
	}
	defer s.m.exit()
	s.smu.Lock()
	defer s.smu.Unlock()
	if s.sbroken != nil {
		return s.sbroken
	}
	if s.m.aborting.Load() {
		return fmt.Errorf("send to %s: %w", s.m.Peer(s.peer), ErrClosed)
	}
	if err := ctx.Err(); err != nil {
		return fmt.Errorf("send to %s on stream %d: %w", s.m.Peer(s.peer), s.idx, err)
	}
	hdr.Seal(payload, s.m.crc)
	return s.write(ctx, hdr, payload, false)
}

// write puts one sealed frame into the outbound ring, in segments when it
// is larger than a record may be. Callers hold smu.
func (s *shmStream) write(ctx context.Context, hdr wire.Header, payload []byte, abort bool) error {
	r := s.out
	maxSeg := int(r.maxRec - recHdr)
	for off, first := 0, true; first || off < len(payload); first = false {
		n := min(len(payload)-off, maxSeg)
		need := recHdr + align64(uint64(n))
		pos, err := s.reserve(ctx, need, abort)
		if err != nil {
			if off > 0 {
				// Part of the frame is in the ring: the stream is out of step.
				s.sbroken = err
			}
			return err
		}
		rec := r.data[pos : pos+need]
		flags := uint32(0)
		if first {
			flags |= recFirst
		}
		if off+n == len(payload) {
			flags |= recLast
		}
		le := binary.LittleEndian
		le.PutUint32(rec[0:], uint32(need))
		le.PutUint32(rec[4:], flags)
		le.PutUint32(rec[8:], uint32(n))
		hdr.Put(rec[32:64])
		copy(rec[recHdr:], payload[off:off+n])
		if n > 0 && s.corrupt.Load() {
			s.corrupt.Store(false)
			rec[recHdr+n/2] ^= 0x40
		}
		r.publish(need)
		off += n
	}
	return nil
}

// reserve waits until need contiguous bytes are free and returns their
// position, writing a wrap marker first when the end of the ring is too
// close.
func (s *shmStream) reserve(ctx context.Context, need uint64, abort bool) (uint64, error) {
	r := s.out
	for {
		head := r.head.Load()
		pos := head % r.cap
		n := need
		if room := r.cap - pos; room < need {
			n = room
		}
		if err := s.wait(ctx, "send to", func() bool { return r.cap-(head-r.tail.Load()) >= n },
			r.consSeq, r.prodWaiting, r.consState, abort, false); err != nil {
			return 0, err
		}
		if n == need {
			return pos, nil
		}
		binary.LittleEndian.PutUint32(r.data[pos:], wrapMark)
		r.publish(n)
	}
}

func (s *shmStream) Recv(ctx context.Context, fn func(wire.Header, []byte) error) error {
	m := s.m
	if !m.enter() {
		return fmt.Errorf("receive from %s: %w", m.Peer(s.peer), ErrClosed)
	}
	defer m.exit()
	if s.rbroken != nil {
		return s.rbroken
	}
	h, p, rl, err := s.next(ctx, &s.asm)
	if err != nil {
		return err
	}
	err = s.deliver(h, p, fn)
	if rl > 0 {
		s.consume(rl, false)
	}
	return err
}

// RecvHold implements Holder. A frame of one record is held in place: its
// ring space (and the space of everything after it) is released once it
// and every frame held before it are released, and the mappings stay
// until then. A frame reassembled from segments is held in one of MaxHeld
// buffers of the stream. Frames held in place share the ring with the
// frames behind them: a split frame (over half the ring) behind a frame
// held in place may need that frame released before it can be completed.
func (s *shmStream) RecvHold(ctx context.Context) (wire.Header, []byte, func(), error) {
	m := s.m
	if !m.enter() {
		return wire.Header{}, nil, nil, fmt.Errorf("receive from %s: %w", m.Peer(s.peer), ErrClosed)
	}
	if s.rbroken != nil {
		m.exit()
		return wire.Header{}, nil, nil, s.rbroken
	}
	b, err := takeHeld(ctx, s.held, m.done, m.Peer(s.peer), s.idx)
	if err != nil {
		m.exit()
		return wire.Header{}, nil, nil, err
	}
	h, p, rl, err := s.next(ctx, &b)
	if err == nil {
		err = s.deliver(h, p, func(wire.Header, []byte) error { return nil })
	}
	if err != nil {
		if rl > 0 {
			s.consume(rl, false)
		}
		s.held <- b
		m.exit()
		return wire.Header{}, nil, nil, err
	}
	var once atomic.Bool
	if rl == 0 {
		m.exit()
		return h, p, func() {
			if once.CompareAndSwap(false, true) {
				s.held <- b
			}
		}, nil
	}
	pin := s.consume(rl, true)
	return h, p, func() {
		if once.CompareAndSwap(false, true) {
			s.unpin(pin)
			s.held <- b
			m.exit()
		}
	}, nil
}

// consume marks the next n bytes of the inbound ring read and releases
// what no held frame pins; with pin, the record read is held in place.
func (s *shmStream) consume(n uint64, pin bool) *shmPin {
	s.hmu.Lock()
	defer s.hmu.Unlock()
	var p *shmPin
	if pin {
		p = &shmPin{start: s.rd}
		s.pins = append(s.pins, p)
	}
	s.rd += n
	s.advanceLocked()
	return p
}

func (s *shmStream) unpin(p *shmPin) {
	s.hmu.Lock()
	defer s.hmu.Unlock()
	p.released = true
	for len(s.pins) > 0 && s.pins[0].released {
		s.pins[0] = nil
		s.pins = s.pins[1:]
	}
	s.advanceLocked()
}

// advanceLocked releases the inbound ring up to the first pinned frame, or
// up to rd. Callers hold hmu.
func (s *shmStream) advanceLocked() {
	to := s.rd
	if len(s.pins) > 0 {
		to = s.pins[0].start
	}
	if tail := s.in.tail.Load(); to > tail {
		s.in.release(to - tail)
	}
}

// next reads the next frame off the inbound ring. A frame of one record is
// returned in place, with rl its record's length, not yet consumed; a split
// frame is reassembled into *dst (grown as needed), with rl 0. Callers are
// inside enter and check rbroken.
func (s *shmStream) next(ctx context.Context, dst *[]byte) (h wire.Header, p []byte, rl uint64, err error) {
	r := s.in
	if !s.rdOn {
		s.hmu.Lock()
		s.rd, s.rdOn = r.tail.Load(), true
		s.hmu.Unlock()
	}
	if s.asmOn {
		// A split frame was interrupted (deadline) in another buffer.
		s.asmInto(dst)
	}
	for {
		rd := s.rd
		if err := s.wait(ctx, "receive from", func() bool { return r.head.Load() != rd },
			r.prodSeq, r.consWaiting, r.prodState, false, true); err != nil {
			var pe *PeerError
			if errors.As(err, &pe) {
				s.rbroken = err
			}
			return h, nil, 0, err
		}
		head := r.head.Load()
		pos := rd % r.cap
		le := binary.LittleEndian
		recLen := le.Uint32(r.data[pos:])
		if recLen == wrapMark {
			if r.cap-pos > head-rd {
				return h, nil, 0, s.broken(fmt.Errorf("stream %d: corrupt ring: a wrap marker at %d with %d bytes published after it", s.idx, pos, head-rd))
			}
			s.consume(r.cap-pos, false)
			continue
		}
		flags, segLen := le.Uint32(r.data[pos+4:]), uint64(le.Uint32(r.data[pos+8:]))
		rl := uint64(recLen)
		if rl%64 != 0 || rl < recHdr || rl > r.cap-pos || rl > head-rd || segLen > rl-recHdr || flags&^(recFirst|recLast) != 0 {
			return h, nil, 0, s.broken(fmt.Errorf("stream %d: corrupt ring record (length %d, segment %d, flags %#x)", s.idx, recLen, segLen, flags))
		}
		rec := r.data[pos : pos+rl]
		seg := rec[recHdr : recHdr+segLen]
		if flags&recFirst != 0 {
			if s.asmOn {
				return h, nil, 0, s.broken(fmt.Errorf("stream %d: a new frame began inside a split frame", s.idx))
			}
			h, err := wire.Parse(rec[32:64])
			if err != nil {
				return h, nil, 0, s.broken(fmt.Errorf("stream %d: %w", s.idx, err))
			}
			if flags&recLast != 0 {
				if uint64(h.Len) != segLen {
					return h, nil, 0, s.broken(fmt.Errorf("stream %d: frame of %d bytes in a record of %d", s.idx, h.Len, segLen))
				}
				return h, seg, rl, nil
			}
			s.asmHdr, s.asmGot, s.asmOn = h, 0, true
			s.asmBuf = nil
			s.asmInto(dst)
		} else if !s.asmOn {
			return h, nil, 0, s.broken(fmt.Errorf("stream %d: a continuation record outside a split frame", s.idx))
		}
		if uint64(s.asmGot)+segLen > uint64(s.asmHdr.Len) {
			return h, nil, 0, s.broken(fmt.Errorf("stream %d: split frame longer than its header says", s.idx))
		}
		copy(s.asmBuf[s.asmGot:], seg)
		s.asmGot += int(segLen)
		s.consume(rl, false)
		if flags&recLast != 0 {
			s.asmOn = false
			if s.asmGot != int(s.asmHdr.Len) {
				return h, nil, 0, s.broken(fmt.Errorf("stream %d: split frame of %d bytes, header says %d", s.idx, s.asmGot, s.asmHdr.Len))
			}
			p := s.asmBuf[:s.asmGot]
			s.asmBuf = nil
			return s.asmHdr, p, 0, nil
		}
	}
}

// asmInto makes *dst (grown as needed) the buffer of the split frame in
// progress, carrying over what was assembled elsewhere.
func (s *shmStream) asmInto(dst *[]byte) {
	n := int(s.asmHdr.Len)
	if cap(*dst) < n {
		*dst = make([]byte, n)
	}
	b := (*dst)[:n]
	if s.asmGot > 0 && unsafe.SliceData(b) != unsafe.SliceData(s.asmBuf) {
		copy(b, s.asmBuf[:s.asmGot])
	}
	s.asmBuf = b
}

func (s *shmStream) broken(err error) error {
	s.rbroken = &PeerError{Peer: s.m.Peer(s.peer), Err: err}
	return s.rbroken
}

func (s *shmStream) deliver(h wire.Header, p []byte, fn func(wire.Header, []byte) error) error {
	if err := h.Verify(p); err != nil {
		return &PeerError{Peer: s.m.Peer(s.peer), Err: fmt.Errorf("stream %d: %w", s.idx, err)}
	}
	switch h.Kind {
	case wire.KindAbort:
		s.rbroken = &PeerError{Peer: s.m.Peer(s.peer), Err: fmt.Errorf("failed: %s", abortText(p))}
		return s.rbroken
	case wire.KindClose:
		s.rbroken = &PeerError{Peer: s.m.Peer(s.peer), Err: ErrPeerClosed}
		return s.rbroken
	}
	return fn(h, p)
}
