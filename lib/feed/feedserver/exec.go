package feedserver

import (
	"context"
	"errors"
	"fmt"
	"sync"
	"sync/atomic"
	"time"

	"github.com/gpubridge/gpubridge/lib/codec"
	"github.com/gpubridge/gpubridge/lib/collective"
	"github.com/gpubridge/gpubridge/lib/feed"
	"github.com/gpubridge/gpubridge/lib/reduce"
)

// worker alternates between reading the socket (while it holds the reader
// role) and running the collectives it read while none was running. It
// hands the role to the standby worker at once before a streamed
// collective (which needs its READYs), else after HandoffDelay
// (docs/FEED.md §5).
func (s *Server) worker() {
	defer s.wg.Done()
	w := &worker{s: s}
	w.timer = time.AfterFunc(time.Hour, w.handOff)
	w.timer.Stop()
	defer w.timer.Stop()
	for {
		select {
		case <-s.role:
		case <-s.inputEnd:
			return
		}
		for {
			exec, err := s.readLoop(s.reader)
			if !exec {
				s.readErr = err
				close(s.inputEnd)
				return
			}
			w.handed.Store(false)
			if s.o.HandoffDelay > 0 {
				w.timer.Reset(s.o.HandoffDelay)
			} else {
				w.handOff()
			}
			s.drain(s.lane0, w)
			w.timer.Stop()
			if !w.handed.CompareAndSwap(false, true) {
				break // the other worker reads now
			}
			// Still the reader: read on.
		}
	}
}

// worker is one of the two goroutines that take turns reading and running
// collectives.
type worker struct {
	s      *Server
	timer  *time.Timer
	handed atomic.Bool
}

// handOff gives the reader role to the other worker, once.
func (w *worker) handOff() {
	if w.handed.CompareAndSwap(false, true) {
		w.s.role <- struct{}{} // wakes the standby worker: it reads on
	}
}

// drain runs l's pending collectives in order until there are none; w is
// the worker running bridge 0's (nil for a joined bridge's goroutine).
func (s *Server) drain(l *lane, w *worker) {
	for {
		s.emu.Lock()
		if len(l.pending) == 0 {
			l.pending = l.pending[:0]
			l.executing = false
			s.emu.Unlock()
			return
		}
		c := l.pending[0]
		l.pending[0] = nil
		l.pending = l.pending[1:]
		s.emu.Unlock()
		if w != nil && c.req.Flags&feed.FlagStreamed != 0 {
			w.handOff()
		}
		s.run(c)
	}
}

// call is one request in flight.
type call struct {
	s       *Server
	lane    *lane // the bridge it runs on
	req     feed.Request
	buf     []byte
	out     []byte
	regs    [2]*region
	arrived time.Time
	started time.Time
	inLen   uint64
	res     *residual // a lossy all_reduce's error feedback (FEEDBACK_KEY)
	pend    Pending   // a SEND's or RECV's, posted when it was read
	done    feed.DoneMsg

	// streaming
	mu       sync.Mutex
	readyEnd uint64
	wake     chan struct{}
	prog     Progress

	// bridge stats for DONE (stats.go), reused
	stats   collective.Stats
	bstats  feed.BridgeStats
	blocked []uint64
	ext     [1]feed.Ext
}

func (s *Server) refuse(r *feed.Request, st feed.Status, msg string, arrived time.Time) {
	s.reply(r.ID, st, fmt.Sprintf("%s %d: %s", r.Kind, r.ID, msg), arrived)
}

