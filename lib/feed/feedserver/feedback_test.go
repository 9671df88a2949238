package feedserver

import (
	"context"
	"errors"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/gpubridge/gpubridge/lib/codec"
	"github.com/gpubridge/gpubridge/lib/feed"
	"github.com/gpubridge/gpubridge/lib/feed/feedtest"
	"github.com/gpubridge/gpubridge/lib/reduce"
	"github.com/gpubridge/gpubridge/lib/testenv"
)

// Version 3 requests reach the bridge with their codec: the id, the dtype
// for the collectives without one of their own (and the caller-reduces
// exchange), a residual only with a feedback key.
func TestCodecsReachTheBridge(t *testing.T) {
	ms := newFakeGroup(2, 64)
	e := startFeeds(t, bridges(ms), nil)
	ctx := context.Background()
	regs := mapRegions(t, e.clients, 4096)
	key := uint64(11)
	sp := func(i, off, n int) feed.Span { return regs[i].Span(off, n) }
	cases := []struct {
		name string
		req  func(i int) feed.Request
		kind string
		want Codec // Residual: non-nil when a residual of that length is wanted
	}{
		{"zstd all_reduce", func(i int) feed.Request {
			return feed.Request{Kind: feed.MsgAllReduce, Codec: uint8(codec.Zstd), DType: reduce.Int32, Op: reduce.Max, Buf: sp(i, 0, 64)}
		}, "all_reduce", Codec{ID: codec.Zstd}},
		{"fp8 all_reduce", func(i int) feed.Request {
			return feed.Request{Kind: feed.MsgAllReduce, Codec: uint8(codec.MXFP8), DType: reduce.Float32, Op: reduce.Avg, Buf: sp(i, 0, 64)}
		}, "all_reduce", Codec{ID: codec.MXFP8}},
		{"bf16 all_reduce with a key", func(i int) feed.Request {
			return feed.Request{Kind: feed.MsgAllReduce, Codec: uint8(codec.BF16), DType: reduce.BFloat16, Op: reduce.Sum, Buf: sp(i, 0, 64),
				FeedbackKey: key, HasFeedbackKey: true}
		}, "all_reduce", Codec{ID: codec.BF16, Residual: make([]byte, 4*32)}},
		{"fp8 caller-reduces", func(i int) feed.Request {
			return feed.Request{Kind: feed.MsgAllReduce, Flags: feed.FlagCallerReduces, Codec: uint8(codec.MXFP8), DType: reduce.BFloat16, Op: reduce.Sum,
				Buf: sp(i, 1000+19*i, 19), Out: sp(i, 1000, 38)}
		}, "all_gather", Codec{ID: codec.MXFP8, DType: reduce.BFloat16}}, // the packings, marked
		{"zstd caller-reduces", func(i int) feed.Request {
			return feed.Request{Kind: feed.MsgAllReduce, Flags: feed.FlagCallerReduces, Codec: uint8(codec.Zstd), DType: reduce.Float32, Op: reduce.Sum,
				Buf: sp(i, 100, 8), Out: sp(i, 200, 16)}
		}, "all_gather", Codec{ID: codec.Zstd, DType: reduce.Float32}},
		{"zstd broadcast of int32", func(i int) feed.Request {
			return feed.Request{Kind: feed.MsgBroadcast, Codec: uint8(codec.Zstd), DType: reduce.Int32, Buf: sp(i, 0, 64), Peer: 1}
		}, "broadcast", Codec{ID: codec.Zstd, DType: reduce.Int32}},
		{"zstd all_gather of bytes", func(i int) feed.Request {
			return feed.Request{Kind: feed.MsgAllGather, Codec: uint8(codec.Zstd), Buf: sp(i, 0, 5), Out: sp(i, 100, 10)}
		}, "all_gather", Codec{ID: codec.Zstd}},
		{"zstd reduce_scatter", func(i int) feed.Request {
			return feed.Request{Kind: feed.MsgReduceScatter, Codec: uint8(codec.Zstd), DType: reduce.Float64, Op: reduce.Min, Buf: sp(i, 0, 32), Out: sp(i, 100, 16)}
		}, "reduce_scatter", Codec{ID: codec.Zstd}},
		{"raw all_reduce", func(i int) feed.Request {
			return feed.Request{Kind: feed.MsgAllReduce, DType: reduce.Float32, Op: reduce.Sum, Buf: sp(i, 0, 64)}
		}, "all_reduce", Codec{}},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			parallel(t, 2, func(i int) error {
				r := tc.req(i)
				if r.Peer == 0 && r.Kind != feed.MsgBroadcast {
					r.Peer = -1
				}
				_, err := e.clients[i].Do(ctx, r)
				return err
			})
			for i, m := range ms {
				got := m.lastCall()
				assert.Equal(t, tc.kind, got.kind, "member %d", i)
				assert.Equal(t, tc.want.ID, got.cd.ID, "member %d", i)
				assert.Equal(t, tc.want.DType, got.cd.DType, "member %d", i)
				assert.Len(t, got.cd.Residual, len(tc.want.Residual), "member %d", i)
				assert.Equal(t, tc.want.Residual == nil, got.cd.Residual == nil, "member %d", i)
			}
		})
	}
	// The packed slots were exchanged as they are.
	for i := range regs {
		for m := range regs {
			assert.Equal(t, regs[m].Mem[1000+19*m:1000+19*(m+1)], regs[i].Mem[1000+19*m:1000+19*(m+1)], "member %d, slot %d", i, m)
		}
	}
	e.closeAll()
}

