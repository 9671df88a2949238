package transport

import (
	"context"
	"errors"
	"fmt"
	"sync"
	"sync/atomic"
	"time"
	"unsafe"

	"github.com/gpubridge/gpubridge/lib/ibverbs"
	"github.com/gpubridge/gpubridge/lib/wire"
)

// verbsStream is one stream (queue pair) to one peer: the records it
// writes into the peer's ring, and the records the peer writes into its
// own ring. One sender (smu) and one receiver use it at a time; the
// progress goroutine and waiters that help it poll its completion queue
// (pollMu); mu guards the state both directions and the completions
// share.
type verbsStream struct {
	m         *verbsMesh
	peer, idx int
	qp        vQP

	smu    sync.Mutex // the sender (Send, Abort's and Close's frames)
	pollMu sync.Mutex
	wcs    [16]ibverbs.WC
	// postMu serializes the queue pair's posts, in the order of their sq
	// entries. ibv_post_send can do the device's work in the caller
	// (rdma_rxe runs its requester in process context), so it is never
	// called with mu held and the progress goroutine never waits for it:
	// credits, pings and pongs are marked due under mu and posted by
	// whoever holds postMu or takes it next (kick).
	postMu  sync.Mutex
	pingDue bool
	pongDue int

	mu sync.Mutex

	// Outbound: the peer's ring.
	rAddr       uint64
	rKey        uint32
	rCap        uint64
	rMaxRec     uint64
	head, tail  uint64   // bytes written into the peer's ring; released by it
	recEnds     []uint64 // end positions of the records not yet released
	sendSeq     uint32
	sq          []sqEntry // posted send requests, in order
	nextWR      uint64
	completedWR uint64 // the last send request that completed
	// staging: frames from unregistered memory are copied here.
	stage          []byte
	stageKey       uint32
	stageAddr      uint64
	stHead, stTail uint64
	// hdrs: one 64-byte header slot per window entry, for records
	// written from registered memory.
	hdrs    []byte
	hdrKey  uint32
	hdrAddr uint64
	sbroken error

	// Inbound: this member's ring.
	ring       []byte
	cap        uint64
	maxRec     uint64
	arrived    uint64 // bytes the peer published (records and skips)
	arrivals   []arrival
	rd         uint64 // bytes read
	released   uint64 // bytes free again (rd, or the first pinned frame)
	reported   uint64 // the last released position sent as credit
	creditBusy bool
	holds      ringHolds
	nextRecvWR uint64
	rbroken    error

	// the receiver's own state (one receiver at a time)
	recvSeq uint32
	asmDst  []byte // Recv's reassembly buffer
	asm     frameAsm
	held    chan []byte

	sendWake, recvWake chan struct{}
	// waitingSince[0] and [1] are when the sender and the receiver began
	// waiting on the peer (unix nanoseconds, 0: not waiting), apart so
	// that one's end does not hide the other's wait: the progress
	// goroutine sends keep-alives to peers that are waited on.
	waitingSince [2]atomic.Int64
}

type sqKind uint8

const (
	sqData sqKind = iota
	sqCredit
	sqSignal // a ping or a pong
)

// sqEntry is a posted send request.
type sqEntry struct {
	wr    uint64
	kind  sqKind
	stEnd uint64 // staging released when it completes (copied records)
}

func newVerbsStream(m *verbsMesh, peer, idx int, qp vQP, ring []byte) *verbsStream {
	s := &verbsStream{m: m, peer: peer, idx: idx, qp: qp, ring: ring, cap: uint64(len(ring)), maxRec: uint64(len(ring)) / 2 &^ 63,
		held: make(chan []byte, MaxHeld), sendWake: make(chan struct{}, 1), recvWake: make(chan struct{}, 1)}
	for range MaxHeld {
		s.held <- nil
	}
	return s
}

func wakeOne(ch chan struct{}) {
	select {
	case ch <- struct{}{}:
	default:
	}
}

