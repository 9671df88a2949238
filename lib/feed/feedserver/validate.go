package feedserver

import (
	"errors"
	"fmt"

	"github.com/gpubridge/gpubridge/lib/codec"
	"github.com/gpubridge/gpubridge/lib/feed"
	"github.com/gpubridge/gpubridge/lib/reduce"
)

// validate checks a request for bridge 0 (validateOn).
func (s *Server) validate(r *feed.Request) error { return s.validateOn(r, s.o.Member, s.o.Members) }

// validateOn checks a request against the protocol and the bridge it runs
// on, of which this server's rank is member of members: the fields every
// request has, what its kind takes, whole elements, and overlapping spans.
// The first problem found is the error.
func (s *Server) validateOn(r *feed.Request, member, members int) error {
	if err := checkFields(r, s.version); err != nil {
		return err
	}
	if err := checkCodec(r, members); err != nil {
		return err
	}
	if err := checkKind(r, member, members); err != nil {
		return err
	}
	if err := checkElements(r); err != nil {
		return err
	}
	return checkOverlap(r, member)
}

// checkFields checks flags, codec id and extensions (against the
// session's version), dtype and op.
func checkFields(r *feed.Request, version uint16) error {
	if err := codec.Check(codec.ID(r.Codec)); err != nil {
		return err
	}
	if r.Codec != feed.CodecRaw && version < feed.CodecVersion {
		return fmt.Errorf("codec %d (%s) is feed protocol %d; this feed speaks version %d", r.Codec, codec.ID(r.Codec).Versioned(), feed.CodecVersion, version)
	}
	if v := feed.ExtVersion(feed.ExtFeedbackKey); r.HasFeedbackKey && version < v {
		return fmt.Errorf("extension feedback-key (%#04x) is feed protocol %d; this feed speaks version %d", feed.ExtFeedbackKey, v, version)
	}
	if r.Flags&^feed.KnownFlags != 0 {
		return fmt.Errorf("unknown flags %#x (this gbbridge speaks feed protocol %d..%d)", r.Flags&^feed.KnownFlags, feed.MinVersion, feed.Version)
	}
	if r.Flags&feed.FlagCallerReduces != 0 {
		if v := feed.FlagVersion(feed.FlagCallerReduces); version < v {
			return fmt.Errorf("flag caller-reduces (%#x) is feed protocol %d; this feed speaks version %d", feed.FlagCallerReduces, v, version)
		}
		if r.Kind != feed.MsgAllReduce {
			return fmt.Errorf("flag caller-reduces is for all_reduce, not %s", r.Kind)
		}
	}
	if r.DType != 0 && r.DType.Size() == 0 {
		return fmt.Errorf("unknown dtype %d", r.DType)
	}
	if r.Kind == feed.MsgAllReduce || r.Kind == feed.MsgReduceScatter {
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
	return nil
}

// checkKind checks the spans, root or peer, and tag that r's kind takes,
// on a bridge of members members of which this server's is member.
func checkKind(r *feed.Request, member, members int) error {
	n := uint64(members)
	switch r.Kind {
	case feed.MsgAllReduce:
		if r.Flags&feed.FlagCallerReduces == 0 {
			return errors.Join(noOut(r), noPeer(r))
		}
		if err := noPeer(r); err != nil {
			return err
		}
		if !isMembersTimes(r.Out.Len, r.Buf.Len, n) {
			return fmt.Errorf("all_reduce (caller reduces): output of %d bytes, want %d members × %d input bytes", r.Out.Len, n, r.Buf.Len)
		}
	case feed.MsgBroadcast:
		if err := errors.Join(noOut(r), isMember(r, "root", members)); err != nil {
			return err
		}
		if r.Tag != 0 {
			return errors.New("broadcast takes no tag")
		}
	case feed.MsgAllGather:
		if err := noPeer(r); err != nil {
			return err
		}
		if !isMembersTimes(r.Out.Len, r.Buf.Len, n) {
			return fmt.Errorf("all_gather: output of %d bytes, want %d members × %d input bytes", r.Out.Len, n, r.Buf.Len)
		}
	case feed.MsgReduceScatter:
		if err := noPeer(r); err != nil {
			return err
		}
		if !isMembersTimes(r.Buf.Len, r.Out.Len, n) {
			return fmt.Errorf("reduce_scatter: input of %d bytes, want %d members × %d output bytes", r.Buf.Len, n, r.Out.Len)
		}
	case feed.MsgBarrier:
		if err := errors.Join(noOut(r), noPeer(r)); err != nil {
			return err
		}
		if r.Buf != (feed.Span{}) {
			return errors.New("barrier takes no buffer")
		}
		if r.DType != 0 {
			return errors.New("barrier takes no dtype")
		}
	case feed.MsgSend, feed.MsgRecv:
		if err := errors.Join(noOut(r), isMember(r, "peer", members)); err != nil {
			return err
		}
		if int(r.Peer) == member {
			return fmt.Errorf("peer %d is this member", r.Peer)
		}
	}
	return nil
}

// isMembersTimes reports whether whole is n parts.
func isMembersTimes(whole, part, n uint64) bool { return whole/n == part && whole%n == 0 }

func isMember(r *feed.Request, what string, members int) error {
	if r.Peer < 0 || int64(r.Peer) >= int64(members) {
		return fmt.Errorf("%s %d is not a member (0..%d)", what, r.Peer, members-1)
	}
	return nil
}

func noOut(r *feed.Request) error {
	if r.Out != (feed.Span{}) {
		return fmt.Errorf("%s takes no output span", r.Kind)
	}
	return nil
}

func noPeer(r *feed.Request) error {
	if r.Peer != -1 || r.Tag != 0 {
		return fmt.Errorf("%s takes no root, peer or tag (want -1 and 0)", r.Kind)
	}
	return nil
}

// checkElements checks that both spans hold whole elements of the dtype
// (a lossy caller-reduces all_reduce's hold packed bytes: checkCodec).
func checkElements(r *feed.Request) error {
	sz := uint64(r.DType.Size())
	if sz <= 1 || packedSlots(r) {
		return nil
	}
	if r.Buf.Len%sz != 0 {
		return fmt.Errorf("buffer of %d bytes is not a whole number of %s elements (%d bytes each)", r.Buf.Len, r.DType, sz)
	}
	if r.Out.Len%sz != 0 {
		return fmt.Errorf("output of %d bytes is not a whole number of %s elements (%d bytes each)", r.Out.Len, r.DType, sz)
	}
	return nil
}

// checkOverlap refuses input and output spans that overlap, except in the
// in-place forms: all_gather's (and a caller-reduces all_reduce's) input as
// this member's slot of the output, reduce_scatter's output as this
// member's segment of the input.
func checkOverlap(r *feed.Request, member int) error {
	b, o := r.Buf, r.Out
	if b.Region == 0 || b.Region != o.Region || b.Len == 0 || o.Len == 0 || b.Off >= o.Off+o.Len || o.Off >= b.Off+b.Len {
		return nil
	}
	me := uint64(member)
	gather := r.Kind == feed.MsgAllGather || r.Kind == feed.MsgAllReduce && r.Flags&feed.FlagCallerReduces != 0
	if gather && b.Off == o.Off+me*b.Len || r.Kind == feed.MsgReduceScatter && o.Off == b.Off+me*o.Len {
		return nil
	}
	return errors.New("input and output overlap (only the in-place forms are allowed: all_gather's or a caller-reduces all_reduce's input as this member's slot of the output, reduce_scatter's output as this member's segment of the input)")
}
