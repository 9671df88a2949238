package harness

import (
	"fmt"

	"github.com/gpubridge/gpubridge/lib/bridge"
	"github.com/gpubridge/gpubridge/lib/transport"
)

// SharedBuffer returns size bytes for a collective's buffer: where the
// member's mesh shares memory with its peers (shm), a sealed memfd offered
// to them, as gbbridge serve's feed regions are, so that the collectives
// read (and, writing through, write) it in place (collective.AlgoDirect,
// AlgoDirectWrite); elsewhere heap memory. free withdraws and unmaps it;
// call it between collectives.
func SharedBuffer(m *bridge.Member, size int64) (buf []byte, free func(), err error) {
	sh, ok := m.Mesh.(transport.Sharer)
	if !ok || size == 0 {
		return make([]byte, size), func() {}, nil
	}
	fd, mem, err := transport.NewMemfd("gpubridge-bench", int(size))
	if err != nil {
		return nil, nil, fmt.Errorf("bench buffer of %d bytes: %w", size, err)
	}
	id, err := sh.Share(fd, mem)
	if err != nil {
		transport.FreeMemfd(fd, mem)
		return nil, nil, fmt.Errorf("bench buffer of %d bytes: %w", size, err)
	}
	return mem, func() {
		sh.Unshare(id)
		transport.FreeMemfd(fd, mem)
	}, nil
}
