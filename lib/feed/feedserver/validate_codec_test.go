package feedserver

import (
	"fmt"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/gpubridge/gpubridge/lib/codec"
	"github.com/gpubridge/gpubridge/lib/feed"
	"github.com/gpubridge/gpubridge/lib/reduce"
)

// The matrix of docs/FEED.md §3a, written out: which codecs each request
// takes, and which dtypes a lossy codec packs.
var (
	codecsOf = map[string][]codec.ID{
		"all_reduce":                {codec.Raw, codec.BF16, codec.MXFP8, codec.Zstd},
		"all_reduce caller-reduces": {codec.Raw, codec.BF16, codec.MXFP8, codec.Zstd},
		"broadcast":                 {codec.Raw, codec.Zstd},
		"all_gather":                {codec.Raw, codec.Zstd},
		"reduce_scatter":            {codec.Raw, codec.Zstd},
		"barrier":                   {codec.Raw},
		"send":                      {codec.Raw},
		"recv":                      {codec.Raw},
	}
	lossyTakes = map[codec.ID][]reduce.DType{
		codec.BF16:  {reduce.Float32, reduce.BFloat16},
		codec.MXFP8: {reduce.Float32, reduce.BFloat16, reduce.Float16},
	}
)

// goodRequest is a request of the named kind that member 1 of 2 accepts
// with codec id: a float32 sum for the reductions (its packing for a lossy
// caller-reduces all_reduce), bytes for the others.
func goodRequest(kind string, id codec.ID) feed.Request {
	sp := func(off, n uint64) feed.Span { return feed.Span{Region: 1, Off: off, Len: n} }
	r := feed.Request{Codec: uint8(id), Peer: -1}
	switch kind {
	case "all_reduce":
		r.Kind, r.DType, r.Op, r.Buf = feed.MsgAllReduce, reduce.Float32, reduce.Sum, sp(0, 4096)
	case "all_reduce caller-reduces":
		r.Kind, r.DType, r.Op, r.Flags = feed.MsgAllReduce, reduce.Float32, reduce.Sum, feed.FlagCallerReduces
		n := uint64(4096)
		if id.Lossy() {
			p, _ := codec.MaxPackedLen(id, reduce.Float32, 1000)
			n = uint64(p)
		}
		r.Buf, r.Out = sp(n, n), sp(0, 2*n)
	case "broadcast":
		r.Kind, r.Buf, r.Peer = feed.MsgBroadcast, sp(0, 100), 0
	case "all_gather":
		r.Kind, r.DType, r.Buf, r.Out = feed.MsgAllGather, reduce.Int64, sp(0, 80), feed.Span{Region: 2, Len: 160}
	case "reduce_scatter":
		r.Kind, r.DType, r.Op, r.Buf, r.Out = feed.MsgReduceScatter, reduce.Float32, reduce.Sum, sp(0, 80), feed.Span{Region: 2, Len: 40}
	case "barrier":
		r.Kind = feed.MsgBarrier
	case "send", "recv":
		r.Kind, r.Buf, r.Peer = feed.MsgSend, sp(0, 10), 0
		if kind == "recv" {
			r.Kind = feed.MsgRecv
		}
	}
	return r
}

// TestValidateCodecs: every request kind with every codec; every dtype and
// op with each lossy codec, plain and caller-reduces.
func TestValidateCodecs(t *testing.T) {
	s := &Server{o: ServerOptions{Member: 1, Members: 2}, version: feed.Version}
	for kind, ok := range codecsOf {
		for _, id := range codec.IDs() {
			t.Run(fmt.Sprintf("%s/%s", kind, id), func(t *testing.T) {
				r := goodRequest(kind, id)
				err := s.validate(&r)
				if contains(ok, id) {
					assert.NoError(t, err)
					return
				}
				require.Error(t, err)
				if contains(ok, codec.Zstd) {
					assert.EqualError(t, err, fmt.Sprintf("codec %s is lossy: it packs only all_reduce's floating sums and averages; %s takes raw or zstd/v1", id.Versioned(), kind))
				} else {
					assert.EqualError(t, err, fmt.Sprintf("%s takes codec raw only, not %s", kind, id.Versioned()))
				}
			})
		}
	}
	for _, cr := range []bool{false, true} {
		for _, id := range []codec.ID{codec.BF16, codec.MXFP8} {
			for _, dt := range reduce.AllDTypes() {
				for _, op := range reduce.AllOps() {
					name := fmt.Sprintf("caller-reduces=%v/%s/%s/%s", cr, id, dt, op)
					t.Run(name, func(t *testing.T) {
						r := feed.Request{Kind: feed.MsgAllReduce, Codec: uint8(id), DType: dt, Op: op, Peer: -1, Buf: feed.Span{Region: 1, Len: 64 * uint64(dt.Size())}}
						if cr {
							n, _ := codec.MaxPackedLen(id, reduce.Float32, 64)
							r.Flags, r.Buf, r.Out = feed.FlagCallerReduces, feed.Span{Region: 1, Len: uint64(n)}, feed.Span{Region: 2, Len: 2 * uint64(n)}
						}
						err := s.validate(&r)
						if reduce.Supported(op, dt) != nil {
							assert.Error(t, err)
							return
						}
						switch {
						case dt.IsFloat() && (op == reduce.Sum || op == reduce.Avg) && contains(lossyTakes[id], dt):
							assert.NoError(t, err)
						case dt.IsFloat() && (op == reduce.Sum || op == reduce.Avg):
							assert.ErrorContains(t, err, fmt.Sprintf("codec %s does not take %s", id.Versioned(), dt))
						default:
							assert.ErrorContains(t, err, fmt.Sprintf("codec %s is lossy: it packs only floating sums and averages", id.Versioned()))
							assert.ErrorContains(t, err, fmt.Sprintf("not %s %s", dt, op))
						}
					})
				}
			}
		}
	}
}

