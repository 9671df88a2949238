package collective

import (
	"context"
	"fmt"
	"sync"
	"sync/atomic"
	"time"

	"github.com/gpubridge/gpubridge/lib/codec"
	"github.com/gpubridge/gpubridge/lib/transport"
)

// pipe is the engine under every data collective. At each step t this
// member sends segment sendSeg(t) to next and receives segment recvSeg(t)
// from prev (either may be -1: none). A segment is cut into chunks of
// chunk bytes; chunk c travels on data stream c % Streams. Per stream one
// goroutine sends and one receives, in (step, chunk) order, so later chunks
// are on the wire while earlier ones are being reduced.
//
// Two dependencies order them, both between items of the same stream:
//   - sendLag >= 0: the send of (t, c) waits for the receive of
//     (t-sendLag, c) (a ring forwards what it received; a broadcast chain
//     forwards what arrived);
//   - recvFrom <= t <= recvTo: consuming the receive of (t, c) waits for the
//     send of (t-recvLag, c) (the received bytes overwrite memory that send
//     reads); the frame itself is read off the stream before that wait.
//
// Over a stream that hands out frames in pieces (transport.PieceReceiver:
// TCP) the receiver consumes each piece as it arrives, from a buffer that
// stays in cache, straight into the destination; pieces that arrive
// before the send they depend on is done wait in a spill buffer (the
// socket is never left undrained for more than spillAfter), and are
// consumed once it is (pieceSink). When the stream also lets the receiver
// hold its pieces (transport.PieceHolder: TCP) and Options.Overlap is on,
// that is two goroutines: pieceReader reads the pieces off the stream,
// pieceConsumer consumes them, so that the kernel's copy of the next
// pieces out of the socket runs while the earlier ones are reduced (with
// c the copy's rate and r the reduction's, one goroutine that reads a
// piece, then reduces it, moves a stream's bytes at 1/(1/c + 1/r); two at
// min(c, r)). At most transport.MaxHeldPieces pieces per stream (2 MiB
// over TCP) are read ahead, in buffers the stream reuses; a stream that
// receives no more than one piece in the call keeps the one goroutine.
// Over a stream that can hold frames (transport.Holder) the receive side
// is two goroutines too: one reads chunks off the stream and holds them,
// one consumes them (waits for the send, reduces, releases), so that the
// stream is read while the previous chunk is reduced, without copying it.
//
// Both require the chunk lists of the paired segments to agree; run checks.
//
// A compressed call's frames are received whole (Holder, else Recv). Under
// zstd the pipe packs what payload returns and unpacks what arrives
// before recv sees it (codec_zstd.go), so the collectives' callbacks are
// raw's; a lossy call's callbacks make and take the packed bytes
// themselves (codec_lossy.go).
type pipe struct {
	cl         *call
	next, prev int
	steps      int
	sendSeg    func(t int) int
	recvSeg    func(t int) int
	segLen     func(j int) int
	chunk      int

	sendLag                   int // -1: sends wait for no receive
	recvLag, recvFrom, recvTo int // recvFrom > recvTo: receives wait for no send

	// payload returns the bytes of chunk c of segment j sent at step t;
	// off is the chunk's offset within the segment.
	payload func(t, j, c, off, n int) ([]byte, error)
	// sent runs after chunk (t, c) was sent; may be nil.
	sent func(t, j, c, off, n int) error
	// prep runs before chunk (t, c) is received; may be nil.
	prep func(t, j, c, off, n int) error
	// recv consumes the payload of chunk (t, c), or of part of it (over a
	// stream that hands out pieces, bytes [off, off+n) of the segment); p
	// is a view valid only during the call.
	recv func(t, j, c, off, n int, p []byte) error
	// into returns where the payload of chunk (t, c) lands as it is (the
	// final bytes of a ring's all-gather or a broadcast's chain, which
	// travel on from there if at all), or nil when recv must see it. Over
	// a stream that reads into memory (transport.IntoReceiver: TCP, unless
	// Options.Overlap reads its pieces ahead) such a chunk is read
	// straight into it, and recv does not run. The wait for the send the
	// chunk depends on then comes after the frame's header and before its
	// payload, which stays in the socket meanwhile: only for chunks whose
	// bytes were computed from that send (so that it is done once they
	// arrive); may be nil.
	into func(t, j, c, off, n int) []byte
	// received runs once chunk (t, c) was wholly consumed (it reports
	// final results: one Progress range per chunk, not per piece); may be
	// nil.
	received func(t, j, c, off, n int)
	// primary: whether a receive timeout points at prev itself.
	primary bool
	// stepOff is added to the schedule's step t in the frames' headers:
	// an algorithm that runs several pipes one after the other (recursive
	// doubling) numbers its frames through.
	stepOff int
}

