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

// holdMeshes returns two joined meshes of transport tr with one data
// stream: shm rings are small, so that 1 MiB frames take the split path.
func holdMeshes(t *testing.T, tr Kind, crc bool) []Mesh {
	t.Helper()
	if tr == "mem" {
		ms := NewMem(2, 1, crc)
		t.Cleanup(func() {
			for _, m := range ms {
				_ = m.Close()
			}
		})
		return ms
	}
	b := newBridge(t, tr, 2, 1, crc)
	b.set(func(c *Config) { c.RingBytes = 1 << 20 })
	return b.mustEstablish(t)
}

// sendFrames sends frames of the given sizes (Seq i, pattern contents) on
// out in a goroutine; the returned function waits for it.
func sendFrames(t *testing.T, out Stream, sizes []int) func() {
	errc := make(chan error, 1)
	go func() {
		for i, n := range sizes {
			p := make([]byte, n)
			pattern(p, 0, 1, 0, uint64(i))
			if err := out.Send(context.Background(), wire.Header{Kind: wire.KindData, Seq: uint64(i)}, p); err != nil {
				errc <- fmt.Errorf("send %d: %w", i, err)
				return
			}
		}
		errc <- nil
	}()
	return func() {
		select {
		case err := <-errc:
			require.NoError(t, err)
		case <-time.After(testenv.Scale(30 * time.Second)):
			t.Fatal("sender stuck")
		}
	}
}

func checkFrame(t *testing.T, h wire.Header, p []byte, seq, n int) {
	t.Helper()
	require.Equal(t, uint64(seq), h.Seq, "frame order")
	require.Len(t, p, n, "frame %d", seq)
	want := make([]byte, n)
	pattern(want, 0, 1, 0, uint64(seq))
	require.True(t, bytes.Equal(want, p), "contents of frame %d", seq)
}

var holdTransports = []Kind{TCP, SHM, Mem}

func TestRecvHold(t *testing.T) {
	// Over shm, frame 0 is split (and reassembled), 1 and 2 are held in
	// place in the ring. (A split frame behind one held in place can only
	// be read once that one is released: they share the ring.)
	sizes := []int{1<<20 + 5, 200 << 10, 100 << 10, 300, 0, 64}
	for _, tr := range holdTransports {
		t.Run(string(tr), func(t *testing.T) {
			ms := holdMeshes(t, tr, true)
			in := ms[1].Stream(0, 0).(Holder)
			wait := sendFrames(t, ms[0].Stream(1, 0), sizes)
			ctx := context.Background()

			h0, p0, r0, err := in.RecvHold(ctx)
			require.NoError(t, err)
			h1, p1, r1, err := in.RecvHold(ctx)
			require.NoError(t, err)
			checkFrame(t, h0, p0, 0, sizes[0])
			checkFrame(t, h1, p1, 1, sizes[1])

			// A third hold waits for a release.
			short, cancel := context.WithTimeout(ctx, 50*time.Millisecond)
			_, _, r, err := in.RecvHold(short)
			cancel()
			require.ErrorIs(t, err, context.DeadlineExceeded)
			require.Nil(t, r)

			type held struct {
				h   wire.Header
				p   []byte
				r   func()
				err error
			}
			got := make(chan held, 1)
			go func() {
				h, p, r, err := in.RecvHold(ctx)
				got <- held{h, p, r, err}
			}()
			select {
			case <-got:
				t.Fatal("a third frame was held while two were")
			case <-time.After(50 * time.Millisecond):
			}
			r0()
			r0() // twice: no effect
			var h2 held
			select {
			case h2 = <-got:
			case <-time.After(testenv.Scale(20 * time.Second)):
				t.Fatal("release did not let the third hold through")
			}
			require.NoError(t, h2.err)
			checkFrame(t, h2.h, h2.p, 2, sizes[2])
			checkFrame(t, h1, p1, 1, sizes[1]) // still intact

			// Out of order, and mixed with Recv.
			h2.r()
			require.NoError(t, in.(Stream).Recv(ctx, func(h wire.Header, p []byte) error {
				checkFrame(t, h, p, 3, sizes[3])
				return nil
			}))
			r1()
			h4, p4, r4, err := in.RecvHold(ctx)
			require.NoError(t, err)
			checkFrame(t, h4, p4, 4, sizes[4])
			h5, p5, r5, err := in.RecvHold(ctx)
			require.NoError(t, err)
			checkFrame(t, h5, p5, 5, sizes[5])
			r4()
			wait()

			// Release after Close.
			for _, m := range ms {
				require.NoError(t, m.Close())
			}
			r5()
			r5()
			_, _, _, err = in.RecvHold(ctx)
			require.Error(t, err)
		})
	}
}