// A version 2 session refuses a codec with §3a's words, and the reference
// client does not even send one; a version 3 session takes it.
func TestCodecNegotiation(t *testing.T) {
	ctx := context.Background()
	t.Run("version 2", func(t *testing.T) {
		ms := newFakeGroup(1, 8)
		e := startFeedsVersion(t, bridges(ms), nil, 2)
		c := e.clients[0]
		require.Equal(t, uint16(2), c.Welcome().Version)
		reg, err := c.Map(ctx, 64)
		require.NoError(t, err)
		_, err = c.Do(ctx, feed.Request{Kind: feed.MsgAllReduce, Codec: uint8(codec.MXFP8), DType: reduce.Float32, Op: reduce.Sum, Buf: reg.Span(0, 64), Peer: -1})
		var re *feedtest.RequestError
		require.ErrorAs(t, err, &re)
		assert.Equal(t, feed.StatusBadRequest, re.Status)
		assert.Contains(t, re.Msg, "codec 2 (fp8/v1) is feed protocol 3; this feed speaks version 2")
		key := uint64(1)
		_, err = c.AllReduceCodec(ctx, reg.Span(0, 64), reduce.Float32, reduce.Sum, 0, &key)
		assert.ErrorContains(t, err, "feedback keys need feed protocol 3; the server chose 2")
		assert.Empty(t, ms[0].recorded(), "nothing reached the bridge")
		// Raw still works.
		require.NoError(t, c.AllReduce(ctx, reg.Span(0, 64), reduce.Float32, reduce.Sum))
		e.closeAll()
	})
	t.Run("version 3", func(t *testing.T) {
		ms := newFakeGroup(1, 8)
		e := startFeedsVersion(t, bridges(ms), nil, 3)
		c := e.clients[0]
		require.Equal(t, uint16(3), c.Welcome().Version)
		reg, err := c.Map(ctx, 64)
		require.NoError(t, err)
		key := uint64(1)
		_, err = c.AllReduceCodec(ctx, reg.Span(0, 64), reduce.Float32, reduce.Sum, uint8(codec.MXFP8), &key)
		require.NoError(t, err)
		assert.Equal(t, codec.MXFP8, ms[0].lastCall().cd.ID)
		e.closeAll()
	})
}