func (s *verbsStream) wakeAll() {
	wakeOne(s.sendWake)
	wakeOne(s.recvWake)
}

// postRecvs fills the receive queue (set-up, before the queue pair is
// connected).
func (s *verbsStream) postRecvs() error {
	s.mu.Lock()
	defer s.mu.Unlock()
	for range verbsRecvQueue {
		if err := s.qp.postRecv(wrRecv | s.nextRecvWR); err != nil {
			return fmt.Errorf("stream %d to %s: %w", s.idx, s.m.Peer(s.peer), err)
		}
		s.nextRecvWR++
	}
	return nil
}

// drain polls the completion queue until it is empty and handles every
// completion. With block it waits for another poller; without, it leaves
// the queue to one that is at it.
func (s *verbsStream) drain(block bool) {
	if block {
		s.pollMu.Lock()
	} else if !s.pollMu.TryLock() {
		return
	}
	defer s.pollMu.Unlock()
	for !s.m.torn.Load() {
		n, err := s.qp.poll(s.wcs[:])
		if err != nil {
			s.m.peerFailed(s.peer, &PeerError{Peer: s.m.Peer(s.peer), Err: fmt.Errorf("stream %d: %w", s.idx, err)})
			return
		}
		for _, w := range s.wcs[:n] {
			s.complete(w)
		}
		if n < len(s.wcs) {
			return
		}
	}
}

// complete handles one completion.
func (s *verbsStream) complete(w ibverbs.WC) {
	m := s.m
	recv := w.WRID&wrRecv != 0
	if w.Status != ibverbs.StatusSuccess {
		s.mu.Lock()
		if !recv {
			s.popSQ(w.WRID)
		}
		s.mu.Unlock()
		err := m.wcError(s, w)
		if errors.Is(err, ErrClosed) || w.Status == ibverbs.StatusFlush {
			// A consequence of an earlier failure, or of Close: the
			// first error stays.
			s.breakWith(err)
		} else {
			m.peerFailed(s.peer, err)
		}
		if !recv {
			s.completedTo(w.WRID)
		}
		return
	}
	var perr error
	if recv {
		m.peersState[s.peer].heard.Store(time.Now().UnixNano())
		perr = s.recvDone(w)
	} else {
		perr = s.sendDone(w)
	}
	s.kick()
	if perr != nil {
		m.peerFailed(s.peer, &PeerError{Peer: m.Peer(s.peer), Err: fmt.Errorf("stream %d: protocol error: %w", s.idx, perr)})
	}
}

// completedTo notes that send requests up to wr are done (flushed ones
// too), for zero-copy senders waiting on them.
func (s *verbsStream) completedTo(wr uint64) {
	s.mu.Lock()
	s.completedWR = max(s.completedWR, wr)
	s.mu.Unlock()
	wakeOne(s.sendWake)
}

// popSQ removes send request wr, which completes in order, from the
// queue. Callers hold mu.
func (s *verbsStream) popSQ(wr uint64) (sqEntry, bool) {
	for len(s.sq) > 0 {
		e := s.sq[0]
		s.sq = s.sq[1:]
		if e.kind == sqData && e.stEnd > s.stTail {
			s.stTail = e.stEnd
		}
		if e.kind == sqCredit {
			s.creditBusy = false
		}
		if e.wr == wr {
			return e, true
		}
	}
	return sqEntry{}, false
}

