package rendezvous

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"strings"
	"time"
	"unicode/utf8"
)

// maxFailureText bounds another member's failure message read from the
// store.
const maxFailureText = 4 << 10

// failTimeout starts a recorded failure that was the set-up timeout, so
// that a member that reads it instead of noticing the timeout itself (they
// all run out at about the same instant) returns an error that is
// context.DeadlineExceeded too.
const failTimeout = "timeout\x00"

// RemoteError is another member's set-up failure, read from the store.
type RemoteError struct {
	msg     string
	timeout bool // the failure was the set-up timeout
}

// newRemoteError makes a failure read from the store safe to show.
func newRemoteError(v []byte) *RemoteError {
	timeout := bytes.HasPrefix(v, []byte(failTimeout))
	v = bytes.TrimPrefix(v, []byte(failTimeout))
	return &RemoteError{msg: PeerText(v, maxFailureText), timeout: timeout}
}

func (e *RemoteError) Error() string { return e.msg }

// Unwrap makes a remote timeout errors.Is(err, context.DeadlineExceeded).
func (e *RemoteError) Unwrap() error {
	if e.timeout {
		return context.DeadlineExceeded
	}
	return nil
}

// SharedError is a failure every member computes the same from what they
// all read (a settings disagreement, a member missing at the deadline). It
// is recorded without naming who noticed it, so that every member's error
// has the same text whether it found the failure itself or read it.
type SharedError struct{ Err error }

func (e *SharedError) Error() string { return e.Err.Error() }
func (e *SharedError) Unwrap() error { return e.Err }

// watch polls the store for another member's failure and cancels ctx with
// it.
func (s *Session) watch(ctx context.Context, cancel context.CancelCauseFunc) {
	t := time.NewTicker(failPoll)
	defer t.Stop()
	for {
		select {
		case <-ctx.Done():
			return
		case <-t.C:
		}
		v, ok, err := s.cfg.Store.TryGet(ctx, s.key(keyFailed))
		if err == nil && ok {
			cancel(newRemoteError(v))
			return
		}
	}
}

// fail records err as this member's set-up failure, unless another failure
// was recorded first.
func (s *Session) fail(ctx context.Context, err error) {
	ctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), failWriteTime)
	defer cancel()
	msg := fmt.Sprintf("%s failed: %v", s.Who(s.cfg.Self), err)
	var se *SharedError
	if errors.As(err, &se) {
		msg = se.Error()
	}
	if errors.Is(err, context.DeadlineExceeded) {
		msg = failTimeout + msg
	}
	if _, e := s.cfg.Store.CompareSet(ctx, s.key(keyFailed), nil, []byte(msg)); e != nil {
		s.cfg.Log.Warn("could not record the setup failure in the store", "err", e)
	}
}

// PeerText makes text another member sent (a failure, a refusal, an abort
// message) safe to show: at most max bytes, valid UTF-8, no control
// characters.
func PeerText(b []byte, max int) string {
	if len(b) > max {
		b = b[:max]
	}
	s := string(b)
	if utf8.ValidString(s) && strings.IndexFunc(s, isControl) < 0 {
		return s
	}
	return strings.Map(func(r rune) rune {
		if isControl(r) {
			return '?'
		}
		return r
	}, strings.ToValidUTF8(s, "?"))
}

func isControl(r rune) bool { return r < 0x20 || r == 0x7f }

// Explain turns an error met while ctx may be done into the set-up's
// error: another member's failure, the set-up timeout (naming the members
// waited for, as a *SharedError every member words the same), or the
// cancellation. While ctx is live it is err, saying what was being done.
func (s *Session) Explain(ctx context.Context, err error, what string, waitingFor ...int) error {
	cause := DoneCause(ctx)
	if cause == nil {
		return fmt.Errorf("%s: %w", what, err)
	}
	var re *RemoteError
	if errors.As(cause, &re) {
		return re
	}
	if errors.Is(cause, context.DeadlineExceeded) {
		if len(waitingFor) > 0 {
			return &SharedError{fmt.Errorf("%s did not %s within %v: %w", s.whoAll(waitingFor), what, s.cfg.Timeout, context.DeadlineExceeded)}
		}
		return fmt.Errorf("%s: no progress within %v: %w", what, s.cfg.Timeout, context.DeadlineExceeded)
	}
	return fmt.Errorf("%s: %w", what, cause)
}

// DoneCause is ctx's cause once it is done, and context.DeadlineExceeded
// once its deadline has passed even if ctx does not say so yet: a store
// call or a connection whose I/O deadline is ctx's may time out an instant
// before ctx's own timer fires (on a loaded machine, much longer), and the
// error must then be the set-up timeout, not the call's i/o timeout. nil
// while ctx is live.
func DoneCause(ctx context.Context) error {
	if ctx.Err() != nil {
		return context.Cause(ctx)
	}
	if dl, ok := ctx.Deadline(); ok && !time.Now().Before(dl) {
		return context.DeadlineExceeded
	}
	return nil
}