// Bad codec requests get status 1 and the server keeps serving.
func TestCodecBadRequests(t *testing.T) {
	e, reg, _ := limitedFeeds(t, 2)
	ctx := context.Background()
	c := e.clients[0]
	key := func(r feed.Request) feed.Request { r.FeedbackKey, r.HasFeedbackKey = 3, true; return r }
	cases := []struct {
		name string
		req  feed.Request
		want string
	}{
		{"unknown codec", feed.Request{Kind: feed.MsgAllReduce, Codec: 9, DType: reduce.Float32, Op: reduce.Sum, Buf: reg.Span(0, 4)}, "codec 9 is unknown to this gpubridge"},
		{"fp8 max", feed.Request{Kind: feed.MsgAllReduce, Codec: 2, DType: reduce.Float32, Op: reduce.Max, Buf: reg.Span(0, 4)}, "codec fp8/v1 is lossy: it packs only floating sums and averages (float32, bfloat16, float16), not float32 max"},
		{"bf16 float16", feed.Request{Kind: feed.MsgAllReduce, Codec: 1, DType: reduce.Float16, Op: reduce.Sum, Buf: reg.Span(0, 4)}, "codec bf16/v1 does not take float16"},
		{"fp8 broadcast", feed.Request{Kind: feed.MsgBroadcast, Codec: 2, Buf: reg.Span(0, 4), Peer: 0}, "codec fp8/v1 is lossy"},
		{"zstd send", feed.Request{Kind: feed.MsgSend, Codec: 3, Buf: reg.Span(0, 4), Peer: 1}, "send takes codec raw only, not zstd/v1"},
		{"feedback key on raw", key(feed.Request{Kind: feed.MsgAllReduce, DType: reduce.Float32, Op: reduce.Sum, Buf: reg.Span(0, 4)}), "not a raw all_reduce"},
		{"feedback key on all_gather", key(feed.Request{Kind: feed.MsgAllGather, Codec: 3, Buf: reg.Span(0, 4), Out: reg.Span(8, 8)}), "not a zstd/v1 all_gather"},
		{"not a packing", feed.Request{Kind: feed.MsgAllReduce, Flags: feed.FlagCallerReduces, Codec: 2, DType: reduce.Float32, Op: reduce.Sum,
			Buf: reg.Span(0, 34), Out: reg.Span(100, 68)}, "34 bytes are not the fp8/v1 packing of a whole number of float32 values"},
		{"feedback key too short", feed.Request{}, "feedback key: value of 4 bytes, want 8"},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			var err error
			if tc.req.Kind == 0 {
				// A malformed key: the request is still answered.
				var k *feedtest.Call
				k, err = c.StartMsg(feed.MsgAllReduce, nil, func(b []byte, id uint64) []byte {
					b = (&feed.Request{Kind: feed.MsgAllReduce, ID: id, Codec: 2, DType: reduce.Float32, Op: reduce.Sum, Buf: reg.Span(0, 4), Peer: -1,
						Ext: []feed.Ext{{Tag: feed.ExtFeedbackKey, Value: []byte{1, 2, 3, 4}}}}).Append(b)
					return b
				})
				require.NoError(t, err)
				_, err = k.Wait(ctx)
			} else {
				if tc.req.Peer == 0 && tc.req.Kind != feed.MsgBroadcast && tc.req.Kind != feed.MsgSend {
					tc.req.Peer = -1
				}
				_, err = c.Do(ctx, tc.req)
			}
			var re *feedtest.RequestError
			require.ErrorAs(t, err, &re)
			assert.Equal(t, feed.StatusBadRequest, re.Status)
			assert.Contains(t, re.Msg, tc.want)
		})
	}
	// Still serving, and no residual was made.
	reg1, err := e.clients[1].Map(ctx, 64)
	require.NoError(t, err)
	parallel(t, 2, func(i int) error {
		return e.clients[i].AllReduce(ctx, []feed.Span{reg.Span(0, 4), reg1.Span(0, 4)}[i], reduce.Float32, reduce.Sum)
	})
	keys, bytes := e.servers[0].fb.usage()
	assert.Zero(t, keys)
	assert.Zero(t, bytes)
	e.closeAll()
}

