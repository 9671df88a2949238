package collective

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"os"
	"runtime"
	"sync"
	"sync/atomic"
	"time"

	"github.com/gpubridge/gpubridge/lib/transport"
	"github.com/gpubridge/gpubridge/lib/wire"
)

// Defaults and limits.
const (
	// DefaultChunkBytes is the pipelining unit when Options.ChunkBytes is 0.
	DefaultChunkBytes = 4 << 20
	// DefaultTimeout bounds one call whose context has no deadline.
	DefaultTimeout = 5 * time.Minute
	// DefaultMaxUnexpected bounds the bytes of point-to-point messages that
	// have arrived before a matching Recv, over all peers and tags.
	DefaultMaxUnexpected = 1 << 30
	// DefaultSmallBytes is the largest all_reduce (bytes per member) that
	// runs recursive doubling when Options.SmallBytes is 0 (doc.go has the
	// measurements it comes from).
	DefaultSmallBytes = 32 << 10
	// DefaultSplitBytes is the smallest all_reduce (bytes per member) that
	// two members split into halves when Options.SplitBytes is 0
	// (docs/BENCHMARKS.md, issue 12, has the measurements it comes from:
	// 64 MiB until the halves' second steps were read straight into the
	// destination over TCP, which made the ring of two 1.05-1.11x the
	// exchange at 16 and 32 MiB).
	DefaultSplitBytes = 16 << 20
	// DefaultStreamBytes is Options.StreamBytes when it is 0: above the
	// 64 MiB buffers that the caches of the 16-core H200 host still helped
	// (30 GB/s there against 23 GB/s at 256 MiB: docs/BENCHMARKS.md, issue
	// 12), so that the sizes that fit keep their cached results.
	DefaultStreamBytes = 128 << 20
	// MaxMembers is the largest bridge the collectives run on (the frame
	// header has 11 bits for the algorithm step).
	MaxMembers = 1024
)

// Options tune a Comm. The zero value gives the defaults.
type Options struct {
	// ChunkBytes is the pipelining unit: collectives cut buffers into
	// chunks of this size (rounded down to whole elements), each one frame,
	// spread over the data streams. Default DefaultChunkBytes; at most
	// wire.MaxPayload. Every member must use the same value.
	ChunkBytes int
	// Workers is the number of goroutines that reduce concurrently,
	// default runtime.NumCPU().
	Workers int
	// Timeout is the deadline of one call whose context has none, default
	// DefaultTimeout.
	Timeout time.Duration
	// SmallBytes is the largest all_reduce, in bytes per member, that three
	// or more members run by recursive doubling (allreduce_rd.go) rather
	// than the ring or the direct path: default DefaultSmallBytes; a
	// negative value turns recursive doubling off. It decides the order of
	// the sums, so every member must use the same value (it is part of an
	// all_reduce's argument fingerprint).
	SmallBytes int
	// SplitBytes is the smallest all_reduce, in bytes per member, that
	// two members run through the transport as a reduce-scatter then an
	// all-gather (the ring of two: each member reduces the half it owns
	// and sends it back) rather than the exchange, where each reduces the
	// whole buffer: the same bytes on the wire, half the reduction and
	// half the reads of the destination. Default DefaultSplitBytes; a
	// negative value never splits. Both orders of the sums are the same
	// (x0 op x1), but the members must run the same algorithm, so every
	// member must use the same value (it is part of a 2-member
	// all_reduce's argument fingerprint).
	SplitBytes int
	// StreamBytes is the smallest destination (the all_reduce's buffer,
	// the all_gather's output), in bytes, into which the direct
	// collectives over shared memory (direct.go), and the rings' last
	// step over any transport (whose received bytes are final and not
	// forwarded), copy with non-temporal stores (lib/ntcopy): past the
	// caches an ordinary copy reads every destination line before writing
	// it (a read for ownership), a third more memory traffic; below it the
	// copies stay in cache for the caller. Default DefaultStreamBytes; a
	// negative value turns it off. It changes no result, so members may
	// differ.
	StreamBytes int
	// Overlap says whether a data stream that hands out frames in pieces
	// the receiver may hold (transport.PieceHolder: TCP) is read by one
	// goroutine while another reduces the pieces already in (pipe.go), so
	// that the kernel's copy out of the socket and the reduction run at
	// once, on two cores. OverlapAuto (the default) is OverlapOff on
	// every host so far (see Overlap.on). It changes no result, so
	// members may differ.
	Overlap Overlap
	// Log receives a record when the communicator breaks; nil discards.
	Log *slog.Logger
}

