package bridge

import (
	"bytes"
	"encoding/json"
	"fmt"
	"strings"
	"testing"

	"github.com/gpubridge/gpubridge/lib/discover"
	"github.com/gpubridge/gpubridge/lib/transport"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

func topologySeeds() [][]byte {
	good, _ := json.Marshal(discover.Topology{Shared: discover.Shared{Schema: discover.TopologySchema, Namespace: "job-1/attempt-0",
		WorldSize: 2, Bridge: discover.Bridge{Members: []int{0, 1}, Transport: discover.BridgeTCP}}})
	return [][]byte{
		good,
		[]byte(`{"schema": 7}`),
		[]byte(`[]`),
		[]byte(`{"schema": "gpubridge.topology/v1",`),
		[]byte(`{"schema": "gpubridge.probe/v1"}`),
		{},
	}
}

func TestReadTopology(t *testing.T) {
	seeds := topologySeeds()
	topo, err := ReadTopology(bytes.NewReader(seeds[0]))
	require.NoError(t, err)
	assert.Equal(t, "job-1/attempt-0", topo.Namespace)
	cases := []struct {
		in   []byte
		want string
	}{
		// Issue 9: valid JSON of the wrong shape was reported as "not JSON".
		{seeds[1], "topology is JSON, but not gbdiscover's topology: "},
		{seeds[2], "topology is JSON, but not gbdiscover's topology: "},
		{seeds[3], "topology is not JSON: "},
		{seeds[4], `topology has schema "gpubridge.probe/v1", want "gpubridge.topology/v1"`},
		{seeds[5], "topology is empty"},
		{[]byte(strings.Repeat(" ", MaxTopologyBytes+1)), "topology is over 16777216 bytes"},
	}
	for _, c := range cases {
		_, err := ReadTopology(bytes.NewReader(c.in))
		assert.ErrorContains(t, err, c.want)
		var te *TopologyError
		assert.ErrorAs(t, err, &te)
	}
}

func TestFromTopology(t *testing.T) {
	topo := func(self int, kind transport.Kind, members []int, hosts []string) *discover.Topology {
		ranks := make([]discover.RankInfo, 4)
		for i := range ranks {
			ranks[i].Hostname = fmt.Sprintf("node%d", i)
		}
		return &discover.Topology{Shared: discover.Shared{Schema: discover.TopologySchema, WorldSize: 4,
			Bridge: discover.Bridge{Members: members, Hosts: hosts, Transport: kind}, Ranks: ranks},
			Self: discover.RankInfo{Rank: self}}
	}
	cases := []struct {
		name string
		topo *discover.Topology
		want Membership
		err  string
	}{
		{"leader", topo(2, discover.BridgeTCP, []int{0, 2}, []string{"a", "b"}),
			Membership{Member: 1, Transport: "tcp", Members: []transport.MemberInfo{{Rank: 0, Host: "a"}, {Rank: 2, Host: "b"}}}, ""},
		{"hosts from the ranks", topo(0, discover.BridgeSHM, []int{0, 3}, nil),
			Membership{Member: 0, Transport: "shm", Members: []transport.MemberInfo{{Rank: 0, Host: "node0"}, {Rank: 3, Host: "node3"}}}, ""},
		{"not a leader", topo(1, discover.BridgeTCP, []int{0, 2}, nil), Membership{},
			"rank 1 is not a bridge member (the island leaders are ranks [0 2]): only leaders run gbbridge serve"},
		{"no bridge", topo(0, discover.BridgeNone, []int{0}, nil), Membership{},
			`the job has no bridge (transport "none", 1 member(s)): a single island needs no gbbridge`},
		{"unknown transport", topo(0, "infiniband", []int{0, 2}, nil), Membership{},
			`bridge transport "infiniband" is not supported by this gbbridge (tcp, shm, verbs)`},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			got, err := FromTopology(c.topo)
			if c.err != "" {
				var me *MembershipError
				require.ErrorAs(t, err, &me)
				assert.Equal(t, c.err, err.Error())
				assert.Equal(t, c.topo.Self.Rank, me.Rank)
				return
			}
			require.NoError(t, err)
			assert.Equal(t, c.want, got)
		})
	}
}

// FuzzReadTopology: whatever serve reads as its topology, ReadTopology
// returns a topology of the right schema or an error, and never panics.
func FuzzReadTopology(f *testing.F) {
	for _, s := range topologySeeds() {
		f.Add(s)
	}
	f.Fuzz(func(t *testing.T, b []byte) {
		topo, err := ReadTopology(bytes.NewReader(b))
		if err != nil {
			return
		}
		if topo.Schema != discover.TopologySchema {
			t.Fatalf("accepted schema %q", topo.Schema)
		}
		_, _ = FromTopology(topo)
	})
}
