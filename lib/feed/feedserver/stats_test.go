package feedserver

import (
	"context"
	"testing"

	"github.com/gpubridge/gpubridge/lib/feed"
	"github.com/gpubridge/gpubridge/lib/reduce"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

// TestBridgeStatsInDone: over collective.Comms an all_reduce's DONE carries
// tag 1 with plausible values; a barrier's does not, and neither does a
// DONE from a bridge that does not measure (the fake).
func TestBridgeStatsInDone(t *testing.T) {
	const n = 1 << 16
	e := startFeeds(t, commBridges(t, 2, 4096), nil)
	ctx := context.Background()
	cs := e.clients
	regs := mapRegions(t, cs, n)
	dones := make([]feed.DoneMsg, 2)
	parallel(t, 2, func(i int) (err error) {
		dones[i], err = cs[i].Do(ctx, feed.Request{Kind: feed.MsgAllReduce, DType: reduce.Float32, Op: reduce.Sum, Buf: regs[i].Span(0, n), Peer: -1})
		return err
	})
	for i, d := range dones {
		require.Len(t, d.Ext, 1, "member %d", i)
		require.Equal(t, feed.ExtBridgeStats, d.Ext[0].Tag)
		var b feed.BridgeStats
		require.NoError(t, feed.DecodeBridgeStats(d.Ext[0].Value, &b))
		assert.LessOrEqual(t, b.StartNS, b.AllArrivedNS, "member %d", i)
		assert.LessOrEqual(t, b.AllArrivedNS, b.EndNS, "member %d", i)
		// Two members exchange their buffers (plus the direct path's
		// descriptors when the mesh offers it).
		assert.GreaterOrEqual(t, b.BytesSent, uint64(n), "member %d", i)
		assert.GreaterOrEqual(t, b.BytesReceived, uint64(n), "member %d", i)
		assert.Less(t, b.BytesReceived, uint64(n+1024), "member %d", i)
		require.Len(t, b.Peers, 1)
		assert.Equal(t, uint32(1-i), b.Peers[0].Member)
		assert.Len(t, b.Peers[0].BlockedNS, b.Streams)
		assert.Equal(t, 2, b.Streams)
		assert.NotEqual(t, int64(feed.BridgeNotHeard), b.Peers[0].ArrivalSkewNS)
	}
	parallel(t, 2, func(i int) (err error) {
		dones[i], err = cs[i].Do(ctx, feed.Request{Kind: feed.MsgBarrier, Peer: -1})
		return err
	})
	assert.Empty(t, dones[0].Ext)
	e.closeAll()

	f := startFeeds(t, bridges(newFakeGroup(2, 4096)), nil)
	regs = mapRegions(t, f.clients, n)
	parallel(t, 2, func(i int) (err error) {
		dones[i], err = f.clients[i].Do(ctx, feed.Request{Kind: feed.MsgAllReduce, DType: reduce.Float32, Op: reduce.Sum, Buf: regs[i].Span(0, n), Peer: -1})
		return err
	})
	assert.Empty(t, dones[0].Ext)
	f.closeAll()
}
