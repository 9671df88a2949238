package trace

import (
	"encoding/json"
	"strings"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

// withBridge gives the leaders' (ranks 0 and 2) bridged records of
// testdata/trace gbbridge's parts, as if rank 2's island were late at the
// bridge by lateNs from seq from on: leader 0 waits for it, leader 2 finds
// leader 0's frames in.
func withBridge(srcs []*Source, from, lateNs int64) {
	for _, s := range srcs {
		r := s.Rank()
		if r != 0 && r != 2 {
			continue
		}
		for i := range s.Collectives {
			c := &s.Collectives[i]
			for _, p := range c.Phases {
				if p.Name != "bridge" || p.End == nil {
					continue
				}
				start, end := p.Start+1000, *p.End-1000
				skew := int64(20_000) // the other leader's frames are in soon
				if c.Seq >= from {
					skew = lateNs
				}
				if r == 2 {
					skew = -skew
				}
				skew = min(skew, (end-start)/2)
				other := 2 - r
				b := &Bridge{Start: start, AllArrived: start + max(skew, 0), End: end,
					BytesSent: c.Bytes, BytesReceived: c.Bytes,
					Peers: []BridgePeer{{Member: 1 - r/2, Rank: &other, ArrivalSkewNs: &skew, BlockedNs: []int64{max(skew, 0), 0}}}}
				c.Bridge = b
			}
		}
	}
}

func TestBridgeParts(t *testing.T) {
	srcs := load(t, "testdata/trace")
	withBridge(srcs, 20, 5_000_000)
	m := Merge(srcs)
	bridged := 0
	for _, c := range m.Collectives {
		var leaders int
		for _, v := range c.Ranks {
			if v.Bridge != nil {
				leaders++
				assert.True(t, v.Leader)
			}
		}
		if leaders == 0 {
			assert.Nil(t, c.BridgeStart)
			continue
		}
		bridged++
		require.Equal(t, 2, leaders, "#%d", c.Seq)
		require.NotNil(t, c.BridgeStart)
		for _, v := range c.Ranks {
			if v.Bridge != nil {
				assert.GreaterOrEqual(t, *c.BridgeStart, v.Bridge.AllArrived, "#%d: the last leader's all_arrived", c.Seq)
			}
		}
		require.NotNil(t, c.BridgeWaitedFor, "#%d", c.Seq)
		assert.Equal(t, 2, *c.BridgeWaitedFor, "#%d: leader 0 waits for leader 2", c.Seq)
		assert.Positive(t, c.BridgeWaitNs)
	}
	assert.Equal(t, 39, bridged)

	flags, sum := Stragglers(m.Collectives, nil, StragglerOptions{Window: 10}, true)
	require.NotEmpty(t, flags)
	late := map[int]float64{}
	for _, f := range flags {
		require.NotNil(t, f.BridgeWaitedFor, "window %d", f.Window)
		assert.Equal(t, 2, *f.BridgeWaitedFor)
		late[f.Window] = f.BridgeWaitUs
	}
	assert.Greater(t, late[3], late[0], "the windows from seq 20 on wait longer")
	golden(t, "trace-bridge.stragglers.jsonl", append(jsonLines(t, flags), jsonLines(t, []StragglerSummary{sum})...))

	// A bridge part out of order, or with too many streams, is refused.
	line := func(b Bridge) string {
		c := srcs[0].Collectives[0]
		c.Bridge = &b
		js, err := json.Marshal(struct {
			Schema string `json:"schema"`
			Kind   string `json:"kind"`
			Collective
		}{Schema, KindCollective, c})
		require.NoError(t, err)
		return `{"schema":"gpubridge.trace/v1","kind":"rank","rank":0,"clock":{"offset_ns":0,"error_ns":0,"ref":0,"method":"same boot"}}` + "\n" + string(js) + "\n"
	}
	_, err := NewReader(Limits{}).DecodeLines(strings.NewReader(line(Bridge{Start: 5, AllArrived: 4, End: 6})), "x")
	assert.ErrorContains(t, err, "not in order")
	_, err = NewReader(Limits{}).DecodeLines(strings.NewReader(line(Bridge{Peers: []BridgePeer{{BlockedNs: make([]int64, 65)}}})), "x")
	assert.ErrorIs(t, err, ErrLimit)
	_, err = NewReader(Limits{}).DecodeLines(strings.NewReader(line(Bridge{Start: 1, AllArrived: 2, End: 3})), "x")
	assert.NoError(t, err)
}
