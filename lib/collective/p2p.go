package collective

import (
	"context"
	"errors"
	"fmt"
	"slices"
	"sync"
	"time"

	"github.com/gpubridge/gpubridge/lib/transport"
	"github.com/gpubridge/gpubridge/lib/wire"
)

// peer is the point-to-point state of one peer member.
type peer struct {
	ctl     chan struct{}   // held while a frame is written to the control stream
	p2pSend []chan struct{} // per point-to-point stream: held while a frame is written
	gone    chan struct{}   // closed when the control stream from the peer ended
	lost    error           // why; set before gone is closed
	goneMu  sync.Once       // closes gone once (the control stream's reader or a point-to-point stream's)

	// drained is closed once every reader of the peer's streams (control
	// and point-to-point) has ended: after that no frame of the peer is
	// filed, so a message still arriving never will.
	drained   chan struct{}
	readersMu sync.Mutex
	readers   int

	tagMu sync.Mutex
	tags  map[uint32]*tagSend

	mu         sync.Mutex // guards the receive side, including copies into posted buffers
	posted     map[uint32][]*recvReq
	unexpected map[uint32][]*message
	inflight   map[uint32]*incoming
	last       map[uint32]uint64 // number of the last message begun, per tag
	striped    map[stripeKey]*striped
	announced  chan struct{} // closed (and replaced) when a striped message is announced
}

// goneErr returns the error of calls on a lost peer, or nil while it is
// there.
func (pr *peer) goneErr() error {
	select {
	case <-pr.gone:
		return &brokenError{pr.lost}
	default:
		return nil
	}
}

// readerDone counts a reader of the peer's streams out.
func (pr *peer) readerDone() {
	pr.readersMu.Lock()
	defer pr.readersMu.Unlock()
	if pr.readers--; pr.readers == 0 {
		close(pr.drained)
	}
}

func newPeer(p2pStreams int) *peer {
	pr := &peer{
		ctl:        make(chan struct{}, 1),
		p2pSend:    make([]chan struct{}, p2pStreams),
		gone:       make(chan struct{}),
		drained:    make(chan struct{}),
		readers:    1 + p2pStreams,
		striped:    map[stripeKey]*striped{},
		announced:  make(chan struct{}),
		tags:       map[uint32]*tagSend{},
		posted:     map[uint32][]*recvReq{},
		unexpected: map[uint32][]*message{},
		inflight:   map[uint32]*incoming{},
		last:       map[uint32]uint64{},
	}
	for i := range pr.p2pSend {
		pr.p2pSend[i] = make(chan struct{}, 1)
	}
	return pr
}

// takePosted takes the first Recv posted on tag, or returns nil when none
// is. pr.mu is held.
func (pr *peer) takePosted(tag uint32) *recvReq { return takeFirst(pr.posted, tag) }

// takeFirst takes the head of a per-tag queue (the posted Recvs, the
// unexpected messages), or returns nil when it is empty.
func takeFirst[T any](queues map[uint32][]*T, tag uint32) *T {
	q := queues[tag]
	if len(q) == 0 {
		return nil
	}
	first := q[0]
	q[0] = nil // the queue's array no longer holds it
	if len(q) == 1 {
		delete(queues, tag)
	} else {
		queues[tag] = q[1:]
	}
	return first
}

// tagSend orders the messages sent on one tag: Sends are queued in the
// order they were posted, and the first in the queue holds the tag for its
// whole message.
type tagSend struct {
	queue []*sendTurn // guarded by the peer's tagMu
	next  uint64      // number of the last message sent; the holder's
}

// sendTurn is one posted Send's place in its tag's queue: ready is closed
// when it reaches the head.
type sendTurn struct{ ready chan struct{} }

// postSend queues a Send on tag and returns its place.
func (pr *peer) postSend(tag uint32) (*tagSend, *sendTurn) {
	pr.tagMu.Lock()
	defer pr.tagMu.Unlock()
	ts := pr.tags[tag]
	if ts == nil {
		ts = &tagSend{}
		pr.tags[tag] = ts
	}
	t := &sendTurn{ready: make(chan struct{})}
	ts.queue = append(ts.queue, t)
	if len(ts.queue) == 1 {
		close(t.ready)
	}
	return ts, t
}

// leaveSend takes a Send out of its tag's queue (it finished or gave up),
// passing the tag on when it held it.
func (pr *peer) leaveSend(ts *tagSend, t *sendTurn) {
	pr.tagMu.Lock()
	defer pr.tagMu.Unlock()
	i := slices.Index(ts.queue, t)
	ts.queue = slices.Delete(ts.queue, i, i+1)
	if i == 0 && len(ts.queue) > 0 {
		close(ts.queue[0].ready)
	}
}

// recvReq is a posted Recv.
type recvReq struct {
	buf   []byte
	state int      // posted, filling, complete
	seq   uint64   // message number, once matched
	n     int      // bytes written into buf
	total int      // message bytes received
	sm    *striped // the striped message arriving into buf, if it is one
	done  chan struct{}
}