func (pp *pipe) nchunks(j int) int { return (pp.segLen(j) + pp.chunk - 1) / pp.chunk }

func (pp *pipe) span(j, c int) (off, n int) {
	off = c * pp.chunk
	return off, min(pp.chunk, pp.segLen(j)-off)
}

func (pp *pipe) sendWaits(t int) bool { return pp.prev >= 0 && pp.sendLag >= 0 && t >= pp.sendLag }
func (pp *pipe) recvWaits(t int) bool {
	return pp.next >= 0 && pp.recvFrom <= t && t <= pp.recvTo && t-pp.recvLag >= 0
}

// run runs the pipe and returns the first error.
func (pp *pipe) run() error {
	for t := range pp.steps {
		if pp.sendWaits(t) && pp.next >= 0 && pp.nchunks(pp.sendSeg(t)) != pp.nchunks(pp.recvSeg(t-pp.sendLag)) {
			panic(fmt.Sprintf("collective: pipe: send step %d does not match receive step %d", t, t-pp.sendLag))
		}
		if pp.recvWaits(t) && pp.prev >= 0 && pp.nchunks(pp.recvSeg(t)) != pp.nchunks(pp.sendSeg(t-pp.recvLag)) {
			panic(fmt.Sprintf("collective: pipe: receive step %d does not match send step %d", t, t-pp.recvLag))
		}
	}
	S := pp.cl.c.streams
	if pp.cl.codec == codec.Zstd && pp.cl.c.zstd == nil {
		pp.cl.c.zstd = make([]zstdScratch, S)
	}
	for s := range S {
		var nsend, nrecv int
		for t := range pp.steps {
			if pp.next >= 0 {
				nsend += max(0, (pp.nchunks(pp.sendSeg(t))-s+S-1)/S)
			}
			if pp.prev >= 0 {
				nrecv += max(0, (pp.nchunks(pp.recvSeg(t))-s+S-1)/S)
			}
		}
		recvTok := make(chan struct{}, nrecv) // receive (t, c) done, for the send of (t+sendLag, c)
		sendTok := make(chan struct{}, nsend) // send (t, c) done, for the receive of (t+recvLag, c)
		var (
			st      transport.Stream
			pr      transport.PieceReceiver
			pieces  bool
			ph      transport.PieceHolder
			overlap bool
			prog    *sendProgress
		)
		if nrecv > 0 {
			st = pp.cl.c.mesh.Stream(pp.prev, s)
			pr, pieces = st.(transport.PieceReceiver)
			// A compressed frame is unpacked whole: fp8's groups and
			// zstd's planes do not fall on the stream's pieces.
			pieces = pieces && pr.PieceSize() > 0 && pp.cl.codec == codec.Raw
			// Reading ahead helps only a stream that receives more
			// than one piece; a small call keeps its one hand-over less.
			ph, overlap = st.(transport.PieceHolder)
			overlap = overlap && pieces && pp.cl.c.overlap && pp.recvMore(s, pr.PieceSize())
		}
		if nsend > 0 && pieces && pp.recvFrom <= pp.recvTo {
			if _, ok := pp.cl.c.mesh.Stream(pp.next, s).(transport.ProgressSender); ok {
				prog = newSendProgress()
			}
		}
		if nsend > 0 {
			pp.cl.spawn(func() error { return pp.sender(s, recvTok, sendTok, prog) })
		}
		if nrecv > 0 {
			if overlap {
				// The reader holds one piece, the consumer one, and
				// the queue the rest: the reader never waits for a
				// buffer, only for room in the queue.
				q := make(chan heldPiece, transport.MaxHeldPieces-2)
				pp.cl.spawn(func() error { return pp.pieceReader(s, ph, q) })
				pp.cl.spawn(func() error { return pp.pieceConsumer(q, pp.newPieceSink(s, recvTok, sendTok, prog)) })
			} else if pieces {
				pp.cl.spawn(func() error { return pp.pieceReceiver(s, pr, pp.newPieceSink(s, recvTok, sendTok, prog)) })
			} else if h, ok := st.(transport.Holder); ok {
				held := make(chan heldChunk, 1)
				pp.cl.spawn(func() error { return pp.holdReceiver(s, h, held) })
				pp.cl.spawn(func() error { return pp.consumer(s, held, recvTok, sendTok) })
			} else {
				pp.cl.spawn(func() error { return pp.receiver(s, recvTok, sendTok) })
			}
		}
	}
	return pp.cl.wait()
}

