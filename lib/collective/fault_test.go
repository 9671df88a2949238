package collective

import (
	"context"
	"errors"
	"fmt"
	"math/rand/v2"
	"regexp"
	"runtime"
	"slices"
	"strconv"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/gpubridge/gpubridge/lib/codec"
	"github.com/gpubridge/gpubridge/lib/reduce"
	"github.com/gpubridge/gpubridge/lib/testenv"
	"github.com/gpubridge/gpubridge/lib/transport"
	"github.com/gpubridge/gpubridge/lib/wire"
)

// TestInvalid: misuse fails before any communication (the peer never
// calls), with ErrInvalid, and takes no sequence number.
func TestInvalid(t *testing.T) {
	cl := newCluster(t, 2, 1, Options{Timeout: testenv.Scale(20 * time.Second)})
	c := cl.comms[0]
	ctx := context.Background()
	b := make([]byte, 64)
	tests := []struct {
		name string
		call func() error
		want string
	}{
		{"avg of ints", func() error { return c.AllReduce(ctx, b, reduce.Int32, reduce.Avg, nil) }, "avg is defined for floating dtypes only"},
		{"bad dtype", func() error { return c.AllReduce(ctx, b, reduce.DType(0), reduce.Sum, nil) }, "invalid dtype"},
		{"bad op", func() error { return c.AllReduce(ctx, b, reduce.Float32, reduce.Op(9), nil) }, "invalid op"},
		{"ragged all_reduce", func() error { return c.AllReduce(ctx, b[:10], reduce.Float32, reduce.Sum, nil) }, "length 10 is not a multiple of the float32 element size 4"},
		{"root too big", func() error { return c.Broadcast(ctx, b, 2, nil) }, "root 2 is not a member (0..1)"},
		{"negative root", func() error { return c.Broadcast(ctx, b, -1, nil) }, "root -1 is not a member"},
		{"all_gather size", func() error { return c.AllGather(ctx, b[:63], b[:8], nil) }, "output of 63 bytes, want 2 members × 8 bytes = 16"},
		{"all_gather overlap", func() error { return c.AllGather(ctx, b[:16], b[4:12], nil) }, "overlaps the output"},
		{"all_gather other slot", func() error { return c.AllGather(ctx, b[:16], b[8:16], nil) }, "overlaps the output"},
		{"reduce_scatter size", func() error { return c.ReduceScatter(ctx, b[:8], b[16:40], reduce.Float32, reduce.Sum, nil) }, "input of 24 bytes, want 2 members × 8 bytes = 16"},
		{"reduce_scatter ragged", func() error { return c.ReduceScatter(ctx, b[:6], b[16:28], reduce.Float32, reduce.Sum, nil) }, "output length 6 is not a multiple"},
		{"reduce_scatter overlap", func() error { return c.ReduceScatter(ctx, b[8:16], b[:16], reduce.Float32, reduce.Sum, nil) }, "overlaps the input"},
		{"reduce_scatter avg int", func() error { return c.ReduceScatter(ctx, b[:8], b[16:32], reduce.Int8, reduce.Avg, nil) }, "avg is defined"},
		{"send to self", func() error { return c.Send(ctx, 0, 1, b) }, "peer 0 is this member itself"},
		{"send to nobody", func() error { return c.Send(ctx, 5, 1, b) }, "peer 5 is not a member"},
		{"recv from self", func() error { _, err := c.Recv(ctx, 0, 1, b); return err }, "peer 0 is this member itself"},
		{"recv from nobody", func() error { _, err := c.Recv(ctx, -1, 1, b); return err }, "peer -1 is not a member"},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			start := time.Now()
			err := tt.call()
			require.ErrorIs(t, err, ErrInvalid)
			require.ErrorContains(t, err, tt.want)
			var e *Error
			require.ErrorAs(t, err, &e)
			assert.Zero(t, e.Seq)
			assert.Less(t, time.Since(start), testenv.Scale(5*time.Second), "refused at once")
		})
	}
	assert.Zero(t, c.Seq())
	// Still usable: the misuse broke nothing.
	requireNoErrors(t, cl.each(func(m int, c *Comm) error {
		return c.AllReduce(ctx, make([]byte, 8), reduce.Float32, reduce.Sum, nil)
	}))
	// In-place forms are accepted.
	requireNoErrors(t, cl.each(func(m int, c *Comm) error {
		out := make([]byte, 16)
		if err := c.AllGather(ctx, out, out[m*8:(m+1)*8], nil); err != nil {
			return err
		}
		in := make([]byte, 16)
		return c.ReduceScatter(ctx, in[m*8:(m+1)*8], in, reduce.Float32, reduce.Sum, nil)
	}))
}