const (
	posted = iota
	filling
	complete
)

// message is one that arrived before a matching Recv.
type message struct {
	seq      uint64
	data     []byte
	complete bool
	done     chan struct{}
}

// incoming is the message arriving on a tag: into a posted Recv, into the
// unexpected queue, or (req and msg nil) dropped.
type incoming struct {
	seq  uint64
	next uint32 // frame index expected next
	req  *recvReq
	msg  *message
}

// errNotSent: a control frame was not sent (the stream was busy until the
// deadline); nothing reached the wire.
type errNotSent struct{ err error }

func (e *errNotSent) Error() string { return e.err.Error() }
func (e *errNotSent) Unwrap() error { return e.err }

// sendControl writes one frame to peer's control stream.
func (c *Comm) sendControl(ctx context.Context, peer int, h wire.Header, payload []byte) error {
	pr := c.peers[peer]
	select {
	case pr.ctl <- struct{}{}:
	case <-ctx.Done():
		return &errNotSent{ctx.Err()}
	case <-c.stop:
		return &errNotSent{c.hardState()}
	}
	defer func() { <-pr.ctl }()
	return c.mesh.Control(peer).Send(ctx, h, payload)
}

func (c *Comm) checkPeer(peer int) error {
	switch {
	case peer < 0 || peer >= c.size:
		return invalid("peer %d is not a member (0..%d)", peer, c.size-1)
	case peer == c.self:
		return invalid("peer %d is this member itself", peer)
	}
	return nil
}

// Send sends buf to peer as one message with tag: PostSend, then Wait. It
// returns once buf may be reused (the message is on its way, not
// necessarily received). Messages to one peer with one tag are received in
// the order their Sends were posted; concurrent Sends may interleave their
// frames on the wire, except on the same tag, where they go one after the
// other.
func (c *Comm) Send(ctx context.Context, peer int, tag uint32, buf []byte) error {
	_, err := c.PostSend(peer, tag, buf).Wait(ctx)
	return err
}

// sendFailed is Send's error when a frame of message seq failed with err.
// A control frame that was not sent (errNotSent) before anything of the
// message went out (first) leaves the streams usable; otherwise part of
// the message may be on the wire, the streams cannot go on, and the
// communicator breaks.
func (c *Comm) sendFailed(ctx context.Context, err error, first bool, peer int, seq uint64, desc string, limit time.Duration) error {
	var ns *errNotSent
	if errors.As(err, &ns) {
		if st := c.hardState(); st != nil {
			return &Error{Op: "send", Seq: seq, Desc: desc, Err: st}
		}
		if first {
			return &Error{Op: "send", Seq: seq, Desc: desc, Err: c.classify(ctx, ns.err, peer, limit, false, "its control stream was busy")}
		}
	}
	e := &Error{Op: "send", Seq: seq, Desc: desc, Err: c.classify(ctx, err, peer, limit, false, "it is not reading")}
	if !errors.Is(err, ErrClosed) {
		c.fail(e)
	}
	return e
}

// sendStripedMessage is Send of a striped message: the announcement on the
// control stream, then the frames over the point-to-point streams.
func (c *Comm) sendStripedMessage(ctx context.Context, peer int, tag uint32, seq uint64, ts *tagSend, buf []byte, unit int, desc string, limit time.Duration) error {
	h := wire.Header{Kind: wire.KindP2P, Seq: seq, Step: tag, Flags: wire.FlagStripe}
	if err := c.sendControl(ctx, peer, h, stripeAnnounce(len(buf), unit)); err != nil {
		return c.sendFailed(ctx, err, true, peer, seq, desc, limit)
	}
	ts.next = seq
	// The frames' errors are never errNotSent: the announcement is out.
	if err := c.sendStriped(ctx, peer, tag, seq, buf, unit); err != nil {
		return c.sendFailed(ctx, err, false, peer, seq, desc, limit)
	}
	return nil
}

// Recv receives the next message from peer with tag into buf and returns
// its length: PostRecv, then Wait. Messages are matched by (peer, tag)
// only, in the order the Recvs were posted: a Recv for one tag completes
// whatever other tags have pending. A message longer than buf is an error
// wrapping ErrTooLong; it is consumed, buf holds its first len(buf) bytes
// and the length returned is the message's.
//
// When ctx ends before a message matched, nothing is consumed. When it ends
// while a message is arriving into buf, the message goes to the next Recv
// posted on the tag, else back to the head of the queue, with what arrived
// so far (unless it had already overflowed buf, then it is dropped).
func (c *Comm) Recv(ctx context.Context, peer int, tag uint32, buf []byte) (int, error) {
	return c.PostRecv(peer, tag, buf).Wait(ctx)
}

func tooLong(n, size int) error {
	return fmt.Errorf("%w: a message of %d bytes for a %d-byte buffer (the message is consumed)", ErrTooLong, n, size)
}