func (pp *pipe) sender(s int, recvTok <-chan struct{}, sendTok chan<- struct{}, prog *sendProgress) error {
	cl := pp.cl
	S := cl.c.streams
	st := cl.c.mesh.Stream(pp.next, s)
	for t := range pp.steps {
		j := pp.sendSeg(t)
		for c := s; c < pp.nchunks(j); c += S {
			if pp.sendWaits(t) {
				if err := cl.await(recvTok); err != nil {
					return err
				}
			}
			off, n := pp.span(j, c)
			p, err := pp.payload(t, j, c, off, n)
			if err == nil && cl.codec == codec.Zstd {
				p, err = pp.zpack(s, p)
			}
			if err != nil {
				return err
			}
			var progress func(int)
			if prog != nil {
				prog.at(t, c, 0)
				progress = func(n int) { prog.at(t, c, n) }
			}
			if err := cl.sendProgress(st, pp.next, pp.stepOff+t, c, p, progress); err != nil {
				return err
			}
			if pp.sent != nil {
				if err := pp.sent(t, j, c, off, n); err != nil {
					return err
				}
			}
			if pp.prev >= 0 && pp.recvWaits(t+pp.recvLag) {
				sendTok <- struct{}{}
			}
		}
	}
	return nil
}

func (pp *pipe) receiver(s int, recvTok chan<- struct{}, sendTok <-chan struct{}) error {
	cl := pp.cl
	st := cl.c.mesh.Stream(pp.prev, s)
	return pp.recvChunks(s, func(k chunkAt) error {
		// The chunk is read off the stream first and waits in the
		// transport's receive buffer for the send it depends on:
		// waiting before the read would leave the socket undrained
		// while the peer's send of the same chunk blocks on it, and
		// the two directions of a stream would take turns.
		waitSend := pp.recvWaits(k.t)
		err := cl.recv(st, s, pp.prev, pp.stepOff+k.t, k.c, k.n, pp.primary, func(p []byte) error {
			if waitSend {
				if err := cl.awaitSend(s, sendTok); err != nil {
					return err
				}
			}
			return pp.consume(s, k, p)
		})
		if err != nil {
			return err
		}
		pp.finished(k, recvTok)
		return nil
	})
}

// consume hands the payload p of chunk k, received whole on data stream
// s, to pp.recv: as it is, or unpacked first when the call is lossless
// compressed (a lossy call's recv takes the packed bytes itself).
func (pp *pipe) consume(s int, k chunkAt, p []byte) error {
	if pp.cl.codec == codec.Zstd {
		var err error
		if p, err = pp.zunpack(s, k, p); err != nil {
			return err
		}
	}
	return pp.recv(k.t, k.j, k.c, k.off, k.n, p)
}

// consumed runs the received hook of chunk k.
func (pp *pipe) consumed(k chunkAt) {
	if pp.received != nil {
		pp.received(k.t, k.j, k.c, k.off, k.n)
	}
}

// pieceReceiver receives the chunks of data stream s piece by piece
// (transport.PieceReceiver) and hands every piece, as it arrives, to the
// stream's pieceSink; the next piece is read once the sink is done with
// it.
func (pp *pipe) pieceReceiver(s int, st transport.PieceReceiver, sink *pieceSink) error {
	cl := pp.cl
	ir, _ := st.(transport.IntoReceiver)
	return pp.recvChunks(s, func(k chunkAt) error {
		sink.begin(k)
		if ir != nil && pp.into != nil {
			if dst := pp.into(k.t, k.j, k.c, k.off, k.n); dst != nil {
				return sink.into(ir, dst)
			}
		}
		err := cl.recvPieces(st, s, pp.prev, pp.stepOff+k.t, k.c, k.n, pp.primary, sink.piece)
		if err != nil {
			return err
		}
		return sink.end()
	})
}

// heldPiece is what pieceReader hands pieceConsumer: bytes [off,
// off+len(p)) of chunk k's payload, held until release; or, with end set
// (and no piece), the end of chunk k's frame.
type heldPiece struct {
	k       chunkAt
	off     int
	p       []byte
	release func()
	end     bool
}

