package bridge

import (
	"context"
	"errors"
	"fmt"
	"slices"
	"strconv"
	"strings"
	"time"

	"github.com/gpubridge/gpubridge/lib/discover"
	"github.com/gpubridge/gpubridge/lib/rendezvous"
	"github.com/gpubridge/gpubridge/lib/store"
	"github.com/gpubridge/gpubridge/lib/transport"
)

// NamedPrefix is the store folder (under the job's namespace) that named
// bridges meet in: bridges/<name>/ (docs/FEED.md §3b).
const NamedPrefix = "bridges"

// Keys of a named bridge's agreement on its members, under
// bridges/<name>/.
const (
	keyMembers       = "members/"       // + global rank: that rank's member list
	keyMembersFailed = "members-failed" // the first disagreement or timeout, for every member
)

// MaxMembersValue bounds a member list read from the store (1024 ranks of
// up to 10 digits and a comma).
const MaxMembersValue = 1024 * 11

// agreePoll bounds the wait between two looks at the store while members
// agree.
const agreePoll = 100 * time.Millisecond

// MembersOf is the bridge of the given global ranks, in that order, as the
// topology places them: each rank's host. An error names a rank that is
// not one of the job's.
func MembersOf(t *discover.Topology, ranks []int) ([]transport.MemberInfo, error) {
	ms := make([]transport.MemberInfo, len(ranks))
	for i, r := range ranks {
		if r < 0 || r >= len(t.Ranks) || t.Ranks[r].Rank != r {
			return nil, fmt.Errorf("rank %d is not a rank of the job (ranks 0..%d)", r, len(t.Ranks)-1)
		}
		ms[i] = transport.MemberInfo{Rank: r, Host: t.Ranks[r].Hostname}
	}
	return ms, nil
}

// NamedTransport is the transport of a named bridge of members: shm when
// every member is on one host; across hosts the job's bridge transport
// (bridge 0's, the same on every rank whether or not it runs bridge 0),
// or tcp when that is none or shm.
func NamedTransport(members []transport.MemberInfo, bridge0 transport.Kind) transport.Kind {
	k, _, err := transport.Choose(transport.Auto, members)
	if err != nil || k == transport.SHM {
		return transport.SHM
	}
	if bridge0 == "" || bridge0 == discover.BridgeNone || bridge0 == transport.SHM || bridge0 == transport.Auto {
		return transport.TCP
	}
	return bridge0
}

// agreeMembers publishes this rank's member list of the named bridge and
// waits for every member's: they must be the same list, in the same
// order. The first disagreement (or timeout) is recorded, so that every
// member returns the same error. kv is the bridge's folder.
func agreeMembers(ctx context.Context, kv *store.Client, name string, members []transport.MemberInfo, self int, timeout time.Duration) error {
	mine := membersValue(members)
	if err := kv.Set(ctx, keyMembers+strconv.Itoa(members[self].Rank), []byte(mine)); err != nil {
		return fmt.Errorf("publish the member list: %w", err)
	}
	views := make([]string, len(members))
	got := make([]bool, len(members))
	wait := 5 * time.Millisecond
	for {
		if v, ok, err := kv.TryGet(ctx, keyMembersFailed); err == nil && ok {
			return &rendezvous.SharedError{Err: errors.New(rendezvous.PeerText(v, 4<<10))}
		}
		var missing []int
		for i, m := range members {
			if got[i] {
				continue
			}
			v, ok, err := kv.TryGet(ctx, keyMembers+strconv.Itoa(m.Rank))
			if err != nil {
				return recordFailure(ctx, kv, timeoutOr(ctx, name, members, []int{i}, timeout, fmt.Errorf("read the member list of rank %d: %w", m.Rank, err)))
			}
			if !ok {
				missing = append(missing, i)
				continue
			}
			if len(v) > MaxMembersValue {
				v = v[:MaxMembersValue]
			}
			views[i], got[i] = rendezvous.PeerText(v, MaxMembersValue), true
		}
		if len(missing) == 0 {
			break
		}
		if rendezvous.DoneCause(ctx) != nil {
			return recordFailure(ctx, kv, timeoutOr(ctx, name, members, missing, timeout, nil))
		}
		select {
		case <-ctx.Done():
		case <-time.After(wait):
		}
		wait = min(2*wait, agreePoll)
	}
	if slices.ContainsFunc(views, func(v string) bool { return v != mine }) {
		return recordFailure(ctx, kv, disagreement(name, members, views))
	}
	return nil
}

// membersValue is a member list as published: "0,4,9".
func membersValue(members []transport.MemberInfo) string {
	s := make([]string, len(members))
	for i, m := range members {
		s[i] = strconv.Itoa(m.Rank)
	}
	return strings.Join(s, ",")
}

// disagreement names who joins with which member list: "members of bridge
// "x" disagree: rank 0 and rank 1 join with ranks [0,1,2], rank 2 with
// [0,2,1]".
func disagreement(name string, members []transport.MemberInfo, views []string) error {
	var order []string
	who := map[string][]string{}
	for i, v := range views {
		if _, ok := who[v]; !ok {
			order = append(order, v)
		}
		who[v] = append(who[v], "rank "+strconv.Itoa(members[i].Rank))
	}
	parts := make([]string, len(order))
	for k, v := range order {
		with := "with"
		if k == 0 && len(who[v]) == 1 {
			with = "joins with"
		} else if k == 0 {
			with = "join with"
		}
		parts[k] = fmt.Sprintf("%s %s ranks [%s]", strings.Join(who[v], " and "), with, v)
	}
	return &rendezvous.SharedError{Err: fmt.Errorf("the members of bridge %q disagree on its members: %s (every member must join with the same ranks in the same order)", name, strings.Join(parts, ", "))}
}

// timeoutOr is the agreement's error when ctx is done (the members not
// heard from by the deadline), else err.
func timeoutOr(ctx context.Context, name string, members []transport.MemberInfo, missing []int, timeout time.Duration, err error) error {
	cause := rendezvous.DoneCause(ctx)
	if cause == nil {
		return err
	}
	if !errors.Is(cause, context.DeadlineExceeded) {
		return cause
	}
	ranks := make([]string, len(missing))
	for k, i := range missing {
		ranks[k] = fmt.Sprintf("rank %d on %s", members[i].Rank, members[i].Host)
	}
	return &rendezvous.SharedError{Err: fmt.Errorf("%s did not join bridge %q within %v: %w", strings.Join(ranks, ", "), name, timeout, context.DeadlineExceeded)}
}

// recordFailure stores a shared failure for the other members, unless one
// was stored first: then that one is this member's error too.
func recordFailure(ctx context.Context, kv *store.Client, err error) error {
	var se *rendezvous.SharedError
	if !errors.As(err, &se) {
		return err
	}
	wctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), 2*time.Second)
	defer cancel()
	held, cerr := kv.CompareSet(wctx, keyMembersFailed, nil, []byte(se.Error()))
	if cerr == nil && string(held) != se.Error() {
		return &rendezvous.SharedError{Err: errors.New(rendezvous.PeerText(held, 4<<10))}
	}
	return err
}
