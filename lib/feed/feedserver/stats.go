package feedserver

import (
	"time"

	"github.com/gpubridge/gpubridge/lib/collective"
	"github.com/gpubridge/gpubridge/lib/feed"
	"golang.org/x/sys/unix"
)

// StatsBridge is a Bridge that measures its collectives; *collective.Comm
// is one. The server then appends the last collective's stats to its DONE
// (feed.ExtBridgeStats).
type StatsBridge interface {
	Bridge
	// LastStats is collective.Comm.LastStats.
	LastStats(out *collective.Stats) bool
}

var _ StatsBridge = (*collective.Comm)(nil)

// The trace clock is CLOCK_MONOTONIC (docs/TRACING.md §2); Go's times
// carry a monotonic reading on the same clock with another origin, so one
// pair read together maps them (to within the reads' gap).
var monoRef, monoBase = func() (time.Time, int64) {
	var ts unix.Timespec
	t := time.Now()
	_ = unix.ClockGettime(unix.CLOCK_MONOTONIC, &ts)
	return t, ts.Nano()
}()

func monoNS(t time.Time) uint64 { return uint64(monoBase + int64(t.Sub(monoRef))) }

// addStats appends the tag-1 value of the collective that just ran to d,
// reusing c's buffers: only for an ok DONE of a data collective, over a
// bridge that measures them.
func (s *Server) addStats(c *call, d *feed.DoneMsg) {
	sb, ok := c.lane.bridge.(StatsBridge)
	if !ok || d.Status != feed.StatusOK || c.req.Kind == feed.MsgBarrier || c.p2p() {
		return
	}
	st := &c.stats
	if !sb.LastStats(st) || st.Seq != d.Seq {
		return
	}
	b := &c.bstats
	peers := b.Peers[:0]
	*b = feed.BridgeStats{
		Streams: st.Streams, StartNS: monoNS(st.Start), AllArrivedNS: monoNS(st.AllArrived), EndNS: monoNS(st.End),
		BytesSent: st.BytesSent, BytesReceived: st.BytesReceived, CodecNS: uint64(st.Codec), ReduceNS: uint64(st.Reduce),
	}
	blocked := c.blocked[:0]
	for _, p := range st.Peers {
		lo := len(blocked)
		for _, w := range p.Blocked {
			blocked = append(blocked, uint64(w))
		}
		skew := int64(p.Arrival)
		if !p.Heard {
			skew = feed.BridgeNotHeard
		}
		peers = append(peers, feed.BridgePeer{Member: uint32(p.Member), ArrivalSkewNS: skew, BlockedNS: blocked[lo:len(blocked):len(blocked)]})
	}
	if cap(c.blocked) < cap(blocked) {
		// blocked grew: the peers' slices point into the new array.
		c.blocked = blocked
	}
	b.Peers = peers
	c.ext[0] = feed.Ext{Tag: feed.ExtBridgeStats, Value: feed.AppendBridgeStats(c.ext[0].Value[:0], b, feed.MaxBridgeStatsValue)}
	d.Ext = c.ext[:]
}
