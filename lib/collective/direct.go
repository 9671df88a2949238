package collective

import (
	"encoding/binary"
	"fmt"
	"sync/atomic"

	"github.com/gpubridge/gpubridge/lib/ntcopy"
	"github.com/gpubridge/gpubridge/lib/transport"
)

// The direct collectives read the peers' buffers in place, over a mesh
// that shares memory (transport.Sharer: shm). Each call begins with every
// member telling every other, on data stream 0, where its buffer lies in
// the memory it shares (a descriptor frame); when every member's buffer
// is shared the call runs directly, otherwise every member runs the
// collective's usual algorithm (the ring or the exchange), so all decide
// alike. Buffers below directMin bytes skip the descriptors (directMin2
// with two members, whose exchange is one hop where the direct path takes
// three).
//
// A direct collective cuts the members' buffers into pieces; each piece has
// an owner, who produces it (reduces it from every member's memory, or, for
// all_gather, owns it as its input). In the copy mode (all_gather, and
// all_reduce unless every member's mesh maps its peers writable) the owner
// writes the result into its own buffer and the other members then copy
// it from there into their own; in the write-through mode (all_reduce when
// every member's descriptor has descWritable) the owner writes the result
// into every member's buffer itself, and the others copy nothing. The
// frames that order this carry no data:
//
//   - ready (stepReady): the sender's input for a piece it does not own is
//     in place (only streamed members send them; a member whose input was
//     whole at the start says so in its descriptor); the owner reads the
//     sender's input of the piece only after it (and, writing through,
//     writes the result there only after reading that input);
//   - final (stepFinal): the owner produced the piece: in the copy mode the
//     others may copy it; writing through, it is in their buffers already,
//     and the owner has finished reading and writing their memory for it;
//   - copied (stepCopied, copy mode only): the sender copied every piece it
//     needed on this stream; a member returns only once every peer said
//     so, since until then they read its buffer.
//
// Writing through needs no copied round: a member's buffer is touched by
// others only as the owners of its pieces read its input there and write
// the results there, each owner before its final for the piece. So once a
// member produced its own pieces (it no longer touches its peers' buffers)
// and received every peer's final for every piece on every stream, nobody
// touches its buffer any more, and it may return.
//
// Piece i travels on stream streamOf(i), where one goroutine per stream
// produces or signals the stream's pieces in order and one per peer and
// stream reads that peer's frames (and, copying, copies its pieces), so the
// reductions and copies run on 2*Streams goroutines at once. In the copy
// mode a member writes only its own buffer and maps peers' memory
// read-only; writing through, each member writes the pieces it owns into
// its peers' buffers, mapped writable (transport.Config.PeerWrite), within
// the range each peer announced for the call (transport.Sharer.PeerMem
// returns only that).

// Steps of the direct collectives' frames: the descriptor's is apart from
// every other algorithm's, as it opens every call.
const (
	stepDesc   = maxStep
	stepReady  = 0
	stepFinal  = 1
	stepCopied = 2
)

// Flags of a descriptor.
const (
	descShared   = 1 << 0 // the buffer lies in a region shared with the peers
	descStreamed = 1 << 1 // its input becomes ready piece by piece: ready frames follow
	// descWritable: the peers may write the buffer (its member's mesh has
	// transport.Config.PeerWrite, so it also maps theirs writable). An
	// all_reduce writes through when every member's descriptor says so.
	descWritable = 1 << 2
)

// descSize is a descriptor's payload: region id, offset, flags.
const descSize = 24

// directMin is the smallest buffer (bytes per member) for which the
// members exchange descriptors: below it the round trips cost more than
// the copies they save (the ring of three or more members takes 2(n-1)
// hops, the direct path three); directMin2 is the same for two members.
// Variables for the tests.
var (
	directMin  = 64 << 10
	directMin2 = 1 << 20
)

