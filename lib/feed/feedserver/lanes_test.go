package feedserver

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"math/rand/v2"
	"sync"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/gpubridge/gpubridge/lib/collective"
	"github.com/gpubridge/gpubridge/lib/feed"
	"github.com/gpubridge/gpubridge/lib/feed/feedtest"
	"github.com/gpubridge/gpubridge/lib/reduce"
	"github.com/gpubridge/gpubridge/lib/testenv"
	"github.com/gpubridge/gpubridge/lib/transport"
)

// memJoiner joins named bridges over in-memory meshes: the first JOIN of
// a name makes the group's meshes, each member takes its own. Names
// starting with "fail/" fail their set-up; fakes[name] are fake bridges
// used instead of Comms (failure injection).
type memJoiner struct {
	mu     sync.Mutex
	groups map[string][]transport.Mesh
	comms  map[string][]*collective.Comm
	fakes  map[string][]*fakeMember
}

func newMemJoiner() *memJoiner {
	return &memJoiner{groups: map[string][]transport.Mesh{}, comms: map[string][]*collective.Comm{}, fakes: map[string][]*fakeMember{}}
}

func (j *memJoiner) Join(ctx context.Context, r JoinRequest) (*Joined, error) {
	if len(r.Name) > 5 && r.Name[:5] == "fail/" {
		return nil, fmt.Errorf("rank %d (member %d of %q): set up the tcp bridge: member 1 refused", r.Ranks[r.Member], r.Member, r.Name)
	}
	j.mu.Lock()
	defer j.mu.Unlock()
	if f := j.fakes[r.Name]; f != nil {
		return &Joined{Bridge: f[r.Member], Transport: "fake", Close: func(error) {}}, nil
	}
	if j.groups[r.Name] == nil {
		j.groups[r.Name] = transport.NewMem(len(r.Ranks), 2, false)
		j.comms[r.Name] = make([]*collective.Comm, len(r.Ranks))
	}
	c := collective.New(j.groups[r.Name][r.Member], collective.Options{ChunkBytes: 4096, Workers: 2, Timeout: testenv.Scale(20 * time.Second)})
	j.comms[r.Name][r.Member] = c
	return &Joined{Bridge: c, Transport: "mem", Close: func(cause error) {
		if cause != nil {
			c.Mesh().Abort(cause)
		}
		_ = c.Close()
	}}, nil
}

// joinFeeds starts n feed servers, ranks 0..n-1 of a job of n, with bridge
// 0 over Comms of all of them (nil: --no-bridge) and the joiner.
func joinFeeds(t *testing.T, n int, bridge0 bool, j Joiner) *feedEnv {
	t.Helper()
	bs := make([]Bridge, n)
	if bridge0 {
		bs = commBridges(t, n, 4096)
	}
	return startFeeds(t, bs, func(o *ServerOptions) {
		o.WorldSize, o.Joiner = n, j
		o.Rank = o.Member
	})
}

// joinAll has every member rank of ranks join bridge id, name.
func joinAll(t *testing.T, e *feedEnv, id uint32, name string, ranks []uint32) {
	t.Helper()
	parallel(t, len(ranks), func(i int) error {
		return e.clients[ranks[i]].Join(context.Background(), id, name, ranks)
	})
}

// allReduceOn runs a float32 sum of n bytes on bridge id at offset off of
// every member's region and checks it bit for bit.
func allReduceOn(t *testing.T, e *feedEnv, regs []*feedtest.Region, id uint32, ranks []uint32, off, n int, seed uint64) {
	t.Helper()
	r := rand.New(rand.NewPCG(seed, uint64(id)))
	inputs := make([][]byte, len(ranks))
	for i, rank := range ranks {
		randomF32(r, regs[rank].Mem[off:off+n])
		inputs[i] = bytes.Clone(regs[rank].Mem[off : off+n])
	}
	want := collective.ReferenceAllReduce(reduce.Sum, reduce.Float32, inputs, len(ranks))
	parallel(t, len(ranks), func(i int) error {
		_, err := e.clients[ranks[i]].On(id).AllReduce(context.Background(), regs[ranks[i]].Span(off, n), reduce.Float32, reduce.Sum)
		return err
	})
	for _, rank := range ranks {
		assert.True(t, bytes.Equal(want, regs[rank].Mem[off:off+n]), "bridge %d, rank %d", id, rank)
	}
}

