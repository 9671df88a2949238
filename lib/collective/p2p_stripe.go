package collective

import (
	"context"
	"encoding/binary"
	"errors"
	"fmt"
	"math"
	"slices"
	"sync"

	"github.com/gpubridge/gpubridge/lib/transport"
	"github.com/gpubridge/gpubridge/lib/wire"
)

// Striped point-to-point messages: a message of at least stripeMin bytes,
// on a mesh with point-to-point streams (transport.Mesh.P2PStreams), is
// announced by one frame on the control stream (FlagStripe; its payload
// the message's length and frame size), and its frames go over the
// point-to-point streams in parallel, frame i on stream i mod P, each
// written by a goroutine of the Send and copied into place by that
// stream's reader. The control stream alone moved a 64 MiB message at a
// third of the all_reduce's rate on the GPU host (one writer, one reader,
// shm's 1 MiB control ring); issue 16.
const (
	// defaultStripeMin is the smallest message that is striped: below it
	// the announcement and the hand-offs cost more than the copies gain.
	defaultStripeMin = 512 << 10
	// defaultStripeFrame is the smallest frame of a striped message; it is
	// cut into about one frame per stream, at most ChunkBytes each.
	defaultStripeFrame = 256 << 10
	// stripeAnnounceLen is the announcement's payload: the length u64 and
	// the frame size u32, little-endian.
	stripeAnnounceLen = 12
	// maxStripeFrames bounds the frames of one striped message (and so
	// the receiver's record of which arrived: 128 KiB); a Send that would
	// need more goes on the control stream.
	maxStripeFrames = 1 << 20
)

// stripeAnnounce encodes the announcement of a message of total bytes in
// frames of unit bytes.
func stripeAnnounce(total, unit int) []byte {
	b := make([]byte, stripeAnnounceLen)
	binary.LittleEndian.PutUint64(b, uint64(total))
	binary.LittleEndian.PutUint32(b[8:], uint32(unit))
	return b
}

// parseStripeAnnounce decodes an announcement, within the limits a sender
// keeps: a length of at least 1, a frame of 1..wire.MaxPayload bytes, at
// most maxStripeFrames frames.
func parseStripeAnnounce(p []byte) (total, unit, frames int, err error) {
	if len(p) != stripeAnnounceLen {
		return 0, 0, 0, fmt.Errorf("an announcement of %d bytes, want %d", len(p), stripeAnnounceLen)
	}
	t := binary.LittleEndian.Uint64(p)
	u := binary.LittleEndian.Uint32(p[8:])
	if u == 0 || u > wire.MaxPayload {
		return 0, 0, 0, fmt.Errorf("frames of %d bytes (1..%d allowed)", u, wire.MaxPayload)
	}
	if t == 0 || t > math.MaxInt64/2 || (t+uint64(u)-1)/uint64(u) > maxStripeFrames {
		return 0, 0, 0, fmt.Errorf("a message of %d bytes in frames of %d bytes (1 byte to %d frames allowed)", t, u, maxStripeFrames)
	}
	total, unit = int(t), int(u)
	return total, unit, (total + unit - 1) / unit, nil
}

// stripeKey names a striped message arriving from a peer.
type stripeKey struct {
	tag uint32
	seq uint64
}

// striped is a striped message arriving: into a posted Recv, into the
// unexpected queue, or (req and msg nil) dropped. Guarded by the peer's
// mu, but for rw.
type striped struct {
	seq         uint64
	total, unit int
	frames      int
	got         int      // bytes arrived
	seen        []uint64 // a bit per frame arrived
	req         *recvReq
	msg         *message
	// rw is read-held by a reader while it copies a frame into dst;
	// detach write-holds it to move the message elsewhere, so that no
	// copy into the old buffer is under way or begins after.
	rw sync.RWMutex
}

func (sm *striped) dst() []byte {
	switch {
	case sm.req != nil:
		return sm.req.buf
	case sm.msg != nil:
		return sm.msg.data
	}
	return nil
}

// frameLen is the length frame i must have.
func (sm *striped) frameLen(i int) int {
	if i == sm.frames-1 {
		return sm.total - i*sm.unit
	}
	return sm.unit
}

// stripes says whether a message of n bytes goes striped, and in frames of
// how many bytes.
func (c *Comm) stripes(n int) (bool, int) {
	if c.p2p == 0 || n < c.stripeMin {
		return false, 0
	}
	unit := (n + c.p2p - 1) / c.p2p
	unit = (unit + 63) &^ 63
	unit = min(max(unit, c.stripeUnit), c.chunk)
	if (n+unit-1)/unit > maxStripeFrames {
		return false, 0
	}
	return true, unit
}

