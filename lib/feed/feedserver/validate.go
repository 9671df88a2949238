package feedserver

import (
	"errors"
	"fmt"

	"github.com/gpubridge/gpubridge/lib/feed"
	"github.com/gpubridge/gpubridge/lib/reduce"
)

// validate checks a request against the protocol and the bridge.
func (s *Server) validate(r *feed.Request) error {
	if r.Codec != feed.CodecRaw {
		return fmt.Errorf("codec %d is not supported (this gbbridge knows only 0, raw)", r.Codec)
	}
	if r.Flags&^feed.KnownFlags != 0 {
		return fmt.Errorf("unknown flags %#x", r.Flags&^feed.KnownFlags)
	}
	if r.DType != 0 && r.DType.Size() == 0 {
		return fmt.Errorf("unknown dtype %d", r.DType)
	}
	reduces := r.Kind == feed.MsgAllReduce || r.Kind == feed.MsgReduceScatter
	if reduces {
		if r.DType == 0 {
			return errors.New("a reduction needs a dtype")
		}
		if err := reduce.Supported(r.Op, r.DType); err != nil {
			return err
		}
	} else if r.Op != 0 {
		return fmt.Errorf("op %d given, but %s does not reduce", r.Op, r.Kind)
	}
	if r.Flags&feed.FlagStreamed != 0 {
		switch r.Kind {
		case feed.MsgBarrier, feed.MsgSend, feed.MsgRecv:
			return fmt.Errorf("%s cannot be streamed", r.Kind)
		}
	}
	n := uint64(s.o.Members)
	member := func(what string) error {
		if r.Peer < 0 || int64(r.Peer) >= int64(s.o.Members) {
			return fmt.Errorf("%s %d is not a member (0..%d)", what, r.Peer, s.o.Members-1)
		}
		return nil
	}
	noOut := func() error {
		if r.Out != (feed.Span{}) {
			return fmt.Errorf("%s takes no output span", r.Kind)
		}
		return nil
	}
	noPeer := func() error {
		if r.Peer != -1 || r.Tag != 0 {
			return fmt.Errorf("%s takes no root, peer or tag (want -1 and 0)", r.Kind)
		}
		return nil
	}
	var err error
	switch r.Kind {
	case feed.MsgAllReduce:
		err = errors.Join(noOut(), noPeer())
	case feed.MsgBroadcast:
		err = errors.Join(noOut(), member("root"))
		if err == nil && r.Tag != 0 {
			err = errors.New("broadcast takes no tag")
		}
	case feed.MsgAllGather:
		err = noPeer()
		if err == nil && (r.Out.Len/n != r.Buf.Len || r.Out.Len%n != 0) {
			err = fmt.Errorf("all_gather: output of %d bytes, want %d members × %d input bytes", r.Out.Len, n, r.Buf.Len)
		}
	case feed.MsgReduceScatter:
		err = noPeer()
		if err == nil && (r.Buf.Len/n != r.Out.Len || r.Buf.Len%n != 0) {
			err = fmt.Errorf("reduce_scatter: input of %d bytes, want %d members × %d output bytes", r.Buf.Len, n, r.Out.Len)
		}
	case feed.MsgBarrier:
		err = errors.Join(noOut(), noPeer())
		if err == nil && r.Buf != (feed.Span{}) {
			err = errors.New("barrier takes no buffer")
		}
		if err == nil && r.DType != 0 {
			err = errors.New("barrier takes no dtype")
		}
	case feed.MsgSend, feed.MsgRecv:
		err = errors.Join(noOut(), member("peer"))
		if err == nil && int(r.Peer) == s.o.Member {
			err = fmt.Errorf("peer %d is this member", r.Peer)
		}
	}
	if err != nil {
		return err
	}
	if sz := uint64(r.DType.Size()); sz > 1 {
		if r.Buf.Len%sz != 0 {
			return fmt.Errorf("buffer of %d bytes is not a whole number of %s elements (%d bytes each)", r.Buf.Len, r.DType, sz)
		}
		if r.Out.Len%sz != 0 {
			return fmt.Errorf("output of %d bytes is not a whole number of %s elements (%d bytes each)", r.Out.Len, r.DType, sz)
		}
	}
	if r.Buf.Region != 0 && r.Buf.Region == r.Out.Region &&
		r.Buf.Off < r.Out.Off+r.Out.Len && r.Out.Off < r.Buf.Off+r.Buf.Len && r.Buf.Len > 0 && r.Out.Len > 0 {
		// The in-place forms: all_gather's input is this member's slot of
		// the output; reduce_scatter's output is this member's segment of
		// the input.
		me := uint64(s.o.Member)
		inPlace := r.Kind == feed.MsgAllGather && r.Buf.Off == r.Out.Off+me*r.Buf.Len ||
			r.Kind == feed.MsgReduceScatter && r.Out.Off == r.Buf.Off+me*r.Out.Len
		if !inPlace {
			return errors.New("input and output overlap (only the in-place forms are allowed: all_gather's input as this member's slot of the output, reduce_scatter's output as this member's segment of the input)")
		}
	}
	return nil
}