// Bridges of 2, 3 and 4 members joined next to bridge 0, each all_reduce
// bit for bit the reference, all of them at once with bridge 0's; every
// bridge counts its own sequence; SEND/RECV on the pair both ways at once.
func TestJoinedBridges(t *testing.T) {
	e := joinFeeds(t, 4, true, newMemJoiner())
	ctx := context.Background()
	regs := mapRegions(t, e.clients, 1<<20)
	bridges := []struct {
		id    uint32
		name  string
		ranks []uint32
	}{
		{1, "pair/0-3", []uint32{0, 3}},
		{2, "trio", []uint32{2, 0, 1}},
		{7, "shard/all", []uint32{3, 2, 1, 0}},
	}
	for _, b := range bridges {
		joinAll(t, e, b.id, b.name, b.ranks)
	}
	// One at a time, then all four bridges at once (disjoint ranges).
	for k, b := range bridges {
		allReduceOn(t, e, regs, b.id, b.ranks, 0, 4*1001, uint64(k))
	}
	var wg sync.WaitGroup
	for k, b := range bridges {
		wg.Go(func() { allReduceOn(t, e, regs, b.id, b.ranks, (k+1)*200000, 4*30011, 10+uint64(k)) })
	}
	wg.Go(func() { allReduceOn(t, e, regs, 0, []uint32{0, 1, 2, 3}, 900000, 4*1000, 99) })
	wg.Wait()

	// Sequence numbers are per bridge: two all_reduces on each joined one,
	// the barrier is the third.
	for _, b := range bridges {
		parallel(t, len(b.ranks), func(i int) error {
			d, err := e.clients[b.ranks[i]].On(b.id).Do(ctx, feed.Request{Kind: feed.MsgBarrier, Peer: -1})
			if err == nil && d.Seq != 3 {
				return fmt.Errorf("bridge %d rank %d: seq %d, want 3", b.id, b.ranks[i], d.Seq)
			}
			return err
		})
	}

	// SEND/RECV on the pair, both directions at once: member 0 is rank 0.
	copy(regs[0].Mem[500000:], "from rank 0")
	copy(regs[3].Mem[500000:], "from rank 3")
	parallel(t, 4, func(i int) error {
		switch i {
		case 0:
			return e.clients[0].On(1).Send(ctx, 1, 9, regs[0].Span(500000, 11))
		case 1:
			return e.clients[3].On(1).Send(ctx, 0, 9, regs[3].Span(500000, 11))
		case 2:
			n, err := e.clients[0].On(1).Recv(ctx, 1, 9, regs[0].Span(600000, 64))
			if err == nil && string(regs[0].Mem[600000:600000+n]) != "from rank 3" {
				return fmt.Errorf("rank 0 received %q", regs[0].Mem[600000:600000+n])
			}
			return err
		default:
			n, err := e.clients[3].On(1).Recv(ctx, 0, 9, regs[3].Span(600000, 64))
			if err == nil && string(regs[3].Mem[600000:600000+n]) != "from rank 0" {
				return fmt.Errorf("rank 3 received %q", regs[3].Mem[600000:600000+n])
			}
			return err
		}
	})
	// The regions were offered to every bridge's peers (the in-memory
	// mesh shares memory), mapped before the JOINs.
	for _, s := range e.servers {
		s.rmu.Lock()
		for _, r := range s.regions {
			assert.GreaterOrEqual(t, len(r.offers), 2, "bridge 0 and at least one joined bridge")
		}
		s.rmu.Unlock()
	}
	e.closeAll()
}

// refusal asserts that err is a DONE with status st whose error contains
// want.
func refusal(t *testing.T, err error, st feed.Status, want string) {
	t.Helper()
	var re *feedtest.RequestError
	require.ErrorAs(t, err, &re)
	assert.Equal(t, st, re.Status, re.Msg)
	assert.Contains(t, re.Msg, want)
}

