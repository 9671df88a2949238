package transport

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"math/rand/v2"
	"sync"
	"testing"
	"time"

	"github.com/gpubridge/gpubridge/lib/testenv"
	"github.com/gpubridge/gpubridge/lib/wire"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

// RecvPieces hands every frame over in order, in pieces of PieceSize
// bytes (the last shorter), each at its offset; with CRCs on there are no
// pieces.
func TestRecvPieces(t *testing.T) {
	piece := tcpPiece
	sizes := []int{0, 1, piece - 1, piece, piece + 1, 3*piece + 5, 4 << 20, 64}
	ms := holdMeshes(t, TCP, false)
	in := ms[1].Stream(0, 0).(PieceReceiver)
	require.Equal(t, piece, in.PieceSize())
	assert.Zero(t, holdMeshes(t, TCP, true)[1].Stream(0, 0).(PieceReceiver).PieceSize(), "no pieces with CRCs on")
	wait := sendFrames(t, ms[0].Stream(1, 0), sizes)
	ctx, cancel := context.WithTimeout(context.Background(), testenv.Scale(30*time.Second))
	defer cancel()
	for i, n := range sizes {
		var h wire.Header
		got := make([]byte, 0, n)
		pieces := 0
		require.NoError(t, in.RecvPieces(ctx, func(hdr wire.Header) error { h = hdr; return nil }, func(off int, p []byte) error {
			require.Equal(t, len(got), off, "piece offsets follow each other")
			if off+len(p) < n {
				require.Len(t, p, piece, "every piece but the last is whole")
			}
			got = append(got, p...)
			pieces++
			return nil
		}))
		checkFrame(t, h, got, i, n)
		assert.Equal(t, (n+piece-1)/piece, pieces, "frame %d of %d bytes", i, n)
	}
	wait()
}

// A refused header or a piece the receiver gives up on leaves the stream
// out of step: later calls fail with that reason. An abort frame is the
// peer's error.
func TestRecvPiecesFailures(t *testing.T) {
	ctx, cancel := context.WithTimeout(context.Background(), testenv.Scale(30*time.Second))
	defer cancel()
	noop := func(int, []byte) error { return nil }
	t.Run("check", func(t *testing.T) {
		ms := holdMeshes(t, TCP, false)
		in := ms[1].Stream(0, 0).(PieceReceiver)
		wait := sendFrames(t, ms[0].Stream(1, 0), []int{1000, 10})
		bad := errors.New("not the frame this member expected")
		err := in.RecvPieces(ctx, func(wire.Header) error { return bad }, noop)
		require.ErrorIs(t, err, bad)
		err = in.RecvPieces(ctx, func(wire.Header) error { return nil }, noop)
		require.ErrorContains(t, err, "stream out of step after a refused frame")
		wait()
	})
	t.Run("piece", func(t *testing.T) {
		ms := holdMeshes(t, TCP, false)
		in := ms[1].Stream(0, 0).(PieceReceiver)
		wait := sendFrames(t, ms[0].Stream(1, 0), []int{3 * tcpPiece, 10})
		bad := errors.New("reduction failed")
		err := in.RecvPieces(ctx, func(wire.Header) error { return nil }, func(off int, _ []byte) error {
			if off > 0 {
				return bad
			}
			return nil
		})
		require.ErrorIs(t, err, bad)
		err = in.RecvPieces(ctx, func(wire.Header) error { return nil }, noop)
		require.ErrorContains(t, err, "stream out of step after a frame was given up")
		wait()
	})
	t.Run("abort", func(t *testing.T) {
		ms := holdMeshes(t, TCP, false)
		in := ms[1].Stream(0, 0).(PieceReceiver)
		ms[0].Abort(errors.New("member 0 gave up"))
		called := false
		err := in.RecvPieces(ctx, func(wire.Header) error { called = true; return nil }, noop)
		var pe *PeerError
		require.ErrorAs(t, err, &pe)
		assert.Contains(t, err.Error(), "failed: member 0 gave up")
		assert.False(t, called)
	})
}