func (s *verbsStream) recvDone(w ibverbs.WC) error {
	s.mu.Lock()
	defer s.mu.Unlock()
	if !s.m.closing.Load() && !s.m.torn.Load() {
		if err := s.qp.postRecv(wrRecv | s.nextRecvWR); err != nil {
			return fmt.Errorf("repost a receive: %w", err)
		}
		s.nextRecvWR++
	}
	if !w.HasImm() {
		return fmt.Errorf("a %d-byte message without immediate data", w.ByteLen)
	}
	switch w.Imm & immKind {
	case immData:
		a, arrived, err := arrive(uint64(w.Imm&immValue)*64, s.arrived, s.released, s.cap, s.maxRec)
		if err != nil {
			return err
		}
		s.arrivals = append(s.arrivals, a)
		s.arrived = arrived
		wakeOne(s.recvWake)
	case immCredit:
		pos, ok := creditPos(w.Imm, s.tail, s.head)
		if !ok {
			return fmt.Errorf("credit up to %d, only %d bytes were written", pos, s.head)
		}
		s.tail = pos
		for len(s.recEnds) > 0 && s.recEnds[0] <= s.tail {
			s.recEnds = s.recEnds[1:]
		}
		wakeOne(s.sendWake)
	case immPing, immPong:
		if w.Imm&immValue != 0 || s.idx != s.m.ctlIndex() {
			return fmt.Errorf("immediate value %#08x on stream %d", w.Imm, s.idx)
		}
		if w.Imm&immKind == immPong {
			s.m.ponged(s.peer)
			return nil
		}
		// Answered by this process (kick, from the progress goroutine):
		// the peer learns that the process is alive, not only its HCA.
		s.pongDue++
	}
	return nil
}

func (s *verbsStream) sendDone(w ibverbs.WC) error {
	s.mu.Lock()
	_, ok := s.popSQ(w.WRID)
	s.completedWR = max(s.completedWR, w.WRID)
	s.mu.Unlock()
	wakeOne(s.sendWake)
	if !ok {
		return fmt.Errorf("completion of send request %d, which is not outstanding", w.WRID)
	}
	return nil
}

// breakWith fails both directions of the stream with err, unless they
// failed already, and wakes their waiters.
func (s *verbsStream) breakWith(err error) {
	s.mu.Lock()
	if s.sbroken == nil {
		s.sbroken = err
	}
	if s.rbroken == nil {
		s.rbroken = err
	}
	s.mu.Unlock()
	s.wakeAll()
}

// await waits until ready (called with mu held) is true or returns an
// error, ctx ends or the mesh closes (unless ctl: Abort's and Close's own
// frames). It polls the queue itself for verbsSpin first. keep says the
// wait is on the peer (keep-alives).
func (s *verbsStream) await(ctx context.Context, wake chan struct{}, ctl, keep bool, op string, ready func() (bool, error)) error {
	check := func() (bool, error) {
		s.mu.Lock()
		defer s.mu.Unlock()
		return ready()
	}
	if ok, err := check(); ok || err != nil {
		return err
	}
	for t0 := time.Now(); time.Since(t0) < verbsSpin; {
		s.drain(false)
		if ok, err := check(); ok || err != nil {
			return err
		}
	}
	if keep {
		w := &s.waitingSince[0]
		if wake == s.recvWake {
			w = &s.waitingSince[1]
		}
		w.Store(time.Now().UnixNano())
		defer w.Store(0)
	}
	t := time.NewTimer(verbsTick)
	defer t.Stop()
	done := s.m.done
	if ctl {
		done = nil
	}
	for {
		if ok, err := check(); ok || err != nil {
			return err
		}
		if !ctl && s.m.closing.Load() {
			return fmt.Errorf("%s %s: %w", op, s.m.Peer(s.peer), ErrClosed)
		}
		select {
		case <-wake:
		case <-ctx.Done():
			if ok, err := check(); ok || err != nil {
				return err
			}
			return fmt.Errorf("%s %s on stream %d: %w", op, s.m.Peer(s.peer), s.idx, ctx.Err())
		case <-done:
		case <-t.C:
			s.drain(false)
			t.Reset(verbsTick)
		}
	}
}

