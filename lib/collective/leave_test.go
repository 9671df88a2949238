package collective

import (
	"context"
	"log/slog"
	"strings"
	"testing"
	"time"

	"github.com/gpubridge/gpubridge/lib/reduce"
	"github.com/gpubridge/gpubridge/lib/store/storetest"
	"github.com/gpubridge/gpubridge/lib/testenv"
	"github.com/gpubridge/gpubridge/lib/transport"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

// TestLeaveLogsPeerClosed: a member that leaves as gbbridge's members do
// (a barrier after its last collective, then Close, a moment later) is
// reported by a peer still running as closed, at Debug, with
// transport.ErrPeerClosed, not as lost with the warning that asks whether
// it died. (Over TCP the barrier's ended context used to make the Close's
// frame on the control stream fail, and the peer read a bare EOF.)
func TestLeaveLogsPeerClosed(t *testing.T) {
	for _, kind := range []transport.Kind{transport.TCP, transport.SHM} {
		t.Run(string(kind), func(t *testing.T) {
			timeout := testenv.Scale(20 * time.Second)
			meshes := realMeshesRing(t, kind, 2, 2, 256<<10, 2)
			var logs [2]storetest.SyncBuffer
			comms := make([]*Comm, 2)
			for i, m := range meshes {
				log := slog.New(slog.NewTextHandler(&logs[i], &slog.HandlerOptions{Level: slog.LevelDebug}))
				comms[i] = New(m, Options{ChunkBytes: 64 << 10, Timeout: timeout, Log: log})
				t.Cleanup(func() { _ = comms[i].Close() })
			}
			errs := (&cluster{meshes: meshes, comms: comms}).each(func(m int, c *Comm) error {
				buf := make([]byte, 1<<20)
				if err := c.AllReduce(context.Background(), buf, reduce.Float32, reduce.Sum, nil); err != nil {
					return err
				}
				return c.Barrier(context.Background())
			})
			requireNoErrors(t, errs)
			time.Sleep(20 * time.Millisecond) // the calls' contexts have ended
			require.NoError(t, comms[1].Close())
			pr := comms[0].peers[1]
			select {
			case <-pr.gone:
			case <-time.After(timeout):
				t.Fatal("member 0 did not notice member 1 leave")
			}
			require.ErrorIs(t, pr.lost, transport.ErrPeerClosed)
			assert.NotErrorIs(t, pr.lost, transport.ErrConnClosed)
			require.Eventually(t, func() bool {
				return strings.Contains(logs[0].String(), `msg="bridge member`)
			}, timeout, time.Millisecond)
			out := logs[0].String()
			assert.Contains(t, out, `level=DEBUG msg="bridge member closed"`)
			assert.NotContains(t, out, "level=WARN", "member 0's log")
		})
	}
}
