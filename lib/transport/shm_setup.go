package transport

import (
	"context"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"sync/atomic"
	"time"

	"golang.org/x/sys/unix"

	"github.com/gpubridge/gpubridge/lib/rendezvous"
)

func init() { register(&driver{kind: SHM, establish: establishSHM}) }

// shmEndpoint is a shared-memory member's endpoint record: its ring file
// and pid namespace.
type shmEndpoint struct {
	endpoint
	SHM   string `json:"shm,omitempty"`
	PIDNS string `json:"pidns,omitempty"`
	// Share is the socket over which the member passes shared memory
	// (shm_share.go).
	Share string `json:"share,omitempty"`
}

// establishSHM creates this member's ring file, publishes it, maps every
// peer's file after checking it, and waits until every member has mapped
// every file before unlinking its own.
func establishSHM(ctx context.Context, s *setup) (_ Mesh, err error) {
	n, self := len(s.cfg.Members), s.cfg.Self
	dataCap := (uint64(s.cfg.RingBytes)+4095)&^4095 + 4096
	lay := shmLayout{size: n, streams: s.cfg.wireStreams(), dataCap: dataCap, ctlCap: min(dataCap, ctlRingCap)}
	m := &shmMesh{meshBase: meshBase[*shmStream]{self: self, size: n, streams: s.cfg.Streams, p2p: s.cfg.P2PStreams, crc: s.cfg.CRC},
		spin: s.cfg.Spin, pids: make([]int, n), pidfds: make([]int, n), dead: make([]atomic.Bool, n), done: make(chan struct{})}
	for i := range m.pidfds {
		m.pidfds[i] = -1
	}
	defer func() {
		if err != nil {
			if m.share != nil {
				m.share.close()
			}
			m.mu.Lock()
			m.closed = true
			m.unmapLocked()
			m.mu.Unlock()
			if m.ownPath != "" {
				_ = os.Remove(m.ownPath)
			}
		}
	}()

	for _, p := range sweepStaleRings(shmDir, time.Now()) {
		s.log.Info("removed a ring file whose member died during its set-up", "path", p)
	}
	// Our file: our outbound rings.
	path := ringPath(s.job, self)
	own, err := createRingFile(path, lay.fileSize())
	if err != nil {
		return nil, err
	}
	m.ownPath = path
	m.maps = append(m.maps, own)
	hdr := shmHeader{proto: int(s.proto), member: self, pid: os.Getpid(), size: n, streams: s.cfg.wireStreams(),
		dataCap: lay.dataCap, ctlCap: lay.ctlCap, job: s.job}
	hdr.put(own[:shmHdrSize], s.rv.Secret())

	ss, sockPath, err := s.startShares(ctx, m)
	if err != nil {
		return nil, err
	}
	defer func() { ss.stop(sockPath, err != nil) }()

	pidns, _ := os.Readlink("/proc/self/ns/pid")
	if err := s.rv.Publish(ctx, shmEndpoint{endpoint: s.endpoint(), SHM: path, PIDNS: pidns, Share: sockPath}); err != nil {
		return nil, err
	}
	eps, err := gather[shmEndpoint](ctx, s)
	if err != nil {
		return nil, err
	}
	if err := s.oneHost(eps); err != nil {
		return nil, err
	}

	m.peers = make([]string, n)
	m.procs = make([]string, n)
	m.died = make([]ProcessDiedError, n)
	for i, e := range eps {
		// The pid is the member's process (gbbridge serve), not the
		// rank's: it is named as such where it matters, when it dies.
		m.peers[i] = fmt.Sprintf("member %d (rank %d on %s)", i, e.Rank, e.Hostname)
		m.procs[i] = fmt.Sprintf("%s of rank %d (pid %d)", s.cfg.Process, e.Rank, e.PID)
		m.died[i] = ProcessDiedError{Program: s.cfg.Process, Rank: e.Rank, PID: e.PID}
		m.pids[i] = e.PID
	}
	m.links = make([][]*shmStream, n)
	for p := range n {
		if p == self {
			continue
		}
		theirs, tl, err := s.mapPeer(&eps[p], p, lay)
		if err != nil {
			return nil, fmt.Errorf("%s: %w", m.peers[p], err)
		}
		m.maps = append(m.maps, theirs)
		if fd, err := unix.PidfdOpen(eps[p].PID, 0); err == nil {
			m.pidfds[p] = fd
		}
		m.links[p] = make([]*shmStream, s.cfg.wireStreams()+1)
		for st := range m.links[p] {
			in := tl.ring(theirs, peerIndex(p, self), st)
			in.consPid.Store(uint32(os.Getpid()))
			m.links[p][st] = newSHMStream(m, p, st, lay.ring(own, peerIndex(self, p), st), in)
		}
	}
	if m.share, err = ss.connect(ctx, eps); err != nil {
		return nil, err
	}
	if err := s.rv.Barrier(ctx); err != nil {
		return nil, err
	}
	// Every member has mapped every file: nothing needs the names now.
	if err := os.Remove(path); err != nil && !errors.Is(err, os.ErrNotExist) {
		s.log.Warn("could not unlink the ring file", "path", path, "err", err)
	}
	m.ownPath = ""
	m.desc = fmt.Sprintf("shm, %d streams per peer%s, %s, %d MiB rings on %s", s.cfg.Streams, p2pWords(s.cfg.P2PStreams), crcWords(s.cfg.CRC),
		(lay.dataCap-4096)>>20, eps[self].Hostname)
	return m, nil
}