// pieceReader reads the chunks of data stream s off the stream piece by
// piece (transport.PieceHolder) and queues them for pieceConsumer, each
// chunk followed by its end: it reads the next pieces while the consumer
// reduces the earlier ones. It waits only for room in the queue (q's
// capacity and the pieces the stream lets it hold are such that a buffer
// is always free), that is for the consumer, which waits at most
// spillAfter per piece before it moves the piece to its spill buffer: so
// the socket is never left undrained for longer, as with pieceReceiver.
func (pp *pipe) pieceReader(s int, st transport.PieceHolder, q chan<- heldPiece) error {
	defer close(q)
	overlaps.Add(1)
	cl := pp.cl
	// hand queues h; false when the call is stopped. (A stopped call is
	// checked first: once the consumer has gone, the queue may have room
	// that nobody empties but its drain.)
	hand := func(h heldPiece) bool {
		if cl.ctx.Err() != nil {
			return false
		}
		select {
		case q <- h:
			return true
		case <-cl.ctx.Done():
			return false
		}
	}
	return pp.recvChunks(s, func(k chunkAt) error {
		stopped := false
		err := cl.recvPiecesHold(st, s, pp.prev, pp.stepOff+k.t, k.c, k.n, pp.primary, func(off int, p []byte, release func()) error {
			if !hand(heldPiece{k: k, off: off, p: p, release: release}) {
				release()
				stopped = true
				return errSibling
			}
			return nil
		})
		switch {
		case stopped:
			// It waited for the consumer, not for the peer.
			return errSibling
		case err != nil:
			return err
		case !hand(heldPiece{k: k, end: true}):
			return errSibling
		}
		return nil
	})
}

// pieceConsumer hands the pieces pieceReader queues to the stream's
// pieceSink, in order, releasing each once the sink is done with it. On
// an error it stops the call (so that the reader stops too) and releases
// what the reader still queues until it has closed the queue.
func (pp *pipe) pieceConsumer(q <-chan heldPiece, sink *pieceSink) (err error) {
	cl := pp.cl
	defer func() {
		if err != nil {
			cl.setErr(err)
		}
		for h := range q {
			if !h.end {
				h.release()
			}
		}
	}()
	in := false // a chunk's pieces are coming
	for h := range q {
		if !in {
			sink.begin(h.k)
			in = true
		}
		if h.end {
			in = false
			if err := sink.end(); err != nil {
				return err
			}
			continue
		}
		err := sink.piece(h.off, h.p)
		h.release()
		if err != nil {
			return cl.recvErr(&localError{err}, pp.prev, pp.primary)
		}
	}
	// The queue closed: every chunk is done, or the reader failed (its
	// error is the call's).
	return nil
}

// pieceSink consumes the pieces of the chunks one data stream receives,
// in order: every piece at once when the send the chunk depends on is out
// (wholly, or, when the stream reports its progress, as far as the
// piece), else into a spill buffer (one chunk per stream, made on first
// need) until the frame is in and that send is done. A piece waits at
// most spillAfter for its send.
type pieceSink struct {
	pp          *pipe
	s           int // the data stream
	recvTok     chan<- struct{}
	sendTok     <-chan struct{}
	prog        *sendProgress
	spill       []byte
	wait        *time.Timer
	k           chunkAt
	needs, sent bool
	spilled     [][2]int // pieces in the spill buffer: offset, length
}

func (pp *pipe) newPieceSink(s int, recvTok chan<- struct{}, sendTok <-chan struct{}, prog *sendProgress) *pieceSink {
	return &pieceSink{pp: pp, s: s, recvTok: recvTok, sendTok: sendTok, prog: prog}
}

// begin starts chunk k.
func (ps *pieceSink) begin(k chunkAt) {
	ps.k = k
	ps.needs = ps.pp.recvWaits(k.t)
	ps.sent = !ps.needs
	ps.spilled = ps.spilled[:0]
}

