package collective

import (
	"context"
	"fmt"
	"math/rand/v2"
	"slices"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/gpubridge/gpubridge/lib/codec"
	"github.com/gpubridge/gpubridge/lib/reduce"
	"github.com/gpubridge/gpubridge/lib/testenv"
	"github.com/gpubridge/gpubridge/lib/transport"
)

// AllReduceInto gives AllReduce's bits in out and leaves in as it was, on
// every algorithm: the two-member exchange natively out of place (over
// the in-memory mesh, TCP's pieces and shm rings), everything else after
// a copy; its input streams in through Ready starting from garbage, so a
// reduction that read the input before it was granted computes garbage.
func TestAllReduceInto(t *testing.T) {
	meshes := map[string]func(t *testing.T, members int) []transport.Mesh{
		"mem": func(_ *testing.T, members int) []transport.Mesh { return transport.NewMem(members, 3, false) },
		"tcp": func(t *testing.T, members int) []transport.Mesh { return realMeshes(t, transport.TCP, members, 3) },
		"shm": func(t *testing.T, members int) []transport.Mesh { return realMeshes(t, transport.SHM, members, 2) },
		"recv": func(_ *testing.T, members int) []transport.Mesh {
			return withoutHold(transport.NewMem(members, 2, false))
		},
	}
	for name, mk := range meshes {
		for _, members := range []int{1, 2, 3} {
			if members == 1 && (name == "tcp" || name == "shm") {
				continue // a bridge has 2 or more
			}
			t.Run(fmt.Sprintf("%s/members=%d", name, members), func(t *testing.T) {
				o := Options{ChunkBytes: testChunk, Workers: 2, SplitBytes: -1, SmallBytes: 2 * testChunk, Timeout: testenv.Scale(30 * time.Second)}
				cl := newClusterMesh(t, mk(t, members), o, DefaultMaxUnexpected)
				rng := rand.New(rand.NewPCG(96, uint64(members)))
				for _, dt := range []reduce.DType{reduce.Float32, reduce.BFloat16, reduce.Int64} {
					es := dt.Size()
					for _, L := range []int{es, testChunk - es, 7*testChunk + 3*es} {
						for _, op := range []reduce.Op{reduce.Sum, reduce.Max} {
							inputs := make([][]byte, members)
							for m := range inputs {
								inputs[m] = randData(rng, dt, L/es)
							}
							plantNaNs(dt, inputs)
							want := wantAllReduce(cl.comms[0], op, dt, inputs)
							what := fmt.Sprintf("%s %s, %d bytes", dt, op, L)
							runAllReduceInto(t, cl, dt, op, inputs, want, what)
							require.Equal(t, members == 2, cl.comms[0].OutOfPlace(L, codec.Raw), what)
						}
					}
				}
				// Where memory is shared the direct path takes the
				// larger buffers.
				_, shares := cl.meshes[0].(transport.Sharer)
				require.Equal(t, members == 2 && !shares, cl.comms[0].OutOfPlace(directMin2, codec.Raw))
				require.False(t, cl.comms[0].OutOfPlace(directMin2, codec.Zstd))
			})
		}
	}
}

// runAllReduceInto runs AllReduceInto on every member with its input
// released piece by piece into a buffer of garbage, and checks the result,
// the reported ranges and that the input was left as released.
func runAllReduceInto(t *testing.T, cl *cluster, dt reduce.DType, op reduce.Op, inputs [][]byte, want []byte, what string) {
	t.Helper()
	ins := make([][]byte, len(inputs))
	outs := make([][]byte, len(inputs))
	recs := make([]*doneRecorder, len(inputs))
	requireNoErrors(t, cl.each(func(m int, c *Comm) error {
		ins[m] = make([]byte, len(inputs[m]))
		garbage(ins[m])
		outs[m] = make([]byte, len(inputs[m]))
		garbage(outs[m])
		g := newReadyGate(t, len(ins[m]))
		go g.release(ins[m], inputs[m], 1000, 50*time.Microsecond)
		recs[m] = &doneRecorder{buf: outs[m]}
		return c.AllReduceInto(context.Background(), outs[m], ins[m], dt, op, Codec{}, &Progress{Ready: g.ready, Done: recs[m].done})
	}))
	for m := range outs {
		requireBits(t, want, outs[m], dt.Size(), "%s, member %d", what, m)
		recs[m].check(t, want, fmt.Sprintf("%s, member %d", what, m))
		require.Equal(t, inputs[m], ins[m], "%s, member %d: the input changed", what, m)
	}
}

// Out of place, the input and the output must be the same length and
// apart; the refusal comes before anything travels.
func TestAllReduceIntoRefuses(t *testing.T) {
	cl := newCluster(t, 2, 1, Options{ChunkBytes: testChunk})
	b := make([]byte, 64)
	for _, tc := range []struct {
		out, in []byte
		msg     string
	}{
		{b[:32], b[32:48], "same length"},
		{b[:32], b[16:48], "overlaps"},
	} {
		errs := cl.each(func(_ int, c *Comm) error {
			return c.AllReduceInto(context.Background(), tc.out, tc.in, reduce.Float32, reduce.Sum, Codec{}, nil)
		})
		for _, err := range errs {
			require.ErrorIs(t, err, ErrInvalid)
			require.ErrorContains(t, err, tc.msg)
		}
	}
	// Nothing was sent: the next call runs.
	bufs := [][]byte{slices.Clone(b[:8]), slices.Clone(b[:8])}
	requireNoErrors(t, cl.each(func(m int, c *Comm) error {
		return c.AllReduce(context.Background(), bufs[m], reduce.Float32, reduce.Sum, nil)
	}))
}
