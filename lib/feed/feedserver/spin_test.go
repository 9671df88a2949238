package feedserver

import (
	"context"
	"fmt"
	"testing"
	"time"

	"github.com/gpubridge/gpubridge/lib/feed"
	"github.com/gpubridge/gpubridge/lib/reduce"
	"github.com/stretchr/testify/assert"
)

// ServerOptions.TinySpin reaches the bridge in the context of every
// collective that moves at most TinyCallBytes (its larger buffer), and of
// no other; without it no call's context sets a spin.
func TestTinySpin(t *testing.T) {
	const tiny = TinyCallBytes
	cases := []struct {
		name string
		req  func(sp func(off, n int) feed.Span) feed.Request
		kind string
		tiny bool
	}{
		{"4-byte all_reduce", func(sp func(int, int) feed.Span) feed.Request {
			return feed.Request{Kind: feed.MsgAllReduce, DType: reduce.Float32, Op: reduce.Sum, Buf: sp(0, 4), Peer: -1}
		}, "all_reduce", true},
		{"all_reduce of TinyCallBytes", func(sp func(int, int) feed.Span) feed.Request {
			return feed.Request{Kind: feed.MsgAllReduce, DType: reduce.Float32, Op: reduce.Sum, Buf: sp(0, tiny), Peer: -1}
		}, "all_reduce", true},
		{"all_reduce of TinyCallBytes+4", func(sp func(int, int) feed.Span) feed.Request {
			return feed.Request{Kind: feed.MsgAllReduce, DType: reduce.Float32, Op: reduce.Sum, Buf: sp(0, tiny+4), Peer: -1}
		}, "all_reduce", false},
		{"caller-reduces all_reduce of 4 bytes", func(sp func(int, int) feed.Span) feed.Request {
			return feed.Request{Kind: feed.MsgAllReduce, Flags: feed.FlagCallerReduces, DType: reduce.Float32, Op: reduce.Sum,
				Buf: sp(0, 4), Out: sp(64, 8), Peer: -1}
		}, "all_gather", true},
		{"all_gather into TinyCallBytes", func(sp func(int, int) feed.Span) feed.Request {
			return feed.Request{Kind: feed.MsgAllGather, Buf: sp(0, tiny/2), Out: sp(tiny, tiny), Peer: -1}
		}, "all_gather", true},
		{"all_gather into more than TinyCallBytes", func(sp func(int, int) feed.Span) feed.Request {
			return feed.Request{Kind: feed.MsgAllGather, Buf: sp(0, tiny/2+4), Out: sp(tiny, tiny+8), Peer: -1}
		}, "all_gather", false},
		{"broadcast of TinyCallBytes+4", func(sp func(int, int) feed.Span) feed.Request {
			return feed.Request{Kind: feed.MsgBroadcast, Buf: sp(0, tiny+4), Peer: 1}
		}, "broadcast", false},
		{"reduce_scatter of 64 bytes", func(sp func(int, int) feed.Span) feed.Request {
			return feed.Request{Kind: feed.MsgReduceScatter, DType: reduce.Float32, Op: reduce.Sum, Buf: sp(0, 64), Out: sp(64, 32), Peer: -1}
		}, "reduce_scatter", true},
		{"barrier", func(func(int, int) feed.Span) feed.Request {
			return feed.Request{Kind: feed.MsgBarrier, Peer: -1}
		}, "barrier", true},
	}
	for _, spin := range []time.Duration{0, 300 * time.Microsecond} {
		t.Run(fmt.Sprintf("TinySpin=%v", spin), func(t *testing.T) {
			ms := newFakeGroup(2, 16<<10)
			e := startFeeds(t, bridges(ms), func(o *ServerOptions) { o.TinySpin = spin })
			regs := mapRegions(t, e.clients, 2*tiny+64)
			for _, tc := range cases {
				parallel(t, 2, func(i int) error {
					_, err := e.clients[i].Do(context.Background(), tc.req(func(off, n int) feed.Span { return regs[i].Span(off, n) }))
					return err
				})
				want := time.Duration(-1) // no spin set
				if tc.tiny && spin > 0 {
					want = spin
				}
				for i, m := range ms {
					got := m.lastCall()
					assert.Equal(t, tc.kind, got.kind, "%s, member %d", tc.name, i)
					assert.Equal(t, want, got.spin, "%s, member %d", tc.name, i)
				}
			}
			e.closeAll()
		})
	}
}
