package transport

import (
	"context"
	"log/slog"
	"net"
	"sync"
	"time"
)

// Admission of connections to a bridge listener. Anyone who can reach the
// port can connect, and until a connection has proved the job's secret it
// may be a stranger. Strangers must not be able to keep the members'
// own connections out, so:
//
//   - a connection must deliver its whole hello within helloTimeout of
//     being accepted (a member sends it at once), and the rest of the
//     handshake within hsTimeout;
//   - at most maxPendingHS handshakes beyond the connections the members
//     still owe this listener are in progress; a new connection is always
//     admitted while an unauthenticated one can make room for it: the one
//     that got least far (no hello with this job's tag yet, then no proof)
//     is closed, the oldest first;
//   - a dialer whose connection is closed before the listener answered its
//     hello dials again, with backoff, until the setup deadline.

// Stages of a pending handshake, in the order they are reached.
const (
	stageHello  = iota // waiting for the hello
	stageTagged        // the hello carries this job's tag: waiting for the proof
	stageAuthed        // the client proved the secret
)

// pendingConn is one accepted connection in its handshake.
type pendingConn struct {
	conn  *net.TCPConn
	since time.Time

	mu      sync.Mutex
	stage   int
	frozen  bool // stopped, or finished: the deadline no longer changes
	evicted bool
	ctxDL   time.Time // the setup deadline; zero: none
}

// extend sets the connection's deadline to d from now, bounded by the
// setup deadline, unless it was stopped.
func (pc *pendingConn) extend(d time.Duration) {
	pc.mu.Lock()
	defer pc.mu.Unlock()
	if pc.frozen {
		return
	}
	dl := time.Now().Add(d)
	if !pc.ctxDL.IsZero() && pc.ctxDL.Before(dl) {
		dl = pc.ctxDL
	}
	_ = pc.conn.SetDeadline(dl)
}

// stop makes the handshake's I/O fail at once, unless it finished.
func (pc *pendingConn) stop(evict bool) {
	pc.mu.Lock()
	defer pc.mu.Unlock()
	if pc.frozen {
		return
	}
	pc.frozen, pc.evicted = true, evict
	_ = pc.conn.SetDeadline(pastDeadline)
}

// finish clears the deadline of a connection whose handshake succeeded.
// It is false when the handshake was stopped meanwhile.
func (pc *pendingConn) finish() bool {
	pc.mu.Lock()
	defer pc.mu.Unlock()
	if pc.frozen {
		return false
	}
	pc.frozen = true
	return pc.conn.SetDeadline(time.Time{}) == nil
}

func (pc *pendingConn) setStage(s int) {
	pc.mu.Lock()
	defer pc.mu.Unlock()
	pc.stage = s
}

func (pc *pendingConn) state() (stage int, evicted bool) {
	pc.mu.Lock()
	defer pc.mu.Unlock()
	return pc.stage, pc.evicted
}

// pendingSet bounds the handshakes in progress on one listener.
type pendingSet struct {
	mu    sync.Mutex
	limit int
	conns map[*pendingConn]struct{}
}

func newPendingSet(limit int) *pendingSet {
	return &pendingSet{limit: limit, conns: make(map[*pendingConn]struct{})}
}

// admit adds pc. When the set is full it evicts the unauthenticated
// connection that got least far, the oldest first, and returns it (its
// handshake fails at once). ok is false only when every slot holds an
// authenticated connection: then pc is not admitted.
func (ps *pendingSet) admit(pc *pendingConn) (victim *pendingConn, ok bool) {
	ps.mu.Lock()
	defer ps.mu.Unlock()
	if len(ps.conns) >= ps.limit {
		for c := range ps.conns {
			cs, _ := c.state()
			if cs == stageAuthed {
				continue
			}
			if victim == nil {
				victim = c
				continue
			}
			vs, _ := victim.state()
			if cs < vs || cs == vs && c.since.Before(victim.since) {
				victim = c
			}
		}
		if victim == nil {
			return nil, false
		}
		delete(ps.conns, victim)
		victim.stop(true)
	}
	ps.conns[pc] = struct{}{}
	return victim, true
}

func (ps *pendingSet) remove(pc *pendingConn) {
	ps.mu.Lock()
	defer ps.mu.Unlock()
	delete(ps.conns, pc)
}

// logLimiter lets through the first logBurst lines of each kind at once,
// then one per logEvery, and counts what it held back, so that a stranger
// who opens thousands of connections cannot flood the log.
type logLimiter struct {
	mu    sync.Mutex
	now   func() time.Time
	kinds map[string]*logBucket
}

type logBucket struct {
	tokens     float64
	last       time.Time
	suppressed int
}

const (
	logBurst = 5
	logEvery = 10 * time.Second
)

func newLogLimiter() *logLimiter {
	return &logLimiter{now: time.Now, kinds: make(map[string]*logBucket)}
}

// allow reports whether a line of this kind may be logged now, and how
// many were held back since the last one that was.
func (l *logLimiter) allow(kind string) (ok bool, suppressed int) {
	l.mu.Lock()
	defer l.mu.Unlock()
	now := l.now()
	b := l.kinds[kind]
	if b == nil {
		b = &logBucket{tokens: logBurst, last: now}
		l.kinds[kind] = b
	}
	b.tokens = min(logBurst, b.tokens+float64(now.Sub(b.last))/float64(logEvery))
	b.last = now
	if b.tokens < 1 {
		b.suppressed++
		return false, 0
	}
	b.tokens--
	n := b.suppressed
	b.suppressed = 0
	return true, n
}

// log writes msg at level through the limiter, under kind.
func (l *logLimiter) log(log *slog.Logger, level slog.Level, kind, msg string, args ...any) {
	ok, n := l.allow(kind)
	if !ok {
		return
	}
	if n > 0 {
		args = append(args, "suppressed", n)
	}
	log.Log(context.Background(), level, msg, args...)
}
