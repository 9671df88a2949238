package collective

import (
	"bytes"
	"context"
	"encoding/binary"
	"fmt"
	"math"
	"math/rand/v2"
	"slices"
	"sync"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	"go.uber.org/goleak"

	"github.com/gpubridge/gpubridge/lib/reduce"
	"github.com/gpubridge/gpubridge/lib/transport"
	"github.com/gpubridge/gpubridge/lib/wire"
)

func TestMain(m *testing.M) { goleak.VerifyTestMain(m) }

// cluster is the communicators of one in-memory bridge.
type cluster struct {
	meshes []transport.Mesh
	comms  []*Comm
}

func newCluster(t testing.TB, n, streams int, o Options) *cluster {
	t.Helper()
	return newClusterLimit(t, n, streams, o, DefaultMaxUnexpected)
}

func newClusterLimit(t testing.TB, n, streams int, o Options, maxUnexpected int64) *cluster {
	t.Helper()
	meshes := transport.NewMem(n, streams, true)
	if stripedP2P {
		meshes = transport.NewMemP2P(n, streams, testP2PStreams, true)
	}
	for i, m := range meshes {
		switch {
		case noHold:
			meshes[i] = noHoldMesh{m}
		case piecesHold:
			meshes[i] = pieceHoldMesh{m}
		case pieces:
			meshes[i] = pieceMesh{m}
		}
	}
	if piecesHold && o.Overlap == OverlapAuto {
		o.Overlap = OverlapOn // auto is off
	}
	cl := newClusterMesh(t, meshes, o, maxUnexpected)
	if stripedP2P {
		for _, c := range cl.comms {
			c.stripeMin, c.stripeUnit = testStripeMin, 64
		}
	}
	return cl
}

// stripedP2P makes newCluster's meshes have testP2PStreams point-to-point
// streams and its communicators stripe messages from testStripeMin bytes.
var stripedP2P bool

const (
	testP2PStreams = 3
	testStripeMin  = testChunk
)

// noHold makes newCluster's streams hide transport.Holder, so that the
// collectives take the Recv path.
var noHold bool

type noHoldMesh struct{ transport.Mesh }

// noHoldStream has only the methods of transport.Stream.
type noHoldStream struct{ transport.Stream }

func (m noHoldMesh) Stream(peer, i int) transport.Stream {
	return noHoldStream{m.Mesh.Stream(peer, i)}
}

// pieces makes newCluster's streams hand out frames in small pieces
// (transport.PieceReceiver), as TCP streams do.
var pieces bool

type pieceMesh struct{ transport.Mesh }

// pieceStream cuts every frame Recv returns into pieces of testPiece bytes.
type pieceStream struct{ transport.Stream }

const testPiece = 128

func (m pieceMesh) Stream(peer, i int) transport.Stream { return pieceStream{m.Mesh.Stream(peer, i)} }

func (s pieceStream) PieceSize() int { return testPiece }

func (s pieceStream) RecvPieces(ctx context.Context, check func(wire.Header) error, fn func(off int, p []byte) error) error {
	return s.Recv(ctx, func(h wire.Header, p []byte) error {
		if err := check(h); err != nil {
			return err
		}
		for off := 0; off < len(p); off += testPiece {
			if err := fn(off, p[off:min(off+testPiece, len(p))]); err != nil {
				return err
			}
		}
		return nil
	})
}

// The collectives work over streams that hand out pieces (TCP's path).
func TestPieces(t *testing.T) {
	pieces = true
	defer func() { pieces = false }()
	runCore(t)
}

// slowStream returns from Send a while after the frame went out, so that
// the peer's chunk arrives before this member's send of the same chunk is
// done: the receiver keeps it in its spill buffer.
type slowStream struct{ pieceStream }

func (s slowStream) Send(ctx context.Context, h wire.Header, p []byte) error {
	err := s.pieceStream.Send(ctx, h, p)
	time.Sleep(200 * time.Microsecond)
	return err
}

// slowHoldStream is slowStream over a pieceHoldStream.
type slowHoldStream struct{ pieceHoldStream }