// accept validates a request and starts it: point-to-point requests are
// posted to their bridge at once, in the order read (so that a (bridge,
// peer, tag)'s SENDs and RECVs are matched in request order), and waited
// for on a goroutine of their own; collectives are queued in order on
// their bridge's lane, and exec says that bridge 0's queue was idle, so
// the caller is to run it (a joined bridge's queue gets a goroutine).
func (s *Server) accept(r *feed.Request, arrived time.Time) (exec bool, err error) {
	if err := s.checkID(r.ID); err != nil {
		return false, err
	}
	l, err := s.laneOf(r)
	if err != nil {
		s.refuse(r, feed.StatusBadRequest, err.Error(), arrived)
		return false, nil
	}
	if b := l.brokenErr(); b != nil {
		s.reply(r.ID, feed.StatusBroken, brokenText(b), arrived)
		return false, nil
	}
	if err := s.validateOn(r, l.member, l.members); err != nil {
		s.refuse(r, feed.StatusBadRequest, err.Error(), arrived)
		return false, nil
	}
	if n := s.inflight.Load(); n >= int64(s.o.MaxInflight) {
		s.refuse(r, feed.StatusBadRequest, fmt.Sprintf("%d requests are in flight, the limit is %d", n, s.o.MaxInflight), arrived)
		return false, nil
	}
	s.rmu.Lock()
	rb, buf, err := s.span("buffer", r.Buf)
	var ro *region
	var out []byte
	if err == nil {
		ro, out, err = s.span("output", r.Out)
		if err != nil && rb != nil {
			rb.refs--
		}
	}
	s.rmu.Unlock()
	if err != nil {
		s.refuse(r, feed.StatusBadRequest, err.Error(), arrived)
		return false, nil
	}
	// Last, as it may replace a key's residual: nothing may refuse after.
	var res *residual
	if r.HasFeedbackKey {
		if res, err = s.fb.take(l.id, r.FeedbackKey, r.DType, r.Buf.Len/uint64(r.DType.Size())); err != nil {
			s.unref(rb)
			s.unref(ro)
			s.refuse(r, feed.StatusBadRequest, err.Error(), arrived)
			return false, nil
		}
	}
	c := s.callPool.Get().(*call)
	c.lane, c.req, c.buf, c.out, c.regs, c.arrived, c.res = l, *r, buf, out, [2]*region{rb, ro}, arrived, res
	c.inLen = r.Buf.Len
	s.inflight.Add(1)
	if r.Flags&feed.FlagStreamed != 0 {
		c.prog = Progress{Ready: c.waitReady, Done: c.progress}
		s.smu.Lock()
		s.streams[r.ID] = c
		s.smu.Unlock()
	}
	if c.p2p() {
		if r.Kind == feed.MsgSend {
			c.pend = l.bridge.PostSend(int(r.Peer), r.Tag, buf)
		} else {
			c.pend = l.bridge.PostRecv(int(r.Peer), r.Tag, buf)
		}
		s.wg.Add(1)
		s.o.goP2P(func() {
			defer s.wg.Done()
			s.run(c)
		})
		return false, nil
	}
	s.emu.Lock()
	l.pending = append(l.pending, c)
	idle := !l.executing
	l.executing = true
	s.emu.Unlock()
	if l == s.lane0 {
		return idle, nil
	}
	if idle {
		s.wg.Add(1)
		go func() {
			defer s.wg.Done()
			s.drain(l, nil)
		}()
	}
	return false, nil
}

// run executes one request and answers it.
func (s *Server) run(c *call) {
	c.started = time.Now()
	d := &c.done
	*d = feed.DoneMsg{ID: c.req.ID}
	if cause := context.Cause(s.ctx); cause != nil {
		d.Status, d.Error = feed.StatusAborted, "feed server stopping: "+cause.Error()
		c.abandon()
	} else if b := c.lane.brokenErr(); b != nil {
		d.Status, d.Error = feed.StatusBroken, brokenText(b)
		c.abandon()
	} else if err := s.call(c); err != nil {
		s.failed(c, err)
	} else {
		s.addStats(c, d)
	}
	s.finish(c)
}

// call runs the request on the bridge and fills DONE's bytes and seq.
func (s *Server) call(c *call) (err error) {
	var p *Progress
	if c.req.Flags&feed.FlagStreamed != 0 {
		p = &c.prog
	}
	br, d := c.lane.bridge, &c.done
	switch {
	case c.req.Kind == feed.MsgAllReduce && c.req.Flags&feed.FlagCallerReduces != 0:
		// The inputs are exchanged, raw or zstd-packed, or (lossy codecs)
		// as the packings the callers made; the caller reduces them.
		err = br.AllGatherCodec(s.callCtx(c), c.out, c.buf, exchangeCodec(codec.ID(c.req.Codec), c.req.DType), p)
		d.Bytes = uint64(len(c.out))
	default:
		err = s.collective(c, p)
	}
	if !c.p2p() {
		d.Seq = br.Seq()
	}
	return err
}

// exchangeCodec is the codec of a caller-reduces all_reduce's exchange:
// the request's, with its dtype. A lossy codec's packings travel as the
// caller packed them, in frames marked with the codec (lib/collective's
// AllGatherCodec decodes nothing then).
func exchangeCodec(id codec.ID, dt reduce.DType) Codec {
	return Codec{ID: id, DType: dt}
}

// TinyCallBytes is the most a collective moves (its larger buffer) for its
// shm waiters to spin ServerOptions.TinySpin: the latency-bound calls, the
// recursive-doubling all_reduce's range and twice that; from 1 MiB up a long
// spin measurably costs 4 members' shm all_reduce (docs/BENCHMARKS.md).
const TinyCallBytes = 64 << 10

// callCtx is the context c's collective runs under: the tiny calls' spin
// when c moves at most TinyCallBytes.
func (s *Server) callCtx(c *call) context.Context {
	if max(len(c.buf), len(c.out)) <= TinyCallBytes {
		return s.tiny
	}
	return s.ctx
}