func TestErrorText(t *testing.T) {
	e := &Error{Op: "all_reduce", Seq: 12, Desc: "float32 sum, 64 MiB", Err: errors.New("member 1 (rank 2 on host-b): connection closed")}
	assert.Equal(t, "all_reduce #12 (float32 sum, 64 MiB): member 1 (rank 2 on host-b): connection closed", e.Error())
	assert.Equal(t, "barrier: x", (&Error{Op: "barrier", Err: errors.New("x")}).Error())
	assert.Equal(t, "64 MiB", fmtBytes(64<<20))
	assert.Equal(t, "1000 B", fmtBytes(1000))
	assert.Equal(t, "5m", fmtDuration(5*time.Minute))
	assert.Equal(t, "300ms", fmtDuration(300*time.Millisecond))
}

// TestStalledMember: a member that never calls makes the others time out
// with an error naming it.
func TestStalledMember(t *testing.T) {
	for _, cfg := range []stallCase{{2, "all_reduce"}, {4, "all_reduce"}, {3, "barrier"}, {2, "broadcast"}, {3, "all_gather"}, {4, "reduce_scatter"}} {
		t.Run(fmt.Sprintf("%s/%d", cfg.op, cfg.members), func(t *testing.T) { testStalledMember(t, cfg) })
	}
}

// stallCase is a collective of TestStalledMember's.
type stallCase struct {
	members int
	op      string
}

func testStalledMember(t *testing.T, cfg stallCase) {
	// Long enough that every member but the stalled one is in the
	// call before it runs out, even on a loaded machine: else a
	// member late to start is the one named.
	timeout := testenv.Scale(time.Second)
	after := "timed out after " + fmtDuration(timeout) + " waiting for member"
	cl := newCluster(t, cfg.members, 2, Options{ChunkBytes: testChunk, Timeout: timeout})
	stalled := cfg.members - 1
	start := time.Now()
	errs := cl.each(func(m int, c *Comm) error {
		if m == stalled {
			return nil
		}
		ctx := context.Background()
		buf := make([]byte, 64<<10)
		switch cfg.op {
		case "all_reduce":
			return c.AllReduce(ctx, buf, reduce.Float32, reduce.Sum, nil)
		case "barrier":
			return c.Barrier(ctx)
		case "broadcast":
			return c.Broadcast(ctx, buf, 0, nil)
		case "all_gather":
			return c.AllGather(ctx, make([]byte, cfg.members*len(buf)), buf, nil)
		default:
			L := len(buf) / cfg.members
			return c.ReduceScatter(ctx, make([]byte, L), buf[:L*cfg.members], reduce.Float32, reduce.Sum, nil)
		}
	})
	elapsed := time.Since(start)
	assert.Less(t, elapsed, timeout+testenv.Scale(5*time.Second), "bounded by the timeout")
	for m, err := range errs {
		if m == stalled {
			continue
		}
		require.Error(t, err, "member %d", m)
		t.Logf("member %d: %v", m, err)
		assert.ErrorContains(t, err, cfg.op+" #1", "member %d", m)
		assert.ErrorContains(t, err, after, "member %d", m)
		assert.ErrorContains(t, err, fmt.Sprintf("member %d", stalled), "member %d", m)
	}
	// The one that waited on it directly names it in its own words.
	next := mod(stalled+1, cfg.members)
	if cfg.op == "broadcast" {
		next = stalled - 1 // the chain runs 0, 1, ...: its predecessor sends to it
	}
	assert.ErrorContains(t, errs[next], fmt.Sprintf("%s %d", after, stalled))
	// The stalled member, when it comes, fails at once with the
	// others' reason (broken already, or on the abort it finds).
	start = time.Now()
	err := cl.comms[stalled].Barrier(context.Background())
	require.ErrorContains(t, err, after)
	assert.Less(t, time.Since(start), timeout/2, "at once, not after a timeout of its own")
}