func (s slowHoldStream) Send(ctx context.Context, h wire.Header, p []byte) error {
	err := s.pieceHoldStream.Send(ctx, h, p)
	time.Sleep(200 * time.Microsecond)
	return err
}

// slowMesh's streams are slowStreams, or with hold slowHoldStreams.
type slowMesh struct {
	transport.Mesh
	hold bool
}

func (m slowMesh) Stream(peer, i int) transport.Stream {
	if m.hold {
		return slowHoldStream{newPieceHoldStream(m.Mesh.Stream(peer, i))}
	}
	return slowStream{pieceStream{m.Mesh.Stream(peer, i)}}
}

// Chunks that arrive before the send they depend on wait in the spill
// buffer; the results stay exact, with the reading of the pieces
// overlapped with their reduction (hold) or not.
func TestPiecesSpill(t *testing.T) {
	for _, hold := range []bool{false, true} {
		for _, members := range []int{2, 3} {
			t.Run(fmt.Sprintf("hold=%v/members=%d", hold, members), func(t *testing.T) { testPiecesSpill(t, members, hold) })
		}
	}
}

func testPiecesSpill(t *testing.T, members int, hold bool) {
	meshes := transport.NewMem(members, 2, false)
	for i, m := range meshes {
		meshes[i] = slowMesh{m, hold}
	}
	beforeOverlaps := overlaps.Load()
	cl := newClusterMesh(t, meshes, Options{ChunkBytes: testChunk, SmallBytes: -1, Overlap: OverlapOn}, DefaultMaxUnexpected)
	rng := rand.New(rand.NewPCG(21, uint64(members)))
	inputs := make([][]byte, members)
	for m := range inputs {
		inputs[m] = randData(rng, reduce.Float32, 20*testChunk/4+3)
	}
	want := wantAllReduce(cl.comms[0], reduce.Sum, reduce.Float32, inputs)
	before := spills.Load()
	bufs := make([][]byte, members)
	requireNoErrors(t, cl.each(func(m int, c *Comm) error {
		bufs[m] = slices.Clone(inputs[m])
		return c.AllReduce(context.Background(), bufs[m], reduce.Float32, reduce.Sum, nil)
	}))
	for m := range bufs {
		requireBits(t, want, bufs[m], 4, "member %d", m)
	}
	if members == 2 {
		// (The ring's receives depend on sends of earlier steps.)
		assert.Positive(t, spills.Load()-before, "no chunk went through the spill buffer")
		// The call's stats say so: the receivers waited for their sends
		// and copied the pieces aside meanwhile.
		var wait time.Duration
		var spilled uint64
		for _, c := range cl.comms {
			var st Stats
			require.True(t, c.LastStats(&st))
			wait += st.SendWait
			spilled += st.Spilled
			assert.LessOrEqual(t, st.Spilled, uint64(len(bufs[0])), "more spilled than received")
		}
		assert.Positive(t, wait, "Stats.SendWait")
		assert.Positive(t, spilled, "Stats.Spilled")
	}
	requireOverlapped(t, hold, beforeOverlaps)
}

// The collectives work over streams that cannot hold frames (Recv path).
func TestRecvFallback(t *testing.T) {
	noHold = true
	defer func() { noHold = false }()
	runCore(t)
}

// runCore runs the tests of every collective and of their failures.
func runCore(t *testing.T) {
	t.Run("AllReduce", TestAllReduce)
	t.Run("Broadcast", TestBroadcast)
	t.Run("AllGather", TestAllGather)
	t.Run("ReduceScatter", TestReduceScatter)
	t.Run("Ready", TestReady)
	t.Run("Mismatch", TestMismatch)
	t.Run("StalledMember", TestStalledMember)
	t.Run("PeerClosed", TestPeerClosed)
	// Compressed frames are received whole over every stream.
	t.Run("CodecLossless", TestCodecLossless)
	t.Run("AllReduceCodecSpecials", TestAllReduceCodecSpecials)
	t.Run("CodecReady", TestCodecReady)
}

func newClusterMesh(t testing.TB, meshes []transport.Mesh, o Options, maxUnexpected int64) *cluster {
	t.Helper()
	cl := &cluster{meshes: meshes}
	for _, m := range cl.meshes {
		cl.comms = append(cl.comms, newComm(m, o, maxUnexpected))
	}
	t.Cleanup(cl.close)
	return cl
}