// Overlap is Options.Overlap.
type Overlap int8

const (
	// OverlapAuto: whatever Overlap.on says (off, so far).
	OverlapAuto Overlap = iota
	// OverlapOn: read and reduce a stream's pieces on two goroutines.
	OverlapOn
	// OverlapOff: one goroutine per stream reads a piece, reduces it,
	// then reads the next.
	OverlapOff
)

// on resolves o: OverlapAuto is off wherever it was measured. Reading
// ahead was to let the kernel's copy and the reduction run on two cores;
// with 8 streams each stream's sender and receiver (and the reductions'
// helpers) keep the cores busy already, and the hand-overs cost more than
// they save: the 2-member TCP all_reduce ran 10-20% slower with it on on
// the 2-core development box, and on the 16-core H200 host (52e06f4,
// host-bridge-bench) 8.3-8.6 GB/s on against 9.2-9.6 off at 256 MiB and
// 1 GiB, 4 members 3.1 against 3.5. A host where it pays (more cores per
// stream) would give auto a rule here.
func (o Overlap) on() bool { return o == OverlapOn }

func (o Overlap) String() string {
	switch o {
	case OverlapAuto:
		return "auto"
	case OverlapOn:
		return "on"
	case OverlapOff:
		return "off"
	}
	return fmt.Sprintf("Overlap(%d)", int8(o))
}

// ParseOverlap reads "auto", "on" or "off" (what String writes).
func ParseOverlap(s string) (Overlap, error) {
	switch s {
	case "auto":
		return OverlapAuto, nil
	case "on":
		return OverlapOn, nil
	case "off":
		return OverlapOff, nil
	}
	return OverlapAuto, fmt.Errorf("overlap %q: want auto, on or off", s)
}

// Errors a call's error can be tested for with errors.Is.
var (
	// ErrBroken: an earlier failure broke the communicator; every later
	// call fails at once with it.
	ErrBroken = errors.New("bridge broken by an earlier failure")
	// ErrClosed: the communicator was closed.
	ErrClosed = errors.New("communicator closed")
	// ErrInvalid: the arguments are wrong (a local misuse, found before
	// anything was sent; the communicator stays usable).
	ErrInvalid = errors.New("invalid arguments")
	// ErrTooLong: a received message is longer than the Recv buffer.
	ErrTooLong = errors.New("message longer than the buffer")
)

// Error is the error of a failed call.
type Error struct {
	Op   string // "all_reduce", "broadcast", "all_gather", "reduce_scatter", "barrier", "send", "recv"
	Seq  uint64 // collective sequence number, or P2P message number; 0 if none was assigned
	Desc string // the arguments: "float32 sum, 64 MiB"
	Err  error
}

func (e *Error) Error() string {
	s := e.Op
	if e.Seq != 0 {
		s += fmt.Sprintf(" #%d", e.Seq)
	}
	if e.Desc != "" {
		s += " (" + e.Desc + ")"
	}
	return s + ": " + e.Err.Error()
}

func (e *Error) Unwrap() error { return e.Err }

// brokenError is what calls on a broken communicator return.
type brokenError struct{ cause error }

func (e *brokenError) Error() string   { return ErrBroken.Error() + ": " + e.cause.Error() }
func (e *brokenError) Unwrap() []error { return []error{ErrBroken, e.cause} }
func invalid(format string, a ...any) error {
	return fmt.Errorf("%w: "+format, append([]any{ErrInvalid}, a...)...)
}