// Send writes one frame (see Stream).
func (s *verbsStream) Send(ctx context.Context, hdr wire.Header, payload []byte) error {
	if len(payload) > wire.MaxPayload {
		return fmt.Errorf("send to %s: payload of %d bytes is over the %d-byte frame limit", s.m.Peer(s.peer), len(payload), wire.MaxPayload)
	}
	s.smu.Lock()
	defer s.smu.Unlock()
	if s.m.closing.Load() || s.m.aborting.Load() {
		return fmt.Errorf("send to %s: %w", s.m.Peer(s.peer), ErrClosed)
	}
	if err := ctx.Err(); err != nil {
		return fmt.Errorf("send to %s on stream %d: %w", s.m.Peer(s.peer), s.idx, err)
	}
	hdr.Seal(payload, s.m.crc)
	return s.sendFrame(ctx, hdr, payload, false)
}

// sendFrame writes a sealed frame, in segments when it is larger than the
// peer's ring takes in one record. Callers hold smu.
func (s *verbsStream) sendFrame(ctx context.Context, hdr wire.Header, payload []byte, ctl bool) error {
	var zc *verbsReg
	if len(payload) >= verbsZeroCopyMin {
		zc = s.m.regs.hold(payload)
	}
	if zc != nil {
		defer s.m.regs.unhold(zc)
	}
	maxSeg := int(s.rMaxRec - verbsRecHdr)
	if zc == nil {
		maxSeg = min(maxSeg, len(s.stage)-verbsRecHdr)
	}
	var last uint64
	for off, first := 0, true; first || off < len(payload); first = false {
		n := min(len(payload)-off, maxSeg)
		flags := uint32(0)
		if first {
			flags |= verbsRecFirst
		}
		if off+n == len(payload) {
			flags |= verbsRecLast
		}
		wr, err := s.writeRecord(ctx, hdr, payload[off:off+n], flags, zc, ctl)
		if err != nil {
			if off > 0 {
				// Part of the frame is in the peer's ring: out of step.
				s.mu.Lock()
				if s.sbroken == nil {
					s.sbroken = fmt.Errorf("send to %s on stream %d: stream out of step after a frame was interrupted: %w", s.m.Peer(s.peer), s.idx, err)
				}
				s.mu.Unlock()
			}
			return err
		}
		last = wr
		off += n
	}
	if zc == nil {
		return nil
	}
	// The device reads the payload in place: wait until it is done.
	sent := func() (bool, error) { return s.completedWR >= last || s.qpGone(), nil }
	err := s.await(ctx, s.sendWake, true, true, "send to", sent)
	if err != nil {
		// Stop the device reading memory the caller gets back: the
		// flush completes the write (bounded, should the device not
		// answer).
		s.failQP()
		fctx, cancel := context.WithTimeout(context.Background(), abortGrace)
		_ = s.await(fctx, s.sendWake, true, false, "send to", sent)
		cancel()
		s.breakWith(err)
		return err
	}
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.sbroken
}

// failQP moves the queue pair to the error state unless it is gone.
func (s *verbsStream) failQP() {
	s.mu.Lock()
	defer s.mu.Unlock()
	if !s.m.torn.Load() {
		_ = s.qp.fail()
	}
}

// qpGone reports whether the queue pair was destroyed (no request of it
// is outstanding then). Callers hold mu.
func (s *verbsStream) qpGone() bool { return s.sq == nil && s.m.torn.Load() }

