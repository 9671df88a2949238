package feedserver

import (
	"fmt"
	"strings"

	"github.com/gpubridge/gpubridge/lib/codec"
	"github.com/gpubridge/gpubridge/lib/feed"
	"github.com/gpubridge/gpubridge/lib/reduce"
)

// checkCodec checks the request's codec (known to this build, and allowed
// by the session's version: checkFields) against its kind, dtype and op,
// and the feedback key against the codec (docs/FEED.md §3a):
//
//   - all_reduce takes every codec; a lossy one (bf16, fp8) only for a
//     floating sum or avg of a dtype it takes;
//   - with caller-reduces, a lossy codec needs two members and a buf that
//     is its packing of n >= 1 values of the dtype;
//   - broadcast, all_gather and reduce_scatter take raw and zstd;
//   - barrier, send and recv raw only;
//   - the feedback key belongs to a lossy all_reduce without caller-reduces.
func checkCodec(r *feed.Request, members int) error {
	id := codec.ID(r.Codec)
	switch r.Kind {
	case feed.MsgAllReduce:
		if id.Lossy() {
			if err := lossyReduction(id, r.DType, r.Op); err != nil {
				return err
			}
		}
	case feed.MsgBroadcast, feed.MsgAllGather, feed.MsgReduceScatter:
		if id.Lossy() {
			return fmt.Errorf("codec %s is lossy: it packs only all_reduce's floating sums and averages; %s takes raw or %s", id.Versioned(), r.Kind, codec.Zstd.Versioned())
		}
	default:
		if id != codec.Raw {
			return fmt.Errorf("%s takes codec raw only, not %s", r.Kind, id.Versioned())
		}
	}
	if r.HasFeedbackKey && (!id.Lossy() || r.Kind != feed.MsgAllReduce || r.Flags&feed.FlagCallerReduces != 0) {
		return fmt.Errorf("the feedback key (extension %#04x) is for a lossy all_reduce (%s or %s) without caller-reduces, not %s",
			feed.ExtFeedbackKey, codec.BF16.Versioned(), codec.MXFP8.Versioned(), describe(r))
	}
	if !packedSlots(r) {
		return nil
	}
	if members != 2 {
		return fmt.Errorf("a lossy caller-reduces all_reduce needs 2 members, the bridge has %d", members)
	}
	if _, ok := packedValues(id, r.Buf.Len); !ok {
		return fmt.Errorf("%d bytes are not the %s packing of a whole number of %s values (at least one)", r.Buf.Len, id.Versioned(), r.DType)
	}
	return nil
}

// lossyReduction checks that lossy codec id packs op over dt: a floating
// sum or avg of a dtype it takes.
func lossyReduction(id codec.ID, dt reduce.DType, op reduce.Op) error {
	if !dt.IsFloat() || op != reduce.Sum && op != reduce.Avg {
		return fmt.Errorf("codec %s is lossy: it packs only floating sums and averages (%s), not %s %s", id.Versioned(), takes(id), dt, op)
	}
	if codec.Supports(id, dt) != nil {
		return fmt.Errorf("codec %s does not take %s (it takes %s)", id.Versioned(), dt, takes(id))
	}
	return nil
}

// takes lists the dtypes codec id packs, in lib/reduce's order but
// float32 first ("float32, bfloat16, float16").
func takes(id codec.ID) string {
	var out []string
	for _, dt := range []reduce.DType{reduce.Float32, reduce.BFloat16, reduce.Float16, reduce.Float64} {
		if codec.Supports(id, dt) == nil {
			out = append(out, dt.String())
		}
	}
	return strings.Join(out, ", ")
}

// describe names a request for a refusal: "a zstd/v1 broadcast", "a
// caller-reduces fp8/v1 all_reduce".
func describe(r *feed.Request) string {
	cr := ""
	if r.Flags&feed.FlagCallerReduces != 0 {
		cr = "caller-reduces "
	}
	return fmt.Sprintf("a %s%s %s", cr, codec.ID(r.Codec).Versioned(), r.Kind)
}

// packedSlots reports whether r is a lossy caller-reduces all_reduce: its
// buf holds this member's packed values, and the bridge exchanges them
// without decoding.
func packedSlots(r *feed.Request) bool {
	return r.Kind == feed.MsgAllReduce && r.Flags&feed.FlagCallerReduces != 0 && codec.ID(r.Codec).Lossy()
}

// packedValues returns n when l bytes are lossy codec id's packing of n >= 1
// values: bf16 2n bytes, fp8 n + ceil(n/32) (each block of 32 values takes
// 33 bytes, a last short block of k values k+1).
func packedValues(id codec.ID, l uint64) (uint64, bool) {
	var n uint64
	switch id {
	case codec.BF16:
		n = l / 2
	case codec.MXFP8:
		const block = codec.BlockElems + 1
		n = l / block * codec.BlockElems
		if rest := l % block; rest > 1 {
			n += rest - 1
		}
	default:
		return 0, false
	}
	if n == 0 || n > 1<<60 {
		return 0, false
	}
	want, err := codec.MaxPackedLen(id, reduce.Float32, int(n))
	return n, err == nil && uint64(want) == l
}
