package feedserver

import (
	"fmt"
	"time"

	"github.com/gpubridge/gpubridge/lib/feed"
	"github.com/gpubridge/gpubridge/lib/transport"
	"golang.org/x/sys/unix"
)

// mapRegion maps size bytes of the client's memfd fd for the server. It
// refuses a file that could shrink under the mapping (no F_SEAL_SHRINK) or
// that is shorter than size: touching a page past the end of a file kills
// the process with SIGBUS (transport.CheckMemfd).
func mapRegion(fd int, size uint64, max uint64) ([]byte, error) {
	return transport.MapMemfd(fd, size, max, true)
}

// inRange reports whether [off, off+n) lies within size bytes, without
// overflowing.
func inRange(off, n, size uint64) bool {
	return off <= size && n <= size-off
}

type region struct {
	id       uint32
	mem      []byte
	shared   uint64 // the id the other members know it by; 0: not shared
	unreg    func() // ends its registration with the mesh's device; nil: none
	refs     int
	released bool
	relID    uint64
	relAt    time.Time
}

func (s *Server) popFD() int {
	if len(s.fds) == 0 {
		return -1
	}
	fd := s.fds[0]
	s.fds = s.fds[1:]
	return fd
}

func (s *Server) addRegion(m *feed.RegionMsg, arrived time.Time) error {
	if err := s.checkID(m.ID); err != nil {
		s.closeFD(s.popFD())
		return err
	}
	fd := s.popFD()
	if fd < 0 {
		s.reply(m.ID, feed.StatusBadRequest, fmt.Sprintf("region %d: no file descriptor came with the message (send it with SCM_RIGHTS)", m.Region), arrived)
		return nil
	}
	defer s.closeFD(fd)
	fail := func(format string, args ...any) error {
		s.reply(m.ID, feed.StatusBadRequest, fmt.Sprintf("region %d: ", m.Region)+fmt.Sprintf(format, args...), arrived)
		return nil
	}
	if m.Region == 0 {
		return fail("region id 0 is reserved for \"no region\"")
	}
	s.rmu.Lock()
	_, dup := s.regions[m.Region]
	n := len(s.regions)
	s.rmu.Unlock()
	if dup {
		return fail("region id is already mapped")
	}
	if n >= s.o.MaxRegions {
		return fail("%d regions are mapped, the limit is %d (release one)", n, s.o.MaxRegions)
	}
	mem, err := mapRegion(fd, m.Size, s.o.MaxRegionBytes)
	if err != nil {
		return fail("%v", err)
	}
	r := &region{id: m.Region, mem: mem}
	if s.o.Share != nil {
		if r.shared, err = s.o.Share.Share(fd, mem); err != nil {
			s.o.Log.Warn("region not shared with the other members: the collectives copy it through the transport", "region", m.Region, "err", err)
		}
	}
	if s.o.Register != nil {
		if r.unreg, err = s.o.Register.Register(mem); err != nil {
			r.unreg = nil
			s.o.Log.Warn("region not registered with the RDMA device: its sends are copied into staging", "region", m.Region, "err", err)
		}
	}
	s.rmu.Lock()
	s.regions[m.Region] = r
	s.rmu.Unlock()
	s.o.Log.Debug("region mapped", "region", m.Region, "bytes", m.Size, "shared", r.shared != 0, "registered", r.unreg != nil)
	s.reply(m.ID, feed.StatusOK, "", arrived)
	return nil
}

func (s *Server) closeFD(fd int) {
	if fd >= 0 {
		_ = unix.Close(fd)
	}
}

func (s *Server) release(m *feed.ReleaseMsg, arrived time.Time) error {
	if err := s.checkID(m.ID); err != nil {
		return err
	}
	s.rmu.Lock()
	r, ok := s.regions[m.Region]
	if !ok || r.released {
		s.rmu.Unlock()
		s.reply(m.ID, feed.StatusBadRequest, fmt.Sprintf("release: region %d is not mapped", m.Region), arrived)
		return nil
	}
	r.released, r.relID, r.relAt = true, m.ID, arrived
	s.inflight.Add(1)
	if r.refs > 0 {
		s.rmu.Unlock()
		return nil
	}
	delete(s.regions, m.Region)
	s.rmu.Unlock()
	s.unmap(r)
	return nil
}

// withdraw stops sharing r and ends its registration (before it is
// unmapped; no collective uses it then, so no peer reads it and no send
// is in flight from it).
func (s *Server) withdraw(r *region) {
	if r.shared != 0 {
		s.o.Share.Unshare(r.shared)
		r.shared = 0
	}
	if r.unreg != nil {
		r.unreg()
		r.unreg = nil
	}
}

// unmap unmaps a released region and answers its RELEASE.
func (s *Server) unmap(r *region) {
	s.withdraw(r)
	err := unix.Munmap(r.mem)
	r.mem = nil
	if err != nil {
		s.reply(r.relID, feed.StatusBadRequest, fmt.Sprintf("release: munmap region %d: %v", r.id, err), r.relAt)
	} else {
		s.reply(r.relID, feed.StatusOK, "", r.relAt)
	}
	s.inflight.Add(-1)
}

// span resolves a request's span to memory and takes a reference on its
// region.
func (s *Server) span(what string, sp feed.Span) (*region, []byte, error) {
	if sp.Region == 0 {
		if sp.Off != 0 || sp.Len != 0 {
			return nil, nil, fmt.Errorf("%s: no region, but offset %d and length %d", what, sp.Off, sp.Len)
		}
		return nil, nil, nil
	}
	r, ok := s.regions[sp.Region]
	if !ok || r.released {
		return nil, nil, fmt.Errorf("%s: region %d is not mapped", what, sp.Region)
	}
	if !inRange(sp.Off, sp.Len, uint64(len(r.mem))) {
		return nil, nil, fmt.Errorf("%s: bytes [%d, %d+%d) are outside region %d of %d bytes", what, sp.Off, sp.Off, sp.Len, sp.Region, len(r.mem))
	}
	r.refs++
	return r, r.mem[sp.Off : sp.Off+sp.Len : sp.Off+sp.Len], nil
}

func (s *Server) unref(r *region) {
	if r == nil {
		return
	}
	s.rmu.Lock()
	r.refs--
	last := r.refs == 0 && r.released
	if last {
		delete(s.regions, r.id)
	}
	s.rmu.Unlock()
	if last {
		s.unmap(r)
	}
}

func (s *Server) unmapAll() {
	s.rmu.Lock()
	defer s.rmu.Unlock()
	for id, r := range s.regions {
		if r.mem != nil {
			s.withdraw(r)
			_ = unix.Munmap(r.mem)
		}
		delete(s.regions, id)
	}
	for _, fd := range s.fds {
		_ = unix.Close(fd)
	}
	s.fds = nil
}