// sendP2P writes one frame to peer's point-to-point stream i.
func (c *Comm) sendP2P(ctx context.Context, peer, i int, h wire.Header, payload []byte) error {
	lock := c.peers[peer].p2pSend[i]
	select {
	case lock <- struct{}{}:
	case <-ctx.Done():
		return ctx.Err()
	case <-c.stop:
		return c.hardState()
	}
	defer func() { <-lock }()
	return c.mesh.P2PStream(peer, i).Send(ctx, h, payload)
}

// sendStriped sends message seq on tag, announced already, in frames of
// unit bytes over the point-to-point streams, one goroutine per stream.
func (c *Comm) sendStriped(ctx context.Context, peer int, tag uint32, seq uint64, buf []byte, unit int) error {
	frames := (len(buf) + unit - 1) / unit
	ctx, cancel := context.WithCancelCause(ctx)
	defer cancel(nil)
	var wg sync.WaitGroup
	var once sync.Once
	var first error
	for s := range min(c.p2p, frames) {
		wg.Go(func() {
			for i := s; i < frames; i += c.p2p {
				h := wire.Header{Kind: wire.KindP2P, Seq: seq, Step: tag, Chunk: uint32(i)}
				if err := c.sendP2P(ctx, peer, s, h, buf[i*unit:min((i+1)*unit, len(buf))]); err != nil {
					once.Do(func() { first = err })
					cancel(errSibling)
					return
				}
			}
		})
	}
	wg.Wait()
	return first
}

// stripeAnnounced files the announcement of a striped message from peer
// (on the control stream's dispatcher): it takes the first posted Recv on
// the tag, or a queue entry of the announced length.
func (c *Comm) stripeAnnounced(peer int, h wire.Header, payload []byte) error {
	pr := c.peers[peer]
	tag := h.Step
	total, unit, frames, err := parseStripeAnnounce(payload)
	if err != nil {
		return fmt.Errorf("%s announced striped message %d on tag %d with %v: protocol error", c.mesh.Peer(peer), h.Seq, tag, err)
	}
	if c.p2p == 0 {
		return fmt.Errorf("%s announced striped message %d on tag %d, but this member has no point-to-point streams: protocol error", c.mesh.Peer(peer), h.Seq, tag)
	}
	pr.mu.Lock()
	defer pr.mu.Unlock()
	if pr.inflight[tag] != nil || h.Chunk != 0 || h.Seq != pr.last[tag]+1 {
		return fmt.Errorf("%s announced striped message %d on tag %d, this member expected frame 0 of message %d or a frame of the message arriving: protocol error", c.mesh.Peer(peer), h.Seq, tag, pr.last[tag]+1)
	}
	sm := &striped{seq: h.Seq, total: total, unit: unit, frames: frames, seen: make([]uint64, (frames+63)/64)}
	if req := pr.takePosted(tag); req != nil {
		req.state, req.seq, req.sm = filling, h.Seq, sm
		sm.req = req
	} else {
		if sum := c.unexpected.Add(int64(total)); sum > c.maxUnexpected {
			return fmt.Errorf("%s: %d bytes of messages wait for a matching Recv, over the limit of %s (message %d on tag %d): post receives earlier", c.mesh.Peer(peer), sum, fmtBytes(int(c.maxUnexpected)), h.Seq, tag)
		}
		sm.msg = &message{seq: h.Seq, data: make([]byte, total), done: make(chan struct{})}
		pr.unexpected[tag] = append(pr.unexpected[tag], sm.msg)
	}
	pr.last[tag] = h.Seq
	pr.striped[stripeKey{tag, h.Seq}] = sm
	close(pr.announced)
	pr.announced = make(chan struct{})
	return nil
}

// errReaderDone ends a point-to-point stream's reader without an error of
// its own (the communicator stopped, or the peer went before announcing a
// message whose frame arrived).
var errReaderDone = errors.New("point-to-point stream reader done")

