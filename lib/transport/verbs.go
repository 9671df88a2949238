package transport

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"sync"
	"sync/atomic"
	"time"

	"github.com/gpubridge/gpubridge/lib/ibverbs"
	"github.com/gpubridge/gpubridge/lib/wire"
)

// RDMA verbs (InfiniBand, RoCE).
//
// Every stream (Streams data streams, P2PStreams point-to-point streams
// and the control stream per pair of members) is one Reliable Connected
// queue pair. Each member registers one receive ring per inbound stream
// (RingBytes+4096 bytes for data and point-to-point streams, 1 MiB+4096
// for control; all of them in one registration whose address and key are
// in its endpoint record; verbs_setup.go's build says what that pins); the peer writes records
// into it with RDMA WRITE with immediate data, so a frame travels from the
// sender's memory into the receiver's ring without the receiver's CPU, and
// the receiver hands the ring itself to Recv's fn (or holds it for
// RecvHold), as the shared-memory transport does.
//
// A record is a 64-byte header (verbs_wire.go: length, flags, segment
// length, record number, the frame's wire header) and the segment, padded
// to 64 bytes; records never wrap: one that does not fit before the end of
// the ring starts at its beginning, by a rule both ends apply, so nothing
// marks the skip. A frame of up to half the ring is one record; larger
// frames are cut into segments and reassembled on receipt (one copy).
//
// The immediate value of each write announces the record (its length in
// 64-byte units); the receiver keeps a receive request posted for it. The
// receiver returns credit as it releases ring space: a zero-length SEND
// with immediate data carrying its released position, at most one in
// flight per stream, the next one as soon as the previous completes. A
// sender writes only into space it has credit for and keeps at most
// verbsWindow records unreleased, so neither ring nor receive queue can
// overflow (receive queues hold 2 × verbsWindow + 8 requests: the peer's
// records and its credits).
//
// Payloads: a frame whose payload lies in memory registered with
// Register is written from there (zero copy; Send waits for the write's
// completion before it returns); others are copied into a registered
// staging ring and Send returns at once.
//
// Completions: one completion queue per queue pair, one completion
// channel per mesh, read by one progress goroutine that blocks in poll(2)
// on the channel, the device's async events and an eventfd; waiters spin
// on their own queue for a few microseconds first. Nothing waits without a
// deadline: a peer that stops reading exhausts the sender's credit and
// its deadline. A member waiting on a peer it has heard nothing from for
// verbsKeepAlive pings it (a zero-length SEND with immediate data on the
// control queue pair, which the peer's progress goroutine answers with a
// pong); a peer unheard for verbsDeadAfter more (its process died or is
// stopped, or the link is down) fails every stream to it, naming it. This
// does not rely on the HCA's transport retries, which fail requests to a
// vanished queue pair after about 8.6 s on real HCAs but, on soft-RoCE
// (rdma_rxe, Linux 6.1), were seen never to. Any failed completion breaks
// every stream to that peer with an error naming it (remote access
// error: a forged or stale endpoint record), and the layer above aborts
// the mesh as with TCP.
//
// Set-up (verbs_setup.go): the endpoint record carries the device, GID or
// LID, MTU, ring address and key, and the control queue pair number for
// each peer; once the control queue pairs are connected, each pair of
// members exchanges its data and point-to-point queue pair numbers over
// its control stream (signed with the job's secret; sealVerbsQPNs) and
// sends a hello on every one of those streams, so a wrong key or a dead
// path fails the set-up naming the peer.
const (
	// verbsWindow bounds the records a sender keeps unreleased.
	verbsWindow = 128
	// verbsSendQueue is each queue pair's send queue: records, credits,
	// keep-alive writes.
	verbsSendQueue = verbsWindow + 8
	verbsRecvQueue = 2*verbsWindow + 8
	// verbsCtlRing is the data capacity of a control stream's ring.
	verbsCtlRing = 1 << 20
	// verbsTick is how often the progress goroutine looks for waiters
	// that need a keep-alive, without events.
	verbsTick = 250 * time.Millisecond
	// verbsCloseGrace bounds the KindClose frames Close sends.
	verbsCloseGrace = 500 * time.Millisecond
	// verbsSettleIdle: Close waits for the writes it posted to complete
	// while completions come, at most this long without one (more than
	// the retry time, after which a silent peer's writes fail).
	verbsSettleIdle = 12 * time.Second
	// verbsSpin is how long a waiter polls its own queue before it sleeps.
	verbsSpin = 20 * time.Microsecond
	// verbsZeroCopyMin: payloads at least this large are written from
	// registered memory in place; smaller ones are copied (cheaper than
	// waiting for the completion).
	verbsZeroCopyMin = 64 << 10
	// wrRecv marks receive requests' ids.
	wrRecv = 1 << 63
)