// TestDeadlineFromContext: a context deadline replaces Options.Timeout.
func TestDeadlineFromContext(t *testing.T) {
	cl := newCluster(t, 2, 1, Options{})
	ctx, cancel := context.WithTimeout(context.Background(), 200*time.Millisecond)
	defer cancel()
	err := cl.comms[0].AllReduce(ctx, make([]byte, 4), reduce.Float32, reduce.Sum, nil)
	require.ErrorIs(t, err, context.DeadlineExceeded)
	// The limit is what was left of the deadline when the call began: under
	// load a few milliseconds of the 200 may be gone.
	m := regexp.MustCompile(`all_reduce #1 \(float32 sum, 4 B\): timed out after (\d+)ms waiting for member 1`).FindStringSubmatch(err.Error())
	require.NotNil(t, m, "%v", err)
	ms, _ := strconv.Atoi(m[1])
	assert.True(t, ms > 0 && ms <= 200, "the limit named, %dms, is the context's 200ms less what passed before the call", ms)
}

// TestCancelled: a caller's cancellation fails the call and, since the
// members are now out of step, breaks the communicator.
func TestCancelled(t *testing.T) {
	cl := newCluster(t, 2, 1, Options{})
	ctx, cancel := context.WithCancel(context.Background())
	time.AfterFunc(50*time.Millisecond, cancel)
	err := cl.comms[0].Barrier(ctx)
	require.ErrorIs(t, err, context.Canceled)
	require.ErrorContains(t, err, "cancelled by the caller")
	require.ErrorIs(t, cl.comms[0].Barrier(context.Background()), ErrBroken)
}

// TestPeerClosed: a member's communicator closed mid-collective makes the
// others fail promptly, naming it: on the ring (256 KiB) and, from 3
// members, on recursive doubling (rdSmall).
func TestPeerClosed(t *testing.T) {
	for _, size := range []int{256 << 10, rdSmall} {
		for _, members := range []int{2, 3, 4, 5} {
			t.Run(fmt.Sprintf("%d/%d", size, members), func(t *testing.T) { testPeerClosed(t, members, size) })
		}
	}
}

func testPeerClosed(t *testing.T, members, size int) {
	timeout := testenv.Scale(20 * time.Second)
	cl := newCluster(t, members, 2, Options{ChunkBytes: testChunk, Timeout: timeout})
	victim := members - 1
	start := time.Now()
	errs := cl.each(func(m int, c *Comm) error {
		buf := make([]byte, size)
		var p *Progress
		if m == victim {
			// Half the input is ready, then the member goes away.
			p = &Progress{Ready: func(ctx context.Context, end int) error {
				if end > len(buf)/2 {
					go func() { _ = c.Close() }()
					<-ctx.Done()
					return ctx.Err()
				}
				return nil
			}}
		}
		return c.AllReduce(context.Background(), buf, reduce.Float32, reduce.Sum, p)
	})
	assert.Less(t, time.Since(start), timeout/2, "promptly, not at the timeout")
	require.ErrorIs(t, errs[victim], ErrClosed)
	for m, err := range errs[:victim] {
		require.Error(t, err, "member %d", m)
		t.Logf("member %d: %v", m, err)
		assert.ErrorContains(t, err, fmt.Sprintf("member %d", victim))
		assert.NotErrorIs(t, err, context.DeadlineExceeded)
	}
	if size <= rdSmall && members >= 3 {
		assert.Equal(t, AlgoRecursiveDoubling, cl.comms[0].AllReduceOrder(size), "the algorithm the call ran")
	}
}