// SendProgress writes a large payload in pieces and reports each: the
// reports grow to the payload's length, and the frame arrives whole.
func TestSendProgress(t *testing.T) {
	ms := holdMeshes(t, TCP, false)
	out := ms[0].Stream(1, 0).(ProgressSender)
	ctx, cancel := context.WithTimeout(context.Background(), testenv.Scale(30*time.Second))
	defer cancel()
	for i, n := range []int{10, 3*tcpPiece + 7} {
		p := make([]byte, n)
		pattern(p, 0, 1, 0, uint64(i))
		got := make(chan error, 1)
		go func() {
			got <- ms[1].Stream(0, 0).Recv(ctx, func(h wire.Header, q []byte) error {
				checkFrame(t, h, q, i, n)
				return nil
			})
		}()
		var seen []int
		require.NoError(t, out.SendProgress(ctx, wire.Header{Kind: wire.KindData, Seq: uint64(i)}, p, func(k int) { seen = append(seen, k) }))
		require.NoError(t, <-got)
		require.NotEmpty(t, seen)
		assert.Equal(t, n, seen[len(seen)-1], "the last report is the whole payload")
		for k := 1; k < len(seen); k++ {
			assert.Greater(t, seen[k], seen[k-1], "reports grow")
		}
		if n > tcpPiece {
			assert.Equal(t, []int{tcpPiece, 2 * tcpPiece, 3 * tcpPiece, n}, seen)
		}
	}
}

// RecvPiecesHold hands every frame over in pieces as RecvPieces does, each
// valid until released: a consumer goroutine that holds them, queued as the
// collectives queue them, finds each intact however far the reader has got,
// and the stream never uses more than MaxHeldPieces buffers. With CRCs on
// the frames are read whole and their pieces copied out, so that they too
// outlive the next frame.
func TestRecvPiecesHold(t *testing.T) {
	for _, crc := range []bool{false, true} {
		t.Run(fmt.Sprint("crc=", crc), func(t *testing.T) {
			piece := tcpPiece
			rng := rand.New(rand.NewPCG(5, 6))
			choices := []int{0, 1, 64, piece - 1, piece, piece + 1, 3*piece + 5}
			sizes := make([]int, 40)
			for i := range sizes {
				sizes[i] = choices[rng.IntN(len(choices))]
			}
			ms := holdMeshes(t, TCP, crc)
			in := ms[1].Stream(0, 0).(PieceHolder)
			wait := sendFrames(t, ms[0].Stream(1, 0), sizes)
			ctx, cancel := context.WithTimeout(context.Background(), testenv.Scale(30*time.Second))
			defer cancel()

			type held struct {
				seq, off int
				p        []byte
				release  func()
			}
			q := make(chan held, MaxHeldPieces-2)
			var bad error
			var consumer sync.WaitGroup
			consumer.Go(func() {
				crng := rand.New(rand.NewPCG(7, 8))
				for h := range q {
					if crng.IntN(4) == 0 {
						time.Sleep(time.Duration(crng.IntN(300)) * time.Microsecond)
					}
					want := make([]byte, sizes[h.seq])
					pattern(want, 0, 1, 0, uint64(h.seq))
					if bad == nil && !bytes.Equal(want[h.off:h.off+len(h.p)], h.p) {
						bad = fmt.Errorf("frame %d, piece at %d: wrong contents", h.seq, h.off)
					}
					h.release()
				}
			})
			bufs := map[*byte]bool{}
			for i, n := range sizes {
				var hdr wire.Header
				at := 0
				require.NoError(t, in.RecvPiecesHold(ctx, func(h wire.Header) error { hdr = h; return nil }, func(off int, p []byte, release func()) error {
					require.Equal(t, at, off, "piece offsets follow each other")
					require.Equal(t, min(piece, n-off), len(p), "every piece but the last is whole")
					at += len(p)
					bufs[&p[:1][0]] = true
					q <- held{i, off, p, release}
					return nil
				}))
				require.Equal(t, uint64(i), hdr.Seq, "frame order")
				require.Equal(t, n, at, "frame %d", i)
			}
			close(q)
			consumer.Wait()
			require.NoError(t, bad)
			assert.LessOrEqual(t, len(bufs), MaxHeldPieces, "buffers the stream used")
			wait()
		})
	}
}

// A receiver that releases each piece before the next gets the same buffer
// every time (it stays in cache); a RecvPieces call in between reads into
// the stream's own buffer.
func TestRecvPiecesHoldReuse(t *testing.T) {
	ms := holdMeshes(t, TCP, false)
	in := ms[1].Stream(0, 0).(PieceHolder)
	sizes := []int{4*tcpPiece + 3, 10, 2 * tcpPiece}
	wait := sendFrames(t, ms[0].Stream(1, 0), sizes)
	ctx, cancel := context.WithTimeout(context.Background(), testenv.Scale(30*time.Second))
	defer cancel()
	bufs := map[*byte]bool{}
	keep := func(off int, p []byte, release func()) error {
		bufs[&p[:1][0]] = true
		release()
		release() // twice: no effect
		return nil
	}
	noCheck := func(wire.Header) error { return nil }
	require.NoError(t, in.RecvPiecesHold(ctx, noCheck, keep))
	require.NoError(t, in.RecvPieces(ctx, noCheck, func(int, []byte) error { return nil }))
	require.NoError(t, in.RecvPiecesHold(ctx, noCheck, keep))
	assert.Len(t, bufs, 1, "one buffer for every piece")
	wait()
}