// Reliable Connected queue pair settings. The ACK timeout is 4.096 µs ×
// 2^verbsAckTimeout (about 1.07 s) per try, verbsRetries+1 tries: a peer
// whose HCA stops answering (its process died, its link went down) fails
// every request to it after about 8.6 s. RNR retries are unlimited: the
// credit protocol keeps receives posted, and a peer that stops posting
// them is caught by the caller's deadline like a peer that stops reading.
const (
	verbsAckTimeout = 18
	verbsRetries    = 7
	verbsRNRRetries = 7
	verbsMinRNR     = 12 // 0.64 ms
)

// verbsKeepAlive: a member waiting on a peer it has heard nothing from for
// this long pings it; verbsDeadAfter more without a word and the peer is
// taken for dead. Variables so that tests can shorten them.
var (
	verbsKeepAlive = 2 * time.Second
	verbsDeadAfter = 12 * time.Second
)

// verbsMesh is one member's verbs links to every other member.
type verbsMesh struct {
	meshBase[*verbsStream]
	dev  vDev
	log  *slog.Logger
	regs *verbsRegs

	// byKey are the streams by completion queue key.
	byKey []*verbsStream
	// mrs are the registrations of the rings (first) and staging.
	mrs []vMR
	// dataCap and ctlCap are the sizes of this member's receive rings.
	dataCap, ctlCap uint64

	peersState []verbsPeer

	closing  atomic.Bool
	aborting atomic.Bool
	done     chan struct{} // closed by Close
	stopped  chan struct{} // closed when the progress goroutine ends
	quit     chan struct{} // closed by teardown (once: quitOnce): the watchdog ends
	quitOnce sync.Once
	watched  chan struct{} // closed when the watchdog ends
	closeMu  sync.Mutex
	closed   bool
	torn     atomic.Bool // the queue pairs are destroyed
	// nopMu guards the keep-alive state of peersState.
	nopMu sync.Mutex
}

// verbsPeer is what the mesh knows about a peer as a whole.
type verbsPeer struct {
	heard    atomic.Int64 // unix nanoseconds of the last message from it
	pingBusy bool         // a ping awaits its pong (nopMu)
	failed   error        // the first failure of any of its queue pairs (nopMu)
}

// startProgress starts the progress goroutine and the watchdog.
func (m *verbsMesh) startProgress() {
	m.stopped, m.quit, m.watched = make(chan struct{}), make(chan struct{}), make(chan struct{})
	now := time.Now().UnixNano()
	for i := range m.peersState {
		m.peersState[i].heard.Store(now)
	}
	go m.progress()
	go m.watch()
}

// watch fails, every verbsTick, the peers waited on and silent for
// verbsKeepAlive+verbsDeadAfter, until teardown. It is not the progress
// goroutine because that one posts (credits, pings, pongs), and a post
// can stay long inside the device's library (rdma_rxe does the work in
// the posting thread, and on a link that went down it takes its time
// failing): the deadline must not wait for it.
func (m *verbsMesh) watch() {
	defer close(m.watched)
	t := time.NewTicker(verbsTick)
	defer t.Stop()
	for {
		select {
		case <-m.quit:
			return
		case now := <-t.C:
			for p, silent := range m.silentPeers(now) {
				if silent > verbsKeepAlive+verbsDeadAfter {
					m.peerFailed(p, &PeerError{Peer: m.Peer(p), Err: fmt.Errorf("%w (nothing heard for %v, keep-alives unanswered): is %s dead or stopped, or is the link down? (this side: %s)",
						ErrConnClosed, silent.Round(time.Second), m.process(p), m.dev.port())})
				}
			}
		}
	}
}

// silentPeers maps each peer a stream has waited on for verbsKeepAlive
// and more, and that has been silent as long, to how long it has been
// silent.
func (m *verbsMesh) silentPeers(now time.Time) map[int]time.Duration {
	var out map[int]time.Duration
	for _, s := range m.byKey {
		for i := range s.waitingSince {
			w := s.waitingSince[i].Load()
			if w == 0 || now.Sub(time.Unix(0, w)) <= verbsKeepAlive {
				continue
			}
			if silent := now.Sub(time.Unix(0, m.peersState[s.peer].heard.Load())); silent >= verbsKeepAlive {
				if out == nil {
					out = make(map[int]time.Duration)
				}
				out[s.peer] = silent
			}
		}
	}
	return out
}

