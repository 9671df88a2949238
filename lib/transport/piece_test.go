package transport

import (
	"context"
	"errors"
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