// desc is where a member's buffer lies in the memory it shares.
type desc struct {
	id, off uint64
	flags   uint32
}

func (d desc) put(b []byte) {
	binary.LittleEndian.PutUint64(b, d.id)
	binary.LittleEndian.PutUint64(b[8:], d.off)
	binary.LittleEndian.PutUint32(b[16:], d.flags)
	binary.LittleEndian.PutUint32(b[20:], 0)
}

func parseDesc(b []byte) (desc, error) {
	d := desc{id: binary.LittleEndian.Uint64(b), off: binary.LittleEndian.Uint64(b[8:]), flags: binary.LittleEndian.Uint32(b[16:])}
	if d.flags&^(descShared|descStreamed|descWritable) != 0 || binary.LittleEndian.Uint32(b[20:]) != 0 {
		return d, fmt.Errorf("descriptor with unknown flags %#x: protocol error", d.flags)
	}
	return d, nil
}

// describe exchanges descriptors of buf (this member's input) with every
// peer when the mesh shares memory and buf is large enough. It returns
// them by member, or nil when the call is not to run directly.
func (c *Comm) describe(cl *call, buf []byte) ([]desc, error) {
	sh, ok := c.mesh.(transport.Sharer)
	if !ok || len(buf) < directMin || c.size == 2 && len(buf) < directMin2 {
		return nil, nil
	}
	var mine desc
	if id, off, ok := sh.Locate(buf); ok {
		mine = desc{id: id, off: off, flags: descShared}
		if cl.readyFn != nil {
			mine.flags |= descStreamed
		}
		if sh.PeerWrite() {
			mine.flags |= descWritable
		}
	}
	var b [descSize]byte
	mine.put(b[:])
	for p := range c.size {
		if p != c.self {
			if err := cl.send(c.mesh.Stream(p, 0), p, stepDesc, 0, b[:]); err != nil {
				return nil, err
			}
		}
	}
	descs := make([]desc, c.size)
	descs[c.self] = mine
	all := mine.flags&descShared != 0
	for p := range c.size {
		if p == c.self {
			continue
		}
		err := cl.recv(c.mesh.Stream(p, 0), 0, p, stepDesc, 0, descSize, true, func(pl []byte) error {
			var err error
			descs[p], err = parseDesc(pl)
			return err
		})
		if err != nil {
			return nil, err
		}
		all = all && descs[p].flags&descShared != 0
	}
	if !all {
		return nil, nil
	}
	return descs, nil
}

// writable reports whether every member's descriptor lets its peers
// write its buffer: then a direct all_reduce writes through.
func writable(descs []desc) bool {
	for _, d := range descs {
		if d.flags&descWritable == 0 {
			return false
		}
	}
	return true
}

// peerViews maps every peer's buffer of n bytes as its descriptor says
// (writable when the mesh maps peers writable: the views are exactly the
// peers' buffers, so no write lands outside them); release lets go of them
// (also after an error).
func (c *Comm) peerViews(cl *call, descs []desc, n int) (views [][]byte, release func(), err error) {
	sh := c.mesh.(transport.Sharer)
	views = make([][]byte, c.size)
	var rels []func()
	release = func() {
		for _, r := range rels {
			r()
		}
	}
	for p, d := range descs {
		if p == c.self {
			continue
		}
		v, rel, err := sh.PeerMem(cl.ctx, p, d.id, d.off, uint64(n))
		if err != nil {
			release()
			return nil, func() {}, cl.c.classify(cl.ctx, err, p, cl.limit, true, "its shared memory never arrived")
		}
		views[p] = v
		rels = append(rels, rel)
	}
	return views, release, nil
}