// progress drains the completion queues the device reports, and every
// verbsTick looks after keep-alives, until the mesh is torn down.
func (m *verbsMesh) progress() {
	defer close(m.stopped)
	next := time.Now().Add(verbsTick)
	for {
		keys, err := m.dev.wait(time.Until(next))
		if m.torn.Load() {
			return
		}
		if err != nil {
			m.log.Warn("verbs progress: waiting for completions failed", "err", err)
			time.Sleep(10 * time.Millisecond)
		}
		for _, k := range keys {
			if k >= 0 && k < len(m.byKey) {
				m.byKey[k].drain(true)
			}
		}
		if time.Now().After(next) {
			m.housekeep()
			next = time.Now().Add(verbsTick)
		}
	}
}

// housekeep polls every queue (a lost event costs at most a tick) and
// pings each peer a stream is waiting on that has been silent for
// verbsKeepAlive (the watchdog fails it after verbsDeadAfter more).
func (m *verbsMesh) housekeep() {
	for _, s := range m.byKey {
		s.drain(false)
		s.kick()
	}
	for p, silent := range m.silentPeers(time.Now()) {
		if silent > verbsKeepAlive+verbsDeadAfter {
			continue // the watchdog's
		}
		m.nopMu.Lock()
		busy := m.peersState[p].pingBusy || m.peersState[p].failed != nil
		if !busy {
			m.peersState[p].pingBusy = true
		}
		m.nopMu.Unlock()
		if !busy {
			m.links[p][m.ctlIndex()].ping()
		}
	}
}

// ctlIndex is the control stream's index in links[peer]: after the data
// and the point-to-point streams.
func (m *verbsMesh) ctlIndex() int { return m.streams + m.p2p }

// streamName names stream st in set-up errors.
func (m *verbsMesh) streamName(st int) string {
	switch {
	case st < m.streams:
		return fmt.Sprintf("data queue pair %d", st)
	case st < m.ctlIndex():
		return fmt.Sprintf("point-to-point queue pair %d", st-m.streams)
	}
	return "control queue pair"
}

// ponged records a pong from peer.
func (m *verbsMesh) ponged(peer int) {
	m.nopMu.Lock()
	m.peersState[peer].pingBusy = false
	m.nopMu.Unlock()
}

// peerFailed breaks every stream to peer with err (the first failure
// wins), so that waiters on all of them learn at once.
func (m *verbsMesh) peerFailed(peer int, err error) {
	m.nopMu.Lock()
	if m.peersState[peer].failed == nil {
		m.peersState[peer].failed = err
	}
	err = m.peersState[peer].failed
	m.nopMu.Unlock()
	for _, s := range m.links[peer] {
		s.breakWith(err)
	}
}

// Abort writes a KindAbort frame on every stream whose sender is free
// within abortGrace, then closes the mesh.
func (m *verbsMesh) Abort(err error) {
	if m.closing.Load() {
		return
	}
	m.aborting.Store(true)
	m.each(func(s *verbsStream) { s.wakeAll() })
	msg := abortMessage(err)
	until := time.Now().Add(abortGrace)
	ctx, cancel := context.WithDeadline(context.Background(), until)
	var wg sync.WaitGroup
	m.each(func(s *verbsStream) {
		wg.Go(func() {
			if !lockUntil(&s.smu, until) {
				return
			}
			defer s.smu.Unlock()
			h := wire.Header{Kind: wire.KindAbort}
			h.Seal(msg, m.crc)
			_ = s.sendFrame(ctx, h, msg, true)
		})
	})
	wg.Wait()
	cancel()
	m.settle(abortGrace)
	m.log.Debug("bridge aborted", "err", err)
	_ = m.Close()
}

// settle waits for every posted send request to complete, so that frames
// Send accepted leave before the queue pairs are flushed: as long as
// completions keep coming (a peer that does not answer fails them within
// the transport's retry time), and at most maxIdle without one.
func (m *verbsMesh) settle(maxIdle time.Duration) {
	last, prev := time.Now(), -1
	for {
		n := 0
		m.nopMu.Lock()
		failed := make([]bool, m.size)
		for p := range m.peersState {
			failed[p] = m.peersState[p].failed != nil
		}
		m.nopMu.Unlock()
		m.each(func(s *verbsStream) {
			s.drain(false)
			s.mu.Lock()
			if !failed[s.peer] {
				// A failed peer's requests are not waited for.
				n += len(s.sq)
			}
			s.mu.Unlock()
		})
		if n == 0 {
			return
		}
		if n != prev {
			last, prev = time.Now(), n
		}
		if time.Since(last) > maxIdle {
			m.log.Warn("verbs: send requests still outstanding at close", "requests", n, "idle", maxIdle)
			return
		}
		time.Sleep(time.Millisecond)
	}
}