// The residuals' life on one member: made as zeros, reused, dropped and
// made again when the key's dtype or length changes, capped, freed when
// the feed ends. The fake adds 1 to every value of the residual it gets
// and records its first value before, so 0 is a fresh residual and k one
// that k earlier calls used.
func TestFeedbackResiduals(t *testing.T) {
	ms := newFakeGroup(1, 8)
	e := startFeeds(t, bridges(ms), func(o *ServerOptions) { o.MaxFeedbackBytes = 300 })
	ctx := context.Background()
	c := e.clients[0]
	s := e.servers[0]
	reg, err := c.Map(ctx, 4096)
	require.NoError(t, err)
	type step struct {
		name   string
		key    *uint64
		codec  codec.ID
		dt     reduce.DType
		values int
		seen   float32 // the residual's first value the bridge saw; -1 none
		keys   int
		bytes  uint64
		refuse string
	}
	k := func(v uint64) *uint64 { return &v }
	steps := []step{
		{"first use", k(1), codec.MXFP8, reduce.Float32, 16, 0, 1, 64, ""},
		{"reused", k(1), codec.MXFP8, reduce.Float32, 16, 1, 1, 64, ""},
		{"reused by the other lossy codec", k(1), codec.BF16, reduce.Float32, 16, 2, 1, 64, ""},
		{"no key: no residual", nil, codec.MXFP8, reduce.Float32, 16, -1, 1, 64, ""},
		{"another length", k(1), codec.MXFP8, reduce.Float32, 32, 0, 1, 128, ""},
		{"another dtype, same values", k(1), codec.MXFP8, reduce.BFloat16, 32, 0, 1, 128, ""},
		{"same bytes, another dtype", k(1), codec.MXFP8, reduce.Float16, 32, 0, 1, 128, ""},
		{"the key once more", k(1), codec.MXFP8, reduce.Float16, 32, 1, 1, 128, ""},
		{"a second key", k(2), codec.BF16, reduce.BFloat16, 16, 0, 2, 192, ""},
		{"over the cap", k(3), codec.MXFP8, reduce.Float32, 32, -1, 2, 192,
			"feedback key 3: a residual of 32 float32 values takes 128 bytes, and this feed's residuals would take 320, over the cap of 300 bytes (gbbridge serve --max-feedback)"},
		{"a key growing past the cap", k(1), codec.MXFP8, reduce.Float32, 60, -1, 2, 192, "over the cap of 300 bytes"},
		{"a key growing up to the cap", k(1), codec.MXFP8, reduce.Float32, 59, 0, 2, 300, ""},
		{"the grown key", k(1), codec.MXFP8, reduce.Float32, 59, 1, 2, 300, ""},
	}
	for _, st := range steps {
		n := len(ms[0].recorded())
		_, err := c.AllReduceCodec(ctx, reg.Span(0, st.values*st.dt.Size()), st.dt, reduce.Sum, uint8(st.codec), st.key)
		if st.refuse != "" {
			var re *feedtest.RequestError
			require.ErrorAs(t, err, &re, st.name)
			assert.Equal(t, feed.StatusBadRequest, re.Status, st.name)
			assert.Contains(t, re.Msg, st.refuse, st.name)
			assert.Len(t, ms[0].recorded(), n, "%s: nothing ran", st.name)
		} else {
			require.NoError(t, err, st.name)
			got := ms[0].lastCall()
			assert.Equal(t, st.seen, got.residual, st.name)
			if st.key != nil {
				assert.Len(t, got.cd.Residual, 4*st.values, st.name)
			}
		}
		keys, bytes := s.fb.usage()
		assert.Equal(t, st.keys, keys, st.name)
		assert.Equal(t, st.bytes, bytes, st.name)
	}
	e.closeAll()
	keys, bytes := s.fb.usage()
	assert.Zero(t, keys, "freed when the feed ended")
	assert.Zero(t, bytes)
}

// Requests queued behind each other take the key's residual in request
// order: a length change drops the residual while an earlier request that
// holds it has still to run, and its bytes count until that one ends.
func TestFeedbackQueued(t *testing.T) {
	ms := newFakeGroup(2, 8)
	e := startFeeds(t, bridges(ms), nil)
	ctx, cancel := context.WithTimeout(context.Background(), testenv.Scale(20*time.Second))
	defer cancel()
	regs := mapRegions(t, e.clients, 4096)
	key := uint64(5)
	sizes := []int{16, 32, 16, 16}
	req := func(i, values int) feed.Request {
		return feed.Request{Kind: feed.MsgAllReduce, Codec: uint8(codec.MXFP8), DType: reduce.Float32, Op: reduce.Sum,
			Buf: regs[i].Span(0, 4*values), Peer: -1, FeedbackKey: key, HasFeedbackKey: true}
	}
	// Member 0 sends all four; they wait for member 1 in the first.
	calls := make([]*feedtest.Call, len(sizes))
	for j, v := range sizes {
		var err error
		calls[j], err = e.clients[0].Start(req(0, v), nil)
		require.NoError(t, err)
	}
	s := e.servers[0]
	// All accepted: the 16-value residual of the first (held), the
	// 32-value one of the second (held), the 16-value one of the last two.
	require.Eventually(t, func() bool { return s.inflight.Load() == 4 }, testenv.Scale(10*time.Second), time.Millisecond)
	keys, bytes := s.fb.usage()
	assert.Equal(t, 1, keys)
	assert.Equal(t, uint64(64+128+64), bytes)
	for _, v := range sizes {
		_, err := e.clients[1].Do(ctx, req(1, v))
		require.NoError(t, err)
	}
	for _, k := range calls {
		_, err := k.Wait(ctx)
		require.NoError(t, err)
	}
	var seen []float32
	for _, fc := range ms[0].recorded() {
		seen = append(seen, fc.residual)
	}
	assert.Equal(t, []float32{0, 0, 0, 1}, seen, "the third made a new one, the fourth reused it")
	keys, bytes = s.fb.usage()
	assert.Equal(t, 1, keys)
	assert.Equal(t, uint64(64), bytes, "the dropped residuals went with their calls")
	e.closeAll()
}

