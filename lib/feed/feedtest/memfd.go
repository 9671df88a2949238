package feedtest

import (
	"fmt"

	"github.com/gpubridge/gpubridge/lib/transport"
)

// NewMemfd creates a shared-memory file of size bytes the way the plugin
// does (os.memfd_create, ftruncate, fcntl F_ADD_SEALS) and maps it: a memfd
// with close-on-exec, sealed against shrinking and growing, so the server's
// mapping can never lose its pages (no SIGBUS). The caller owns fd and mem
// (unix.Munmap, unix.Close).
func NewMemfd(name string, size int) (fd int, mem []byte, err error) {
	fd, mem, err = transport.NewMemfd(name, size)
	if err != nil {
		return -1, nil, fmt.Errorf("feed: %w", err)
	}
	return fd, mem, nil
}
