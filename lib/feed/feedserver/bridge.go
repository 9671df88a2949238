package feedserver

import (
	"context"

	"github.com/gpubridge/gpubridge/lib/collective"
	"github.com/gpubridge/gpubridge/lib/reduce"
)

// Progress is how the feed streams one collective through the bridge: Ready
// blocks until input bytes [0,end) are in place, Done reports result ranges
// that are final (disjoint, covering the result once, possibly from several
// goroutines). It is collective.Progress.
type Progress = collective.Progress

// Codec is how a collective packs what it sends (collective.Codec): the
// request's codec id, the dtype whose byte planes a lossless codec packs,
// and a lossy all_reduce's error-feedback residual.
type Codec = collective.Codec

// Pending is a SEND or RECV posted on a bridge: its place in the order of
// its (peer, tag) is fixed, and Wait runs it to its end (bytes sent, or
// the received message's length). It is collective.Pending.
type Pending = collective.Pending

// Bridge is what the feed server drives: the collectives and point-to-point
// operations of one bridge member, each collective with the request's
// codec (the zero Codec: raw). *collective.Comm implements it.
// Collectives are called from one goroutine, in request order. PostSend
// and PostRecv are called from the feed's reader, in request order, and
// must not block: the bridge matches a (peer, tag)'s Sends and Recvs in
// the order they were posted; each Pending's Wait is called once, from a
// goroutine of its own, beside the collectives and the other waits. p is
// nil for requests that are not streamed.
type Bridge interface {
	AllReduceCodec(ctx context.Context, buf []byte, dt reduce.DType, op reduce.Op, cd Codec, p *Progress) error
	BroadcastCodec(ctx context.Context, buf []byte, root int, cd Codec, p *Progress) error
	AllGatherCodec(ctx context.Context, out, in []byte, cd Codec, p *Progress) error
	ReduceScatterCodec(ctx context.Context, out, in []byte, dt reduce.DType, op reduce.Op, cd Codec, p *Progress) error
	Barrier(ctx context.Context) error
	PostSend(peer int, tag uint32, buf []byte) Pending
	PostRecv(peer int, tag uint32, buf []byte) Pending
	// Seq is the sequence number of the last collective started (the
	// first is 1; 0 before any).
	Seq() uint64
}

var _ Bridge = (*collective.Comm)(nil)
