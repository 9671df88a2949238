package transport

import (
	"context"
	"sync"
	"time"
)

// pastDeadline is a deadline in the past: I/O fails at once.
var pastDeadline = time.Unix(1, 0)

// guard maps a context onto one direction of a connection's deadlines: the
// context's deadline becomes the I/O deadline and its cancellation sets a
// deadline in the past, which unblocks the I/O in flight. The cancellation
// hook is registered once per distinct context and kept while the same
// context is used again, so a collective that sends many frames under one
// context allocates nothing per frame.
type guard struct {
	set func(time.Time) error

	mu    sync.Mutex
	ctx   context.Context
	stop  func() bool
	cur   time.Time // the deadline on the connection
	limit time.Time // an upper bound set by Abort; zero: none
	fired bool      // ctx was cancelled: the deadline is in the past
}

// arm prepares an I/O under ctx. It returns ctx's error when ctx is done.
func (g *guard) arm(ctx context.Context) error {
	g.mu.Lock()
	defer g.mu.Unlock()
	if g.ctx != ctx {
		g.unhook()
		g.ctx, g.fired = ctx, false
		if ctx.Done() != nil {
			g.stop = context.AfterFunc(ctx, func() { g.cancel(ctx) })
		}
	}
	if err := ctx.Err(); err != nil {
		return err
	}
	dl, _ := ctx.Deadline()
	g.apply(dl)
	return nil
}

func (g *guard) cancel(ctx context.Context) {
	g.mu.Lock()
	defer g.mu.Unlock()
	if g.ctx == ctx {
		g.fired = true
		g.setLocked(pastDeadline)
	}
}

// apply sets the earlier of dl and the limit. Callers hold mu.
func (g *guard) apply(dl time.Time) {
	if g.fired {
		return
	}
	if !g.limit.IsZero() && (dl.IsZero() || g.limit.Before(dl)) {
		dl = g.limit
	}
	g.setLocked(dl)
}

func (g *guard) setLocked(dl time.Time) {
	if !dl.Equal(g.cur) {
		g.cur = dl
		_ = g.set(dl)
	}
}

// setLimit bounds every I/O, the one in flight included, by t.
func (g *guard) setLimit(t time.Time) {
	g.mu.Lock()
	defer g.mu.Unlock()
	g.limit = t
	var dl time.Time
	if g.ctx != nil {
		dl, _ = g.ctx.Deadline()
	}
	g.apply(dl)
}

// detach leaves the context of earlier I/O behind and bounds the next
// I/O by t alone: for the frames Close and Abort write outside any call.
// The guard keeps a context's hook after its I/O returned (so that a call
// registers it once), and a call's context ends when the call does: its
// hook then puts the deadline in the past, where setLimit leaves it (it
// must not revive I/O that a cancellation stopped), so without detach
// those frames would fail at once, and the peer would read a bare end of
// the connection instead of the close or the abort. Callers hold the lock
// of the guarded direction (no I/O is in flight).
func (g *guard) detach(t time.Time) {
	g.mu.Lock()
	defer g.mu.Unlock()
	g.unhook()
	// A hook already running finds another context here and does nothing.
	g.ctx, g.fired, g.limit = nil, false, t
	g.setLocked(t)
}

// unhook drops the cancellation hook of g.ctx, if any. Callers hold mu.
func (g *guard) unhook() {
	if g.stop != nil {
		g.stop()
		g.stop = nil
	}
}

// release drops the cancellation hook.
func (g *guard) release() {
	g.mu.Lock()
	defer g.mu.Unlock()
	g.unhook()
	g.ctx = nil
}