// Bad JOINs and requests on bridges that are not there are refused with
// status 1, and the feed goes on.
func TestBadJoins(t *testing.T) {
	e := joinFeeds(t, 2, true, newMemJoiner())
	ctx := context.Background()
	c := e.clients[0]
	joinAll(t, e, 5, "pair/0-1", []uint32{0, 1})
	raw := func(m *feed.JoinMsg) error {
		k, err := c.StartMsg(feed.MsgJoin, nil, func(b []byte, id uint64) []byte {
			m.ID = id
			return m.Append(b)
		})
		require.NoError(t, err)
		_, err = k.Wait(ctx)
		return err
	}
	cases := []struct {
		name string
		err  error
		want string
	}{
		{"not among the members", c.Join(ctx, 6, "x", []uint32{1, 3}), "this rank (0) is not among the members [1 3]"},
		{"not a rank of the job", c.Join(ctx, 6, "x", []uint32{0, 2}), "rank 2 is not a rank of the job (0..1)"},
		{"id in use", c.Join(ctx, 5, "y", []uint32{0, 1}), `bridge id 5 is in use (bridge 5 ("pair/0-1"))`},
		{"name joined already", c.Join(ctx, 6, "pair/0-1", []uint32{0, 1}), `bridge "pair/0-1" was joined on this feed already (bridge 5)`},
		{"id 0", raw(&feed.JoinMsg{Bridge: 0, Name: "x", Members: []uint32{0, 1}}), "bridge id 0 is outside 1 .. 2147483648"},
		{"bad name", raw(&feed.JoinMsg{Bridge: 6, Name: "a b", Members: []uint32{0, 1}}), `bridge name "a b" has " " at byte 1`},
		{"duplicate member", raw(&feed.JoinMsg{Bridge: 6, Name: "x", Members: []uint32{0, 0}}), "rank 0 is member 0 and member 1"},
		{"unknown bridge", c.On(9).Barrier(ctx), "bridge 9 was not joined on this feed"},
		{"peer of the joined bridge", c.On(5).Send(ctx, 2, 0, feed.Span{}), "peer 2 is not a member (0..1)"},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) { refusal(t, tc.err, feed.StatusBadRequest, tc.want) })
	}
	// A version 3 session knows neither.
	old := startFeedsVersion(t, commBridges(t, 1, 4096), func(o *ServerOptions) { o.Joiner = newMemJoiner() }, 3)
	err := old.clients[0].Join(ctx, 1, "x", []uint32{0, 1})
	refusal(t, err, feed.StatusBadRequest, "join is feed protocol 4; this feed speaks version 3")
	err = old.clients[0].On(1).Barrier(ctx)
	refusal(t, err, feed.StatusBadRequest, "extension bridge (0x8003) is feed protocol 4; this feed speaks version 3")
	// A server without a joiner refuses JOIN.
	none := startFeeds(t, commBridges(t, 1, 4096), nil)
	refusal(t, none.clients[0].Join(ctx, 1, "x", []uint32{0, 1}), feed.StatusBadRequest, "this feed server joins no bridges")
	// The bridges still work.
	regs := mapRegions(t, e.clients, 4096)
	allReduceOn(t, e, regs, 5, []uint32{0, 1}, 0, 64, 1)
	allReduceOn(t, e, regs, 0, []uint32{0, 1}, 0, 64, 2)
	e.closeAll()
	old.closeAll()
	none.closeAll()
}