// TestAbortPropagates: a member that aborts the mesh with a reason makes
// the others fail with that reason; later calls fail at once.
func TestAbortPropagates(t *testing.T) {
	timeout := testenv.Scale(20 * time.Second)
	cl := newCluster(t, 3, 2, Options{ChunkBytes: testChunk, Timeout: timeout})
	errs := cl.each(func(m int, c *Comm) error {
		if m == 1 {
			time.Sleep(20 * time.Millisecond)
			c.Mesh().Abort(errors.New("GPU fell off the bus"))
			return nil
		}
		return c.AllReduce(context.Background(), make([]byte, 1<<20), reduce.Float32, reduce.Sum, nil)
	})
	for _, m := range []int{0, 2} {
		t.Logf("member %d: %v", m, errs[m])
		require.ErrorContains(t, errs[m], "member 1")
		require.ErrorContains(t, errs[m], "GPU fell off the bus")
		start := time.Now()
		err := cl.comms[m].AllReduce(context.Background(), make([]byte, 4), reduce.Float32, reduce.Sum, nil)
		require.ErrorIs(t, err, ErrBroken)
		require.ErrorContains(t, err, "bridge broken by an earlier failure: ")
		require.ErrorContains(t, err, "GPU fell off the bus")
		_, err = cl.comms[m].Recv(context.Background(), 1, 0, nil)
		require.ErrorIs(t, err, ErrBroken)
		require.ErrorIs(t, cl.comms[m].Send(context.Background(), 1, 0, nil), ErrBroken)
		assert.Less(t, time.Since(start), timeout/10, "at once, not after a wait")
	}
}

// TestMismatch: members calling different collectives, or one collective
// with different arguments, fail on every member with a message saying so.
func TestMismatch(t *testing.T) {
	ctx := context.Background()
	ar := func(c *Comm, n int) error { return c.AllReduce(ctx, make([]byte, n), reduce.Float32, reduce.Sum, nil) }
	tests := []struct {
		name    string
		members int
		calls   func(m int, c *Comm) error
		want    string
		small   int // Options.SmallBytes
	}{
		{"all_reduce vs all_gather", 2, func(m int, c *Comm) error {
			if m == 0 {
				return ar(c, 4096)
			}
			return c.AllGather(ctx, make([]byte, 8192), make([]byte, 4096), nil)
		}, "members called collectives in different orders", 0},
		{"ring all_reduce vs broadcast", 3, func(m int, c *Comm) error {
			if m == 1 {
				return c.Broadcast(ctx, make([]byte, 4096), 1, nil)
			}
			return ar(c, 4096)
		}, "members called collectives in different orders", -1},
		// Member 0 waits for member 2's fold first, and gets the
		// broadcast's frames.
		{"recursive doubling all_reduce vs broadcast", 3, func(m int, c *Comm) error {
			if m == 2 {
				return c.Broadcast(ctx, make([]byte, 4096), 2, nil)
			}
			return ar(c, 4096)
		}, "members called collectives in different orders", 0},
		{"barrier vs all_reduce", 2, func(m int, c *Comm) error {
			if m == 0 {
				return c.Barrier(ctx)
			}
			return ar(c, 4096)
		}, "members called collectives in different orders", 0},
		{"barrier vs all_reduce, barrier late", 2, func(m int, c *Comm) error {
			if m == 0 {
				time.Sleep(50 * time.Millisecond)
				return c.Barrier(ctx)
			}
			return ar(c, 4096)
		}, "members called collectives in different orders", 0},
		{"one call skipped", 3, func(m int, c *Comm) error {
			if m != 2 {
				if err := ar(c, 64); err != nil {
					return err
				}
			}
			return c.AllGather(ctx, make([]byte, 3*64), make([]byte, 64), nil)
		}, "members called collectives in different orders", 0},
		{"sizes differ", 2, func(m int, c *Comm) error { return ar(c, 4096*(m+1)) }, "with other arguments than this member", 0},
		{"dtypes differ", 3, func(m int, c *Comm) error {
			dt := reduce.Float32
			if m == 2 {
				dt = reduce.Int32
			}
			return c.AllReduce(ctx, make([]byte, 4096), dt, reduce.Sum, nil)
		}, "with other arguments than this member", 0},
		{"roots differ", 2, func(m int, c *Comm) error { return c.Broadcast(ctx, make([]byte, 64), m, nil) }, "with other arguments than this member", 0},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			timeout := testenv.Scale(10 * time.Second)
			cl := newCluster(t, tt.members, 2, Options{ChunkBytes: testChunk, Timeout: timeout, SmallBytes: tt.small})
			start := time.Now()
			errs := cl.each(tt.calls)
			// A member that only sent (a broadcast root) cannot tell; it
			// learns in its next call, from the others' aborts or from the
			// frames it finds on the wire.
			next := cl.each(func(m int, c *Comm) error {
				if errs[m] != nil {
					return nil
				}
				return ar(c, 64)
			})
			assert.Less(t, time.Since(start), timeout/2, "a mismatch must not wait for the timeout")
			for m, err := range errs {
				if err == nil {
					err = next[m]
				}
				require.Error(t, err, "member %d", m)
				t.Logf("member %d: %v", m, err)
				assert.True(t, strings.Contains(err.Error(), tt.want) || strings.Contains(err.Error(), "different orders"), "member %d: %v", m, err)
			}
		})
	}
}

