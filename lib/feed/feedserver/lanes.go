package feedserver

import (
	"context"
	"errors"
	"fmt"
	"slices"
	"sync"
	"time"

	"github.com/gpubridge/gpubridge/lib/collective"
	"github.com/gpubridge/gpubridge/lib/feed"
	"github.com/gpubridge/gpubridge/lib/transport"
)

// lane is one bridge the feed drives (docs/FEED.md §3b): bridge 0, the
// leaders' bridge serve joined at start, or one joined by JOIN. Each has
// its own executor: its collectives run one at a time in request order,
// those of different lanes at the same time.
type lane struct {
	id        uint32
	name      string // "" for bridge 0
	bridge    Bridge
	member    int
	members   int
	transport string
	share     transport.Sharer    // nil: regions are not offered to its peers
	register  transport.Registrar // nil: regions are not registered with its device
	close     func(cause error)   // a joined bridge's end; nil for bridge 0 (its owner ends it)

	// Guarded by Server.emu: collectives accepted and not yet started, in
	// order, and whether a goroutine is draining them.
	pending   []*call
	executing bool

	bmu    sync.Mutex
	broken error
}

// newLane is the lane of bridge b, whose mesh (a *collective.Comm's)
// gives the sharer and registrar unless share and register are set.
func newLane(id uint32, name string, b Bridge, member, members int, desc string, share transport.Sharer, register transport.Registrar, noShare bool) *lane {
	if c, ok := b.(*collective.Comm); ok {
		if share == nil {
			share, _ = c.Mesh().(transport.Sharer)
		}
		if register == nil {
			register, _ = c.Mesh().(transport.Registrar)
		}
	}
	if noShare {
		share = nil
	}
	return &lane{id: id, name: name, bridge: b, member: member, members: members, transport: desc, share: share, register: register}
}

// who names the lane in messages: "bridge 0", `bridge 3 ("pair/0-5")`.
func (l *lane) who() string {
	if l.name == "" {
		return fmt.Sprintf("bridge %d", l.id)
	}
	return fmt.Sprintf("bridge %d (%q)", l.id, l.name)
}

func (l *lane) brokenErr() error {
	l.bmu.Lock()
	defer l.bmu.Unlock()
	return l.broken
}

// Joiner sets up the bridges a client asks for with JOIN (gbbridge serve:
// lib/bridge's named bridges). Join must return within its set-up timeout
// and when ctx ends; its error names the member and the step.
type Joiner interface {
	Join(ctx context.Context, j JoinRequest) (*Joined, error)
}

// JoinRequest is a JOIN the server accepted: the bridge's id on this feed,
// its name, its members' global ranks in member order, and this rank's
// index among them.
type JoinRequest struct {
	ID     uint32
	Name   string
	Ranks  []int
	Member int
}

// Joined is a bridge a Joiner set up.
type Joined struct {
	Bridge Bridge
	// Transport describes its mesh (Mesh.Describe()), for logs.
	Transport string
	// Close ends the bridge when the feed ends (after its last request);
	// a non-nil cause says the session failed, so that the peers learn
	// why (abort first).
	Close func(cause error)
}

// laneOf is the lane a request runs on: its BRIDGE extension's, or bridge
// 0. A bridge that this feed has not joined is a bad request.
func (s *Server) laneOf(r *feed.Request) (*lane, error) {
	if v := feed.ExtVersion(feed.ExtBridge); r.HasBridge && s.version < v {
		return nil, fmt.Errorf("extension bridge (%#04x) is feed protocol %d; this feed speaks version %d", feed.ExtBridge, v, s.version)
	}
	if !r.HasBridge || r.Bridge == 0 {
		if s.lane0 == nil {
			return nil, errors.New("this gbbridge serve has no bridge 0 (it was started with --no-bridge): name a joined bridge (extension bridge, 0x8003)")
		}
		return s.lane0, nil
	}
	s.lmu.Lock()
	defer s.lmu.Unlock()
	if l := s.lanes[r.Bridge]; l != nil {
		return l, nil
	}
	if j, ok := s.joins[r.Bridge]; ok {
		if j.err != nil {
			return nil, fmt.Errorf("bridge %d (%q) could not be joined: %v", r.Bridge, j.name, j.err)
		}
		return nil, fmt.Errorf("bridge %d (%q) is still being joined: wait for its JOIN's DONE", r.Bridge, j.name)
	}
	return nil, fmt.Errorf("bridge %d was not joined on this feed", r.Bridge)
}

// joinState is a JOIN's bridge id that is not (yet) a lane: being set up,
// or failed (err).
type joinState struct {
	name string
	err  error
}

