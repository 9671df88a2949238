package transport

import (
	"fmt"

	"golang.org/x/sys/unix"
)

// NewMemfd creates a shared-memory file of size bytes the way the torch
// plugin creates its feed regions (memfd_create, ftruncate, F_ADD_SEALS)
// and maps it read-write: close-on-exec, sealed against shrinking and
// growing, so no mapping of it can ever lose its pages (no SIGBUS). Such a
// file can be shared with the peers of a Sharer mesh. The caller owns fd
// and mem (FreeMemfd).
func NewMemfd(name string, size int) (fd int, mem []byte, err error) {
	if size <= 0 {
		return -1, nil, fmt.Errorf("memfd of %d bytes: the size must be positive", size)
	}
	fd, err = unix.MemfdCreate(name, unix.MFD_CLOEXEC|unix.MFD_ALLOW_SEALING)
	if err != nil {
		return -1, nil, fmt.Errorf("memfd_create: %w", err)
	}
	fail := func(what string, err error) (int, []byte, error) {
		_ = unix.Close(fd)
		return -1, nil, fmt.Errorf("%s: %w", what, err)
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

// FreeMemfd unmaps mem and closes fd (either may be absent: nil, -1).
func FreeMemfd(fd int, mem []byte) {
	if mem != nil {
		_ = unix.Munmap(mem)
	}
	if fd >= 0 {
		_ = unix.Close(fd)
	}
}

// CheckMemfd checks that fd can be mapped for size bytes without risk: a
// regular file, a memfd sealed against shrinking (a file that shrinks
// under a mapping turns the next access into SIGBUS), at least size bytes
// long, and no larger than max.
func CheckMemfd(fd int, size, max uint64) error {
	if size == 0 {
		return fmt.Errorf("region size is 0")
	}
	if size > max {
		return fmt.Errorf("region of %d bytes is over the %d-byte limit", size, max)
	}
	var st unix.Stat_t
	if err := unix.Fstat(fd, &st); err != nil {
		return fmt.Errorf("fstat region fd: %w", err)
	}
	if st.Mode&unix.S_IFMT != unix.S_IFREG {
		return fmt.Errorf("region fd is not a regular file (mode %#o): send a memfd", st.Mode)
	}
	seals, err := unix.FcntlInt(uintptr(fd), unix.F_GET_SEALS, 0)
	if err != nil {
		return fmt.Errorf("region fd is not a sealable memfd (F_GET_SEALS: %v): create it with MFD_ALLOW_SEALING and seal it with F_SEAL_SHRINK", err)
	}
	if seals&unix.F_SEAL_SHRINK == 0 {
		return fmt.Errorf("region memfd is not sealed with F_SEAL_SHRINK (seals %#x): it could shrink under the mapping", seals)
	}
	if st.Size < 0 || uint64(st.Size) < size {
		return fmt.Errorf("region memfd holds %d bytes, the message says %d", st.Size, size)
	}
	if size > uint64(int(^uint(0)>>1)) {
		return fmt.Errorf("region of %d bytes cannot be mapped", size)
	}
	return nil
}

// CheckWritableMemfd checks that fd (a memfd that passed CheckMemfd) may
// be mapped writable: it is not sealed against writes (F_SEAL_WRITE,
// F_SEAL_FUTURE_WRITE).
func CheckWritableMemfd(fd int) error {
	seals, err := unix.FcntlInt(uintptr(fd), unix.F_GET_SEALS, 0)
	if err != nil {
		return fmt.Errorf("F_GET_SEALS: %w", err)
	}
	if seals&(unix.F_SEAL_WRITE|unix.F_SEAL_FUTURE_WRITE) != 0 {
		return fmt.Errorf("region memfd is sealed against writes (seals %#x): it cannot be mapped writable", seals)
	}
	return nil
}

// MapMemfd maps size bytes of fd shared, after CheckMemfd; writable says
// whether the mapping may be written (a peer's region is mapped read-only
// unless the mesh has Config.PeerWrite), and then the memfd must pass
// CheckWritableMemfd too.
func MapMemfd(fd int, size, max uint64, writable bool) ([]byte, error) {
	if err := CheckMemfd(fd, size, max); err != nil {
		return nil, err
	}
	if writable {
		if err := CheckWritableMemfd(fd); err != nil {
			return nil, err
		}
	}
	prot := unix.PROT_READ
	if writable {
		prot |= unix.PROT_WRITE
	}
	mem, err := unix.Mmap(fd, 0, int(size), prot, unix.MAP_SHARED)
	if err != nil {
		return nil, fmt.Errorf("mmap region: %w", err)
	}
	return mem, nil
}