// piece consumes bytes [off, off+len(p)) of the chunk's payload, or
// copies them into the spill buffer; p is not kept.
func (ps *pieceSink) piece(off int, p []byte) error {
	pp, k := ps.pp, ps.k
	if !ps.sent {
		select {
		case <-ps.sendTok:
			ps.sent = true
		default:
		}
	}
	direct := ps.sent
	if !direct && ps.prog != nil {
		var err error
		t0 := time.Now()
		direct, err = ps.prog.await(pp.cl.ctx, k.t-pp.recvLag, k.c, off+len(p), &ps.wait)
		pp.cl.waitedSend(ps.s, t0)
		if err != nil {
			return err
		}
	}
	if direct {
		return pp.recv(k.t, k.j, k.c, k.off+off, len(p), p)
	}
	if ps.spill == nil {
		ps.spill = make([]byte, pp.chunk)
	}
	if len(ps.spilled) == 0 {
		spills.Add(1)
	}
	pp.cl.st.spilled.Add(int64(len(p)))
	copy(ps.spill[off:], p)
	if n := len(ps.spilled); n > 0 && ps.spilled[n-1][0]+ps.spilled[n-1][1] == off {
		ps.spilled[n-1][1] += len(p)
	} else {
		ps.spilled = append(ps.spilled, [2]int{off, len(p)})
	}
	return nil
}

// into receives the chunk straight into dst (pipe.into): the send it
// depends on must be done before the payload lands, so it is awaited once
// the header is in. Then it reports the chunk and lets the sender go on.
func (ps *pieceSink) into(st transport.IntoReceiver, dst []byte) error {
	pp, k, cl := ps.pp, ps.k, ps.pp.cl
	err := cl.recvInto(st, ps.s, pp.prev, pp.stepOff+k.t, k.c, k.n, pp.primary, func() error {
		if ps.needs {
			return cl.awaitSend(ps.s, ps.sendTok)
		}
		return nil
	}, dst)
	if err != nil {
		return err
	}
	directRecvs.Add(1)
	pp.finished(k, ps.recvTok)
	return nil
}

// directRecvs counts the chunks read straight into their destination
// (tests).
var directRecvs atomic.Int64

// end finishes the chunk once its frame is wholly in: it waits for the
// send the chunk depends on, consumes what was spilled, reports the chunk
// and lets the sender go on.
func (ps *pieceSink) end() error {
	pp, k, cl := ps.pp, ps.k, ps.pp.cl
	if ps.needs && !ps.sent {
		if err := cl.awaitSend(ps.s, ps.sendTok); err != nil {
			return err
		}
	}
	for _, sp := range ps.spilled {
		if err := pp.recv(k.t, k.j, k.c, k.off+sp[0], sp[1], ps.spill[sp[0]:sp[0]+sp[1]]); err != nil {
			return cl.recvErr(&localError{err}, pp.prev, pp.primary)
		}
	}
	pp.finished(k, ps.recvTok)
	return nil
}

// recvMore says whether data stream s receives more than piece bytes in
// the call.
func (pp *pipe) recvMore(s, piece int) bool {
	S, got := pp.cl.c.streams, 0
	for t := range pp.steps {
		j := pp.recvSeg(t)
		for c := s; c < pp.nchunks(j); c += S {
			_, n := pp.span(j, c)
			if got += n; got > piece {
				return true
			}
		}
	}
	return false
}

// spillAfter is how long a piece waits for the send it depends on before
// it goes to the spill buffer.
const spillAfter = 2 * time.Millisecond

// sendProgress is how far a stream's sender has got: chunk (t, c), in the
// sender's order, has its first n bytes out, and every chunk before it is
// wholly out.
type sendProgress struct {
	mu   sync.Mutex
	t, c int
	n    int
	bump chan struct{} // a receiver waiting is woken by the next step
}

func newSendProgress() *sendProgress {
	return &sendProgress{t: -1, bump: make(chan struct{}, 1)}
}

func (sp *sendProgress) at(t, c, n int) {
	sp.mu.Lock()
	sp.t, sp.c, sp.n = t, c, n
	sp.mu.Unlock()
	select {
	case sp.bump <- struct{}{}:
	default:
	}
}

// passed reports whether the first n bytes of chunk (t, c) are out.
func (sp *sendProgress) passed(t, c, n int) bool {
	sp.mu.Lock()
	defer sp.mu.Unlock()
	return sp.t > t || sp.t == t && (sp.c > c || sp.c == c && sp.n >= n)
}