// TestClose: Close ends waiting calls, refuses later ones and is
// idempotent.
func TestClose(t *testing.T) {
	cl := newCluster(t, 2, 1, Options{})
	c := cl.comms[0]
	done := make(chan error, 1)
	go func() {
		_, err := c.Recv(context.Background(), 1, 9, make([]byte, 4))
		done <- err
	}()
	time.Sleep(20 * time.Millisecond)
	require.NoError(t, c.Close())
	require.ErrorIs(t, <-done, ErrClosed)
	require.NoError(t, c.Close())
	require.ErrorIs(t, c.Barrier(context.Background()), ErrClosed)
	require.ErrorIs(t, c.Send(context.Background(), 1, 0, nil), ErrClosed)
}

// TestPeerClosesAfterLastCall: a member that closes right after its last
// collective does not fail the others' same collective, still finishing;
// a message it sent before closing can still be received. Later calls
// report it gone.
func TestPeerClosesAfterLastCall(t *testing.T) {
	cl := newCluster(t, 2, 1, Options{ChunkBytes: testChunk, Timeout: testenv.Scale(20 * time.Second)})
	ctx := context.Background()
	inputs := [][]byte{randBytes(rand.New(rand.NewPCG(1, 2)), 32*testChunk), randBytes(rand.New(rand.NewPCG(3, 4)), 32*testChunk)}
	for m := range inputs {
		for i := 2; i < len(inputs[m]); i += 4 {
			inputs[m][i] &= 0x3f // no NaN or Inf float32s
		}
	}
	want := ReferenceAllReduce(reduce.Sum, reduce.Float32, inputs, 2)
	bufs := [][]byte{slices.Clone(inputs[0]), slices.Clone(inputs[1])}
	errs := cl.each(func(m int, c *Comm) error {
		if m == 0 {
			if err := c.AllReduce(ctx, bufs[0], reduce.Float32, reduce.Sum, nil); err != nil {
				return err
			}
			if err := c.Send(ctx, 1, 3, []byte("bye")); err != nil {
				return err
			}
			return c.Close()
		}
		// A slow consumer: member 0 is done and gone before this ends.
		slow := &Progress{Done: func(int, int) { time.Sleep(2 * time.Millisecond) }}
		return c.AllReduce(ctx, bufs[1], reduce.Float32, reduce.Sum, slow)
	})
	requireNoErrors(t, errs)
	requireBits(t, want, bufs[1], 4, "member 1")
	c := cl.comms[1]
	require.Eventually(t, func() bool { return c.state() != nil }, testenv.Scale(10*time.Second), time.Millisecond)
	buf := make([]byte, 8)
	n, err := c.Recv(ctx, 0, 3, buf)
	require.NoError(t, err)
	assert.Equal(t, "bye", string(buf[:n]))
	_, err = c.Recv(ctx, 0, 3, buf)
	require.ErrorIs(t, err, ErrBroken)
	require.ErrorContains(t, err, "member 0: closed its end of the bridge")
	err = c.Barrier(ctx)
	require.ErrorIs(t, err, ErrBroken)
	require.ErrorContains(t, err, "barrier: bridge broken by an earlier failure: member 0: closed its end of the bridge")
}

