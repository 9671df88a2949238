package transport

import (
	"context"
	"fmt"
	"sync"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

// A transport plugs in by its own files alone: this test file registers
// one ("loop": in-process meshes, found through the endpoint records) and
// Establish runs it through the same rendezvous as tcp and shm.
const loop Kind = "loop"

type loopEndpoint struct {
	endpoint
	Mesh string `json:"mesh"`
}

var loops = struct {
	sync.Mutex
	meshes map[string][]Mesh
}{meshes: map[string][]Mesh{}}

func init() {
	register(&driver{kind: loop, establish: func(ctx context.Context, s *setup) (Mesh, error) {
		name := fmt.Sprintf("%x", s.job[:8])
		if err := s.rv.Publish(ctx, loopEndpoint{endpoint: s.endpoint(), Mesh: name}); err != nil {
			return nil, err
		}
		eps, err := gather[loopEndpoint](ctx, s)
		if err != nil {
			return nil, err
		}
		for i, e := range eps {
			if e.Mesh != name {
				return nil, fmt.Errorf("%s is in mesh %s, not %s", s.rv.Who(i), e.Mesh, name)
			}
		}
		loops.Lock()
		ms := loops.meshes[name]
		if ms == nil {
			ms = NewMem(len(eps), s.cfg.Streams, s.cfg.CRC)
			loops.meshes[name] = ms
		}
		loops.Unlock()
		return ms[s.cfg.Self], s.rv.Barrier(ctx)
	}})
}

func TestRegisteredTransport(t *testing.T) {
	b := newBridge(t, loop, 3, 2, true)
	meshes := b.mustEstablish(t)
	assert.Equal(t, "mem, 2 streams per peer, crc32c", meshes[0].Describe())
	exchange(t, meshes, []int{0, 5, 1 << 16})

	// It is built, but no one may ask for it: Choose offers what users
	// can request.
	_, _, err := Choose(loop, b.cfgs[0].Members)
	require.EqualError(t, err, `bridge "loop" is not a transport (auto, tcp, shm, verbs)`)
}

func TestUnknownTransport(t *testing.T) {
	b := newBridge(t, "carrier-pigeon", 2, 1, false)
	_, err := Establish(context.Background(), b.cfgs[0])
	assert.EqualError(t, err, `bridge setup: unknown transport "carrier-pigeon" (tcp, shm, verbs or loop)`)
}
