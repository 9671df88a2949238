package collective

import (
	"context"
	"errors"
	"fmt"
	"sync"
	"sync/atomic"
	"time"

	"github.com/gpubridge/gpubridge/lib/codec"
	"github.com/gpubridge/gpubridge/lib/reduce"
	"github.com/gpubridge/gpubridge/lib/transport"
	"github.com/gpubridge/gpubridge/lib/wire"
)

// call is one collective in progress.
type call struct {
	c      *Comm
	kind   kind
	seq    uint64
	desc   string
	fp     uint16
	ctx    context.Context
	cancel context.CancelCauseFunc
	stopT  context.CancelFunc
	limit  time.Duration
	heard  []atomic.Bool // a frame of this call came from that member
	st     *callStats
	pre    error // found before the call started: it fails at once

	// codec packs the call's data frames (every frame carries it); cdt
	// is the dtype of its values (a lossless codec's planes; 0: bytes).
	codec  codec.ID
	cdt    reduce.DType
	packed bool // the bytes are packed already (args.packed): sent as they are
	small  int  // the resolved Options.SmallBytes in the fingerprint (args.small), 0: none

	readyFn func(context.Context, int) error
	readyTo atomic.Int64
	doneFn  func(off, n int)

	mu       sync.Mutex
	err      error
	fallback bool // a goroutine stopped on the context without an error of its own
	wg       sync.WaitGroup
}

// begin starts collective k: it checks the communicator, takes the next
// sequence number and registers the call. On error nothing was started.
func (c *Comm) begin(ctx context.Context, k kind, desc string, fp uint16, p *Progress) (*call, error) {
	if c.size > MaxMembers {
		return nil, &Error{Op: k.String(), Desc: desc, Err: invalid("%d members, at most %d are supported", c.size, MaxMembers)}
	}
	if r := c.refuse(); r != nil {
		return nil, &Error{Op: k.String(), Desc: desc, Err: r}
	}
	c.collMu.Lock()
	cl := &call{c: c, kind: k, desc: desc, fp: fp, heard: make([]atomic.Bool, c.size), st: c.newCallStats()}
	if p != nil {
		cl.readyFn, cl.doneFn = p.Ready, p.Done
	}
	var tctx context.Context
	tctx, cl.stopT, cl.limit = c.deadline(ctx)
	cl.ctx, cl.cancel = context.WithCancelCause(tctx)

	c.mu.Lock()
	if c.stateLocked() != nil {
		c.mu.Unlock()
		cl.cancel(nil)
		cl.stopT()
		c.collMu.Unlock()
		return nil, &Error{Op: k.String(), Desc: desc, Err: c.refuse()}
	}
	cl.seq = c.seq.Add(1)
	c.cur = cl
	// Barrier tokens queued from a collective this member has passed, or
	// for this one when it is no barrier, mean the orders differ.
	var mismatch error
	for p, q := range c.bq {
		if len(q) > 0 && (q[0].seq < cl.seq || q[0].seq == cl.seq && k != kBarrier) {
			mismatch = fmt.Errorf("%s sent barrier #%d, this member is in %s #%d: members called collectives in different orders", c.mesh.Peer(p), q[0].seq, k, cl.seq)
			break
		}
	}
	c.mu.Unlock()
	cl.pre = mismatch
	return cl, nil
}

// refuse returns nil while collectives can run, else the error they fail
// with. A member that refuses a collective because a peer was lost breaks
// the bridge, so that the others, who may be in that collective already,
// do not wait for it.
func (c *Comm) refuse() error {
	c.mu.Lock()
	lost := c.cause == nil && c.lost != nil
	cause := c.lost
	c.mu.Unlock()
	if lost {
		c.fail(cause)
	}
	return c.state()
}

// run runs the body of the call and finishes it.
func (c *Comm) run(cl *call, body func() error) error {
	if cl.pre != nil {
		return c.finish(cl, cl.pre)
	}
	return c.finish(cl, body())
}

