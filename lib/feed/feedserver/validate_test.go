package feedserver

import (
	"testing"

	"github.com/stretchr/testify/assert"

	"github.com/gpubridge/gpubridge/lib/feed"
	"github.com/gpubridge/gpubridge/lib/reduce"
)

// validate on its own, member 1 of 3: what the server accepts (the
// in-place forms among them) and the first problem of what it refuses.
func TestValidate(t *testing.T) {
	sp := func(off, n uint64) feed.Span { return feed.Span{Region: 1, Off: off, Len: n} }
	other := feed.Span{Region: 2, Len: 12}
	cases := []struct {
		name string
		req  feed.Request
		want string // "": accepted
	}{
		{"all_reduce", feed.Request{Kind: feed.MsgAllReduce, DType: reduce.Float32, Op: reduce.Sum, Buf: sp(0, 8), Peer: -1}, ""},
		{"broadcast", feed.Request{Kind: feed.MsgBroadcast, Buf: sp(0, 8), Peer: 2}, ""},
		{"all_gather in place", feed.Request{Kind: feed.MsgAllGather, Buf: sp(4, 4), Out: sp(0, 12), Peer: -1}, ""},
		{"all_gather apart", feed.Request{Kind: feed.MsgAllGather, Buf: sp(0, 4), Out: other, Peer: -1}, ""},
		{"reduce_scatter in place", feed.Request{Kind: feed.MsgReduceScatter, DType: reduce.Uint8, Op: reduce.Max, Buf: sp(0, 12), Out: sp(4, 4), Peer: -1}, ""},
		{"send", feed.Request{Kind: feed.MsgSend, Buf: sp(0, 3), Peer: 0, Tag: 9}, ""},
		{"barrier", feed.Request{Kind: feed.MsgBarrier, Peer: -1}, ""},
		{"all_gather in the wrong slot", feed.Request{Kind: feed.MsgAllGather, Buf: sp(0, 4), Out: sp(0, 12), Peer: -1}, "input and output overlap"},
		{"reduce_scatter in the wrong segment", feed.Request{Kind: feed.MsgReduceScatter, DType: reduce.Uint8, Op: reduce.Max, Buf: sp(0, 12), Out: sp(8, 4), Peer: -1}, "input and output overlap"},
		{"output and peer on all_reduce", feed.Request{Kind: feed.MsgAllReduce, DType: reduce.Float32, Op: reduce.Sum, Buf: sp(0, 8), Out: other, Peer: 1},
			"all_reduce takes no output span\nall_reduce takes no root, peer or tag (want -1 and 0)"},
		{"broadcast with tag", feed.Request{Kind: feed.MsgBroadcast, Buf: sp(0, 8), Peer: 0, Tag: 1}, "broadcast takes no tag"},
		{"barrier with dtype", feed.Request{Kind: feed.MsgBarrier, DType: reduce.Int8, Peer: -1}, "barrier takes no dtype"},
		{"recv from itself", feed.Request{Kind: feed.MsgRecv, Buf: sp(0, 3), Peer: 1}, "peer 1 is this member"},
		{"output of half elements", feed.Request{Kind: feed.MsgAllGather, DType: reduce.Float16, Buf: sp(0, 2), Out: feed.Span{Region: 2, Len: 7}, Peer: -1},
			"all_gather: output of 7 bytes, want 3 members × 2 input bytes"},
		{"reduce_scatter of odd elements", feed.Request{Kind: feed.MsgReduceScatter, DType: reduce.Int32, Op: reduce.Sum, Buf: feed.Span{Region: 2, Len: 6}, Out: sp(0, 2), Peer: -1},
			"buffer of 6 bytes is not a whole number of int32 elements (4 bytes each)"},
	}
	s := &Server{o: ServerOptions{Member: 1, Members: 3}}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			err := s.validate(&c.req)
			if c.want == "" {
				assert.NoError(t, err)
				return
			}
			assert.ErrorContains(t, err, c.want)
		})
	}
}