func contains[T comparable](xs []T, x T) bool {
	for _, y := range xs {
		if x == y {
			return true
		}
	}
	return false
}

// The refusals §3a words, the feedback key's place, and the versions.
func TestValidateCodecRefusals(t *testing.T) {
	ar := func(id codec.ID, dt reduce.DType, op reduce.Op, n uint64) feed.Request {
		return feed.Request{Kind: feed.MsgAllReduce, Codec: uint8(id), DType: dt, Op: op, Buf: feed.Span{Region: 1, Len: n}, Peer: -1}
	}
	cr := func(id codec.ID, dt reduce.DType, n uint64) feed.Request {
		r := ar(id, dt, reduce.Sum, n)
		r.Flags, r.Out = feed.FlagCallerReduces, feed.Span{Region: 2, Len: 2 * n}
		return r
	}
	key := func(r feed.Request) feed.Request { r.FeedbackKey, r.HasFeedbackKey = 7, true; return r }
	cases := []struct {
		name    string
		version uint16
		members int
		req     feed.Request
		want    string // "": accepted
	}{
		{"fp8 int32 max", 3, 2, ar(codec.MXFP8, reduce.Int32, reduce.Max, 64), "codec fp8/v1 is lossy: it packs only floating sums and averages (float32, bfloat16, float16), not int32 max"},
		{"bf16 float16", 3, 2, ar(codec.BF16, reduce.Float16, reduce.Sum, 64), "codec bf16/v1 does not take float16 (it takes float32, bfloat16)"},
		{"fp8 float64", 3, 2, ar(codec.MXFP8, reduce.Float64, reduce.Avg, 64), "codec fp8/v1 does not take float64"},
		{"fp8 float32 max", 3, 2, ar(codec.MXFP8, reduce.Float32, reduce.Max, 64), "not float32 max"},
		{"zstd int32 max", 3, 2, ar(codec.Zstd, reduce.Int32, reduce.Max, 64), ""},
		{"zstd caller-reduces int8", 3, 2, cr(codec.Zstd, reduce.Int8, 5), ""},
		{"unknown codec", 3, 2, ar(7, reduce.Float32, reduce.Sum, 64), "codec 7 is unknown to this gpubridge (it knows 0 raw, 1 bf16/v1, 2 fp8/v1, 3 zstd/v1): every member must run a gpubridge that knows the job's codec"},
		{"unknown codec, version 1", 1, 2, ar(200, reduce.Float32, reduce.Sum, 64), "codec 200 is unknown to this gpubridge"},
		{"fp8 in version 2", 2, 2, ar(codec.MXFP8, reduce.Float32, reduce.Sum, 64), "codec 2 (fp8/v1) is feed protocol 3; this feed speaks version 2"},
		{"zstd in version 1", 1, 2, ar(codec.Zstd, reduce.Float32, reduce.Sum, 64), "codec 3 (zstd/v1) is feed protocol 3; this feed speaks version 1"},
		{"raw in version 2", 2, 2, ar(codec.Raw, reduce.Float32, reduce.Sum, 64), ""},
		{"feedback key in version 2", 2, 2, key(ar(codec.Raw, reduce.Float32, reduce.Sum, 64)), "extension feedback-key (0x8002) is feed protocol 3; this feed speaks version 2"},

		{"lossy caller-reduces, 3 members", 3, 3, cr(codec.MXFP8, reduce.Float32, 33), "a lossy caller-reduces all_reduce needs 2 members, the bridge has 3"},
		{"fp8 packing of 18 values", 3, 2, cr(codec.MXFP8, reduce.Float32, 19), ""},
		{"fp8 packing of 1 value", 3, 2, cr(codec.MXFP8, reduce.BFloat16, 2), ""},
		{"fp8 packing of 1025 values", 3, 2, cr(codec.MXFP8, reduce.Float16, 1025+33), ""},
		{"no fp8 packing: 34 bytes", 3, 2, cr(codec.MXFP8, reduce.Float32, 34), "34 bytes are not the fp8/v1 packing of a whole number of float32 values"},
		{"no fp8 packing: 1 byte", 3, 2, cr(codec.MXFP8, reduce.Float32, 1), "1 bytes are not the fp8/v1 packing"},
		{"no fp8 packing: empty", 3, 2, cr(codec.MXFP8, reduce.Float32, 0), "0 bytes are not the fp8/v1 packing of a whole number of float32 values (at least one)"},
		{"bf16 packing", 3, 2, cr(codec.BF16, reduce.Float32, 2), ""},
		{"no bf16 packing: odd", 3, 2, cr(codec.BF16, reduce.BFloat16, 7), "7 bytes are not the bf16/v1 packing of a whole number of bfloat16 values"},
		{"lossy caller-reduces output", 3, 2, func() feed.Request { r := cr(codec.MXFP8, reduce.Float32, 19); r.Out.Len = 38 + 1; return r }(), "output of 39 bytes, want 2 members × 19 input bytes"},
		{"raw caller-reduces, not whole elements", 3, 2, cr(codec.Raw, reduce.Float32, 19), "not a whole number of float32 elements"},

		{"feedback key, fp8", 3, 2, key(ar(codec.MXFP8, reduce.Float32, reduce.Avg, 64)), ""},
		{"feedback key, bf16", 3, 3, key(ar(codec.BF16, reduce.BFloat16, reduce.Sum, 64)), ""},
		{"feedback key, raw", 3, 2, key(ar(codec.Raw, reduce.Float32, reduce.Sum, 64)),
			"the feedback key (extension 0x8002) is for a lossy all_reduce (bf16/v1 or fp8/v1) without caller-reduces, not a raw all_reduce"},
		{"feedback key, zstd", 3, 2, key(ar(codec.Zstd, reduce.Float32, reduce.Sum, 64)), "not a zstd/v1 all_reduce"},
		{"feedback key, caller-reduces", 3, 2, key(cr(codec.MXFP8, reduce.Float32, 33)), "not a caller-reduces fp8/v1 all_reduce"},
		{"feedback key, broadcast", 3, 2, key(feed.Request{Kind: feed.MsgBroadcast, Buf: feed.Span{Region: 1, Len: 8}, Peer: 0}), "not a raw broadcast"},
		{"feedback key, reduce_scatter", 3, 2, key(feed.Request{Kind: feed.MsgReduceScatter, Codec: uint8(codec.Zstd), DType: reduce.Float32, Op: reduce.Sum,
			Buf: feed.Span{Region: 1, Len: 8}, Out: feed.Span{Region: 2, Len: 4}, Peer: -1}), "not a zstd/v1 reduce_scatter"},
		{"feedback key, barrier", 3, 2, key(feed.Request{Kind: feed.MsgBarrier, Peer: -1}), "not a raw barrier"},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			s := &Server{o: ServerOptions{Member: 0, Members: tc.members}, version: tc.version}
			err := s.validate(&tc.req)
			if tc.want == "" {
				assert.NoError(t, err)
				return
			}
			assert.ErrorContains(t, err, tc.want)
		})
	}
}

// packedValues inverts the packed sizes: every length is the packing of
// exactly the n MaxPackedLen says, or of none.
func TestPackedValues(t *testing.T) {
	for _, id := range []codec.ID{codec.BF16, codec.MXFP8} {
		of := map[uint64]uint64{}
		for n := 1; n <= 5000; n++ {
			l, err := codec.MaxPackedLen(id, reduce.Float32, n)
			require.NoError(t, err)
			of[uint64(l)] = uint64(n)
		}
		for l := uint64(0); l < 5000; l++ {
			n, ok := packedValues(id, l)
			want, wantOK := of[l]
			require.Equal(t, wantOK, ok, "%s, %d bytes", id, l)
			if ok {
				require.Equal(t, want, n, "%s, %d bytes", id, l)
			}
		}
	}
	_, ok := packedValues(codec.Zstd, 8)
	assert.False(t, ok)
	_, ok = packedValues(codec.MXFP8, 1<<63)
	assert.False(t, ok, "past what a request can hold")
}