// stripeFrame copies frame h of a striped message from peer into place (on
// the reader of a point-to-point stream). A frame may come before its
// announcement (another stream): it waits for it.
func (c *Comm) stripeFrame(peer int, h wire.Header, payload []byte) error {
	pr := c.peers[peer]
	key := stripeKey{h.Step, h.Seq}
	pr.mu.Lock()
	sm := pr.striped[key]
	for sm == nil {
		if h.Seq <= pr.last[h.Step] {
			pr.mu.Unlock()
			return fmt.Errorf("%s sent frame %d of striped message %d on tag %d, which is not arriving: protocol error", c.mesh.Peer(peer), h.Chunk, h.Seq, h.Step)
		}
		announced := pr.announced
		pr.mu.Unlock()
		select {
		case <-announced:
		case <-c.stop:
			return errReaderDone
		case <-pr.gone:
			return errReaderDone
		}
		pr.mu.Lock()
		sm = pr.striped[key]
	}
	i := int(h.Chunk)
	switch {
	case i >= sm.frames:
		pr.mu.Unlock()
		return fmt.Errorf("%s sent frame %d of striped message %d on tag %d, which has %d: protocol error", c.mesh.Peer(peer), i, h.Seq, h.Step, sm.frames)
	case len(payload) != sm.frameLen(i):
		pr.mu.Unlock()
		return fmt.Errorf("%s sent frame %d of striped message %d on tag %d with %d bytes, want %d: protocol error", c.mesh.Peer(peer), i, h.Seq, h.Step, len(payload), sm.frameLen(i))
	case sm.seen[i/64]&(1<<(i%64)) != 0:
		pr.mu.Unlock()
		return fmt.Errorf("%s sent frame %d of striped message %d on tag %d twice: protocol error", c.mesh.Peer(peer), i, h.Seq, h.Step)
	}
	sm.seen[i/64] |= 1 << (i % 64)
	sm.rw.RLock()
	dst := sm.dst()
	pr.mu.Unlock()
	if off := i * sm.unit; off < len(dst) {
		copy(dst[off:], payload)
	}
	sm.rw.RUnlock()
	pr.mu.Lock()
	defer pr.mu.Unlock()
	sm.got += len(payload)
	if sm.got < sm.total {
		return nil
	}
	delete(pr.striped, key)
	switch {
	case sm.req != nil:
		r := sm.req
		r.n, r.total = min(sm.total, len(r.buf)), sm.total
		r.state = complete
		close(r.done)
	case sm.msg != nil:
		sm.msg.complete = true
		close(sm.msg.done)
	}
	return nil
}

// detachStriped is detach for a striped message: it waits for the copies
// into req's buffer under way, then moves what arrived (and the gaps, which
// later frames fill) to the next posted Recv or the head of the queue.
// pr.mu is held.
func (c *Comm) detachStriped(pr *peer, tag uint32, req *recvReq) {
	sm := req.sm
	sm.rw.Lock()
	defer sm.rw.Unlock()
	sm.req = nil
	if sm.total > len(req.buf) {
		return // overflowed: the bytes past buf are gone; drop the rest
	}
	data := req.buf[:sm.total]
	if next := pr.takePosted(tag); next != nil {
		next.state, next.seq, next.sm = filling, sm.seq, sm
		copy(next.buf, data) // may overflow next.buf: then it fails with ErrTooLong
		sm.req = next
		return
	}
	m := &message{seq: sm.seq, data: slices.Clone(data), done: make(chan struct{})}
	c.unexpected.Add(int64(len(m.data)))
	pr.unexpected[tag] = append([]*message{m}, pr.unexpected[tag]...)
	sm.msg = m
}

// dispatchP2P reads peer's point-to-point stream i until the communicator
// stops or the stream ends: frames of striped messages go into place.
func (c *Comm) dispatchP2P(peer, i int) {
	defer c.wg.Done()
	defer c.peers[peer].readerDone()
	st := c.mesh.P2PStream(peer, i)
	for {
		err := st.Recv(c.dctx, func(h wire.Header, payload []byte) error {
			var err error
			switch {
			case h.Kind == wire.KindClose:
				return errReaderDone
			case h.Kind != wire.KindP2P || h.Flags&(wire.FlagStripe|wire.FlagLast) != 0:
				err = fmt.Errorf("%s sent a %s frame (flags %#02x) on point-to-point stream %d: protocol error", c.mesh.Peer(peer), h.Kind, h.Flags, i)
			default:
				err = c.stripeFrame(peer, h, payload)
			}
			if err != nil && err != errReaderDone {
				return &localError{err}
			}
			return err
		})
		if err == nil {
			continue
		}
		select {
		case <-c.stop:
			return
		default:
		}
		if !errors.Is(err, errReaderDone) && !errors.Is(err, transport.ErrPeerClosed) {
			c.readerEnded(peer, err)
		} // else the control stream says why the peer went
		return
	}
}
