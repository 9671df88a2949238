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
	"fmt"
	"log/slog"
	"strings"
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
