package discover

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"log/slog"
	"os"
	"strconv"
	"strings"
	"time"

	"github.com/gpubridge/gpubridge/lib/store"
)

// Failure is the verdict of a job that cannot start. Its message is the same
// on every rank.
type Failure struct {
	Namespace string   `json:"namespace"`
	Problems  []string `json:"problems"`
}

func (f *Failure) Error() string {
	var b strings.Builder
	fmt.Fprintf(&b, "discovery failed (namespace %s): %d problem", f.Namespace, len(f.Problems))
	if len(f.Problems) != 1 {
		b.WriteString("s")
	}
	for _, p := range f.Problems {
		b.WriteString("\n  - ")
		b.WriteString(p)
	}
	return b.String()
}

// Options configure one rank's exchange.
type Options struct {
	Namespace string
	Rank      int
	WorldSize int
	// Timeout bounds the whole exchange, from the call to the verdict (or
	// less, when ctx's deadline comes first); messages name it.
	Timeout time.Duration
	// Claim names the rank's process (default: this process, NewClaim of
	// os.Getpid()). It is compared and set in the store before anything
	// else; the record carries it.
	Claim *Claim
	Log   *slog.Logger
}

// KeyPrefix is where gpubridge keeps its keys in a job's store; the wire key
// of a record is "/gpubridge/<namespace>/record/<rank>".
const KeyPrefix = "gpubridge"

const gatherComplete = "complete"

// DefaultNamespace is the namespace of a job and attempt as launchers name
// them: job-<run id>/attempt-<restart count>.
func DefaultNamespace(getenv func(string) string) string {
	job := getenv("TORCHELASTIC_RUN_ID")
	if job == "" {
		job = getenv("SLURM_JOB_ID")
	}
	if job == "" {
		job = "default"
	}
	attempt := getenv("TORCHELASTIC_RESTART_COUNT")
	if attempt == "" {
		attempt = "0"
	}
	return "job-" + job + "/attempt-" + attempt
}

// Exchange writes rec into the store, gathers every rank's record and
// decides. It returns the topology, or a *Failure whose message is the same
// on every rank; any other error means the store itself failed this rank.
//
// First of all the rank claims its rank (see Claim). A rank already claimed
// by another process (a second job on the same store and namespace) fails
// this rank with a *Failure naming that process; if the exchange has not
// decided yet, that becomes its outcome, so no rank of either job starts
// with a stranger among its peers. A record whose writer does not hold its
// rank's claim fails the exchange the same way.
//
// The exchange ends in one agreed outcome even when a rank reports late: the
// first rank to finish gathering, or to give up waiting, compare-and-sets the
// key "gather" to "complete" or to its timeout message, and every rank adopts
// what is stored there. Rank 0, whose process may host the store, waits on
// failure for the other ranks' read marks, within the same deadline, so that
// nobody is left with a connection error instead of the reason.
func Exchange(ctx context.Context, c *store.Client, rec *Record, o Options) (*Topology, error) {
	if o.Timeout <= 0 {
		o.Timeout = 60 * time.Second
	}
	if o.Log == nil {
		o.Log = slog.New(slog.DiscardHandler)
	}
	ctx, cancel := context.WithTimeout(ctx, o.Timeout)
	defer cancel()
	deadline, _ := ctx.Deadline()
	// Gathering gives up a little before the deadline, leaving rank 0 time
	// to wait for the others to read the verdict.
	grace := min(o.Timeout/10, 5*time.Second)
	gatherDeadline := deadline.Add(-grace)

	kv := c.Prefix(KeyPrefix).Prefix(o.Namespace)
	if o.Claim == nil {
		o.Claim = NewClaim(os.Getpid())
	}
	if err := claim(ctx, kv, o); err != nil {
		return nil, err
	}
	rec.Claim = o.Claim
	body, err := rec.encodeFit(MaxRecordBytes)
	if err != nil {
		return nil, fmt.Errorf("encode record: %w", err)
	}
	if err := kv.Set(ctx, recordKey(o.Rank), body); err != nil {
		return nil, fmt.Errorf("write record of rank %d: %w", o.Rank, err)
	}
	if _, err := kv.Add(ctx, "reported", 1); err != nil {
		return nil, fmt.Errorf("count record of rank %d: %w", o.Rank, err)
	}
	o.Log.Debug("record written", "namespace", o.Namespace, "rank", o.Rank)

	outcome, err := gather(ctx, kv, o, gatherDeadline)
	if err != nil {
		return nil, err
	}
	var verdictErr error
	var topo *Topology
	if outcome != gatherComplete {
		verdictErr = &Failure{Namespace: o.Namespace, Problems: []string{outcome}}
	} else {
		topo, verdictErr = decideFromStore(ctx, kv, o)
	}
	if _, err := kv.Add(ctx, "read", 1); err != nil {
		o.Log.Warn("could not mark the verdict read", "err", err)
	}
	var failure *Failure
	if errors.As(verdictErr, &failure) && o.Rank == 0 {
		waitForReaders(ctx, kv, o)
	}
	return topo, verdictErr
}