func (cl *cluster) close() {
	for _, c := range cl.comms {
		_ = c.Close()
	}
}

// each runs f for every member at once and returns their errors.
func (cl *cluster) each(f func(m int, c *Comm) error) []error {
	errs := make([]error, len(cl.comms))
	var wg sync.WaitGroup
	for m, c := range cl.comms {
		wg.Go(func() { errs[m] = f(m, c) })
	}
	wg.Wait()
	return errs
}

func requireNoErrors(t testing.TB, errs []error) {
	t.Helper()
	for m, err := range errs {
		require.NoError(t, err, "member %d", m)
	}
}

// specialBits are interesting raw values of the floating dtypes: zeros,
// denormals, infinities, quiet and signalling NaNs with payloads.
var specialBits = map[reduce.DType][]uint64{
	reduce.Float16:  {0x0000, 0x8000, 0x0001, 0x83ff, 0x0400, 0x7bff, 0x7c00, 0xfc00, 0x7e00, 0xfe01, 0x7d00, 0x7c01},
	reduce.BFloat16: {0x0000, 0x8000, 0x0001, 0x807f, 0x0080, 0x7f7f, 0x7f80, 0xff80, 0x7fc0, 0xffc1, 0x7f81, 0x7fa5},
	reduce.Float32: {0, 0x80000000, 1, 0x807fffff, 0x00800000, 0x7f7fffff, 0x7f800000, 0xff800000,
		0x7fc00000, 0xffc00001, 0x7f800001, 0x7fa5a5a5},
	reduce.Float64: {0, 1 << 63, 1, 0x800fffffffffffff, 0x0010000000000000, 0x7fefffffffffffff,
		0x7ff0000000000000, 0xfff0000000000000, 0x7ff8000000000000, 0xfff8000000000001, 0x7ff0000000000001, 0x7ff4a5a5a5a5a5a5},
}

// randData returns n random elements of dt: for the floating dtypes mostly
// ordinary values of either sign, with random bit patterns and the special
// values above mixed in.
func randData(rng *rand.Rand, dt reduce.DType, n int) []byte {
	es := dt.Size()
	b := make([]byte, n*es)
	for i := range n {
		e := b[i*es : (i+1)*es]
		var bits uint64
		r := rng.IntN(16)
		switch {
		case !dt.IsFloat() || r == 0:
			bits = rng.Uint64()
		case r == 1:
			sp := specialBits[dt]
			bits = sp[rng.IntN(len(sp))]
		default:
			f := (rng.Float64()*4 - 2) * math.Pow(2, float64(rng.IntN(9)-4))
			switch dt {
			case reduce.Float16:
				bits = uint64(reduce.F32ToF16(float32(f)))
			case reduce.BFloat16:
				bits = uint64(reduce.F32ToBF16(float32(f)))
			case reduce.Float32:
				bits = uint64(math.Float32bits(float32(f)))
			case reduce.Float64:
				bits = math.Float64bits(f)
			}
		}
		var w [8]byte
		binary.LittleEndian.PutUint64(w[:], bits)
		copy(e, w[:es])
	}
	return b
}

func randBytes(rng *rand.Rand, n int) []byte {
	b := make([]byte, n)
	for i := range b {
		b[i] = byte(rng.Uint32())
	}
	return b
}

// wantAllReduce is what c's AllReduce of inputs (one per member) leaves:
// the reference of the algorithm whose order it follows at that size.
func wantAllReduce(c *Comm, op reduce.Op, dt reduce.DType, inputs [][]byte) []byte {
	return ReferenceAllReduceAlgo(c.AllReduceOrder(len(inputs[0])), op, dt, inputs, len(inputs))
}

// requireBits fails with the first differing element when got != want.
func requireBits(t testing.TB, want, got []byte, es int, msg string, args ...any) {
	t.Helper()
	if bytes.Equal(want, got) {
		return
	}
	require.Equal(t, len(want), len(got), "length: %s", fmt.Sprintf(msg, args...))
	for i := 0; i < len(want); i += es {
		if !bytes.Equal(want[i:i+es], got[i:i+es]) {
			t.Fatalf("%s: element %d (byte %d of %d): want %x, got %x", fmt.Sprintf(msg, args...), i/es, i, len(want), want[i:i+es], got[i:i+es])
		}
	}
}

