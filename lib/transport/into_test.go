package transport

import (
	"context"
	"errors"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/gpubridge/gpubridge/lib/testenv"
	"github.com/gpubridge/gpubridge/lib/wire"
)

// RecvInto reads every frame, in order, straight into the caller's
// buffer, with CRCs on (read whole, checked, copied) and off, the
// bytes around dst untouched; check sees the header before the payload
// lands, and may wait.
func TestRecvInto(t *testing.T) {
	sizes := []int{0, 1, tcpPiece - 1, tcpPiece + 1, 3*tcpPiece + 5, 4 << 20, 64}
	for _, crc := range []bool{false, true} {
		t.Run(map[bool]string{false: "plain", true: "crc"}[crc], func(t *testing.T) {
			ms := holdMeshes(t, TCP, crc)
			in := ms[1].Stream(0, 0).(IntoReceiver)
			wait := sendFrames(t, ms[0].Stream(1, 0), sizes)
			ctx, cancel := context.WithTimeout(context.Background(), testenv.Scale(30*time.Second))
			defer cancel()
			for i, n := range sizes {
				buf := make([]byte, n+2)
				buf[0], buf[n+1] = 0xa5, 0x5a
				var h wire.Header
				err := in.RecvInto(ctx, func(hdr wire.Header) error {
					h = hdr
					assert.Equal(t, make([]byte, n), buf[1:n+1], "the payload landed before check returned")
					time.Sleep(time.Millisecond) // check may wait
					return nil
				}, buf[1:n+1])
				require.NoError(t, err)
				checkFrame(t, h, buf[1:n+1], i, n)
				assert.Equal(t, []byte{0xa5, 0x5a}, []byte{buf[0], buf[n+1]}, "bytes around dst")
			}
			wait()
		})
	}
}

// A refused header, or a payload of another length than dst, leaves the
// stream out of step; an abort frame is the peer's error, unchecked.
func TestRecvIntoFailures(t *testing.T) {
	ctx, cancel := context.WithTimeout(context.Background(), testenv.Scale(30*time.Second))
	defer cancel()
	ok := func(wire.Header) error { return nil }
	t.Run("check", func(t *testing.T) {
		ms := holdMeshes(t, TCP, false)
		in := ms[1].Stream(0, 0).(IntoReceiver)
		wait := sendFrames(t, ms[0].Stream(1, 0), []int{1000, 10})
		bad := errors.New("the call ended while waiting for its send")
		require.ErrorIs(t, in.RecvInto(ctx, func(wire.Header) error { return bad }, make([]byte, 1000)), bad)
		require.ErrorContains(t, in.RecvInto(ctx, ok, make([]byte, 10)), "stream out of step after a refused frame")
		wait()
	})
	t.Run("length", func(t *testing.T) {
		ms := holdMeshes(t, TCP, false)
		in := ms[1].Stream(0, 0).(IntoReceiver)
		wait := sendFrames(t, ms[0].Stream(1, 0), []int{1000, 10})
		err := in.RecvInto(ctx, ok, make([]byte, 999))
		require.ErrorContains(t, err, "a frame of 1000 bytes where 999 were expected")
		require.ErrorContains(t, in.RecvInto(ctx, ok, make([]byte, 10)), "stream out of step")
		wait()
	})
	t.Run("abort", func(t *testing.T) {
		ms := holdMeshes(t, TCP, false)
		in := ms[1].Stream(0, 0).(IntoReceiver)
		ms[0].Abort(errors.New("member 0 gave up"))
		called := false
		err := in.RecvInto(ctx, func(wire.Header) error { called = true; return nil }, make([]byte, 8))
		var pe *PeerError
		require.ErrorAs(t, err, &pe)
		assert.Contains(t, err.Error(), "failed: member 0 gave up")
		assert.False(t, called)
	})
	t.Run("deadline", func(t *testing.T) {
		ms := holdMeshes(t, TCP, false)
		in := ms[1].Stream(0, 0).(IntoReceiver)
		short, stop := context.WithTimeout(ctx, 50*time.Millisecond)
		defer stop()
		err := in.RecvInto(short, ok, make([]byte, 8))
		require.ErrorIs(t, err, context.DeadlineExceeded)
		// Nothing was read: the stream is still in step.
		wait := sendFrames(t, ms[0].Stream(1, 0), []int{8})
		require.NoError(t, in.RecvInto(ctx, ok, make([]byte, 8)))
		wait()
	})
}
