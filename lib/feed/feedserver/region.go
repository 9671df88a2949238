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
	id  uint32
	mem []byte
	fd  int // the client's memfd, kept to offer it to bridges joined later
	// offers are the lanes it is shared with or registered on (guarded by
	// rmu; written under shareMu).
	offers   []offer
	refs     int
	released bool
	relID    uint64
	relAt    time.Time
}

// offer is a region's place on one lane: the id that lane's peers know it
// by (0: not shared), and the end of its registration with the lane's
// device (nil: none).
type offer struct {
	l      *lane
	shared uint64
	unreg  func()
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
	fail := func(format string, args ...any) error {
		s.closeFD(fd)
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
	r := &region{id: m.Region, mem: mem, fd: fd}
	// Offered to every lane there is, and mapped before another lane is
	// added (which offers it the regions mapped then).
	s.shareMu.Lock()
	for _, l := range s.allLanes() {
		s.offer(r, l)
	}
	shared, registered := 0, 0 // read before another lane may add offers
	for _, o := range r.offers {
		if o.shared != 0 {
			shared++
		}
		if o.unreg != nil {
			registered++
		}
	}
	bridges := len(r.offers)
	s.rmu.Lock()
	s.regions[m.Region] = r
	s.rmu.Unlock()
	s.shareMu.Unlock()
	s.o.Log.Debug("region mapped", "region", m.Region, "bytes", m.Size, "shared", shared > 0, "registered", registered > 0, "bridges", bridges)
	s.reply(m.ID, feed.StatusOK, "", arrived)
	return nil
}

// allLanes are bridge 0's lane, if any, and the joined ones.
func (s *Server) allLanes() []*lane {
	s.lmu.Lock()
	defer s.lmu.Unlock()
	ls := make([]*lane, 0, 1+len(s.lanes))
	if s.lane0 != nil {
		ls = append(ls, s.lane0)
	}
	for _, l := range s.lanes {
		ls = append(ls, l)
	}
	return ls
}

// offer shares r with l's peers and registers it with l's device, where l
// does either; the caller holds shareMu and r cannot be unmapped.
func (s *Server) offer(r *region, l *lane) {
	o := offer{l: l}
	var err error
	if l.share != nil {
		if o.shared, err = l.share.Share(r.fd, r.mem); err != nil {
			o.shared = 0
			s.o.Log.Warn("region not shared with the other members: the collectives copy it through the transport", "region", r.id, "bridge", l.id, "err", err)
		}
	}
	if l.register != nil {
		if o.unreg, err = l.register.Register(r.mem); err != nil {
			o.unreg = nil
			s.o.Log.Warn("region not registered with the RDMA device: its sends are copied into staging", "region", r.id, "bridge", l.id, "err", err)
		}
	}
	if o.shared != 0 || o.unreg != nil {
		s.rmu.Lock()
		r.offers = append(r.offers, o)
		s.rmu.Unlock()
	}
}

// offerRegions offers l, a lane just added, every region mapped; the
// caller holds shareMu.
func (s *Server) offerRegions(l *lane) {
	if l.share == nil && l.register == nil {
		return
	}
	s.rmu.Lock()
	var rs []*region
	for _, r := range s.regions {
		if !r.released && r.mem != nil {
			r.refs++ // not unmapped while offered
			rs = append(rs, r)
		}
	}
	s.rmu.Unlock()
	for _, r := range rs {
		s.offer(r, l)
		s.unref(r)
	}
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

// withdraw stops sharing r and ends its registrations, on every lane, and
// closes its memfd (before it is unmapped; no collective uses it then, so
// no peer reads it and no send is in flight from it).
func (s *Server) withdraw(r *region) {
	for _, o := range r.offers {
		if o.shared != 0 {
			o.l.share.Unshare(o.shared)
		}
		if o.unreg != nil {
			o.unreg()
		}
	}
	r.offers = nil
	s.closeFD(r.fd)
	r.fd = -1
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