// finish ends the call with err (nil: success). A failure breaks the
// communicator. It returns the call's error.
func (c *Comm) finish(cl *call, err error) error {
	var te *timeoutError
	var pe *transport.PeerError
	switch {
	case errors.As(err, &te) && !te.primary:
		// This member waited for one that is itself waiting: give the
		// member that found the cause the chance to report it first.
		grace := graceFor(cl.limit)
		if te.likely {
			grace /= 2
		}
		t := time.NewTimer(grace)
		select {
		case <-c.stop:
		case <-c.lostCh:
		case <-t.C:
		}
		t.Stop()
		if r := c.reason(); r != nil {
			err = r
		}
	case errors.As(err, &pe):
		// A data stream to a peer broke: its abort message, if it sent
		// one, comes on the control stream; wait a little for it.
		if p := c.memberOf(pe.Peer); p >= 0 {
			pr := c.peers[p]
			t := time.NewTimer(graceFor(cl.limit))
			select {
			case <-pr.gone:
				err = pr.lost
			case <-c.stop:
			case <-t.C:
			}
			t.Stop()
		}
	}
	end := time.Now()
	c.mu.Lock()
	c.cur = nil
	c.finished = cl.seq
	cl.snapshot(&c.last, end)
	c.mu.Unlock()
	cl.cancel(nil)
	cl.stopT()
	defer c.collMu.Unlock()
	if err == nil {
		return nil
	}
	e := &Error{Op: cl.kind.String(), Seq: cl.seq, Desc: cl.desc, Err: err}
	if !errors.Is(err, ErrClosed) {
		c.fail(e)
	}
	return e
}

// spawn runs f in a goroutine of the call; the first error stops the others.
func (cl *call) spawn(f func() error) {
	cl.wg.Add(1)
	go func() {
		defer cl.wg.Done()
		if err := f(); err != nil {
			cl.setErr(err)
		}
	}()
}

func (cl *call) setErr(err error) {
	cl.mu.Lock()
	defer cl.mu.Unlock()
	if err == errSibling {
		cl.fallback = true
		return
	}
	if cl.err == nil {
		cl.err = err
		cl.cancel(errSibling)
		return
	}
	// Goroutines woken by the same deadline: keep the timeout that points
	// at a member that is not itself waiting.
	var old, nw *timeoutError
	if errors.As(cl.err, &old) && !old.primary && errors.As(err, &nw) && nw.primary {
		cl.err = err
	}
}

// wait waits for the call's goroutines and returns the first error.
func (cl *call) wait() error {
	cl.wg.Wait()
	cl.mu.Lock()
	defer cl.mu.Unlock()
	if cl.err == nil && cl.fallback {
		// Parts of the call stopped on the context while the parts
		// they waited for ended without an error of their own.
		if errors.Is(context.Cause(cl.ctx), context.DeadlineExceeded) {
			cl.err = &timeoutError{after: cl.limit, who: "the collective to finish", primary: true}
		} else {
			cl.err = cl.c.classify(cl.ctx, cl.ctx.Err(), -1, cl.limit, true, "")
		}
	}
	return cl.err
}

// send sends one data frame to peer on st.
func (cl *call) send(st transport.Stream, peer, step, chunk int, payload []byte) error {
	return cl.sendProgress(st, peer, step, chunk, payload, nil)
}

// sendProgress is send, telling progress how much of the payload is out
// as it goes when the stream can say (transport.ProgressSender).
func (cl *call) sendProgress(st transport.Stream, peer, step, chunk int, payload []byte, progress func(int)) error {
	h := wire.Header{Kind: wire.KindData, Codec: uint8(cl.codec), Seq: cl.seq, Step: encodeStep(cl.kind, step, cl.fp), Chunk: uint32(chunk)}
	var err error
	if ps, ok := st.(transport.ProgressSender); ok && progress != nil {
		err = ps.SendProgress(cl.ctx, h, payload, progress)
	} else {
		err = st.Send(cl.ctx, h, payload)
	}
	cl.st.sent.Add(int64(len(payload)))
	if err != nil {
		return cl.c.classify(cl.ctx, err, peer, cl.limit, false, "it is not reading")
	}
	return nil
}

// recv receives the data frame (step, chunk) of n bytes from peer on st (its
// data stream s) and
// hands its payload to fn. primary says whether a timeout here points at
// peer itself rather than at a member peer waits for.
func (cl *call) recv(st transport.Stream, s, peer, step, chunk, n int, primary bool, fn func(p []byte) error) error {
	asked := time.Now()
	err := st.Recv(cl.ctx, func(h wire.Header, p []byte) error {
		if err := cl.check(peer, h, step, chunk, n); err != nil {
			return &localError{err}
		}
		cl.frameIn(peer, s, asked, len(p))
		cl.heard[peer].Store(true)
		if err := fn(p); err != nil {
			return &localError{err}
		}
		return nil
	})
	if err == nil {
		return nil
	}
	return cl.recvErr(err, peer, primary)
}

// recvHold is recv for a stream that can hold frames: it returns the
// payload of the data frame (step, chunk) of n bytes from peer, valid until
// release is called (once). Errors are recv's.
func (cl *call) recvHold(st transport.Holder, s, peer, step, chunk, n int, primary bool) (p []byte, release func(), err error) {
	asked := time.Now()
	h, p, release, err := st.RecvHold(cl.ctx)
	if err != nil {
		return nil, nil, cl.recvErr(err, peer, primary)
	}
	if err := cl.check(peer, h, step, chunk, n); err != nil {
		release()
		return nil, nil, cl.recvErr(&localError{err}, peer, primary)
	}
	cl.frameIn(peer, s, asked, len(p))
	cl.heard[peer].Store(true)
	return p, release, nil
}