// collective runs every request but the caller-reduces all_reduce.
func (s *Server) collective(c *call, p *Progress) (err error) {
	br, d := c.lane.bridge, &c.done
	ctx := s.callCtx(c)
	// Collectives without a dtype of their own pack the request's dtype's
	// byte planes (zstd); all_reduce and reduce_scatter use theirs.
	id := codec.ID(c.req.Codec)
	switch c.req.Kind {
	case feed.MsgAllReduce:
		cd := Codec{ID: id}
		if c.res != nil {
			cd.Residual = s.fb.memory(c.res)
		}
		err = br.AllReduceCodec(ctx, c.buf, c.req.DType, c.req.Op, cd, p)
		d.Bytes = uint64(len(c.buf))
	case feed.MsgBroadcast:
		err = br.BroadcastCodec(ctx, c.buf, int(c.req.Peer), Codec{ID: id, DType: c.req.DType}, p)
		d.Bytes = uint64(len(c.buf))
	case feed.MsgAllGather:
		err = br.AllGatherCodec(ctx, c.out, c.buf, Codec{ID: id, DType: c.req.DType}, p)
		d.Bytes = uint64(len(c.out))
	case feed.MsgReduceScatter:
		err = br.ReduceScatterCodec(ctx, c.out, c.buf, c.req.DType, c.req.Op, Codec{ID: id}, p)
		d.Bytes = uint64(len(c.out))
	case feed.MsgBarrier:
		err = br.Barrier(ctx)
	case feed.MsgSend, feed.MsgRecv:
		var n int
		n, err = c.pend.Wait(s.ctx)
		d.Bytes = uint64(n)
	}
	return err
}

// failed sets DONE's status and error for a request the bridge failed, and
// breaks the bridge if the failure did: a failed collective does; a failed
// send or recv may not have (a recv that timed out, a message too long),
// and the bridge says so on the next call if it did.
func (s *Server) failed(c *call, err error) {
	d := &c.done
	d.Error = err.Error()
	switch {
	case context.Cause(s.ctx) != nil:
		d.Status, d.Error = feed.StatusAborted, "feed server stopping ("+context.Cause(s.ctx).Error()+"): "+err.Error()
	case errors.Is(err, collective.ErrInvalid):
		// Refused by the bridge before anything was sent.
		d.Status = feed.StatusBadRequest
	case errors.Is(err, collective.ErrBroken):
		d.Status = feed.StatusBroken
	default:
		d.Status = feed.StatusBridgeError
	}
	if d.Status != feed.StatusBadRequest && (!c.p2p() || errors.Is(err, collective.ErrBroken)) {
		s.breakBridge(c.lane, err)
	}
}

// finish releases the request's regions, answers it with DONE and returns
// the call to the pool.
func (s *Server) finish(c *call) {
	if c.req.Flags&feed.FlagStreamed != 0 {
		s.smu.Lock()
		delete(s.streams, c.req.ID)
		s.smu.Unlock()
	}
	s.unref(c.regs[0])
	s.unref(c.regs[1])
	s.fb.release(c.res)
	d := &c.done
	d.QueueUS = uint64(c.started.Sub(c.arrived).Microseconds())
	d.TotalUS = uint64(time.Since(c.arrived).Microseconds())
	_ = s.write(d.Append)
	s.inflight.Add(-1)
	c.mu.Lock()
	c.wake, c.readyEnd = nil, 0
	c.mu.Unlock()
	c.lane, c.buf, c.out, c.regs, c.prog, c.done.Error, c.res, c.pend = nil, nil, nil, [2]*region{}, Progress{}, "", nil, nil
	s.callPool.Put(c)
}

// canceled is the context of a posted SEND or RECV that is not to run.
var canceled = func() context.Context {
	ctx, cancel := context.WithCancel(context.Background())
	cancel()
	return ctx
}()

// abandon ends a posted SEND or RECV that is not to run (the server stops,
// the bridge broke since it was posted): a SEND leaves its tag's order
// unsent, a RECV consumes nothing that has not arrived whole.
func (c *call) abandon() {
	if c.pend != nil {
		_, _ = c.pend.Wait(canceled)
	}
}

// p2p reports whether the call is a send or recv, which run beside the
// collectives and have no sequence number.
func (c *call) p2p() bool { return c.req.Kind == feed.MsgSend || c.req.Kind == feed.MsgRecv }

// brokenText is the error of a request refused because the bridge broke
// earlier: the original cause, in the words of collective.ErrBroken.
func brokenText(cause error) string {
	if errors.Is(cause, collective.ErrBroken) {
		return cause.Error()
	}
	return collective.ErrBroken.Error() + ": " + cause.Error()
}

// breakBridge marks l broken by err; the other bridges go on.
func (s *Server) breakBridge(l *lane, err error) {
	l.bmu.Lock()
	if l.broken == nil {
		l.broken = err
		s.o.Log.Error("bridge broken", "bridge", l.id, "name", l.name, "err", err)
	}
	l.bmu.Unlock()
	// No call of l runs again: their residuals are of no use.
	s.fb.dropBridge(l.id)
}
