// Package rendezvous is how the members of a bridge meet through the job's
// c10d store before any connection exists (gloo's rendezvous, NCCL's
// bootstrap): member 0 makes a per-job secret with compare-and-set, every
// member publishes a record signed with it and gathers everyone's, and a
// barrier ends the set-up. A member that fails records its error in the
// store, so every other member fails naming the cause instead of waiting
// for its deadline. What the records hold, and what is done with them, is
// the transport's business.
package rendezvous

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"strings"
	"sync"
	"time"
)

// Store is what a rendezvous needs of the job's store; lib/store's Client
// satisfies it.
type Store interface {
	Set(ctx context.Context, key string, value []byte) error
	// TryGet returns key's value without waiting; ok is false when the
	// key does not exist.
	TryGet(ctx context.Context, key string) (value []byte, ok bool, err error)
	// CompareSet replaces key's value with desired when it equals
	// expected and returns the value now held (torch's semantics: an
	// empty expected creates a missing key).
	CompareSet(ctx context.Context, key string, expected, desired []byte) ([]byte, error)
}

// Member is one member as discovery describes it.
type Member struct {
	Rank int    // global rank
	Host string // hostname from discovery
}

// Config says who meets where.
type Config struct {
	// Store is the job's store, prefixed to the job's namespace.
	Store Store
	// Scope names the keys' folder: "bridge" puts them under "bridge/".
	Scope string
	// Self is this member's index in Members.
	Self    int
	Members []Member
	// Timeout is the set-up's time limit, named in timeout messages; the
	// deadline itself is the context's.
	Timeout time.Duration
	// Log receives what cannot be reported otherwise (default: discard).
	Log *slog.Logger
}

// Keys under Config.Scope.
const (
	keySecret = "secret"
	keyFailed = "failed"
	keyRecord = "endpoint/"
	keyReady  = "ready/"
)

const (
	failPoll      = 100 * time.Millisecond // how often a member looks for another's failure
	failWriteTime = 2 * time.Second        // bounds the write of this member's failure
)

// Session is one member's part in a rendezvous, valid while Run's connect
// runs.
type Session struct {
	cfg    Config
	secret []byte
}

// Run joins the rendezvous (member 0 makes the job's secret, the others
// wait for it) and calls connect. While connect runs, a failure another
// member records cancels connect's context with a *RemoteError. Any other
// error, of joining or of connect, is recorded for the other members
// before Run returns it.
func Run(ctx context.Context, cfg Config, connect func(ctx context.Context, s *Session) error) error {
	if cfg.Log == nil {
		cfg.Log = slog.New(slog.DiscardHandler)
	}
	s := &Session{cfg: cfg}
	err := s.run(ctx, connect)
	var re *RemoteError
	if err != nil && !errors.As(err, &re) {
		s.fail(ctx, err)
	}
	return err
}

func (s *Session) run(ctx context.Context, connect func(context.Context, *Session) error) error {
	if err := s.join(ctx); err != nil {
		return err
	}
	ctx, cancel := context.WithCancelCause(ctx)
	var wg sync.WaitGroup
	wg.Go(func() { s.watch(ctx, cancel) })
	defer wg.Wait()
	defer cancel(nil)
	return connect(ctx, s)
}

// Secret is the job's secret: 32 random bytes, the same for every member.
func (s *Session) Secret() []byte { return s.secret }

// Self is this member's index, Size the number of members.
func (s *Session) Self() int { return s.cfg.Self }
func (s *Session) Size() int { return len(s.cfg.Members) }

// Who names member i for messages: "member 1 (rank 2 on host-b)".
func (s *Session) Who(i int) string {
	m := s.cfg.Members[i]
	return fmt.Sprintf("member %d (rank %d on %s)", i, m.Rank, m.Host)
}

func (s *Session) whoAll(is []int) string {
	d := make([]string, len(is))
	for k, i := range is {
		d[k] = s.Who(i)
	}
	return strings.Join(d, ", ")
}

func (s *Session) key(k string) string { return s.cfg.Scope + "/" + k }

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