func recordKey(rank int) string { return "record/" + strconv.Itoa(rank) }

// claim compare-and-sets this rank's claim. When another process holds it,
// the exchange's outcome becomes the conflict (unless it was decided
// already) and this rank fails naming the holder.
func claim(ctx context.Context, kv *store.Client, o Options) error {
	mine := o.Claim.encode()
	held, err := kv.CompareSet(ctx, claimKey(o.Rank), nil, mine)
	if err != nil {
		return fmt.Errorf("claim rank %d: %w", o.Rank, err)
	}
	if bytes.Equal(held, mine) {
		return nil
	}
	if other, err := decodeClaim(held); err == nil && other.Same(o.Claim) {
		return nil // this rank's process runs discovery again
	}
	msg := claimConflict(o.Namespace, o.Rank, held, o.Claim)
	o.Log.Warn("rank already claimed by another process", "namespace", o.Namespace, "rank", o.Rank, "problem", msg)
	if _, err := agree(ctx, kv, msg); err != nil {
		o.Log.Warn("could not tell the other ranks", "err", err)
	}
	return &Failure{Namespace: o.Namespace, Problems: []string{msg}}
}

// gather waits until every rank has reported or the gather deadline passes,
// then agrees with the other ranks on the outcome.
func gather(ctx context.Context, kv *store.Client, o Options, until time.Time) (string, error) {
	wait := 2 * time.Millisecond
	for {
		n, err := kv.Add(ctx, "reported", 0)
		if err != nil {
			return "", fmt.Errorf("count reported ranks: %w", err)
		}
		if n >= int64(o.WorldSize) {
			return agree(ctx, kv, gatherComplete)
		}
		// Another rank may already have given up.
		if v, ok, err := kv.TryGet(ctx, "gather"); err != nil {
			return "", fmt.Errorf("read gather outcome: %w", err)
		} else if ok {
			return string(v), nil
		}
		if time.Now().Add(wait).After(until) {
			missing, err := missingRanks(ctx, kv, o.WorldSize)
			if err != nil {
				return "", err
			}
			if len(missing) == 0 {
				return agree(ctx, kv, gatherComplete)
			}
			msg := fmt.Sprintf("rank %s never reported within %s (world size %d; every other rank did)",
				rankList(missing), o.Timeout.Round(time.Millisecond), o.WorldSize)
			if len(missing) > 1 {
				msg = "ranks" + msg[len("rank"):]
			}
			return agree(ctx, kv, msg)
		}
		select {
		case <-ctx.Done():
			return "", fmt.Errorf("gather records: %w", ctx.Err())
		case <-time.After(wait):
		}
		wait = min(wait*2, 100*time.Millisecond)
	}
}

// agree stores outcome as the exchange's outcome unless another rank stored
// one first, and returns the stored one.
func agree(ctx context.Context, kv *store.Client, outcome string) (string, error) {
	got, err := kv.CompareSet(ctx, "gather", nil, []byte(outcome))
	if err != nil {
		return "", fmt.Errorf("agree on gather outcome: %w", err)
	}
	return string(got), nil
}