// writeRecord waits for room and posts one record; it returns the send
// request's id.
func (s *verbsStream) writeRecord(ctx context.Context, hdr wire.Header, seg []byte, flags uint32, zc *verbsReg, ctl bool) (uint64, error) {
	need := verbsRecHdr + align64(uint64(len(seg)))
	var pos, used, stPos, stUsed uint64
	err := s.await(ctx, s.sendWake, ctl, true, "send to", func() (bool, error) {
		if s.sbroken != nil {
			return false, s.sbroken
		}
		if !ctl && s.m.aborting.Load() {
			return false, fmt.Errorf("send to %s: %w", s.m.Peer(s.peer), ErrClosed)
		}
		pos, used = place(need, s.head, s.rCap)
		// Room stays for a credit, a ping and a pong.
		if s.head+used-s.tail > s.rCap || len(s.recEnds) >= verbsWindow || len(s.sq) >= verbsSendQueue-4 {
			return false, nil
		}
		if zc == nil {
			if s.stHead == s.stTail {
				// Nothing staged is in flight: start at the beginning, so
				// that any record up to the staging's size fits (the ring
				// is smaller than two of the largest).
				s.stHead, s.stTail = 0, 0
			}
			stPos, stUsed = place(need, s.stHead, uint64(len(s.stage)))
			if s.stHead+stUsed-s.stTail > uint64(len(s.stage)) {
				return false, nil
			}
		}
		return true, nil
	})
	if err != nil {
		return 0, err
	}
	s.postMu.Lock()
	defer s.kick()
	defer s.postMu.Unlock()
	s.mu.Lock()
	if s.m.torn.Load() {
		s.mu.Unlock()
		return 0, fmt.Errorf("send to %s: %w", s.m.Peer(s.peer), ErrClosed)
	}
	rec := verbsRecord{length: uint32(need), flags: flags, seg: uint32(len(seg)), seq: s.sendSeq, hdr: hdr}
	var sges [2]ibverbs.SGE
	var ns int
	stEnd := uint64(0)
	if zc == nil {
		at := stPos % uint64(len(s.stage))
		b := s.stage[at : at+need]
		putVerbsRecord(b[:verbsRecHdr], rec)
		copy(b[verbsRecHdr:], seg)
		sges[0] = ibverbs.SGE{Addr: s.stageAddr + at, Len: uint32(need), LKey: s.stageKey}
		ns = 1
		stEnd = s.stHead + stUsed
		s.stHead = stEnd
		s.m.regs.copied.Add(int64(len(seg)))
	} else {
		at := uint64(s.sendSeq%verbsWindow) * verbsRecHdr
		putVerbsRecord(s.hdrs[at:at+verbsRecHdr], rec)
		sges[0] = ibverbs.SGE{Addr: s.hdrAddr + at, Len: verbsRecHdr, LKey: s.hdrKey}
		// The padding after the segment is not written: the receiver
		// reads the segment's length from the header.
		sges[1] = ibverbs.SGE{Addr: uint64(uintptr(unsafe.Pointer(unsafe.SliceData(seg)))), Len: uint32(len(seg)), LKey: zc.lkey}
		ns = 2
		if len(seg) == 0 {
			ns = 1
		}
		s.m.regs.zeroCopied.Add(int64(len(seg)))
	}
	// The request is accounted for before it is posted (its completion
	// may come at once); postMu keeps the posts in this order.
	wr := s.nextWR + 1
	s.nextWR = wr
	s.sq = append(s.sq, sqEntry{wr: wr, kind: sqData, stEnd: stEnd})
	raddr := s.rAddr + pos%s.rCap
	s.head += used
	s.recEnds = append(s.recEnds, s.head)
	s.sendSeq++
	s.mu.Unlock()
	// A post can take long (rdma_rxe does the work in this thread, and on
	// a link that went down it takes its time failing): the keep-alives
	// count it as waiting on the peer.
	s.waitingSince[0].Store(time.Now().UnixNano())
	err = s.qp.write(wr, sges[:ns], raddr, s.rKey, immData|uint32(need/64), true)
	s.waitingSince[0].Store(0)
	if err != nil {
		e := &PeerError{Peer: s.m.Peer(s.peer), Err: fmt.Errorf("stream %d: %w", s.idx, err)}
		s.breakWith(e)
		return 0, e
	}
	s.flushDue()
	return wr, nil
}

// ping asks the peer for a pong (control streams).
func (s *verbsStream) ping() {
	s.mu.Lock()
	s.pingDue = true
	s.mu.Unlock()
	s.kick()
}

// kick posts what is due unless another goroutine holds postMu (which
// posts it when done); it never waits.
func (s *verbsStream) kick() {
	for s.postMu.TryLock() {
		s.flushDue()
		s.postMu.Unlock()
		s.mu.Lock()
		more := s.dueLocked()
		s.mu.Unlock()
		if !more {
			return
		}
	}
}

