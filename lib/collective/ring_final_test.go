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

// The rings' final bytes (all_reduce's all-gather, all_gather; and what
// a broadcast's chain carries) land without a pass of ours: over TCP read straight into the destination
// (pipe.into), nothing streamed; elsewhere the last step copies them with
// non-temporal stores from Options.StreamBytes on (none below it, or with
// it off). The results stay exact.
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
					switch {
					case name == "tcp":
						require.Equal(t, before, streamedCopies.Load(), "streamed over TCP")
						// Chunks received in the all-gather steps: 2 per
						// step of each member (L in 16 KiB chunks over 2
						// streams is 7 chunks per slot; a third of L per
						// segment with 3 members is 2 or 3).
						require.Greater(t, directRecvs.Load()-direct, int64(2*members), "read straight into the destination")
					case stream == 1:
						require.Greater(t, streamedCopies.Load(), before, "nothing streamed")
						require.Equal(t, direct, directRecvs.Load())
					default:
						require.Equal(t, before, streamedCopies.Load(), "streamed below StreamBytes or with it off")
						require.Equal(t, direct, directRecvs.Load())
					}
				})
			}
		}
	}
}
