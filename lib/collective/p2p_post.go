package collective

import (
	"context"
	"fmt"
	"slices"
	"time"

	"github.com/gpubridge/gpubridge/lib/wire"
)

// Pending is a Send or Recv posted with PostSend or PostRecv: its place in
// the order of its (peer, tag) is fixed; Wait runs it to its end and
// returns the bytes sent or the received message's length. Every Pending
// is waited for exactly once: until then a posted Send holds up the later
// Sends on its tag, and a posted Recv may take a message.
type Pending interface {
	Wait(ctx context.Context) (int, error)
}

// PostSend places a Send of buf to peer with tag in the order of its
// (peer, tag) — after every Send posted before on the tag, before every
// one posted after — without waiting: the caller may post more before
// waiting for any (gbbridge serve posts requests in the order it read
// them, then waits for each on a goroutine of its own). Nothing is sent
// until Wait. A Send that cannot run (a wrong peer, a broken communicator,
// a peer gone) fails in Wait.
func (c *Comm) PostSend(peer int, tag uint32, buf []byte) Pending {
	p := &pendingSend{pendingP2P: c.newPending("send", peer, tag, buf, func(who string) string {
		return fmt.Sprintf("tag %d, %s to %s", tag, fmtBytes(len(buf)), who)
	})}
	if p.err != nil {
		return p
	}
	if err := c.peers[peer].goneErr(); err != nil {
		p.err = &Error{Op: "send", Desc: p.desc, Err: err}
		return p
	}
	p.ts, p.turn = c.peers[peer].postSend(tag)
	return p
}

// pendingP2P is what a posted Send and a posted Recv share.
type pendingP2P struct {
	c    *Comm
	peer int
	tag  uint32
	buf  []byte
	desc string
	err  error // refused when posted
}

// newPending is the start of a posted op ("send" or "recv"): its
// description, naming the peer as describe(who) does (by member index
// until the peer is known valid, then by the mesh's name for it), and the
// error its Wait returns when it cannot be posted (a wrong peer, a broken
// communicator).
func (c *Comm) newPending(op string, peer int, tag uint32, buf []byte, describe func(who string) string) pendingP2P {
	p := pendingP2P{c: c, peer: peer, tag: tag, buf: buf, desc: describe(fmt.Sprintf("member %d", peer))}
	if err := c.checkPeer(peer); err != nil {
		p.err = &Error{Op: op, Desc: p.desc, Err: err}
		return p
	}
	p.desc = describe(c.mesh.Peer(peer))
	if err := c.hardState(); err != nil {
		p.err = &Error{Op: op, Desc: p.desc, Err: err}
	}
	return p
}

// pendingSend is a posted Send.
type pendingSend struct {
	pendingP2P
	ts   *tagSend
	turn *sendTurn
}

// Wait waits for the Send's turn on its tag, then sends the message.
func (p *pendingSend) Wait(ctx context.Context) (int, error) {
	if p.err != nil {
		return 0, p.err
	}
	c, peer, pr := p.c, p.peer, p.c.peers[p.peer]
	defer pr.leaveSend(p.ts, p.turn)
	ctx, cancel, limit := c.deadline(ctx)
	defer cancel()
	waiting := func() (int, error) {
		return 0, &Error{Op: "send", Desc: p.desc, Err: c.classify(ctx, ctx.Err(), peer, limit, false, "an earlier message on this tag was still being sent")}
	}
	if ctx.Err() != nil {
		return waiting()
	}
	select {
	case <-p.turn.ready:
	case <-ctx.Done():
		return waiting()
	case <-c.stop:
		return 0, &Error{Op: "send", Desc: p.desc, Err: c.hardState()}
	}
	// The peer may have gone while this Send waited for its turn.
	if err := pr.goneErr(); err != nil {
		return 0, &Error{Op: "send", Desc: p.desc, Err: err}
	}
	if err := p.send(ctx, limit); err != nil {
		return 0, err
	}
	return len(p.buf), nil
}

// send writes the message, in its turn.
func (p *pendingSend) send(ctx context.Context, limit time.Duration) error {
	c, peer, tag, buf, ts := p.c, p.peer, p.tag, p.buf, p.ts
	seq := ts.next + 1
	if ok, unit := c.stripes(len(buf)); ok {
		return c.sendStripedMessage(ctx, peer, tag, seq, ts, buf, unit, p.desc, limit)
	}
	frames := max(1, (len(buf)+c.chunk-1)/c.chunk)
	for i := range frames {
		lo := i * c.chunk
		hi := min(lo+c.chunk, len(buf))
		h := wire.Header{Kind: wire.KindP2P, Seq: seq, Step: tag, Chunk: uint32(i)}
		if i == frames-1 {
			h.Flags = wire.FlagLast
		}
		if err := c.sendControl(ctx, peer, h, buf[lo:hi]); err != nil {
			return c.sendFailed(ctx, err, i == 0, peer, seq, p.desc, limit)
		}
		ts.next = seq
	}
	return nil
}