// doneRecorder checks Progress.Done: ranges disjoint, covering [0, n)
// exactly once, each final when reported (compared with want at the end).
type doneRecorder struct {
	mu     sync.Mutex
	buf    []byte // the result buffer being reported on
	ranges [][2]int
	snaps  [][]byte
}

func (d *doneRecorder) done(off, n int) {
	snap := slices.Clone(d.buf[off : off+n])
	d.mu.Lock()
	defer d.mu.Unlock()
	d.ranges = append(d.ranges, [2]int{off, n})
	d.snaps = append(d.snaps, snap)
}

func (d *doneRecorder) check(t testing.TB, want []byte, what string) {
	t.Helper()
	d.mu.Lock()
	defer d.mu.Unlock()
	idx := make([]int, len(d.ranges))
	for i := range idx {
		idx[i] = i
	}
	slices.SortFunc(idx, func(a, b int) int { return d.ranges[a][0] - d.ranges[b][0] })
	at := 0
	for _, i := range idx {
		r := d.ranges[i]
		require.Greater(t, r[1], 0, "%s: empty range reported", what)
		require.Equal(t, at, r[0], "%s: ranges %v leave a gap or overlap at %d", what, d.ranges, at)
		require.True(t, bytes.Equal(want[r[0]:r[0]+r[1]], d.snaps[i]), "%s: range [%d,+%d) was not final when reported", what, r[0], r[1])
		at += r[1]
	}
	require.Equal(t, len(want), at, "%s: ranges cover %d of %d bytes", what, at, len(want))
}

// readyGate releases an input as a growing prefix: its Ready blocks until
// release has made [0,end) ready (safe for concurrent calls, as Ready must
// be). It checks that Ready is never called beyond the input.
type readyGate struct {
	t       testing.TB
	mu      sync.Mutex
	cond    *sync.Cond
	upto    int
	size    int
	maxCall int
}

func newReadyGate(t testing.TB, size int) *readyGate {
	g := &readyGate{t: t, size: size}
	g.cond = sync.NewCond(&g.mu)
	return g
}

func (g *readyGate) ready(ctx context.Context, end int) error {
	g.mu.Lock()
	defer g.mu.Unlock()
	if end > g.size || end <= 0 {
		g.t.Errorf("Ready(%d) for an input of %d bytes", end, g.size)
	}
	g.maxCall = max(g.maxCall, end)
	stop := context.AfterFunc(ctx, func() {
		g.mu.Lock()
		defer g.mu.Unlock()
		g.cond.Broadcast()
	})
	defer stop()
	for g.upto < end {
		if ctx.Err() != nil {
			return ctx.Err()
		}
		g.cond.Wait()
	}
	return nil
}

// release copies src into dst piece by piece, making each piece ready after
// writing it, with a pause between pieces.
func (g *readyGate) release(dst, src []byte, piece int, pause time.Duration) {
	for off := 0; off < len(src); off += piece {
		end := min(off+piece, len(src))
		g.mu.Lock()
		copy(dst[off:end], src[off:end])
		g.upto = end
		g.cond.Broadcast()
		g.mu.Unlock()
		time.Sleep(pause)
	}
}

// garbage fills b with a pattern that no test input has.
func garbage(b []byte) {
	for i := range b {
		b[i] = 0xA5 ^ byte(i*7)
	}
}

// Over piece streams a chunk's result is reported once, when the whole
// chunk is in (the feed sends a PROGRESS per range: not one per piece).
func TestPiecesReportChunks(t *testing.T) {
	pieces = true
	defer func() { pieces = false }()
	cl := newCluster(t, 2, 2, Options{ChunkBytes: testChunk})
	const n = 10*testChunk + 64
	bufs := [][]byte{make([]byte, n), make([]byte, n)}
	recs := []*doneRecorder{{buf: bufs[0]}, {buf: bufs[1]}}
	requireNoErrors(t, cl.each(func(m int, c *Comm) error {
		return c.AllReduce(context.Background(), bufs[m], reduce.Float32, reduce.Sum, &Progress{Done: recs[m].done})
	}))
	for m, r := range recs {
		assert.Len(t, r.ranges, 11, "member %d: one range per chunk", m)
	}
}