// Frames held two at a time by a consumer goroutine, like the collectives
// do, across ring wraps and split frames.
func TestRecvHoldPipelined(t *testing.T) {
	for _, tr := range holdTransports {
		t.Run(string(tr), func(t *testing.T) {
			ms := holdMeshes(t, tr, true)
			in := ms[1].Stream(0, 0).(Holder)
			rng := rand.New(rand.NewPCG(1, 2))
			choices := []int{0, 1 << 10, 100<<10 + 7, 400 << 10, 700 << 10}
			sizes := make([]int, 120)
			for i := range sizes {
				sizes[i] = choices[rng.IntN(len(choices))]
			}
			wait := sendFrames(t, ms[0].Stream(1, 0), sizes)
			type item struct {
				h wire.Header
				p []byte
				r func()
			}
			items := make(chan item, 1)
			var wg sync.WaitGroup
			var bad error
			wg.Go(func() {
				for it := range items {
					want := make([]byte, sizes[it.h.Seq])
					pattern(want, 0, 1, 0, it.h.Seq)
					if bad == nil && !bytes.Equal(want, it.p) {
						bad = fmt.Errorf("frame %d: wrong contents", it.h.Seq)
					}
					it.r()
				}
			})
			for i := range sizes {
				h, p, r, err := in.RecvHold(context.Background())
				require.NoError(t, err)
				require.Equal(t, uint64(i), h.Seq)
				items <- item{h, p, r}
			}
			close(items)
			wg.Wait()
			require.NoError(t, bad)
			wait()
		})
	}
}

func TestRecvHoldCloseAndAbort(t *testing.T) {
	for _, tr := range holdTransports {
		t.Run(string(tr)+"/close", func(t *testing.T) {
			ms := holdMeshes(t, tr, false)
			in := ms[1].Stream(0, 0).(Holder)
			wait := sendFrames(t, ms[0].Stream(1, 0), []int{10, 20})
			_, _, r0, err := in.RecvHold(context.Background())
			require.NoError(t, err)
			_, _, r1, err := in.RecvHold(context.Background())
			require.NoError(t, err)
			wait()
			errc := make(chan error, 1)
			go func() {
				_, _, _, err := in.RecvHold(context.Background())
				errc <- err
			}()
			time.Sleep(50 * time.Millisecond)
			require.NoError(t, ms[1].Close())
			select {
			case err := <-errc:
				assert.ErrorIs(t, err, ErrClosed)
			case <-time.After(testenv.Scale(10 * time.Second)):
				t.Fatal("a blocked RecvHold did not return after Close")
			}
			r1()
			r0()
		})
		t.Run(string(tr)+"/abort", func(t *testing.T) {
			ms := holdMeshes(t, tr, true)
			ms[0].Abort(errors.New("reduce failed"))
			ctx, cancel := context.WithTimeout(context.Background(), testenv.Scale(10*time.Second))
			defer cancel()
			_, _, r, err := ms[1].Stream(0, 0).(Holder).RecvHold(ctx)
			var pe *PeerError
			require.ErrorAs(t, err, &pe)
			assert.Contains(t, err.Error(), "failed: reduce failed")
			assert.Nil(t, r)
		})
		t.Run(string(tr)+"/cancel", func(t *testing.T) {
			ms := holdMeshes(t, tr, false)
			ctx, cancel := context.WithCancel(context.Background())
			go func() { time.Sleep(30 * time.Millisecond); cancel() }()
			_, _, _, err := ms[1].Stream(0, 0).(Holder).RecvHold(ctx)
			require.ErrorIs(t, err, context.Canceled)
			// The stream is still in step.
			wait := sendFrames(t, ms[0].Stream(1, 0), []int{5})
			h, p, r, err := ms[1].Stream(0, 0).(Holder).RecvHold(context.Background())
			require.NoError(t, err)
			checkFrame(t, h, p, 0, 5)
			r()
			wait()
		})
	}
}