// PostRecv places a Recv of a message from peer with tag into buf in the
// order of its (peer, tag), without waiting: it takes the message at the
// head of the tag's queue (arrived, or arriving), else it is posted for
// the next message to arrive, after the Recvs posted before it. Wait
// completes it.
func (c *Comm) PostRecv(peer int, tag uint32, buf []byte) Pending {
	p := &pendingRecv{pendingP2P: c.newPending("recv", peer, tag, buf, func(who string) string {
		return fmt.Sprintf("tag %d from %s, %s buffer", tag, who, fmtBytes(len(buf)))
	})}
	if p.err != nil {
		return p
	}
	pr := c.peers[peer]
	pr.mu.Lock()
	defer pr.mu.Unlock()
	if m := takeFirst(pr.unexpected, tag); m != nil {
		if m.complete {
			// Messages that arrived whole are delivered even once the
			// peer has gone; Wait copies it (not here: the poster may
			// have more to post).
			p.msg = m
		} else {
			p.req = c.claim(pr, tag, m, buf)
		}
		return p
	}
	if err := pr.goneErr(); err != nil {
		p.err = &Error{Op: "recv", Desc: p.desc, Err: err}
		return p
	}
	p.req = &recvReq{buf: buf, done: make(chan struct{})}
	pr.posted[tag] = append(pr.posted[tag], p.req)
	return p
}

// claim makes message m, which is arriving into the unexpected queue (and
// was just taken off it), arrive into buf instead, for a new Recv: what
// arrived so far is copied over (as detach does the other way). pr.mu is
// held.
func (c *Comm) claim(pr *peer, tag uint32, m *message, buf []byte) *recvReq {
	req := &recvReq{buf: buf, state: filling, seq: m.seq, done: make(chan struct{})}
	c.unexpected.Add(-int64(len(m.data)))
	if sm := pr.striped[stripeKey{tag, m.seq}]; sm != nil && sm.msg == m {
		// No frame copy into m.data is under way or begins after.
		sm.rw.Lock()
		copy(buf, m.data) // the gaps too: later frames fill them
		sm.msg, sm.req, req.sm = nil, req, sm
		sm.rw.Unlock()
		return req
	}
	in := pr.inflight[tag] // the message on the control stream: in.msg is m
	req.n = copy(buf, m.data)
	req.total = len(m.data) // may overflow buf: then it fails with ErrTooLong
	in.msg, in.req = nil, req
	return req
}

// pendingRecv is a posted Recv: a complete message it took (msg), or its
// request, posted or filling (req).
type pendingRecv struct {
	pendingP2P
	msg *message
	req *recvReq
}

// Wait waits for the Recv's message to arrive whole.
func (p *pendingRecv) Wait(ctx context.Context) (int, error) {
	if p.err != nil {
		return 0, p.err
	}
	c, pr, buf := p.c, p.c.peers[p.peer], p.buf
	if m := p.msg; m != nil {
		c.unexpected.Add(-int64(len(m.data)))
		copy(buf, m.data)
		if len(m.data) > len(buf) {
			return len(m.data), &Error{Op: "recv", Seq: m.seq, Desc: p.desc, Err: tooLong(len(m.data), len(buf))}
		}
		return len(m.data), nil
	}
	ctx, cancel, limit := c.deadline(ctx)
	defer cancel()
	stopped := func(seq uint64) (int, error) {
		err := c.hardState()
		if err == nil {
			err = pr.goneErr()
		}
		if err == nil {
			err = c.classify(ctx, ctx.Err(), p.peer, limit, true, "no message with this tag arrived")
		}
		return 0, &Error{Op: "recv", Seq: seq, Desc: p.desc, Err: err}
	}
	req := p.req
	if ctx.Err() == nil {
		select {
		case <-req.done:
		case <-ctx.Done():
		case <-c.stop:
		case <-pr.gone:
			// Nothing new matches now; a striped message arriving may
			// still be completed by the point-to-point streams.
			pr.mu.Lock()
			arriving := req.state == filling && req.sm != nil
			pr.mu.Unlock()
			if arriving {
				select {
				case <-req.done:
				case <-ctx.Done():
				case <-c.stop:
				case <-pr.drained:
				}
			}
		}
	}
	pr.mu.Lock()
	switch req.state {
	case posted:
		pr.posted[p.tag] = slices.DeleteFunc(pr.posted[p.tag], func(r *recvReq) bool { return r == req })
		if len(pr.posted[p.tag]) == 0 {
			delete(pr.posted, p.tag)
		}
		pr.mu.Unlock()
		return stopped(0)
	case filling:
		if req.sm != nil {
			c.detachStriped(pr, p.tag, req)
		} else {
			c.detach(pr, p.tag, req)
		}
		pr.mu.Unlock()
		return stopped(req.seq)
	}
	pr.mu.Unlock()
	if req.total > len(buf) {
		return req.total, &Error{Op: "recv", Seq: req.seq, Desc: p.desc, Err: tooLong(req.total, len(buf))}
	}
	return req.total, nil
}