// copier is the copy of the pieces a member takes from its peers into
// buffers of L bytes (the direct collectives' copy mode, writing through
// stores with plainCopy; the rings' last step): with non-temporal stores
// when streamed(L), else the built-in copy. lib/ntcopy's copy fences its
// stores, so they are in memory before the final frame that announces
// them.
func (c *Comm) copier(L int) func(dst, src []byte) int {
	if c.streamed(L) {
		return func(dst, src []byte) int {
			streamedCopies.Add(1)
			return ntcopy.Copy(dst, src)
		}
	}
	return func(dst, src []byte) int { return copy(dst, src) }
}

// streamed says whether final bytes copied into a destination of L bytes
// go there with non-temporal stores: from Options.StreamBytes on (the
// destination is the caller's, read only after the call, and too large
// to stay in cache).
func (c *Comm) streamed(L int) bool { return c.stream >= 0 && L >= c.stream }

// streamedCopies counts the copies copier made with non-temporal stores
// (tests).
var streamedCopies atomic.Int64

// dpiece is one piece of a direct collective: its owner and its bytes
// [off, off+n) of the owner's buffer (and of this member's, for
// all_reduce); seg is the ring segment it lies in.
type dpiece struct{ owner, off, n, seg int }

// directPlan is what a direct collective does with its pieces.
type directPlan struct {
	pieces []dpiece
	// gather: pieces need no ready frames (their owner's input is the
	// piece).
	gather bool
	// copied: non-owners read the owners' buffers after the finals, so
	// the copied round ends the call (not when writing through).
	copied bool
	// ownEnd is the end of this member's input that piece i needs ready.
	ownEnd func(p *dpiece) int
	// produce is the owner's work on a piece (then it is final), take a
	// non-owner's part once a piece is final (its copy, or nothing but
	// Progress.Done when writing through); both report Progress.Done.
	produce func(p *dpiece) error
	take    func(p *dpiece) error
}

// pieceMin is the smallest piece of a direct collective: smaller buffers
// use fewer streams, as each piece costs a few frames and goroutine
// wake-ups (a variable for the tests).
var pieceMin = 256 << 10

// pieceSize is the piece of a direct collective over buffers of L bytes:
// about one piece per member and stream, at least pieceMin, at most the
// chunk, a whole number of 64-byte cache lines (so of every element size).
func (c *Comm) pieceSize(L int) int {
	p := L / (c.size * c.streams)
	p = min(max(p, pieceMin), max(c.chunk, pieceMin))
	return (p + 63) &^ 63
}

// streamOf is the stream piece i travels on.
func (c *Comm) streamOf(i int) int { return i / c.size % c.streams }

// runDirect runs a direct plan; descs say which peers stream their input.
func (c *Comm) runDirect(cl *call, pl *directPlan, descs []desc) error {
	S := c.streams
	byStream := make([][]int, S)
	for i := range pl.pieces {
		s := c.streamOf(i)
		byStream[s] = append(byStream[s], i)
	}
	for s := range S {
		if len(byStream[s]) == 0 {
			continue
		}
		d := &directStream{c: c, cl: cl, pl: pl, descs: descs, s: s, list: byStream[s],
			taken: make(chan struct{}, c.size)}
		if !pl.gather {
			nready := 0
			for _, i := range d.list {
				if pl.pieces[i].owner == c.self {
					nready += c.size - 1
				}
			}
			d.readies = make(chan int, nready)
		}
		cl.spawn(d.work)
		for p := range c.size {
			if p != c.self {
				cl.spawn(func() error { return d.receive(p) })
			}
		}
	}
	if err := cl.wait(); err != nil {
		return err
	}
	cl.movedDirect(pl)
	return nil
}