func missingRanks(ctx context.Context, kv *store.Client, n int) ([]int, error) {
	var missing []int
	for r := 0; r < n; r++ {
		ok, err := kv.Check(ctx, recordKey(r))
		if err != nil {
			return nil, fmt.Errorf("check record of rank %d: %w", r, err)
		}
		if !ok {
			missing = append(missing, r)
		}
	}
	return missing, nil
}

func decideFromStore(ctx context.Context, kv *store.Client, o Options) (*Topology, error) {
	keys := make([]string, o.WorldSize)
	for r := range keys {
		keys[r] = recordKey(r)
	}
	vals, err := kv.MultiGet(ctx, keys)
	if err != nil {
		return nil, fmt.Errorf("read records: %w", err)
	}
	recs := make([]*Record, o.WorldSize)
	var problems []string
	for r, v := range vals {
		rec, err := DecodeRecord(r, v)
		if err != nil {
			problems = append(problems, err.Error())
			continue
		}
		recs[r] = rec
	}
	claims, err := readClaims(ctx, kv, recs)
	if err != nil {
		return nil, err
	}
	problems = append(problems, claimProblems(o.Namespace, recs, claims)...)
	if len(problems) > 0 {
		return nil, &Failure{Namespace: o.Namespace, Problems: problems}
	}
	sh, problems := Decide(o.Namespace, recs)
	if len(problems) > 0 {
		return nil, &Failure{Namespace: o.Namespace, Problems: problems}
	}
	return sh.ForRank(o.Rank), nil
}

// readClaims returns the stored claim of every rank whose record decoded
// (nil where there is none). A record that carries a claim was written after
// its claim was set, so those are read in one request; the others (records
// of the torch plugin's publish_failure) are checked one by one.
func readClaims(ctx context.Context, kv *store.Client, recs []*Record) ([][]byte, error) {
	claims := make([][]byte, len(recs))
	var ranks []int
	var keys []string
	for r, rec := range recs {
		switch {
		case rec == nil:
		case rec.Claim != nil:
			ranks = append(ranks, r)
			keys = append(keys, claimKey(r))
		default:
			v, ok, err := kv.TryGet(ctx, claimKey(r))
			if err != nil {
				return nil, fmt.Errorf("read claim of rank %d: %w", r, err)
			}
			if ok {
				claims[r] = v
			}
		}
	}
	if len(keys) == 0 {
		return claims, nil
	}
	// They exist unless a record was written without claiming (a forged
	// or foreign record): then look at each, rather than wait for them.
	all, err := kv.Check(ctx, keys...)
	if err != nil {
		return nil, fmt.Errorf("check claims: %w", err)
	}
	if !all {
		for _, r := range ranks {
			v, ok, err := kv.TryGet(ctx, claimKey(r))
			if err != nil {
				return nil, fmt.Errorf("read claim of rank %d: %w", r, err)
			}
			if ok {
				claims[r] = v
			}
		}
		return claims, nil
	}
	vals, err := kv.MultiGet(ctx, keys)
	if err != nil {
		return nil, fmt.Errorf("read claims: %w", err)
	}
	for i, r := range ranks {
		claims[r] = vals[i]
	}
	return claims, nil
}

// waitForReaders keeps rank 0 (and the store it may host) alive until every
// rank has read the verdict, or the deadline passes.
func waitForReaders(ctx context.Context, kv *store.Client, o Options) {
	wait := 2 * time.Millisecond
	for {
		n, err := kv.Add(ctx, "read", 0)
		if err != nil || n >= int64(o.WorldSize) {
			return
		}
		select {
		case <-ctx.Done():
			o.Log.Warn("not every rank read the verdict before the deadline", "read", n, "world_size", o.WorldSize)
			return
		case <-time.After(wait):
		}
		wait = min(wait*2, 50*time.Millisecond)
	}
}
