package collective

import (
	"context"
	"fmt"
	"testing"

	"github.com/gpubridge/gpubridge/lib/reduce"
	"github.com/gpubridge/gpubridge/lib/transport"
)

// BenchmarkAllReduce: 1 MiB and 64 MiB of float32 over in-memory meshes of 4 streams
// without CRC, default chunk. The mem transport copies every frame once, so this
// measures the algorithm's overhead, not a wire (the lead benchmarks real
// transports). Bytes/s is the algorithm bandwidth of one member.
func BenchmarkAllReduce(b *testing.B) {
	for _, members := range []int{2, 4} {
		for _, size := range []int{1 << 20, 64 << 20} {
			b.Run(fmt.Sprintf("members=%d/%dMiB", members, size>>20), func(b *testing.B) {
				cl := newClusterMesh(b, transport.NewMem(members, 4, false), Options{}, DefaultMaxUnexpected)
				bufs := make([][]byte, members)
				for m := range bufs {
					bufs[m] = make([]byte, size)
				}
				b.SetBytes(int64(size))
				b.ResetTimer()
				for range b.N {
					requireNoErrors(b, cl.each(func(m int, c *Comm) error {
						return c.AllReduce(context.Background(), bufs[m], reduce.Float32, reduce.Sum, nil)
					}))
				}
			})
		}
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