// A receiver that holds MaxHeldPieces pieces makes the next read wait for
// a release: until ctx ends (inside a frame: the stream is out of step
// afterwards) or the mesh closes; pieces are released after Close too. An
// error of fn leaves the stream out of step; an abort frame is the peer's
// error, and neither check nor fn is called.
func TestRecvPiecesHoldFailures(t *testing.T) {
	ctx, cancel := context.WithTimeout(context.Background(), testenv.Scale(30*time.Second))
	defer cancel()
	noCheck := func(wire.Header) error { return nil }
	// holdAll keeps every piece it gets.
	holdAll := func(rs *[]func()) func(int, []byte, func()) error {
		return func(_ int, _ []byte, release func()) error {
			*rs = append(*rs, release)
			return nil
		}
	}
	t.Run("cancel", func(t *testing.T) {
		ms := holdMeshes(t, TCP, false)
		in := ms[1].Stream(0, 0).(PieceHolder)
		wait := sendFrames(t, ms[0].Stream(1, 0), []int{(MaxHeldPieces + 1) * tcpPiece, 10})
		var rs []func()
		cctx, cancelHold := context.WithCancel(ctx)
		defer cancelHold()
		hold := holdAll(&rs)
		err := in.RecvPiecesHold(cctx, noCheck, func(off int, p []byte, release func()) error {
			if off == (MaxHeldPieces-1)*tcpPiece {
				cancelHold() // while the next piece waits for a buffer
			}
			return hold(off, p, release)
		})
		require.ErrorIs(t, err, context.Canceled)
		require.Len(t, rs, MaxHeldPieces, "pieces handed over before the wait")
		for _, r := range rs {
			r()
		}
		err = in.RecvPiecesHold(ctx, noCheck, holdAll(&rs))
		require.ErrorContains(t, err, "stream out of step after a frame was given up")
		wait()
	})
	t.Run("close", func(t *testing.T) {
		ms := holdMeshes(t, TCP, false)
		in := ms[1].Stream(0, 0).(PieceHolder)
		wait := sendFrames(t, ms[0].Stream(1, 0), []int{(MaxHeldPieces + 1) * tcpPiece})
		var rs []func()
		errc := make(chan error, 1)
		go func() { errc <- in.RecvPiecesHold(ctx, noCheck, holdAll(&rs)) }()
		time.Sleep(50 * time.Millisecond)
		require.NoError(t, ms[1].Close())
		select {
		case err := <-errc:
			require.ErrorIs(t, err, ErrClosed)
		case <-time.After(testenv.Scale(10 * time.Second)):
			t.Fatal("a RecvPiecesHold waiting for a release did not return after Close")
		}
		require.Len(t, rs, MaxHeldPieces)
		for _, r := range rs {
			r()
		}
		wait()
	})
	t.Run("piece", func(t *testing.T) {
		ms := holdMeshes(t, TCP, false)
		in := ms[1].Stream(0, 0).(PieceHolder)
		wait := sendFrames(t, ms[0].Stream(1, 0), []int{3 * tcpPiece, 10})
		bad := errors.New("reduction failed")
		err := in.RecvPiecesHold(ctx, noCheck, func(off int, _ []byte, release func()) error {
			release()
			if off > 0 {
				return bad
			}
			return nil
		})
		require.ErrorIs(t, err, bad)
		err = in.RecvPiecesHold(ctx, noCheck, holdAll(new([]func())))
		require.ErrorContains(t, err, "stream out of step after a frame was given up")
		wait()
	})
	t.Run("abort", func(t *testing.T) {
		ms := holdMeshes(t, TCP, false)
		in := ms[1].Stream(0, 0).(PieceHolder)
		ms[0].Abort(errors.New("member 0 gave up"))
		called := false
		err := in.RecvPiecesHold(ctx, func(wire.Header) error { called = true; return nil }, func(int, []byte, func()) error { called = true; return nil })
		var pe *PeerError
		require.ErrorAs(t, err, &pe)
		assert.Contains(t, err.Error(), "failed: member 0 gave up")
		assert.False(t, called)
	})
}
