package feed

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

// mapRegion maps size bytes of the client's memfd fd for the server. It
// refuses a file that could shrink under the mapping (no F_SEAL_SHRINK) or
// that is shorter than size: touching a page past the end of a file kills
// the process with SIGBUS.
func mapRegion(fd int, size uint64, max uint64) ([]byte, error) {
	if size == 0 {
		return nil, fmt.Errorf("region size is 0")
	}
	if size > max {
		return nil, fmt.Errorf("region of %d bytes is over the %d-byte limit", size, max)
	}
	var st unix.Stat_t
	if err := unix.Fstat(fd, &st); err != nil {
		return nil, fmt.Errorf("fstat region fd: %w", err)
	}
	if st.Mode&unix.S_IFMT != unix.S_IFREG {
		return nil, fmt.Errorf("region fd is not a regular file (mode %#o): send a memfd", st.Mode)
	}
	seals, err := unix.FcntlInt(uintptr(fd), unix.F_GET_SEALS, 0)
	if err != nil {
		return nil, fmt.Errorf("region fd is not a sealable memfd (F_GET_SEALS: %v): create it with MFD_ALLOW_SEALING and seal it with F_SEAL_SHRINK", err)
	}
	if seals&unix.F_SEAL_SHRINK == 0 {
		return nil, fmt.Errorf("region memfd is not sealed with F_SEAL_SHRINK (seals %#x): it could shrink under the mapping", seals)
	}
	if st.Size < 0 || uint64(st.Size) < size {
		return nil, fmt.Errorf("region memfd holds %d bytes, the message says %d", st.Size, size)
	}
	if size > uint64(int(^uint(0)>>1)) {
		return nil, fmt.Errorf("region of %d bytes cannot be mapped", size)
	}
	mem, err := unix.Mmap(fd, 0, int(size), unix.PROT_READ|unix.PROT_WRITE, unix.MAP_SHARED)
	if err != nil {
		return nil, fmt.Errorf("mmap region: %w", err)
	}
	return mem, nil
}

// inRange reports whether [off, off+n) lies within size bytes, without
// overflowing.
func inRange(off, n, size uint64) bool {
	return off <= size && n <= size-off
}