// recvPieces is recv for a stream that hands out pieces: fn gets the
// payload of the data frame (step, chunk) of n bytes from peer piece by
// piece (off within the payload), each valid only during the call. Errors
// are recv's.
func (cl *call) recvPieces(st transport.PieceReceiver, s, peer, step, chunk, n int, primary bool, fn func(off int, p []byte) error) error {
	err := st.RecvPieces(cl.ctx, cl.checkPieces(s, peer, step, chunk, n), func(off int, p []byte) error {
		if err := fn(off, p); err != nil {
			return &localError{err}
		}
		return nil
	})
	if err == nil {
		return nil
	}
	return cl.recvErr(err, peer, primary)
}

// recvInto is recv for a chunk read straight into dst: ready runs once
// the header is in and checked, before the payload lands (its error ends
// the receive). Errors are recv's.
func (cl *call) recvInto(st transport.IntoReceiver, s, peer, step, chunk, n int, primary bool, ready func() error, dst []byte) error {
	check := cl.checkPieces(s, peer, step, chunk, n)
	err := st.RecvInto(cl.ctx, func(h wire.Header) error {
		if err := check(h); err != nil {
			return err
		}
		if err := ready(); err != nil {
			return &localError{err}
		}
		return nil
	}, dst)
	if err == nil {
		return nil
	}
	return cl.recvErr(err, peer, primary)
}

// recvPiecesHold is recvPieces for a stream whose pieces the receiver may
// hold: fn gets each piece with its release (transport.PieceHolder), and
// owns it whatever it returns. Errors are recv's.
func (cl *call) recvPiecesHold(st transport.PieceHolder, s, peer, step, chunk, n int, primary bool, fn func(off int, p []byte, release func()) error) error {
	err := st.RecvPiecesHold(cl.ctx, cl.checkPieces(s, peer, step, chunk, n), func(off int, p []byte, release func()) error {
		if err := fn(off, p, release); err != nil {
			return &localError{err}
		}
		return nil
	})
	if err == nil {
		return nil
	}
	return cl.recvErr(err, peer, primary)
}

// checkPieces is the header check of recvPieces and recvPiecesHold, whose
// receive begins now.
func (cl *call) checkPieces(s, peer, step, chunk, n int) func(wire.Header) error {
	asked := time.Now()
	return func(h wire.Header) error {
		if err := cl.check(peer, h, step, chunk, n); err != nil {
			return &localError{err}
		}
		cl.frameIn(peer, s, asked, int(h.Len))
		cl.heard[peer].Store(true)
		return nil
	}
}

// recvErr classifies an error of a receive from peer; primary is recv's.
func (cl *call) recvErr(err error, peer int, primary bool) error {
	err = corruptHint(err)
	hint := "nothing received from it in this collective"
	if cl.heard[peer].Load() {
		primary = false
		hint = "it stopped sending partway; it may be waiting for another member"
	}
	return cl.c.classify(cl.ctx, err, peer, cl.limit, primary, hint)
}

// ready waits until the input bytes [0,end) are ready (Progress.Ready); an
// end at or below one already granted returns at once. Streams call it at
// the same time: one waiting for a far end must not hold up another whose
// nearer end is ready already (that serialised the streams behind the last
// chunk of a streamed input), so Ready runs concurrently and readyTo only
// grows.
func (cl *call) ready(end int) error {
	if cl.readyFn == nil || int64(end) <= cl.readyTo.Load() {
		return nil
	}
	if err := cl.readyFn(cl.ctx, end); err != nil {
		if cl.ctx.Err() != nil {
			return cl.c.classify(cl.ctx, err, -1, cl.limit, true, "")
		}
		return fmt.Errorf("input not ready: %w", err)
	}
	for {
		cur := cl.readyTo.Load()
		if int64(end) <= cur || cl.readyTo.CompareAndSwap(cur, int64(end)) {
			return nil
		}
	}
}

// done reports a final result range (Progress.Done).
func (cl *call) done(off, n int) {
	if cl.doneFn != nil && n > 0 {
		cl.doneFn(off, n)
	}
}

// whole handles a collective with nothing to communicate (one member): the
// input is read once ready, then the result is reported in one range.
func (cl *call) whole(n int, f func() error) error {
	if err := cl.ready(n); err != nil {
		return err
	}
	if err := f(); err != nil {
		return err
	}
	cl.done(0, n)
	return nil
}