// Comm runs collectives and point-to-point messages over a mesh. Create it
// with New on every member; Close it when done.
type Comm struct {
	mesh                transport.Mesh
	self, size, streams int
	p2p                 int // point-to-point streams per peer (striped messages); 0: none
	stripeMin           int // the smallest message striped (defaultStripeMin; tests lower it)
	stripeUnit          int // the smallest frame of a striped message (defaultStripeFrame)
	chunk               int
	stream              int  // Options.StreamBytes resolved: -1 off
	small               int  // Options.SmallBytes resolved: -1 off
	split               int  // Options.SplitBytes resolved: -1 off
	overlap             bool // Options.Overlap resolved
	workers             int
	timeout             time.Duration
	log                 *slog.Logger
	maxUnexpected       int64

	collMu  sync.Mutex // serialises collectives
	seq     atomic.Uint64
	algo    atomic.Int32  // the algorithm of the last collective, an index of algoNames
	scratch []byte        // reduce_scatter partials, reused (under collMu)
	packed  []byte        // a lossy all_reduce's packing of the buffer, reused (under collMu)
	zstd    []zstdScratch // per data stream, a lossless call's frames, reused (under collMu)

	mu       sync.Mutex
	cur      *call  // the collective in progress
	finished uint64 // seq of the last collective that ended
	last     Stats  // its stats
	cause    error  // why the communicator stopped (ErrClosed when closed)
	closed   bool
	stop     chan struct{} // closed with cause set
	lost     error         // the first peer lost (its control stream ended), or nil
	lostCh   chan struct{} // closed with lost set
	bq       [][]token     // barrier tokens received, per peer
	bnote    []chan struct{}

	peers      []*peer // point-to-point state, nil for self
	unexpected atomic.Int64

	dctx    context.Context // dispatchers
	dcancel context.CancelFunc
	wg      sync.WaitGroup
}

// New returns the communicator of this member over mesh and starts reading
// its control streams. The Comm owns the mesh: Close closes it, a failure
// aborts it.
func New(mesh transport.Mesh, o Options) *Comm {
	return newComm(mesh, o, DefaultMaxUnexpected)
}

func newComm(mesh transport.Mesh, o Options, maxUnexpected int64) *Comm {
	c := &Comm{
		mesh:          mesh,
		self:          mesh.Self(),
		size:          mesh.Size(),
		streams:       mesh.Streams(),
		p2p:           mesh.P2PStreams(),
		stripeMin:     defaultStripeMin,
		stripeUnit:    defaultStripeFrame,
		chunk:         o.ChunkBytes,
		workers:       o.Workers,
		timeout:       o.Timeout,
		log:           o.Log,
		maxUnexpected: maxUnexpected,
		stop:          make(chan struct{}),
		lostCh:        make(chan struct{}),
	}
	if c.chunk <= 0 {
		c.chunk = DefaultChunkBytes
	}
	c.small = resolveThreshold(o.SmallBytes, DefaultSmallBytes)
	c.split = resolveThreshold(o.SplitBytes, DefaultSplitBytes)
	c.stream = o.StreamBytes
	switch {
	case c.stream == 0:
		c.stream = DefaultStreamBytes
	case c.stream < 0:
		c.stream = -1
	}
	c.chunk = min(c.chunk, wire.MaxPayload)
	c.overlap = o.Overlap.on()
	if c.workers <= 0 {
		c.workers = runtime.NumCPU()
	}
	if c.timeout <= 0 {
		c.timeout = DefaultTimeout
	}
	if c.log == nil {
		c.log = slog.New(slog.DiscardHandler)
	}
	c.bq = make([][]token, c.size)
	c.bnote = make([]chan struct{}, c.size)
	c.peers = make([]*peer, c.size)
	c.dctx, c.dcancel = context.WithCancel(context.Background())
	for p := range c.size {
		if p == c.self {
			continue
		}
		c.bnote[p] = make(chan struct{}, 1)
		c.peers[p] = newPeer(c.p2p)
		c.wg.Add(1 + c.p2p)
		go c.dispatch(p)
		for i := range c.p2p {
			go c.dispatchP2P(p, i)
		}
	}
	return c
}

// Mesh returns the mesh the communicator runs over.
func (c *Comm) Mesh() transport.Mesh { return c.mesh }

// Algorithms a collective runs (Comm.Algorithm).
const (
	AlgoExchange = "exchange" // two members send each other their buffers in chunks through the transport
	AlgoRing     = "ring"     // the pipelined ring through the transport
	AlgoChain    = "chain"    // broadcast: a chain from the root
	AlgoDirect   = "direct"   // the members read each other's shared buffers (direct.go)
	AlgoLocal    = "local"    // one member or an empty buffer: nothing travels
	// AlgoDirectWrite: the direct all_reduce, writing through: each
	// piece's owner reads it from every member's shared buffer and writes
	// the result into every member's (direct.go; every member's mesh has
	// transport.Config.PeerWrite).
	AlgoDirectWrite = "direct-write"
	// AlgoRecursiveDoubling: small all_reduces of three or more members,
	// log2 rounds of whole-buffer exchanges (allreduce_rd.go).
	AlgoRecursiveDoubling = "recursive_doubling"
)