// Close sends KindClose on every idle stream (bounded by closeGrace),
// then flushes and destroys every queue pair and frees the device.
// Frames held with RecvHold stay readable: the rings are Go memory.
func (m *verbsMesh) Close() error {
	m.closeMu.Lock()
	if m.closed {
		m.closeMu.Unlock()
		return nil
	}
	m.closed = true
	m.closeMu.Unlock()
	m.closing.Store(true)
	close(m.done)
	m.each(func(s *verbsStream) { s.wakeAll() })
	until := time.Now().Add(verbsCloseGrace)
	ctx, cancel := context.WithDeadline(context.Background(), until)
	m.each(func(s *verbsStream) {
		if s.smu.TryLock() {
			h := wire.Header{Kind: wire.KindClose}
			h.Seal(nil, m.crc)
			_ = s.sendFrame(ctx, h, nil, true)
			s.smu.Unlock()
		}
	})
	cancel()
	m.settle(verbsSettleIdle)
	m.teardown()
	return nil
}

// teardown flushes every queue pair (outstanding writes complete with a
// flush status, so nothing reads a sender's memory afterwards), waits for
// the flushes within abortGrace, stops the progress goroutine and frees
// everything.
func (m *verbsMesh) teardown() {
	m.each(func(s *verbsStream) { s.failQP() })
	m.settle(abortGrace)
	m.torn.Store(true)
	m.dev.wake()
	if m.stopped != nil {
		m.quitOnce.Do(func() { close(m.quit) })
		<-m.watched
		<-m.stopped
	}
	var errs []error
	m.each(func(s *verbsStream) {
		// Nobody polls or posts on it once it is gone.
		s.postMu.Lock()
		s.pollMu.Lock()
		s.mu.Lock()
		errs = append(errs, s.qp.close())
		s.sq = nil
		s.mu.Unlock()
		s.pollMu.Unlock()
		s.postMu.Unlock()
		s.wakeAll()
	})
	m.regs.closeAll()
	for _, mr := range m.mrs {
		errs = append(errs, mr.close())
	}
	errs = append(errs, m.dev.close())
	if err := errors.Join(errs...); err != nil {
		m.log.Warn("verbs: freeing the device's resources", "err", err)
	}
}

// wcError explains a failed completion on stream s; nil for a flush of a
// closing mesh.
func (m *verbsMesh) wcError(s *verbsStream, w ibverbs.WC) error {
	if w.Status == ibverbs.StatusFlush {
		if m.closing.Load() || m.aborting.Load() {
			return fmt.Errorf("stream to %s: %w", m.Peer(s.peer), ErrClosed)
		}
		return &PeerError{Peer: m.Peer(s.peer), Err: fmt.Errorf("stream %d: a request was flushed (the queue pair failed)", s.idx)}
	}
	what := ibverbs.StatusString(w.Status)
	recv := w.WRID&wrRecv != 0
	var err error
	switch {
	case w.Status == ibverbs.StatusRemAccess && recv:
		// The receive a peer's write took (rdma_rxe completes it so):
		// this member's device refused the write, and failed the queue
		// pair.
		err = fmt.Errorf("stream %d: this member's device %w from it (%s): the ring address or key in this member's endpoint record is not valid (a forged or stale record?)", s.idx, ErrRingRefused, what)
	case w.Status == ibverbs.StatusRemAccess:
		err = fmt.Errorf("%w on stream %d (%s): the ring address or key its endpoint record gave is not valid (a forged or stale record?)", ErrRingRefused, s.idx, what)
	case w.Status == ibverbs.StatusRetryExc:
		err = fmt.Errorf("%w (stream %d: no acknowledgement after %d tries, %s): did %s die, or did the link go down? (this side: %s)",
			ErrConnClosed, s.idx, verbsRetries+1, what, m.process(s.peer), m.dev.port())
	case w.Status == ibverbs.StatusRNRRetry:
		err = fmt.Errorf("stopped posting receives on stream %d (%s)", s.idx, what)
	case w.Status == ibverbs.StatusRemInvReq, w.Status == ibverbs.StatusRemOp:
		err = fmt.Errorf("rejected a request on stream %d (%s)", s.idx, what)
	default:
		err = fmt.Errorf("stream %d failed locally: %s (vendor error %#x; %s)", s.idx, what, w.VendorErr, m.dev.port())
	}
	if m.dev.portDown() {
		err = fmt.Errorf("%w; the local port went down", err)
	}
	return &PeerError{Peer: m.Peer(s.peer), Err: err}
}
