package bridge

import (
	"context"
	"encoding/binary"
	"errors"
	"fmt"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/gpubridge/gpubridge/lib/collective"
	"github.com/gpubridge/gpubridge/lib/discover"
	"github.com/gpubridge/gpubridge/lib/reduce"
	"github.com/gpubridge/gpubridge/lib/store/storetest"
	"github.com/gpubridge/gpubridge/lib/testenv"
	"github.com/gpubridge/gpubridge/lib/transport"
)

// namedConfig is member self's config of the named bridge of ranks (all on
// host "h").
func namedConfig(addr, name string, ranks []int, self int, kind transport.Kind, timeout time.Duration) Config {
	ms := make([]transport.MemberInfo, len(ranks))
	for i, r := range ranks {
		ms[i] = transport.MemberInfo{Rank: r, Host: "h"}
	}
	return Config{Store: addr, Namespace: "named-test", Bridge: name, Name: fmt.Sprintf("rank %d", ranks[self]),
		Mesh: transport.Config{Self: self, Members: ms, Transport: kind, Streams: 1, ListenHost: "127.0.0.1",
			Timeout: timeout, RingBytes: 64 << 10, Process: "bridge test"},
		Comm: collective.Options{ChunkBytes: 4096, Timeout: testenv.Scale(30 * time.Second)}}
}

// Two named bridges of the same ranks side by side (and bridge 0's keys
// untouched): each its own mesh and sequence, on tcp and shm.
func TestJoinNamed(t *testing.T) {
	for _, kind := range []transport.Kind{transport.TCP, transport.SHM} {
		t.Run(string(kind), func(t *testing.T) {
			addr := storetest.Start(t)
			ranks := []int{4, 1, 7}
			var all [][]*Member
			for _, name := range []string{"shard/0", "shard/1"} {
				ms, errs := joinAll(t, len(ranks), func(self int) Config {
					return namedConfig(addr, name, ranks, self, kind, testenv.Scale(30*time.Second))
				})
				for i, err := range errs {
					require.NoError(t, err, "member %d", i)
				}
				all = append(all, ms)
			}
			for b, ms := range all {
				done := make(chan error, len(ms))
				bufs := make([][]byte, len(ms))
				for i, m := range ms {
					assert.Contains(t, m.Mesh.Describe(), string(kind))
					bufs[i] = binary.LittleEndian.AppendUint32(nil, uint32(10*b+i))
					go func() { done <- m.Comm.AllReduce(context.Background(), bufs[i], reduce.Int32, reduce.Sum, nil) }()
				}
				for range ms {
					require.NoError(t, <-done)
				}
				for i := range ms {
					assert.Equal(t, uint32(30*b+3), binary.LittleEndian.Uint32(bufs[i]), "bridge %d member %d", b, i)
				}
			}
			for _, ms := range all {
				for _, m := range ms {
					require.NoError(t, m.Close())
				}
			}
		})
	}
}

// Members that join one name with other member lists fail, every one with
// the same words naming who joined with what.
func TestJoinNamedMembersDisagree(t *testing.T) {
	addr := storetest.Start(t)
	views := [][]int{{0, 1, 2}, {0, 1, 2}, {0, 2, 1}}
	self := []int{0, 1, 1}
	ms, errs := joinAll(t, 3, func(i int) Config {
		return namedConfig(addr, "flat", views[i], self[i], transport.TCP, testenv.Scale(20*time.Second))
	})
	var texts []string
	for i, err := range errs {
		assert.Nil(t, ms[i])
		var je *JoinError
		require.ErrorAs(t, err, &je, "member %d", i)
		assert.Equal(t, `agree on the members of bridge "flat"`, je.Step)
		texts = append(texts, errors.Unwrap(err).Error())
	}
	assert.Equal(t, `the members of bridge "flat" disagree on its members: rank 0 and rank 1 join with ranks [0,1,2], rank 2 with ranks [0,2,1] (every member must join with the same ranks in the same order)`, texts[0])
	assert.Equal(t, texts[0], texts[1])
	assert.Equal(t, texts[0], texts[2])
}

// A member that never joins: the others fail by the set-up timeout naming
// it, and the error is a timeout.
func TestJoinNamedMemberMissing(t *testing.T) {
	addr := storetest.Start(t)
	_, err := Join(context.Background(), namedConfig(addr, "pair/0-3", []int{0, 3}, 0, transport.TCP, testenv.Scale(500*time.Millisecond)))
	require.Error(t, err)
	assert.ErrorIs(t, err, context.DeadlineExceeded)
	assert.Contains(t, err.Error(), `rank 0: agree on the members of bridge "pair/0-3": rank 3 on h did not join bridge "pair/0-3" within`)
}

func TestNamedTransportAndMembers(t *testing.T) {
	one := []transport.MemberInfo{{Rank: 0, Host: "a"}, {Rank: 1, Host: "a"}}
	two := []transport.MemberInfo{{Rank: 0, Host: "a"}, {Rank: 2, Host: "b"}}
	cases := []struct {
		members []transport.MemberInfo
		bridge0 transport.Kind
		want    transport.Kind
	}{
		{one, transport.TCP, transport.SHM},
		{one, discover.BridgeNone, transport.SHM},
		{two, transport.Verbs, transport.Verbs},
		{two, transport.TCP, transport.TCP},
		{two, transport.SHM, transport.TCP},
		{two, discover.BridgeNone, transport.TCP},
	}
	for _, c := range cases {
		assert.Equal(t, c.want, NamedTransport(c.members, c.bridge0), "%v over %s", c.members, c.bridge0)
	}
	topo := &discover.Topology{Shared: discover.Shared{Ranks: []discover.RankInfo{{Rank: 0, Hostname: "a"}, {Rank: 1, Hostname: "b"}}}}
	ms, err := MembersOf(topo, []int{1, 0})
	require.NoError(t, err)
	assert.Equal(t, []transport.MemberInfo{{Rank: 1, Host: "b"}, {Rank: 0, Host: "a"}}, ms)
	_, err = MembersOf(topo, []int{0, 2})
	assert.EqualError(t, err, "rank 2 is not a rank of the job (ranks 0..1)")
}