// join checks a JOIN and sets the bridge up on a goroutine of its own;
// DONE answers it.
func (s *Server) join(m *feed.JoinMsg, arrived time.Time) error {
	if err := s.checkID(m.ID); err != nil {
		return err
	}
	refuse := func(format string, args ...any) error {
		s.reply(m.ID, feed.StatusBadRequest, fmt.Sprintf("join %d: ", m.ID)+fmt.Sprintf(format, args...), arrived)
		return nil
	}
	if s.o.Joiner == nil {
		return refuse("this feed server joins no bridges")
	}
	member := slices.Index(m.Members, uint32(s.o.Rank))
	if s.o.Rank < 0 || member < 0 {
		return refuse("this rank (%d) is not among the members %v", s.o.Rank, m.Members)
	}
	ranks := make([]int, len(m.Members))
	for i, r := range m.Members {
		if s.o.WorldSize > 0 && int64(r) >= int64(s.o.WorldSize) {
			return refuse("rank %d is not a rank of the job (0..%d)", r, s.o.WorldSize-1)
		}
		ranks[i] = int(r)
	}
	if n := s.inflight.Load(); n >= int64(s.o.MaxInflight) {
		return refuse("%d requests are in flight, the limit is %d", n, s.o.MaxInflight)
	}
	s.lmu.Lock()
	if l := s.lanes[m.Bridge]; l != nil {
		s.lmu.Unlock()
		return refuse("bridge id %d is in use (%s)", m.Bridge, l.who())
	}
	if j, ok := s.joins[m.Bridge]; ok {
		s.lmu.Unlock()
		return refuse("bridge id %d is in use (a JOIN of %q)", m.Bridge, j.name)
	}
	for id, l := range s.lanes {
		if l.name == m.Name {
			s.lmu.Unlock()
			return refuse("bridge %q was joined on this feed already (bridge %d)", m.Name, id)
		}
	}
	for id, j := range s.joins {
		if j.name == m.Name {
			s.lmu.Unlock()
			return refuse("bridge %q was joined on this feed already (bridge %d)", m.Name, id)
		}
	}
	s.joins[m.Bridge] = &joinState{name: m.Name}
	s.lmu.Unlock()
	s.inflight.Add(1)
	s.wg.Add(1)
	go func() {
		defer s.wg.Done()
		defer s.inflight.Add(-1)
		s.setUpLane(m.ID, JoinRequest{ID: m.Bridge, Name: m.Name, Ranks: ranks, Member: member}, arrived)
	}()
	return nil
}

// setUpLane joins the bridge, makes it a lane, offers it the feed's
// regions and answers the JOIN.
func (s *Server) setUpLane(reqID uint64, j JoinRequest, arrived time.Time) {
	jb, err := s.o.Joiner.Join(s.ctx, j)
	if err == nil && context.Cause(s.ctx) != nil {
		jb.Close(context.Cause(s.ctx))
		err = context.Cause(s.ctx)
	}
	if err != nil {
		s.lmu.Lock()
		s.joins[j.ID].err = err
		s.lmu.Unlock()
		st := feed.StatusBridgeError
		if context.Cause(s.ctx) != nil {
			st = feed.StatusAborted
		}
		s.o.Log.Error("join failed", "bridge", j.ID, "name", j.Name, "err", err)
		s.reply(reqID, st, fmt.Sprintf("join %d: bridge %d (%q): %v", reqID, j.ID, j.Name, err), arrived)
		return
	}
	l := newLane(j.ID, j.Name, jb.Bridge, j.Member, len(j.Ranks), jb.Transport, nil, nil, s.o.NoShare)
	l.close = jb.Close
	s.shareMu.Lock()
	s.lmu.Lock()
	delete(s.joins, j.ID)
	s.lanes[j.ID] = l
	s.lmu.Unlock()
	s.offerRegions(l)
	s.shareMu.Unlock()
	s.o.Log.Info("bridge joined", "bridge", j.ID, "name", j.Name, "member", j.Member, "members", len(j.Ranks), "transport", jb.Transport)
	s.reply(reqID, feed.StatusOK, "", arrived)
}

// closeLanes ends the joined bridges when the feed has ended: every
// request is done.
func (s *Server) closeLanes(cause error) {
	s.lmu.Lock()
	ls := make([]*lane, 0, len(s.lanes))
	for _, l := range s.lanes {
		ls = append(ls, l)
	}
	s.lmu.Unlock()
	for _, l := range ls {
		if l.close != nil {
			l.close(cause)
		}
	}
}

// brokenLanes returns the first broken lane's error, bridge 0's first, a
// joined one's naming it; nil when none broke.
func (s *Server) brokenLanes() error {
	if s.lane0 != nil {
		if b := s.lane0.brokenErr(); b != nil {
			return b
		}
	}
	s.lmu.Lock()
	ls := make([]*lane, 0, len(s.lanes))
	for _, l := range s.lanes {
		ls = append(ls, l)
	}
	s.lmu.Unlock()
	slices.SortFunc(ls, func(a, b *lane) int { return int(int64(a.id) - int64(b.id)) })
	for _, l := range ls {
		if b := l.brokenErr(); b != nil {
			return fmt.Errorf("%s: %w", l.who(), b)
		}
	}
	return nil
}