// dueLocked says whether a credit, ping or pong is due and can be
// posted. Callers hold mu.
func (s *verbsStream) dueLocked() bool {
	if s.m.torn.Load() || s.sbroken != nil || len(s.sq) >= verbsSendQueue {
		return false
	}
	credit := !s.creditBusy && s.released > s.reported && s.rbroken == nil && !s.m.closing.Load()
	return credit || s.pingDue || s.pongDue > 0
}

// flushDue posts the due credit (one in flight: its completion lets the
// next go), ping and pongs. Callers hold postMu.
func (s *verbsStream) flushDue() {
	type post struct {
		wr   uint64
		imm  uint32
		what string
	}
	var posts [3]post
	n := 0
	s.mu.Lock()
	add := func(kind sqKind, imm uint32, what string) {
		wr := s.nextWR + 1
		s.nextWR = wr
		s.sq = append(s.sq, sqEntry{wr: wr, kind: kind})
		posts[n] = post{wr, imm, what}
		n++
	}
	if s.dueLocked() {
		if !s.creditBusy && s.released > s.reported && s.rbroken == nil && !s.m.closing.Load() {
			s.creditBusy, s.reported = true, s.released
			add(sqCredit, creditImm(s.released), "credit")
		}
		if s.pongDue > 0 && len(s.sq) < verbsSendQueue {
			s.pongDue--
			add(sqSignal, immPong, "pong")
		}
		if s.pingDue && len(s.sq) < verbsSendQueue {
			s.pingDue = false
			add(sqSignal, immPing, "ping")
		}
	}
	s.mu.Unlock()
	for _, p := range posts[:n] {
		if err := s.qp.sendImm(p.wr, p.imm); err != nil {
			s.m.peerFailed(s.peer, &PeerError{Peer: s.m.Peer(s.peer), Err: fmt.Errorf("stream %d: %s: %w", s.idx, p.what, err)})
			return
		}
	}
}

// Recv reads the next frame (see Stream).
func (s *verbsStream) Recv(ctx context.Context, fn func(wire.Header, []byte) error) error {
	h, p, end, err := s.next(ctx, &s.asmDst)
	if err != nil {
		return err
	}
	err = s.deliver(h, p, fn)
	if end > 0 {
		s.consume(end, false)
	}
	return err
}

// RecvHold implements Holder. A frame of one record is held in place: its
// ring space (and what follows it) is released once it and every frame
// held before it are released. A reassembled frame is held in one of
// MaxHeld buffers of the stream.
func (s *verbsStream) RecvHold(ctx context.Context) (wire.Header, []byte, func(), error) {
	b, err := takeHeld(ctx, s.held, s.m.done, s.m.Peer(s.peer), s.idx)
	if err != nil {
		return wire.Header{}, nil, nil, err
	}
	h, p, end, err := s.next(ctx, &b)
	if err == nil {
		err = s.deliver(h, p, func(wire.Header, []byte) error { return nil })
	}
	if err != nil {
		if end > 0 {
			s.consume(end, false)
		}
		s.held <- b
		return wire.Header{}, nil, nil, err
	}
	var once atomic.Bool
	if end == 0 {
		return h, p, func() {
			if once.CompareAndSwap(false, true) {
				s.held <- b
			}
		}, nil
	}
	pin := s.consume(end, true)
	return h, p, func() {
		if once.CompareAndSwap(false, true) {
			s.unpin(pin)
			s.held <- b
		}
	}, nil
}

// consume marks the ring read up to end and releases what no held frame
// pins; with pin, the frame just read is held in place.
func (s *verbsStream) consume(end uint64, pin bool) *verbsPin {
	defer s.kick()
	s.mu.Lock()
	defer s.mu.Unlock()
	var p *verbsPin
	if pin {
		p = s.holds.hold(s.rd)
	}
	s.rd = end
	s.advanceLocked()
	return p
}