// Without bridge 0 a request must name a joined bridge; a JOIN whose
// set-up fails is answered with status 2 naming it, and its id is then
// refused.
func TestNoBridgeAndFailedJoin(t *testing.T) {
	e := joinFeeds(t, 2, false, newMemJoiner())
	ctx := context.Background()
	w := e.clients[0].Welcome()
	assert.Equal(t, uint32(0), w.Members)
	assert.Contains(t, w.Transport, "no bridge 0")
	refusal(t, e.clients[0].Barrier(ctx), feed.StatusBadRequest, "this gbbridge serve has no bridge 0 (it was started with --no-bridge)")
	refusal(t, e.clients[0].On(0).Barrier(ctx), feed.StatusBadRequest, "no bridge 0")

	err := e.clients[0].Join(ctx, 3, "fail/x", []uint32{0, 1})
	refusal(t, err, feed.StatusBridgeError, `join `)
	assert.Contains(t, err.Error(), `bridge 3 ("fail/x"): rank 0 (member 0 of "fail/x"): set up the tcp bridge: member 1 refused`)
	refusal(t, e.clients[0].On(3).Barrier(ctx), feed.StatusBadRequest, `bridge 3 ("fail/x") could not be joined: rank 0`)

	joinAll(t, e, 4, "pair/0-1", []uint32{0, 1})
	regs := mapRegions(t, e.clients, 4096)
	allReduceOn(t, e, regs, 4, []uint32{0, 1}, 0, 4096, 3)
	assert.Nil(t, e.servers[0].Broken())
	e.closeAll()
}

// A joined bridge whose collective fails is broken: its later requests
// fail with status 3; bridge 0 and the other joined bridges go on, and
// Broken names the bridge.
func TestJoinedBridgeBreaks(t *testing.T) {
	j := newMemJoiner()
	fake := newFakeGroup(2, 8)
	fake[0].g.failSeq, fake[0].g.failMember, fake[0].g.failErr = 1, 1, errors.New("member 1 (rank 1 on h): connection reset")
	j.fakes["bad"] = fake
	e := joinFeeds(t, 2, true, j)
	ctx := context.Background()
	joinAll(t, e, 1, "bad", []uint32{0, 1})
	joinAll(t, e, 2, "good", []uint32{1, 0})
	regs := mapRegions(t, e.clients, 4096)
	// The fake fails member 1's call at once (member 0 never joins it).
	_, err := e.clients[1].On(1).AllReduce(ctx, regs[1].Span(0, 16), reduce.Float32, reduce.Sum)
	refusal(t, err, feed.StatusBridgeError, "connection reset")
	refusal(t, e.clients[1].On(1).Barrier(ctx), feed.StatusBroken, "bridge broken by an earlier failure")
	allReduceOn(t, e, regs, 0, []uint32{0, 1}, 64, 256, 4)
	allReduceOn(t, e, regs, 2, []uint32{1, 0}, 512, 256, 5)
	assert.ErrorContains(t, e.servers[1].Broken(), `bridge 1 ("bad"): `)
	assert.Nil(t, e.servers[1].lane0.brokenErr())
	e.closeAll()
}

// A member of a joined bridge that goes away (its mesh aborted, as when
// its process dies): the others' requests on that bridge fail naming the
// cause within the collective timeout; bridge 0 goes on.
func TestJoinedBridgeMemberGone(t *testing.T) {
	j := newMemJoiner()
	e := joinFeeds(t, 3, true, j)
	ctx := context.Background()
	joinAll(t, e, 1, "trio", []uint32{0, 1, 2})
	regs := mapRegions(t, e.clients, 4096)
	j.mu.Lock()
	j.comms["trio"][2].Mesh().Abort(errors.New("gbbridge serve stopped: killed"))
	j.mu.Unlock()
	start := time.Now()
	parallel(t, 2, func(i int) error {
		_, err := e.clients[i].On(1).AllReduce(ctx, regs[i].Span(0, 64), reduce.Float32, reduce.Sum)
		var re *feedtest.RequestError
		// A bridge error, or broken at once when the mesh already knows.
		if !errors.As(err, &re) || re.Status != feed.StatusBridgeError && re.Status != feed.StatusBroken ||
			!bytes.Contains([]byte(re.Msg), []byte("member 2: failed: gbbridge serve stopped: killed")) {
			return fmt.Errorf("rank %d: want a bridge error naming the cause, got %v", i, err)
		}
		return nil
	})
	assert.Less(t, time.Since(start), testenv.Scale(10*time.Second))
	allReduceOn(t, e, regs, 0, []uint32{0, 1, 2}, 1024, 256, 6)
	e.closeAll()
}
