package collective

import (
	"context"
	"fmt"
	"math/rand/v2"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/gpubridge/gpubridge/lib/reduce"
	"github.com/gpubridge/gpubridge/lib/testenv"
	"github.com/gpubridge/gpubridge/lib/transport"
)

// The final bytes of a ring's all-gather, of all_gather and of a
// broadcast's chain land with one pass at most: over TCP read straight
// into the destination (pipe.into), but for a ring's last step from
// Options.StreamBytes on, which, as over the other transports, copies
// them with non-temporal stores (none below it, or with it off). The
// results stay exact.
func TestRingFinalBytes(t *testing.T) {
	meshes := map[string]func(t *testing.T, members int) []transport.Mesh{
		"mem": func(_ *testing.T, members int) []transport.Mesh {
			return withoutHold(transport.NewMem(members, 2, false))
		},
		"tcp": func(t *testing.T, members int) []transport.Mesh { return realMeshes(t, transport.TCP, members, 2) },
	}
	const L = 6*(16<<10) + 4*37 // chunks of 16 KiB: pieces past ntcopy's least streamed copy
	for name, mk := range meshes {
		for _, members := range []int{2, 3} {
			for _, stream := range []int{1, -1, 1 << 30} {
				t.Run(fmt.Sprintf("%s/members=%d/stream=%d", name, members, stream), func(t *testing.T) {
					o := Options{ChunkBytes: 16 << 10, SmallBytes: -1, SplitBytes: 1, StreamBytes: stream, Workers: 2, Timeout: testenv.Scale(30 * time.Second)}
					cl := newClusterMesh(t, mk(t, members), o, DefaultMaxUnexpected)
					rng := rand.New(rand.NewPCG(100, uint64(members)))
					inputs := make([][]byte, members)
					for m := range inputs {
						inputs[m] = randData(rng, reduce.Float32, L/4)
					}
					before, direct := streamedCopies.Load(), directRecvs.Load()
					want := wantAllReduce(cl.comms[0], reduce.Sum, reduce.Float32, inputs)
					runAllReduce(t, cl, reduce.Float32, reduce.Sum, Codec{}, inputs, want, AlgoRing, "all_reduce")
					switch ar := directRecvs.Load() - direct; {
					case name == "mem":
					case stream == 1 && members == 2:
						require.Zero(t, ar, "the last step streamed, not read into buf")
					default:
						require.Positive(t, ar, "the all-gather read into buf")
					}
					var gathered []byte
					for _, in := range inputs {
						gathered = append(gathered, in...)
					}
					outs := make([][]byte, members)
					requireNoErrors(t, cl.each(func(m int, c *Comm) error {
						outs[m] = make([]byte, members*L)
						garbage(outs[m])
						return c.AllGather(context.Background(), outs[m], inputs[m], nil)
					}))
					for m := range outs {
						requireBits(t, gathered, outs[m], 1, "all_gather, member %d", m)
					}
					root := members - 1
					requireNoErrors(t, cl.each(func(m int, c *Comm) error {
						outs[m] = outs[m][:L]
						if m == root {
							copy(outs[m], inputs[root])
						} else {
							garbage(outs[m])
						}
						return c.Broadcast(context.Background(), outs[m], root, nil)
					}))
					for m := range outs {
						requireBits(t, inputs[root], outs[m], 1, "broadcast, member %d", m)
					}
					// Over TCP the final bytes are read straight into the
					// destination (a broadcast's always, a ring's but for
					// its last step's when streamed): every stream of
					// every member but the root receives some.
					if name == "tcp" {
						require.Greater(t, directRecvs.Load()-direct, int64(2*(members-1)), "read straight into the destination")
					} else {
						require.Equal(t, direct, directRecvs.Load(), "read into the destination over mem")
					}
					if stream == 1 {
						require.Greater(t, streamedCopies.Load(), before, "nothing streamed")
					} else {
						require.Equal(t, before, streamedCopies.Load(), "streamed below StreamBytes or with it off")
					}
				})
			}
		}
	}
}