func TestOptionsDefaults(t *testing.T) {
	meshes := transport.NewMem(1, 1, false)
	c := New(meshes[0], Options{})
	defer c.Close()
	assert.Equal(t, DefaultChunkBytes, c.chunk)
	assert.Equal(t, DefaultTimeout, c.timeout)
	assert.Equal(t, runtime.NumCPU(), c.workers)
	assert.Same(t, meshes[0], c.Mesh())
	c2 := New(transport.NewMem(1, 1, false)[0], Options{ChunkBytes: 1 << 30, Workers: 3})
	defer c2.Close()
	assert.Equal(t, wire.MaxPayload, c2.chunk)
	assert.Equal(t, 2, c2.workersPer(2))
	assert.Equal(t, wire.MaxPayload, c2.chunkFor(8))
	c3 := New(transport.NewMem(1, 1, false)[0], Options{ChunkBytes: 1001})
	defer c3.Close()
	assert.Equal(t, 1000, c3.chunkFor(8))
	assert.Equal(t, 1001, c3.chunkFor(1))
}

// corruptMesh reports the first data frame member 1 receives from member 0
// as corrupt, the way a transport does when its CRC32C does not match.
type corruptMesh struct{ transport.Mesh }

type corruptStream struct {
	transport.Stream
	peer string
	once *atomic.Bool
}

func (m corruptMesh) Stream(peer, i int) transport.Stream {
	return corruptStream{Stream: m.Mesh.Stream(peer, i), peer: m.Peer(peer), once: new(atomic.Bool)}
}

func (s corruptStream) Recv(ctx context.Context, fn func(wire.Header, []byte) error) error {
	var bad *wire.CorruptError
	err := s.Stream.Recv(ctx, func(h wire.Header, p []byte) error {
		if s.once.CompareAndSwap(false, true) {
			bad = &wire.CorruptError{Header: h, Got: h.CRC ^ 1}
			return nil
		}
		return fn(h, p)
	})
	if bad != nil {
		return &transport.PeerError{Peer: s.peer, Err: fmt.Errorf("stream 0: %w", bad)}
	}
	return err
}

// Issue 9: after a corrupt frame the error showed the header's raw step
// field as if it were a step ("step 134281332"). It names the raw field as
// such, and what the collective's header says in its own terms.
func TestCorruptFrameNamed(t *testing.T) {
	meshes := transport.NewMem(2, 1, true)
	meshes[1] = corruptMesh{meshes[1]}
	cl := newClusterMesh(t, meshes, Options{Timeout: testenv.Scale(5 * time.Second)}, DefaultMaxUnexpected)
	errs := cl.each(func(m int, c *Comm) error {
		return c.AllReduce(context.Background(), make([]byte, 64), reduce.Float32, reduce.Sum, nil)
	})
	err := errs[1]
	require.Error(t, err)
	assert.ErrorIs(t, err, wire.ErrCorrupt)
	var pe *transport.PeerError
	require.ErrorAs(t, err, &pe)
	raw := encodeStep(kAllReduce, 0, fingerprint(kAllReduce, 64, reduce.Float32, reduce.Sum, 0, cl.comms[0].chunkFor(4), codec.Raw, cl.comms[0].smallFor(codec.Raw)))
	assert.NotContains(t, err.Error(), fmt.Sprintf("step %d", raw), "the raw step field is no step number")
	assert.Contains(t, err.Error(), fmt.Sprintf("step field %#08x", raw))
	assert.Contains(t, err.Error(), "by its header, chunk 0 of step 0 of all_reduce #1 (argument fingerprint")
	assert.True(t, strings.HasPrefix(err.Error(), "all_reduce #1 (float32 sum, 64 B): member 0"), err.Error())
	// Member 0 may have finished its part; its next call learns of the
	// failure.
	if errs[0] == nil {
		errs[0] = cl.comms[0].Barrier(context.Background())
	}
	assert.ErrorContains(t, errs[0], "corrupt frame")
}