// detach takes a message that is arriving into req (whose Recv gives up)
// away from it: to the next posted Recv on the tag, else back to the head
// of the unexpected queue, else (it overflowed req) nowhere. pr.mu is held.
func (c *Comm) detach(pr *peer, tag uint32, req *recvReq) {
	in := pr.inflight[tag]
	in.req = nil
	if req.total > req.n {
		return // overflowed: the bytes past buf are gone; drop the rest
	}
	data := req.buf[:req.n]
	if next := pr.takePosted(tag); next != nil {
		next.state, next.seq = filling, in.seq
		next.n = copy(next.buf, data)
		next.total = len(data) // may overflow next.buf: then it fails with ErrTooLong
		in.req = next
		return
	}
	m := &message{seq: in.seq, data: slices.Clone(data), done: make(chan struct{})}
	c.unexpected.Add(int64(len(m.data)))
	pr.unexpected[tag] = append([]*message{m}, pr.unexpected[tag]...)
	in.msg = m
}

// p2pFrame files a point-to-point frame from peer (on the dispatcher):
// into the posted Recv it matches, copied straight from the frame, or into
// the unexpected queue.
func (c *Comm) p2pFrame(peer int, h wire.Header, payload []byte) error {
	pr := c.peers[peer]
	tag := h.Step
	pr.mu.Lock()
	defer pr.mu.Unlock()
	in := pr.inflight[tag]
	if in == nil {
		if h.Chunk != 0 || h.Seq != pr.last[tag]+1 {
			return fmt.Errorf("%s sent frame %d of message %d on tag %d, this member expected frame 0 of message %d: protocol error", c.mesh.Peer(peer), h.Chunk, h.Seq, tag, pr.last[tag]+1)
		}
		pr.last[tag] = h.Seq
		in = &incoming{seq: h.Seq}
		if in.req = pr.takePosted(tag); in.req != nil {
			in.req.state, in.req.seq = filling, h.Seq
		} else {
			in.msg = &message{seq: h.Seq, done: make(chan struct{})}
			pr.unexpected[tag] = append(pr.unexpected[tag], in.msg)
		}
		pr.inflight[tag] = in
	} else if h.Seq != in.seq || h.Chunk != in.next {
		return fmt.Errorf("%s sent frame %d of message %d on tag %d, this member expected frame %d of message %d: protocol error", c.mesh.Peer(peer), h.Chunk, h.Seq, tag, in.next, in.seq)
	}
	in.next++
	switch {
	case in.req != nil:
		r := in.req
		r.n += copy(r.buf[r.n:], payload)
		r.total += len(payload)
	case in.msg != nil:
		if total := c.unexpected.Add(int64(len(payload))); total > c.maxUnexpected {
			return fmt.Errorf("%s: %d bytes of messages wait for a matching Recv, over the limit of %s (message %d on tag %d): post receives earlier", c.mesh.Peer(peer), total, fmtBytes(int(c.maxUnexpected)), h.Seq, tag)
		}
		in.msg.data = append(in.msg.data, payload...)
	}
	if h.Flags&wire.FlagLast != 0 {
		delete(pr.inflight, tag)
		switch {
		case in.req != nil:
			in.req.state = complete
			close(in.req.done)
		case in.msg != nil:
			in.msg.complete = true
			close(in.msg.done)
		}
	}
	return nil
}

// dispatch reads peer's control stream until the communicator stops:
// point-to-point frames go to their Recv or queue, barrier tokens to the
// barrier. A failure breaks the communicator.
func (c *Comm) dispatch(peer int) {
	defer c.wg.Done()
	defer c.peers[peer].readerDone()
	st := c.mesh.Control(peer)
	for {
		err := st.Recv(c.dctx, func(h wire.Header, payload []byte) error {
			var err error
			switch {
			case h.Kind == wire.KindP2P && h.Flags&wire.FlagStripe != 0:
				err = c.stripeAnnounced(peer, h, payload)
			case h.Kind == wire.KindP2P:
				err = c.p2pFrame(peer, h, payload)
			case h.Kind == wire.KindBarrier:
				err = c.barrierFrame(peer, h)
			case h.Kind == wire.KindClose:
				return &transport.PeerError{Peer: c.mesh.Peer(peer), Err: errors.New("closed the bridge")}
			default:
				err = fmt.Errorf("%s sent a %s frame on the control stream: protocol error", c.mesh.Peer(peer), h.Kind)
			}
			if err != nil {
				return &localError{err}
			}
			return nil
		})
		if err == nil {
			continue
		}
		select {
		case <-c.stop:
			return
		default:
		}
		c.readerEnded(peer, err)
		return
	}
}

// readerEnded handles the error that ended a reader of one of peer's
// streams (the control stream, a point-to-point stream): this member's own
// finding that the peer's frames are wrong breaks the communicator, so the
// peer learns it too; anything else loses the peer.
func (c *Comm) readerEnded(peer int, err error) {
	var le *localError
	if errors.As(err, &le) {
		c.fail(le.err)
		return
	}
	var pe *transport.PeerError
	if !errors.As(err, &pe) {
		err = &transport.PeerError{Peer: c.mesh.Peer(peer), Err: err}
	}
	c.lose(peer, corruptHint(err))
}