func (s *verbsStream) unpin(p *verbsPin) {
	defer s.kick()
	s.mu.Lock()
	defer s.mu.Unlock()
	s.holds.drop(p)
	s.advanceLocked()
}

// advanceLocked releases the ring up to the first pinned frame, or up to
// rd; the caller kicks the credit out. Callers hold mu.
func (s *verbsStream) advanceLocked() {
	s.released = max(s.released, s.holds.freeUpTo(s.rd))
}

// next reads the next frame. A frame of one record is returned in place,
// with end the ring position after it (not consumed yet); a split frame is
// reassembled into *dst (grown as needed), with end 0.
func (s *verbsStream) next(ctx context.Context, dst *[]byte) (wire.Header, []byte, uint64, error) {
	if s.asm.active {
		// A split frame was interrupted (deadline) in another buffer.
		s.asm.use(dst)
	}
	for {
		var a arrival
		err := s.await(ctx, s.recvWake, false, true, "receive from", func() (bool, error) {
			if len(s.arrivals) > 0 {
				a = s.arrivals[0]
				s.arrivals = s.arrivals[1:]
				return true, nil
			}
			return false, s.rbroken
		})
		if err != nil {
			return wire.Header{}, nil, 0, err
		}
		at := a.pos % s.cap
		rec := s.ring[at : at+a.n]
		r, err := parseVerbsRecord(rec, s.recvSeq)
		if err != nil {
			return wire.Header{}, nil, 0, s.broken(err)
		}
		s.recvSeq++
		seg := rec[verbsRecHdr : verbsRecHdr+r.seg]
		end := a.pos + a.n
		first, last := r.flags&verbsRecFirst != 0, r.flags&verbsRecLast != 0
		switch {
		case first && s.asm.active:
			return wire.Header{}, nil, 0, s.broken(errors.New("a new frame began inside a split frame"))
		case first && last:
			if r.hdr.Len != r.seg {
				return wire.Header{}, nil, 0, s.broken(fmt.Errorf("frame of %d bytes in a record of %d", r.hdr.Len, r.seg))
			}
			return r.hdr, seg, end, nil // in place
		case first:
			s.asm.start(r.hdr, dst)
		case !s.asm.active:
			return wire.Header{}, nil, 0, s.broken(errors.New("a continuation record outside a split frame"))
		}
		if err := s.asm.add(seg); err != nil {
			return wire.Header{}, nil, 0, s.broken(err)
		}
		s.consume(end, false)
		if last {
			h, p, err := s.asm.done()
			if err != nil {
				return wire.Header{}, nil, 0, s.broken(err)
			}
			return h, p, 0, nil
		}
	}
}

// broken fails the receive side for a protocol error of the peer.
func (s *verbsStream) broken(err error) error {
	e := &PeerError{Peer: s.m.Peer(s.peer), Err: fmt.Errorf("stream %d: %w", s.idx, err)}
	s.mu.Lock()
	s.rbroken = e
	s.mu.Unlock()
	return e
}

func (s *verbsStream) deliver(h wire.Header, p []byte, fn func(wire.Header, []byte) error) error {
	if err := h.Verify(p); err != nil {
		return &PeerError{Peer: s.m.Peer(s.peer), Err: fmt.Errorf("stream %d: %w", s.idx, err)}
	}
	var perr error
	switch h.Kind {
	case wire.KindAbort:
		perr = &PeerError{Peer: s.m.Peer(s.peer), Err: fmt.Errorf("failed: %s", abortText(p))}
	case wire.KindClose:
		perr = &PeerError{Peer: s.m.Peer(s.peer), Err: ErrPeerClosed}
	}
	if perr != nil {
		// This stream is done both ways. The others stay until they see
		// their own close (as TCP connections do): a peer that finished
		// closes while its last frames on other queue pairs are still on
		// their way, which nothing orders against this one.
		s.breakWith(perr)
		return perr
	}
	return fn(h, p)
}