// movedDirect counts the bytes of a direct plan that crossed between
// members' memories as moved: what this member read of its peers' buffers
// or they wrote into its (received), and what they read of its or it wrote
// into theirs (sent, by the same plan). The two all_reduce modes move as
// many bytes, in other ways.
func (cl *call) movedDirect(pl *directPlan) {
	n, me := cl.c.size, cl.c.self
	var sent, received int
	for i := range pl.pieces {
		p := &pl.pieces[i]
		switch {
		case p.owner == me && pl.gather:
			sent += (n - 1) * p.n // every peer copies it
		case pl.gather:
			received += p.n
		case p.owner == me:
			// It reduces the piece from every peer's input (received);
			// every peer copies the result from it, or it writes the
			// result into every peer's buffer (sent).
			received, sent = received+(n-1)*p.n, sent+(n-1)*p.n
		default:
			// The owner reads its input of the piece (sent); it copies
			// the result from the owner, or the owner writes it here
			// (received).
			received, sent = received+p.n, sent+p.n
		}
	}
	cl.st.sent.Add(int64(sent))
	cl.st.received.Add(int64(received))
}

// directStream is one stream's part of a direct collective.
type directStream struct {
	c       *Comm
	cl      *call
	pl      *directPlan
	descs   []desc
	s       int
	list    []int         // its pieces, in order
	readies chan int      // pieces whose ready frame arrived, one entry per frame
	taken   chan struct{} // a receiver of this stream copied all its pieces
}

func (d *directStream) streamed(p int) bool { return d.descs[p].flags&descStreamed != 0 }

// work produces the stream's own pieces and signals the others' readiness,
// then (copy mode) tells every peer that this member copied what it
// needed.
func (d *directStream) work() error {
	c, cl, me := d.c, d.cl, d.c.self
	count := map[int]int{}
	need := 0
	if !d.pl.gather {
		for p := range c.size {
			if p != me && d.streamed(p) {
				need++
			}
		}
	}
	for _, i := range d.list {
		pc := &d.pl.pieces[i]
		switch {
		case pc.owner == me:
			if err := cl.ready(d.pl.ownEnd(pc)); err != nil {
				return err
			}
			for count[i] < need {
				select {
				case j := <-d.readies:
					count[j]++
				case <-cl.ctx.Done():
					return errSibling
				}
			}
			if err := d.pl.produce(pc); err != nil {
				return err
			}
			for p := range c.size {
				if p != me {
					if err := cl.send(c.mesh.Stream(p, d.s), p, stepFinal, i, nil); err != nil {
						return err
					}
				}
			}
		case !d.pl.gather && d.streamed(me):
			if err := cl.ready(d.pl.ownEnd(pc)); err != nil {
				return err
			}
			if err := cl.send(c.mesh.Stream(pc.owner, d.s), pc.owner, stepReady, i, nil); err != nil {
				return err
			}
		}
	}
	if !d.pl.copied {
		return nil
	}
	for range c.size - 1 {
		if err := cl.await(d.taken); err != nil {
			return err
		}
	}
	for p := range c.size {
		if p != me {
			if err := cl.send(c.mesh.Stream(p, d.s), p, stepCopied, 0, nil); err != nil {
				return err
			}
		}
	}
	return nil
}

// receive reads peer p's frames on the stream: readies of this member's
// pieces, finals of p's (whose bytes it copies, in the copy mode), then
// p's copied (copy mode).
func (d *directStream) receive(p int) error {
	c, cl, me := d.c, d.cl, d.c.self
	st := c.mesh.Stream(p, d.s)
	primary := c.size == 2
	noop := func([]byte) error { return nil }
	for _, i := range d.list {
		pc := &d.pl.pieces[i]
		switch {
		case pc.owner == me && !d.pl.gather && d.streamed(p):
			if err := cl.recv(st, d.s, p, stepReady, i, 0, true, noop); err != nil {
				return err
			}
			d.readies <- i
		case pc.owner == p:
			if err := cl.recv(st, d.s, p, stepFinal, i, 0, primary, noop); err != nil {
				return err
			}
			if err := d.pl.take(pc); err != nil {
				return err
			}
		}
	}
	if !d.pl.copied {
		return nil
	}
	d.taken <- struct{}{}
	return cl.recv(st, d.s, p, stepCopied, 0, 0, primary, noop)
}
