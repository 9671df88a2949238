package bridge

import (
	"context"
	"encoding/binary"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	"go.uber.org/goleak"

	"github.com/gpubridge/gpubridge/lib/collective"
	"github.com/gpubridge/gpubridge/lib/reduce"
	"github.com/gpubridge/gpubridge/lib/store/storetest"
	"github.com/gpubridge/gpubridge/lib/testenv"
	"github.com/gpubridge/gpubridge/lib/transport"
)

func TestMain(m *testing.M) { goleak.VerifyTestMain(m) }

// joinAll joins n members concurrently with configs made by cfg.
func joinAll(t *testing.T, n int, cfg func(self int) Config) ([]*Member, []error) {
	t.Helper()
	ms, errs := make([]*Member, n), make([]error, n)
	done := make(chan struct{})
	for i := range n {
		go func() {
			ms[i], errs[i] = Join(context.Background(), cfg(i))
			done <- struct{}{}
		}()
	}
	for range n {
		<-done
	}
	return ms, errs
}

// Members that name no members learn each other's hosts through the store
// and, asking for auto on one host, get shm; given members and a transport
// are taken as they are. Either way the communicator works.
func TestJoin(t *testing.T) {
	cases := []struct {
		name      string
		members   []transport.MemberInfo
		requested transport.Kind
		want      string
	}{
		{"hosts exchanged, auto", nil, "auto", "shm"},
		{"hosts exchanged, tcp", nil, "tcp", "tcp"},
		{"members given", []transport.MemberInfo{{Rank: 0, Host: "a"}, {Rank: 5, Host: "a"}}, "tcp", "tcp"},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			addr := storetest.Start(t)
			ms, errs := joinAll(t, 2, func(self int) Config {
				return Config{Store: addr, Namespace: "join-test", Size: 2,
					Mesh: transport.Config{Self: self, Members: c.members, Transport: c.requested, Streams: 2,
						ListenHost: "127.0.0.1", Timeout: testenv.Scale(30 * time.Second), Process: "bridge test"},
					Comm: collective.Options{ChunkBytes: 4096, Timeout: testenv.Scale(30 * time.Second)}}
			})
			for i, err := range errs {
				require.NoError(t, err, "member %d", i)
			}
			bufs := make([][]byte, 2)
			done := make(chan error, 2)
			for i, m := range ms {
				assert.Equal(t, i, m.Self)
				assert.Equal(t, 2, m.Size)
				assert.Contains(t, m.Mesh.Describe(), c.want)
				bufs[i] = binary.LittleEndian.AppendUint32(nil, uint32(i+1))
				go func() { done <- m.Comm.AllReduce(context.Background(), bufs[i], reduce.Int32, reduce.Sum, nil) }()
			}
			for range ms {
				require.NoError(t, <-done)
			}
			assert.Equal(t, uint32(3), binary.LittleEndian.Uint32(bufs[0]))
			assert.Equal(t, uint32(3), binary.LittleEndian.Uint32(bufs[1]))
			for _, m := range ms {
				go func() { done <- m.Leave(testenv.Scale(5 * time.Second)) }()
			}
			for range ms {
				assert.NoError(t, <-done)
			}
		})
	}
}

func TestJoinErrorsNameMemberAndStep(t *testing.T) {
	t.Run("no store", func(t *testing.T) {
		_, err := Join(context.Background(), Config{Store: "127.0.0.1:1", Name: "rank 3 (bridge member 1 of 2)",
			Mesh: transport.Config{Self: 1, Timeout: testenv.Scale(2 * time.Second)}})
		var je *JoinError
		require.ErrorAs(t, err, &je)
		assert.Equal(t, "rank 3 (bridge member 1 of 2)", je.Member)
		assert.Equal(t, "connect to the store at 127.0.0.1:1", je.Step)
		assert.Contains(t, err.Error(), "rank 3 (bridge member 1 of 2): connect to the store at 127.0.0.1:1: ")
	})
	t.Run("a member never comes", func(t *testing.T) {
		addr := storetest.Start(t)
		_, err := Join(context.Background(), Config{Store: addr, Namespace: "alone", Size: 2,
			Mesh: transport.Config{Self: 0, Transport: "tcp", Timeout: testenv.Scale(1 * time.Second)}})
		var je *JoinError
		require.ErrorAs(t, err, &je)
		assert.Equal(t, "member 0", je.Member)
		assert.Equal(t, "waiting for member 1 to join", je.Step)
	})
	t.Run("shm across hosts", func(t *testing.T) {
		addr := storetest.Start(t)
		_, err := Join(context.Background(), Config{Store: addr, Namespace: "hosts",
			Mesh: transport.Config{Self: 0, Transport: transport.SHM, Timeout: testenv.Scale(5 * time.Second),
				Members: []transport.MemberInfo{{Rank: 0, Host: "a"}, {Rank: 1, Host: "b"}}}})
		var je *JoinError
		require.ErrorAs(t, err, &je)
		assert.Equal(t, "choose the transport", je.Step)
		var ce *transport.ChoiceError
		assert.ErrorAs(t, err, &ce)
	})
}