// progressStream reports how far its Send got (transport.ProgressSender)
// in steps, as the TCP stream does: it takes the payload first (so what it
// reports out is out), then reports thirds with pauses, then sends.
type progressStream struct{ pieceStream }

func (s progressStream) SendProgress(ctx context.Context, h wire.Header, p []byte, progress func(int)) error {
	return sendInThirds(ctx, s.pieceStream, h, p, progress)
}

// sendInThirds is progressStream's SendProgress over st.
func sendInThirds(ctx context.Context, st transport.Stream, h wire.Header, p []byte, progress func(int)) error {
	own := slices.Clone(p)
	if progress != nil {
		for k := 1; k <= 2; k++ {
			progress(len(p) * k / 3)
			time.Sleep(100 * time.Microsecond)
		}
	}
	err := st.Send(ctx, h, own)
	if err == nil && progress != nil {
		progress(len(p))
	}
	return err
}

// progressHoldStream is progressStream over a pieceHoldStream.
type progressHoldStream struct{ pieceHoldStream }

func (s progressHoldStream) SendProgress(ctx context.Context, h wire.Header, p []byte, progress func(int)) error {
	return sendInThirds(ctx, s.pieceHoldStream, h, p, progress)
}

// progressMesh's streams are progressStreams, or with hold
// progressHoldStreams.
type progressMesh struct {
	transport.Mesh
	hold bool
}

func (m progressMesh) Stream(peer, i int) transport.Stream {
	if m.hold {
		return progressHoldStream{newPieceHoldStream(m.Mesh.Stream(peer, i))}
	}
	return progressStream{pieceStream{m.Mesh.Stream(peer, i)}}
}

// Pieces whose send is reported out go straight to the destination, the
// others wait or spill; every way gives the reference's bits, streamed
// input too, with the reading of the pieces overlapped with their
// reduction (hold) or not.
func TestPiecesProgress(t *testing.T) {
	for _, hold := range []bool{false, true} {
		for _, members := range []int{2, 3} {
			t.Run(fmt.Sprintf("hold=%v/members=%d", hold, members), func(t *testing.T) { testPiecesProgress(t, members, hold) })
		}
	}
}

func testPiecesProgress(t *testing.T, members int, hold bool) {
	meshes := transport.NewMem(members, 2, false)
	for i, m := range meshes {
		meshes[i] = progressMesh{m, hold}
	}
	beforeOverlaps := overlaps.Load()
	cl := newClusterMesh(t, meshes, Options{ChunkBytes: testChunk, SmallBytes: -1, Overlap: OverlapOn}, DefaultMaxUnexpected)
	rng := rand.New(rand.NewPCG(23, uint64(members)))
	for _, streamed := range []bool{false, true} {
		inputs := make([][]byte, members)
		for m := range inputs {
			inputs[m] = randData(rng, reduce.BFloat16, 30*testChunk/2+5)
		}
		want := wantAllReduce(cl.comms[0], reduce.Sum, reduce.BFloat16, inputs)
		bufs := make([][]byte, members)
		requireNoErrors(t, cl.each(func(m int, c *Comm) error {
			bufs[m] = make([]byte, len(inputs[m]))
			var p *Progress
			if streamed {
				garbage(bufs[m])
				g := newReadyGate(t, len(bufs[m]))
				go g.release(bufs[m], inputs[m], 700, 50*time.Microsecond)
				p = &Progress{Ready: g.ready}
			} else {
				copy(bufs[m], inputs[m])
			}
			return c.AllReduce(context.Background(), bufs[m], reduce.BFloat16, reduce.Sum, p)
		}))
		for m := range bufs {
			requireBits(t, want, bufs[m], 2, "member %d, streamed %v", m, streamed)
		}
	}
	requireOverlapped(t, hold, beforeOverlaps)
}