var algoNames = []string{"", AlgoExchange, AlgoRing, AlgoChain, AlgoDirect, AlgoLocal, AlgoRecursiveDoubling, AlgoDirectWrite}

// Algorithm returns the algorithm the last collective ran (AlgoRing,
// AlgoDirect, ...), "" before any.
func (c *Comm) Algorithm() string { return algoNames[c.algo.Load()] }

// ran records the algorithm of the collective in progress (one of the
// Algo constants).
func (c *Comm) ran(algo string) {
	for i, a := range algoNames {
		if a == algo {
			c.algo.Store(int32(i))
			return
		}
	}
	panic("collective: unknown algorithm " + algo)
}

// Seq returns the number of collectives started so far (completed or not);
// the next collective is number Seq()+1.
func (c *Comm) Seq() uint64 { return c.seq.Load() }

// Close stops the communicator: calls in progress fail, later calls return
// ErrClosed, the mesh is closed and the control stream readers end before
// Close returns. Close may be called more than once.
func (c *Comm) Close() error {
	c.mu.Lock()
	if c.closed {
		c.mu.Unlock()
		return nil
	}
	c.closed = true
	c.mu.Unlock()
	c.stopWith(ErrClosed)
	c.dcancel()
	err := c.mesh.Close()
	c.wg.Wait()
	return err
}

// state returns nil while the communicator works, else the error calls get.
func (c *Comm) state() error {
	c.mu.Lock()
	defer c.mu.Unlock()
	return c.stateLocked()
}

func (c *Comm) stateLocked() error {
	switch {
	case c.cause == nil && c.lost == nil:
		return nil
	case c.cause == nil:
		return &brokenError{c.lost}
	case c.closed || c.cause == ErrClosed:
		return ErrClosed
	}
	return &brokenError{c.cause}
}

// hardState is state for point-to-point calls: a lost peer does not stop
// messages to and from the others.
func (c *Comm) hardState() error {
	c.mu.Lock()
	defer c.mu.Unlock()
	if c.cause == nil {
		return nil
	}
	return c.stateLocked()
}

// reason returns the best account of why the communicator stopped or lost
// a peer: the cause of a break, else the loss, else nil.
func (c *Comm) reason() error {
	c.mu.Lock()
	defer c.mu.Unlock()
	if c.cause != nil && c.cause != ErrClosed {
		return c.cause
	}
	return c.lost
}

// lose records that peer's control stream ended with err: the peer closed,
// died or aborted. It is a softer break than fail: the collective in
// progress goes on (it fails by itself if it still needs that peer, and it
// may not: the peer may have closed right after finishing it), but calls
// waiting on the control stream of that peer fail, and later calls are
// refused with err.
func (c *Comm) lose(peer int, err error) {
	c.mu.Lock()
	first := c.lost == nil
	if first {
		c.lost = err
		close(c.lostCh)
	}
	c.mu.Unlock()
	pr := c.peers[peer]
	closed := false
	pr.goneMu.Do(func() {
		pr.lost = err
		close(pr.gone)
		closed = true
	})
	if !closed {
		return // a reader of another of its streams told it first
	}
	// A peer that closed its end in order (it finished, like this member
	// will) is news only when a later call needs it.
	if errors.Is(err, transport.ErrPeerClosed) {
		c.log.Debug("bridge member closed", "member", c.self, "peer", peer, "err", err)
	} else {
		c.log.Warn("bridge member lost", "member", c.self, "peer", peer, "err", err)
	}
}

// memberOf returns the member Mesh.Peer describes as desc, or -1.
func (c *Comm) memberOf(desc string) int {
	for p := range c.size {
		if p != c.self && c.mesh.Peer(p) == desc {
			return p
		}
	}
	return -1
}

// causeNow returns why the communicator stopped, or nil.
func (c *Comm) causeNow() error {
	c.mu.Lock()
	defer c.mu.Unlock()
	return c.cause
}

// stopWith makes cause the communicator's cause unless it has one already,
// and cancels the collective in progress with it. It returns the cause
// that stands and whether it is this one.
func (c *Comm) stopWith(cause error) (error, bool) {
	c.mu.Lock()
	if c.cause != nil {
		prev := c.cause
		c.mu.Unlock()
		return prev, false
	}
	c.cause = cause
	close(c.stop)
	cur := c.cur
	c.mu.Unlock()
	if cur != nil {
		cur.cancel(cause)
	}
	return cause, true
}

