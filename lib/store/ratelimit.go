package store

import (
	"fmt"
	"log/slog"
	"sync"
	"time"
)

// Defaults of the warning rate limit: per message, the first logBurst lines
// of a logWindow are logged, the rest counted and summed up in one line when
// the window ends.
const (
	logBurst  = 5
	logWindow = 10 * time.Second
)

// logLimiter rate-limits the server's warnings, which remote peers can
// trigger at will (1,000 clients that never send their handshake must not
// give 1,000 lines). Warnings are grouped by message; their attributes (the
// remote address, the reason) do not count.
type logLimiter struct {
	log    *slog.Logger
	burst  int
	window time.Duration

	mu     sync.Mutex
	kinds  map[string]*logKind
	closed bool
}

type logKind struct {
	start      time.Time // start of the current window
	logged     int       // lines logged in it
	suppressed int       // lines not logged, to be summed up
	timer      *time.Timer
}

func newLogLimiter(log *slog.Logger, burst int, window time.Duration) *logLimiter {
	return &logLimiter{log: log, burst: burst, window: window, kinds: make(map[string]*logKind)}
}

// warn logs msg at WARN unless more than burst lines with the same message
// were logged in the current window.
func (l *logLimiter) warn(msg string, args ...any) {
	now := time.Now()
	l.mu.Lock()
	k := l.kinds[msg]
	if k == nil {
		k = &logKind{start: now}
		l.kinds[msg] = k
	}
	if now.Sub(k.start) >= l.window && k.suppressed == 0 {
		k.start, k.logged = now, 0
	}
	if k.logged < l.burst || l.closed {
		k.logged++
		l.mu.Unlock()
		l.log.Warn(msg, args...)
		return
	}
	k.suppressed++
	if k.timer == nil {
		k.timer = time.AfterFunc(k.start.Add(l.window).Sub(now), func() { l.flush(msg) })
	}
	l.mu.Unlock()
}

// flush logs the summary of msg's window and starts a new one.
func (l *logLimiter) flush(msg string) {
	l.mu.Lock()
	k := l.kinds[msg]
	if k == nil {
		l.mu.Unlock()
		return
	}
	n := k.suppressed
	k.suppressed, k.timer = 0, nil
	// The lines summed up count against the next window too, so a steady
	// flood gives one summary per window and no burst.
	k.start, k.logged = time.Now(), l.burst
	if n == 0 {
		delete(l.kinds, msg)
	}
	l.mu.Unlock()
	if n > 0 {
		l.log.Warn(fmt.Sprintf("%s ... and %d more like this in the last %v", msg, n, l.window))
	}
}

// close stops the timers and logs the pending summaries at once; later
// warnings are logged without limit (there are few after a shutdown).
func (l *logLimiter) close() {
	l.mu.Lock()
	l.closed = true
	var pending []string
	for msg, k := range l.kinds {
		if k.timer != nil {
			k.timer.Stop()
			pending = append(pending, msg)
		}
	}
	l.mu.Unlock()
	for _, msg := range pending {
		l.flush(msg)
	}
}