// ringPath is member self's ring file of job, while set-up runs.
func ringPath(job [jobTagSize]byte, self int) string {
	return filepath.Join(shmDir, fmt.Sprintf("gpubridge-%x-m%d", job[:8], self))
}

// oneHost refuses members on several hosts or in several pid namespaces
// (the same error on every member).
func (s *setup) oneHost(eps []shmEndpoint) error {
	for i, e := range eps {
		if e.Hostname != eps[0].Hostname {
			return &rendezvous.SharedError{Err: fmt.Errorf("the shm transport needs every member on one host: %s is on %s, %s on %s; use tcp",
				s.rv.Who(0), eps[0].Hostname, s.rv.Who(i), e.Hostname)}
		}
		if e.PIDNS != eps[0].PIDNS {
			return &rendezvous.SharedError{Err: fmt.Errorf("the shm transport needs every member in one pid namespace: %s is in %s, %s in %s; use tcp",
				s.rv.Who(0), eps[0].PIDNS, s.rv.Who(i), e.PIDNS)}
		}
	}
	return nil
}

// createRingFile creates (replacing a stale one of an earlier attempt of
// this job) and maps a zeroed file of size bytes with mode 0600.
func createRingFile(path string, size uint64) ([]byte, error) {
	flags := unix.O_RDWR | unix.O_CREAT | unix.O_EXCL | unix.O_CLOEXEC | unix.O_NOFOLLOW
	fd, err := unix.Open(path, flags, 0o600)
	if errors.Is(err, unix.EEXIST) {
		_ = os.Remove(path)
		fd, err = unix.Open(path, flags, 0o600)
	}
	if err != nil {
		return nil, fmt.Errorf("create ring file %s: %w", path, err)
	}
	defer unix.Close(fd)
	if err := unix.Fchmod(fd, 0o600); err != nil {
		_ = os.Remove(path)
		return nil, fmt.Errorf("ring file %s: %w", path, err)
	}
	if err := unix.Fallocate(fd, 0, 0, int64(size)); err != nil {
		_ = os.Remove(path)
		return nil, fmt.Errorf("allocate %d MiB for the ring file %s: %w (is %s full?)", size>>20, path, err, shmDir)
	}
	b, err := unix.Mmap(fd, 0, int(size), unix.PROT_READ|unix.PROT_WRITE, unix.MAP_SHARED)
	if err != nil {
		_ = os.Remove(path)
		return nil, fmt.Errorf("map ring file %s: %w", path, err)
	}
	return b, nil
}

// mapPeer opens, checks and maps member p's ring file.
func (s *setup) mapPeer(ep *shmEndpoint, p int, lay shmLayout) ([]byte, shmLayout, error) {
	if filepath.Dir(ep.SHM) != filepath.Clean(shmDir) {
		return nil, shmLayout{}, fmt.Errorf("ring file %q is not in %s", ep.SHM, shmDir)
	}
	fd, err := unix.Open(ep.SHM, unix.O_RDWR|unix.O_CLOEXEC|unix.O_NOFOLLOW, 0)
	if err != nil {
		return nil, shmLayout{}, fmt.Errorf("open ring file: %w", err)
	}
	defer unix.Close(fd)
	var st unix.Stat_t
	if err := unix.Fstat(fd, &st); err != nil {
		return nil, shmLayout{}, fmt.Errorf("ring file %s: %w", ep.SHM, err)
	}
	if st.Mode&unix.S_IFMT != unix.S_IFREG || st.Mode&0o077 != 0 || int(st.Uid) != os.Geteuid() {
		return nil, shmLayout{}, fmt.Errorf("ring file %s: mode %o owner uid %d; want a regular file with mode 0600 owned by uid %d",
			ep.SHM, st.Mode, st.Uid, os.Geteuid())
	}
	var hb [shmHdrSize]byte
	if _, err := unix.Pread(fd, hb[:], 0); err != nil {
		return nil, shmLayout{}, fmt.Errorf("ring file %s: %w", ep.SHM, err)
	}
	h, err := parseSHMHeader(hb[:], s.rv.Secret())
	if err != nil {
		return nil, shmLayout{}, fmt.Errorf("ring file %s: %w", ep.SHM, err)
	}
	if h.member != p || h.pid != ep.PID || h.job != s.job || h.size != lay.size || h.streams != lay.streams || h.proto != int(s.proto) {
		return nil, shmLayout{}, fmt.Errorf("ring file %s is member %d's (pid %d, %d members, %d streams, v%d), want member %d's (pid %d)",
			ep.SHM, h.member, h.pid, h.size, h.streams, h.proto, p, ep.PID)
	}
	if h.dataCap%4096 != 0 || h.ctlCap%4096 != 0 || h.dataCap < 2*4096 || h.ctlCap < 2*4096 || h.dataCap > 2*maxRingBytes || h.ctlCap > h.dataCap {
		return nil, shmLayout{}, fmt.Errorf("ring file %s: bad ring sizes %d and %d", ep.SHM, h.dataCap, h.ctlCap)
	}
	theirs := shmLayout{size: lay.size, streams: lay.streams, dataCap: h.dataCap, ctlCap: h.ctlCap}
	if uint64(st.Size) != theirs.fileSize() {
		return nil, shmLayout{}, fmt.Errorf("ring file %s has %d bytes, its header implies %d", ep.SHM, st.Size, theirs.fileSize())
	}
	b, err := unix.Mmap(fd, 0, int(st.Size), unix.PROT_READ|unix.PROT_WRITE, unix.MAP_SHARED)
	if err != nil {
		return nil, shmLayout{}, fmt.Errorf("map ring file %s: %w", ep.SHM, err)
	}
	return b, theirs, nil
}
