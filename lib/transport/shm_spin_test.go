package transport

import (
	"context"
	"testing"
	"time"

	"github.com/gpubridge/gpubridge/lib/testenv"
	"github.com/gpubridge/gpubridge/lib/wire"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

func TestWithSpin(t *testing.T) {
	_, ok := SpinFrom(context.Background())
	assert.False(t, ok, "no spin without WithSpin")
	for _, tc := range []struct{ set, want time.Duration }{
		{200 * time.Microsecond, 200 * time.Microsecond},
		{0, 0},
		{-time.Microsecond, 0},
		{MaxSpin + time.Microsecond, MaxSpin},
	} {
		ctx, cancel := context.WithCancel(WithSpin(context.Background(), tc.set))
		got, ok := SpinFrom(ctx)
		cancel()
		assert.True(t, ok, "%v: kept through a derived context", tc.set)
		assert.Equal(t, tc.want, got, "%v", tc.set)
	}
	got, _ := SpinFrom(WithSpin(WithSpin(context.Background(), MaxSpin), time.Microsecond))
	assert.Equal(t, time.Microsecond, got, "the innermost WithSpin wins")
}

// A shm wait spins as its context says, not as its mesh does: under
// WithSpin(0) a receiver on a mesh that spins 10 ms sleeps on its futex
// while the frame is 5 ms away. (A regression that spins the mesh's 10 ms
// could pass only when the sender is held up past 10 ms, never fail
// spuriously.)
func TestShmWaitSpinsAsContextSays(t *testing.T) {
	b := newBridge(t, SHM, 2, 1, false)
	b.set(func(c *Config) { c.Spin = MaxSpin })
	meshes := b.mustEstablish(t)
	ctx, cancel := context.WithTimeout(context.Background(), testenv.Scale(30*time.Second))
	defer cancel()
	m1 := meshes[1].(*shmMesh)
	before := m1.slept.Load()
	sent := make(chan error, 1)
	go func() {
		time.Sleep(5 * time.Millisecond)
		sent <- meshes[0].Stream(1, 0).Send(ctx, wire.Header{Kind: wire.KindData, Seq: 1}, []byte("tiny"))
	}()
	var got []byte
	require.NoError(t, meshes[1].Stream(0, 0).Recv(WithSpin(ctx, 0), func(_ wire.Header, p []byte) error {
		got = append(got, p...)
		return nil
	}))
	require.NoError(t, <-sent)
	assert.Equal(t, "tiny", string(got))
	assert.GreaterOrEqual(t, m1.slept.Load()-before, uint64(1), "the receiver spun the mesh's 10 ms instead of sleeping")
}
