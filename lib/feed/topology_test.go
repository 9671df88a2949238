package feed

import (
	"bytes"
	"encoding/json"
	"strings"
	"testing"

	"github.com/gpubridge/gpubridge/lib/discover"
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
		_, _ = BridgeMembership(topo)
	})
}