// await waits up to spillAfter until the first n bytes of chunk (t, c)
// are out; false when they are not by then. *timer is reused.
func (sp *sendProgress) await(ctx context.Context, t, c, n int, timer **time.Timer) (bool, error) {
	if sp.passed(t, c, n) {
		return true, nil
	}
	if *timer == nil {
		*timer = time.NewTimer(spillAfter)
	} else {
		(*timer).Reset(spillAfter)
	}
	defer (*timer).Stop()
	for {
		select {
		case <-sp.bump:
			if sp.passed(t, c, n) {
				return true, nil
			}
		case <-(*timer).C:
			return sp.passed(t, c, n), nil
		case <-ctx.Done():
			return false, errSibling
		}
	}
}

// spills counts the chunks that began in a spill buffer, overlaps the
// streams whose pieces were read ahead of their reduction (tests).
var spills, overlaps atomic.Int64

// chunkAt is a chunk of the schedule: step t, segment j, chunk c, bytes
// [off, off+n) of the segment.
type chunkAt struct{ t, j, c, off, n int }

// recvChunks calls fn for every chunk data stream s receives, in order,
// each once pp.prep (when set) made it ready; the first error ends it.
func (pp *pipe) recvChunks(s int, fn func(k chunkAt) error) error {
	for t := range pp.steps {
		j := pp.recvSeg(t)
		for c := s; c < pp.nchunks(j); c += pp.cl.c.streams {
			off, n := pp.span(j, c)
			if pp.prep != nil {
				if err := pp.prep(t, j, c, off, n); err != nil {
					return err
				}
			}
			if err := fn(chunkAt{t, j, c, off, n}); err != nil {
				return err
			}
		}
	}
	return nil
}

// finished reports chunk k wholly consumed (the received hook) and, when
// its receive lets this member's sender go on, gives it the token.
func (pp *pipe) finished(k chunkAt, recvTok chan<- struct{}) {
	pp.consumed(k)
	if pp.unblocksSend(k.t) {
		recvTok <- struct{}{}
	}
}

// unblocksSend says whether the receive of step t lets this member's
// sender go on (a token on recvTok).
func (pp *pipe) unblocksSend(t int) bool {
	return pp.next >= 0 && pp.sendLag >= 0 && t+pp.sendLag < pp.steps
}

// await takes a token from ch, or gives up when the call is stopped.
func (cl *call) await(ch <-chan struct{}) error {
	select {
	case <-ch:
		return nil
	case <-cl.ctx.Done():
		return errSibling
	}
}

// awaitSend is await for the token of this member's own send that a
// receiver on data stream s waits for; the wait counts as SendWait.
func (cl *call) awaitSend(s int, ch <-chan struct{}) error {
	select {
	case <-ch:
		return nil
	default:
	}
	t0 := time.Now()
	defer cl.waitedSend(s, t0)
	return cl.await(ch)
}

// heldChunk is a chunk read off a stream and held for the consumer.
type heldChunk struct {
	chunkAt
	p       []byte
	release func()
}

// holdReceiver reads the chunks of data stream s off the stream and hands
// them to the consumer, holding each until the consumer releases it; at
// most transport.MaxHeld are held, so it runs one chunk ahead.
func (pp *pipe) holdReceiver(s int, st transport.Holder, held chan<- heldChunk) error {
	defer close(held)
	cl := pp.cl
	return pp.recvChunks(s, func(k chunkAt) error {
		p, release, err := cl.recvHold(st, s, pp.prev, pp.stepOff+k.t, k.c, k.n, pp.primary)
		if err != nil {
			return err
		}
		select {
		case held <- heldChunk{chunkAt: k, p: p, release: release}:
			return nil
		case <-cl.ctx.Done():
			release()
			return errSibling
		}
	})
}

// consumer consumes the chunks holdReceiver hands it (from data stream
// s), in order: it waits for the send each depends on, passes it to
// pp.consume and releases it.
func (pp *pipe) consumer(s int, held <-chan heldChunk, recvTok chan<- struct{}, sendTok <-chan struct{}) (err error) {
	cl := pp.cl
	defer func() {
		// On an error, release what the receiver still hands over: it
		// stops on the call's context, which the error cancels (here
		// already, as the receiver may be waiting for a frame).
		if err != nil {
			cl.setErr(err)
		}
		for h := range held {
			h.release()
		}
	}()
	for h := range held {
		if pp.recvWaits(h.t) {
			if err := cl.awaitSend(s, sendTok); err != nil {
				h.release()
				return err
			}
		}
		err := pp.consume(s, h.chunkAt, h.p)
		h.release()
		if err != nil {
			return cl.recvErr(&localError{err}, pp.prev, pp.primary)
		}
		pp.finished(h.chunkAt, recvTok)
	}
	return nil
}