// fail breaks the communicator with cause, unless it has stopped already:
// the collective in progress is cancelled, waiting calls wake, and the mesh
// is aborted so that the peers fail promptly with cause's text. It returns
// the cause that stands (an earlier one if there was one).
func (c *Comm) fail(cause error) error {
	if prev, ok := c.stopWith(cause); !ok {
		return prev
	}
	c.log.Error("bridge broken", "member", c.self, "err", cause)
	c.mesh.Abort(cause)
	return cause
}

// deadline applies Options.Timeout to a context without a deadline, and
// returns the time limit the call runs under, for messages.
func (c *Comm) deadline(ctx context.Context) (context.Context, context.CancelFunc, time.Duration) {
	if dl, ok := ctx.Deadline(); ok {
		ctx, cancel := context.WithCancel(ctx)
		return ctx, cancel, time.Until(dl).Round(time.Millisecond)
	}
	ctx, cancel := context.WithTimeout(ctx, c.timeout)
	return ctx, cancel, c.timeout
}

// workersPer is the number of reduction goroutines each of k concurrent
// reducers gets.
func (c *Comm) workersPer(k int) int { return max(1, (c.workers+k-1)/k) }

// chunkFor is the chunk size for elements of size es: ChunkBytes rounded
// down to whole elements, at least one element.
func (c *Comm) chunkFor(es int) int { return max(es, c.chunk-c.chunk%es) }

// timeoutError is a call that ran out of time waiting for someone.
type timeoutError struct {
	after   time.Duration
	who     string
	hint    string
	primary bool // the member named is likely the cause (not waiting for someone else)
	// likely: not primary, but the member named waits for at most one
	// other, who would be primary: report after half the grace.
	likely bool
}

func (e *timeoutError) Error() string {
	s := "timed out after " + fmtDuration(e.after) + " waiting for " + e.who
	if e.hint != "" {
		s += " (" + e.hint + ")"
	}
	return s
}

func (e *timeoutError) Unwrap() error { return context.DeadlineExceeded }

// classify turns the error of a transport operation on peer into the error
// a call reports. hint and primary describe a timeout.
func (c *Comm) classify(ctx context.Context, err error, peer int, limit time.Duration, primary bool, hint string) error {
	// A transport's I/O deadline is the context's, and may fire an instant
	// before the context itself reports it: a deadline error is a timeout
	// either way.
	deadline := errors.Is(err, context.DeadlineExceeded) || errors.Is(err, os.ErrDeadlineExceeded)
	if ctx.Err() != nil || deadline {
		cause := context.Cause(ctx)
		if cause == nil {
			cause = context.DeadlineExceeded
		}
		switch {
		case cause == errSibling:
			return errSibling
		case errors.Is(cause, context.DeadlineExceeded):
			who := "the input to become ready (Progress.Ready)"
			if peer >= 0 {
				who = c.mesh.Peer(peer)
			}
			return &timeoutError{after: limit, who: who, hint: hint, primary: primary}
		case cause == context.Canceled:
			return fmt.Errorf("cancelled by the caller: %w", cause)
		}
		return cause
	}
	var le *localError
	if errors.As(err, &le) {
		return le.err
	}
	if errors.Is(err, transport.ErrClosed) {
		if cause := c.causeNow(); cause != nil {
			return cause
		}
		return fmt.Errorf("this member's mesh was closed or aborted under the call: %w", err)
	}
	var pe *transport.PeerError
	if errors.As(err, &pe) || peer < 0 {
		return err
	}
	return &transport.PeerError{Peer: c.mesh.Peer(peer), Err: err}
}

// localError carries an error found by this member (a protocol check, a
// reduction) out of a Stream.Recv callback unchanged.
type localError struct{ err error }

func (e *localError) Error() string { return e.err.Error() }
func (e *localError) Unwrap() error { return e.err }

// errSibling stops the goroutines of a call after one of them failed.
var errSibling = errors.New("stopped: another part of the call failed")

// graceFor is how long a member that timed out waiting for a member that
// is itself waiting gives the others to report the root cause first.
func graceFor(limit time.Duration) time.Duration {
	return min(max(limit/10, 50*time.Millisecond), 2*time.Second)
}