// A failed collective breaks the bridge: no call runs again, and the
// residuals are dropped at once.
func TestFeedbackDroppedWhenBroken(t *testing.T) {
	ms := newFakeGroup(1, 8)
	ms[0].g.failSeq, ms[0].g.failErr = 3, errors.New("member 1: connection reset")
	e := startFeeds(t, bridges(ms), nil)
	ctx := context.Background()
	c := e.clients[0]
	reg, err := c.Map(ctx, 4096)
	require.NoError(t, err)
	for i, key := range []uint64{1, 2} {
		_, err := c.AllReduceCodec(ctx, reg.Span(0, 64), reduce.Float32, reduce.Avg, uint8(codec.BF16), &key)
		require.NoError(t, err, "call %d", i)
	}
	keys, _ := e.servers[0].fb.usage()
	require.Equal(t, 2, keys)
	key := uint64(1)
	_, err = c.AllReduceCodec(ctx, reg.Span(0, 64), reduce.Float32, reduce.Avg, uint8(codec.BF16), &key)
	var re *feedtest.RequestError
	require.ErrorAs(t, err, &re)
	assert.Equal(t, feed.StatusBridgeError, re.Status)
	keys, bytes := e.servers[0].fb.usage()
	assert.Zero(t, keys)
	assert.Zero(t, bytes)
	_, err = c.AllReduceCodec(ctx, reg.Span(0, 64), reduce.Float32, reduce.Avg, uint8(codec.BF16), &key)
	require.ErrorAs(t, err, &re)
	assert.Equal(t, feed.StatusBroken, re.Status)
	keys, _ = e.servers[0].fb.usage()
	assert.Zero(t, keys, "a refused request makes none")
	e.closeAll()
}

// The residual store on its own: what take, release and dropAll count.
func TestFeedbackStore(t *testing.T) {
	f := newFeedback(1000)
	a, err := f.take(0, 1, reduce.Float32, 100)
	require.NoError(t, err)
	assert.Nil(t, a.mem, "memory comes with the first call that runs")
	mem := f.memory(a)
	assert.Equal(t, make([]byte, 400), mem)
	mem[0] = 1
	a2, err := f.take(0, 1, reduce.Float32, 100)
	require.NoError(t, err)
	assert.Same(t, a, a2)
	assert.Equal(t, byte(1), f.memory(a2)[0])
	f.release(a)
	f.release(a2)
	// Replacing a residual nobody holds frees it first: 400 → 800 fits.
	b, err := f.take(0, 1, reduce.Float32, 200)
	require.NoError(t, err)
	assert.NotSame(t, a, b)
	_, bytes := f.usage()
	assert.Equal(t, uint64(800), bytes)
	// Held, it counts until released: 800 + 400 > 1000.
	_, err = f.take(0, 1, reduce.Float32, 100)
	assert.ErrorContains(t, err, "would take 1200, over the cap of 1000 bytes")
	_, err = f.take(0, 2, reduce.Float32, 1<<62)
	assert.ErrorContains(t, err, "over the cap", "no overflow")
	f.release(b)
	c, err := f.take(0, 1, reduce.Float32, 100)
	require.NoError(t, err)
	f.dropAll()
	_, bytes = f.usage()
	assert.Equal(t, uint64(400), bytes, "held by its call")
	f.release(c)
	keys, bytes := f.usage()
	assert.Zero(t, keys)
	assert.Zero(t, bytes)
	assert.Nil(t, c.mem)
}
