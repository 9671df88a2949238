package collective

import (
	"context"
	"fmt"
	"testing"

	"github.com/gpubridge/gpubridge/lib/reduce"
	"github.com/gpubridge/gpubridge/lib/transport"
)

// BenchmarkAllReduce: 64 MiB of float32 over in-memory meshes of 4 streams
// without CRC, default chunk. The mem transport copies every frame once, so this
// measures the algorithm's overhead, not a wire (the lead benchmarks real
// transports). Bytes/s is the algorithm bandwidth of one member.
func BenchmarkAllReduce(b *testing.B) {
	for _, members := range []int{2, 4} {
		b.Run(fmt.Sprintf("members=%d/64MiB", members), func(b *testing.B) {
			const size = 64 << 20
			cl := newClusterMesh(b, transport.NewMem(members, 4, false), Options{}, DefaultMaxUnexpected)
			bufs := make([][]byte, members)
			for m := range bufs {
				bufs[m] = make([]byte, size)
			}
			b.SetBytes(size)
			b.ResetTimer()
			for range b.N {
				requireNoErrors(b, cl.each(func(m int, c *Comm) error {
					return c.AllReduce(context.Background(), bufs[m], reduce.Float32, reduce.Sum, nil)
				}))
			}
		})
	}
}

// BenchmarkAllReduceSmall: the latency of a 4-byte all_reduce of 2
// members, in memory.
func BenchmarkAllReduceSmall(b *testing.B) {
	cl := newCluster(b, 2, 4, Options{})
	bufs := [][]byte{make([]byte, 4), make([]byte, 4)}
	b.ResetTimer()
	for range b.N {
		requireNoErrors(b, cl.each(func(m int, c *Comm) error {
			return c.AllReduce(context.Background(), bufs[m], reduce.Float32, reduce.Sum, nil)
		}))
	}
}
