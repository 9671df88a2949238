package collective

import (
	"context"
	"testing"

	"github.com/gpubridge/gpubridge/lib/reduce"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

// TestLastStats: every member's stats of an all_reduce are plausible: one
// entry per peer with a value per stream, times in order, and the bytes
// that moved (a ring moves 2(n-1)/n of the buffer each way, an exchange
// the buffer).
func TestLastStats(t *testing.T) {
	for _, members := range []int{2, 3} {
		const size = 3 << 20
		cl := newCluster(t, members, 2, Options{})
		var none Stats
		assert.False(t, cl.comms[0].LastStats(&none))
		bufs := make([][]byte, members)
		for m := range bufs {
			bufs[m] = make([]byte, size)
		}
		requireNoErrors(t, cl.each(func(m int, c *Comm) error {
			return c.AllReduce(context.Background(), bufs[m], reduce.Float32, reduce.Sum, nil)
		}))
		for m, c := range cl.comms {
			var st Stats
			require.True(t, c.LastStats(&st))
			assert.Equal(t, uint64(1), st.Seq)
			assert.False(t, st.End.Before(st.AllArrived), "member %d", m)
			assert.False(t, st.AllArrived.Before(st.Start), "member %d", m)
			moved := uint64(2 * (members - 1) * size / members)
			if c.Algorithm() == AlgoRing || c.Algorithm() == AlgoExchange {
				// With the descriptors a member may exchange first (direct.go).
				desc := uint64(descSize * (members - 1))
				assert.Contains(t, []uint64{moved, moved + desc}, st.BytesSent, "member %d", m)
				assert.Contains(t, []uint64{moved, moved + desc}, st.BytesReceived, "member %d", m)
				assert.Positive(t, st.Reduce, "member %d", m)
			}
			require.Len(t, st.Peers, members-1)
			heard := 0
			for _, p := range st.Peers {
				assert.NotEqual(t, m, p.Member)
				assert.Len(t, p.Blocked, 2)
				if p.Heard {
					heard++
				}
			}
			assert.Positive(t, heard, "member %d heard from no peer", m)
			// Reusing out allocates nothing.
			assert.Zero(t, testing.AllocsPerRun(10, func() { c.LastStats(&st) }))
		}
	}
}

// TestLastStatsDirect: on the direct path the bytes that cross between
// members' buffers count: an all_reduce of n members reads (n-1)/n of the
// buffer from each peer for its own pieces and copies the rest, or
// writes its pieces into every peer's buffer instead of copying; either
// way each direction adds up to (n-1)/n of the buffer per member, 2(n-1)/n
// both ways as the ring's, beside the descriptors.
func TestLastStatsDirect(t *testing.T) {
	smallDirect(t)
	const members, size = 3, 3 << 12
	for _, mode := range directModes {
		t.Run(mode.name, func(t *testing.T) {
			cl := newDirectCluster(t, members, 2, Options{SmallBytes: -1}, mode.write)
			bufs := make([][]byte, members)
			for m := range bufs {
				bufs[m] = shared(t, cl, m, make([]byte, size))
			}
			requireNoErrors(t, cl.each(func(m int, c *Comm) error {
				return c.AllReduce(context.Background(), bufs[m], reduce.Float32, reduce.Sum, nil)
			}))
			var received, sent uint64
			for m, c := range cl.comms {
				require.Equal(t, mode.algo, c.Algorithm())
				var st Stats
				require.True(t, c.LastStats(&st))
				desc := uint64(descSize * (members - 1))
				assert.GreaterOrEqual(t, st.BytesReceived, desc, "member %d", m)
				assert.GreaterOrEqual(t, st.BytesSent, desc, "member %d", m)
				received += st.BytesReceived - desc
				sent += st.BytesSent - desc
				assert.Positive(t, st.Reduce, "member %d", m)
				for _, p := range st.Peers {
					assert.True(t, p.Heard, "member %d: every peer sends a descriptor", m)
				}
			}
			// Each member reads (n-1) inputs' bytes of the pieces it owns,
			// and copies every piece it does not own or has it written
			// by its owner: (n-1)·size + (n-1)·size over all, each way.
			assert.Equal(t, uint64(2*(members-1)*size), received)
			assert.Equal(t, received, sent)
		})
	}
}
