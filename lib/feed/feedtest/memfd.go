package feedtest

import (
	"fmt"

	"golang.org/x/sys/unix"
)

// NewMemfd creates a shared-memory file of size bytes the way the plugin
// does (os.memfd_create, ftruncate, fcntl F_ADD_SEALS) and maps it: a memfd
// with close-on-exec, sealed against shrinking and growing, so the server's
// mapping can never lose its pages (no SIGBUS). The caller owns fd and mem
// (unix.Munmap, unix.Close).
func NewMemfd(name string, size int) (fd int, mem []byte, err error) {
	if size <= 0 {
		return -1, nil, fmt.Errorf("feed: region size %d must be positive", size)
	}
	fd, err = unix.MemfdCreate(name, unix.MFD_CLOEXEC|unix.MFD_ALLOW_SEALING)
	if err != nil {
		return -1, nil, fmt.Errorf("feed: memfd_create: %w", err)
	}
	fail := func(what string, err error) (int, []byte, error) {
		_ = unix.Close(fd)
		return -1, nil, fmt.Errorf("feed: %s: %w", what, err)
	}
	if err := unix.Ftruncate(fd, int64(size)); err != nil {
		return fail("ftruncate memfd", err)
	}
	if _, err := unix.FcntlInt(uintptr(fd), unix.F_ADD_SEALS, unix.F_SEAL_SHRINK|unix.F_SEAL_GROW|unix.F_SEAL_SEAL); err != nil {
		return fail("seal memfd", err)
	}
	mem, err = unix.Mmap(fd, 0, size, unix.PROT_READ|unix.PROT_WRITE, unix.MAP_SHARED)
	if err != nil {
		return fail("mmap memfd", err)
	}
	return fd, mem, nil
}
