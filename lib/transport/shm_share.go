package transport

import (
	"context"
	"crypto/hmac"
	"crypto/rand"
	"crypto/sha256"
	"encoding/binary"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"net"
	"os"
	"path/filepath"
	"slices"
	"sync"
	"time"

	"golang.org/x/sys/unix"
)

// Sharing memory between shm members.
//
// Every pair of members keeps one Unix stream socket over which each sends
// the other the memfds it shares (SCM_RIGHTS). At set-up each member
// listens on a socket next to its ring file (mode 0600, named in its signed
// endpoint record, unlinked after the set-up barrier); a member connects to
// every member of a lower index. A connection is admitted only when the
// peer's SO_PEERCRED names this user and the pid of the signed record of
// the member it claims to be, and it proves the job's secret: the
// connecting member sends a hello (its index, the job tag, a nonce), the
// listener answers with its nonce and HMAC-SHA256(secret, "gbshare-s" |
// tag | from | to | nonces), the connector with the "gbshare-c" MAC, and the
// listener confirms. Both sides check the other's credentials and MAC.
//
// Then each side only reads (one reader goroutine per peer) and writes
// messages of shareMsgSize bytes: SHARE (region id, size) with exactly one
// fd, which the reader checks (CheckMemfd) and maps read-only, or writable
// with Config.PeerWrite (after CheckWritableMemfd); UNSHARE (region id)
// with none.

const (
	shareMagic    = "GBSH"
	shareVersion  = 1
	shareHelloLen = 64
	shareReplyLen = 64
	shareProofLen = 32
	shareOK       = "GBSHOK\x00\x00"
	shareMsgSize  = 24
	shareMsgShare = 1
	shareMsgDrop  = 2
	// shareHSTimeout bounds one handshake on the share socket (a member
	// talks at once).
	shareHSTimeout = 10 * time.Second
	// shareWriteTimeout bounds one message to a peer that stopped reading.
	shareWriteTimeout = 10 * time.Second
	// maxPendingShare bounds the handshakes in progress on a listener.
	maxPendingShare = 16
)

// shareHello is the connecting member's first message.
type shareHello struct {
	from, to uint32
	job      [jobTagSize]byte
	nonce    [32]byte
}

func (h *shareHello) put(b []byte) {
	copy(b, shareMagic)
	binary.LittleEndian.PutUint16(b[4:], shareVersion)
	binary.LittleEndian.PutUint16(b[6:], 0)
	binary.LittleEndian.PutUint32(b[8:], h.from)
	binary.LittleEndian.PutUint32(b[12:], h.to)
	copy(b[16:32], h.job[:])
	copy(b[32:64], h.nonce[:])
}

// parseShareHello decodes a hello of exactly shareHelloLen bytes.
func parseShareHello(b []byte) (shareHello, error) {
	var h shareHello
	if len(b) != shareHelloLen {
		return h, fmt.Errorf("share hello of %d bytes, want %d", len(b), shareHelloLen)
	}
	if string(b[:4]) != shareMagic {
		return h, errors.New("not a gpubridge share hello")
	}
	if v := binary.LittleEndian.Uint16(b[4:]); v != shareVersion {
		return h, fmt.Errorf("share protocol version %d, this member speaks %d", v, shareVersion)
	}
	if binary.LittleEndian.Uint16(b[6:]) != 0 {
		return h, errors.New("share hello: reserved bytes are not zero")
	}
	h.from, h.to = binary.LittleEndian.Uint32(b[8:]), binary.LittleEndian.Uint32(b[12:])
	copy(h.job[:], b[16:32])
	copy(h.nonce[:], b[32:64])
	return h, nil
}

func shareMAC(secret []byte, label string, h *shareHello, serverNonce []byte) []byte {
	m := hmac.New(sha256.New, secret)
	m.Write([]byte(label))
	var b [shareHelloLen]byte
	h.put(b[:])
	m.Write(b[:])
	m.Write(serverNonce)
	return m.Sum(nil)
}

// shareMsg is one message after the handshake.
type shareMsg struct {
	typ  uint32
	id   uint64
	size uint64
}

func (m shareMsg) put(b []byte) {
	binary.LittleEndian.PutUint32(b[0:], m.typ)
	binary.LittleEndian.PutUint32(b[4:], 0)
	binary.LittleEndian.PutUint64(b[8:], m.id)
	binary.LittleEndian.PutUint64(b[16:], m.size)
}

// parseShareMsg decodes and checks a message of exactly shareMsgSize bytes.
func parseShareMsg(b []byte) (shareMsg, error) {
	if len(b) != shareMsgSize {
		return shareMsg{}, fmt.Errorf("share message of %d bytes, want %d", len(b), shareMsgSize)
	}
	m := shareMsg{typ: binary.LittleEndian.Uint32(b), id: binary.LittleEndian.Uint64(b[8:]), size: binary.LittleEndian.Uint64(b[16:])}
	if binary.LittleEndian.Uint32(b[4:]) != 0 {
		return m, errors.New("share message: reserved bytes are not zero")
	}
	if m.id == 0 {
		return m, errors.New("share message for region 0")
	}
	switch m.typ {
	case shareMsgShare:
		if m.size == 0 || m.size > MaxSharedBytes {
			return m, fmt.Errorf("shared region of %d bytes (1 .. %d allowed)", m.size, uint64(MaxSharedBytes))
		}
	case shareMsgDrop:
		if m.size != 0 {
			return m, errors.New("unshare message with a size")
		}
	default:
		return m, fmt.Errorf("unknown share message type %d", m.typ)
	}
	return m, nil
}

// shmShare is the shm mesh's side of sharing.
type shmShare struct {
	tab       *shareTable
	writable  bool            // Config.PeerWrite: peers' regions are mapped writable
	conns     []*net.UnixConn // by member; nil for self
	wmu       []sync.Mutex
	done      <-chan struct{} // the mesh's
	wg        sync.WaitGroup  // readers
	closeOnce sync.Once
}

// sharePath is where member self of job listens during set-up: next to its
// ring file (the sweep of stale ones relies on the name).
func sharePath(job [jobTagSize]byte, self int) string {
	return ringPath(job, self) + ".sock"
}

// listenShare opens member self's share socket (replacing a stale one of
// an earlier attempt of this job), mode 0600.
func listenShare(job [jobTagSize]byte, self int) (*net.UnixListener, string, error) {
	path := sharePath(job, self)
	_ = os.Remove(path)
	ln, err := net.ListenUnix("unix", &net.UnixAddr{Name: path, Net: "unix"})
	if err != nil {
		return nil, "", fmt.Errorf("listen on the share socket %s: %w", path, err)
	}
	ln.SetUnlinkOnClose(false)
	if err := os.Chmod(path, 0o600); err != nil {
		_ = ln.Close()
		_ = os.Remove(path)
		return nil, "", fmt.Errorf("share socket %s: %w", path, err)
	}
	return ln, path, nil
}

// peerCred returns the pid and uid at the other end of c.
func peerCred(c *net.UnixConn) (pid int, uid uint32, err error) {
	rc, err := c.SyscallConn()
	if err != nil {
		return 0, 0, err
	}
	var cred *unix.Ucred
	var cerr error
	if err := rc.Control(func(fd uintptr) {
		cred, cerr = unix.GetsockoptUcred(int(fd), unix.SOL_SOCKET, unix.SO_PEERCRED)
	}); err != nil {
		return 0, 0, err
	}
	if cerr != nil {
		return 0, 0, cerr
	}
	return int(cred.Pid), cred.Uid, nil
}

// checkCred checks that c's other end is member p's process of this user.
func checkCred(c *net.UnixConn, pid int) error {
	got, uid, err := peerCred(c)
	if err != nil {
		return fmt.Errorf("SO_PEERCRED: %w", err)
	}
	if uid != uint32(os.Geteuid()) {
		return fmt.Errorf("the other end runs as uid %d, not %d", uid, os.Geteuid())
	}
	if got != pid {
		return fmt.Errorf("the other end is pid %d, not the member's pid %d", got, pid)
	}
	return nil
}

// shareSetup connects this member's share sockets with every peer: it
// accepts the members above this one from the start of the set-up (their
// pids are checked once the endpoint records are in) and dials those below.
type shareSetup struct {
	s      *setup
	m      *shmMesh
	ln     *net.UnixListener
	lim    *logLimiter
	epsIn  chan struct{} // closed once eps is set
	eps    []shmEndpoint
	cancel context.CancelFunc
	wg     sync.WaitGroup

	mu     sync.Mutex
	conns  []*net.UnixConn
	need   int // connections from higher members still to come
	joined chan struct{}
	closed bool
}

// startShares listens on this member's share socket and starts accepting.
func (s *setup) startShares(ctx context.Context, m *shmMesh) (*shareSetup, string, error) {
	n, self := len(s.cfg.Members), s.cfg.Self
	ln, path, err := listenShare(s.job, self)
	if err != nil {
		return nil, "", err
	}
	ss := &shareSetup{s: s, m: m, ln: ln, lim: newLogLimiter(), epsIn: make(chan struct{}),
		conns: make([]*net.UnixConn, n), need: n - 1 - self, joined: make(chan struct{})}
	if ss.need == 0 {
		close(ss.joined)
	}
	actx, cancel := context.WithCancel(ctx)
	ss.cancel = cancel
	ss.wg.Go(func() { ss.accept(actx) })
	return ss, path, nil
}

// stop ends the accepting, closes and unlinks the socket, and with fail
// closes every connection made.
func (ss *shareSetup) stop(path string, fail bool) {
	ss.cancel()
	_ = ss.ln.SetDeadline(pastDeadline)
	ss.wg.Wait()
	_ = ss.ln.Close()
	_ = os.Remove(path)
	ss.mu.Lock()
	defer ss.mu.Unlock()
	ss.closed = true
	if fail {
		for i, c := range ss.conns {
			if c != nil {
				_ = c.Close()
				ss.conns[i] = nil
			}
		}
	}
}

// connect dials the members below this one, waits for those above, and
// starts a reader per peer.
func (ss *shareSetup) connect(ctx context.Context, eps []shmEndpoint) (*shmShare, error) {
	n, self, m := len(eps), ss.s.cfg.Self, ss.m
	ss.eps = eps
	close(ss.epsIn)
	for p := range self {
		c, err := ss.dial(ctx, p)
		if err != nil {
			return nil, fmt.Errorf("share memory with %s: %w", m.Peer(p), err)
		}
		ss.mu.Lock()
		ss.conns[p] = c
		ss.mu.Unlock()
	}
	select {
	case <-ss.joined:
	case <-ctx.Done():
		var missing []int
		ss.mu.Lock()
		for p := self + 1; p < n; p++ {
			if ss.conns[p] == nil {
				missing = append(missing, p)
			}
		}
		ss.mu.Unlock()
		return nil, fmt.Errorf("members %v did not connect to this member's share socket: %w", missing, context.Cause(ctx))
	}
	ss.mu.Lock()
	conns := slices.Clone(ss.conns)
	ss.mu.Unlock()
	sh := &shmShare{tab: newShareTable(n, m.Peer), writable: ss.s.cfg.PeerWrite, conns: conns, wmu: make([]sync.Mutex, n), done: m.done}
	for p, c := range sh.conns {
		if c != nil {
			sh.wg.Go(func() { sh.read(p, c) })
		}
	}
	return sh, nil
}

// accept admits connections from the higher members until all came.
func (ss *shareSetup) accept(ctx context.Context) {
	if dl, ok := ctx.Deadline(); ok {
		_ = ss.ln.SetDeadline(dl)
	}
	sem := make(chan struct{}, maxPendingShare)
	var wg sync.WaitGroup
	defer wg.Wait()
	for {
		c, err := ss.ln.AcceptUnix()
		if err != nil {
			return
		}
		select {
		case sem <- struct{}{}:
		case <-ctx.Done():
			_ = c.Close()
			return
		}
		wg.Go(func() {
			defer func() { <-sem }()
			if err := ss.admit(ctx, c); err != nil {
				_ = c.Close()
				ss.lim.log(ss.s.log, slog.LevelWarn, "share-refused", "refused a connection to the shared-memory socket", "err", err)
			}
		})
	}
}

// admit runs the listener's side of a handshake on c: the proof of the
// secret first, then (once the endpoint records are in) the pid.
func (ss *shareSetup) admit(ctx context.Context, c *net.UnixConn) error {
	stop := context.AfterFunc(ctx, func() { _ = c.SetDeadline(pastDeadline) })
	defer stop()
	_ = c.SetDeadline(time.Now().Add(shareHSTimeout))
	var b [shareHelloLen]byte
	if _, err := io.ReadFull(c, b[:]); err != nil {
		return fmt.Errorf("reading the hello: %w", err)
	}
	h, err := parseShareHello(b[:])
	if err != nil {
		return err
	}
	self, n := ss.s.cfg.Self, len(ss.conns)
	if h.job != ss.s.job {
		return errors.New("a hello of another job")
	}
	if int(h.to) != self || int(h.from) <= self || int(h.from) >= n {
		return fmt.Errorf("a hello from member %d to member %d", h.from, h.to)
	}
	var reply [shareReplyLen]byte
	if _, err := rand.Read(reply[:32]); err != nil {
		return err
	}
	secret := ss.s.rv.Secret()
	copy(reply[32:], shareMAC(secret, "gbshare-s\x00", &h, reply[:32]))
	if _, err := c.Write(reply[:]); err != nil {
		return fmt.Errorf("answering member %d: %w", h.from, err)
	}
	var proof [shareProofLen]byte
	if _, err := io.ReadFull(c, proof[:]); err != nil {
		return fmt.Errorf("reading member %d's proof: %w", h.from, err)
	}
	if !hmac.Equal(proof[:], shareMAC(secret, "gbshare-c\x00", &h, reply[:32])) {
		return fmt.Errorf("a hello as member %d without the job's secret", h.from)
	}
	select {
	case <-ss.epsIn:
	case <-ctx.Done():
		return fmt.Errorf("the set-up ended while member %d connected", h.from)
	}
	if err := checkCred(c, ss.eps[h.from].PID); err != nil {
		return fmt.Errorf("a connection as member %d: %w", h.from, err)
	}
	ss.mu.Lock()
	defer ss.mu.Unlock()
	if ss.conns[h.from] != nil || ss.closed {
		return fmt.Errorf("member %d connected twice", h.from)
	}
	if !stop() {
		return fmt.Errorf("the set-up ended while member %d connected", h.from)
	}
	if _, err := c.Write([]byte(shareOK)); err != nil {
		return fmt.Errorf("confirming member %d: %w", h.from, err)
	}
	_ = c.SetDeadline(time.Time{})
	ss.conns[h.from] = c
	if ss.need--; ss.need == 0 {
		close(ss.joined)
	}
	return nil
}

// dial runs the connecting side of a handshake with member p.
func (ss *shareSetup) dial(ctx context.Context, p int) (*net.UnixConn, error) {
	ep := &ss.eps[p]
	if filepath.Dir(ep.Share) != filepath.Clean(shmDir) {
		return nil, fmt.Errorf("share socket %q is not in %s", ep.Share, shmDir)
	}
	var d net.Dialer
	dctx, cancel := context.WithTimeout(ctx, shareHSTimeout)
	defer cancel()
	nc, err := d.DialContext(dctx, "unix", ep.Share)
	if err != nil {
		return nil, fmt.Errorf("connect: %w", err)
	}
	c := nc.(*net.UnixConn)
	fail := func(err error) (*net.UnixConn, error) {
		_ = c.Close()
		return nil, err
	}
	stop := context.AfterFunc(dctx, func() { _ = c.SetDeadline(pastDeadline) })
	defer stop()
	if err := checkCred(c, ep.PID); err != nil {
		return fail(err)
	}
	h := shareHello{from: uint32(ss.s.cfg.Self), to: uint32(p), job: ss.s.job}
	if _, err := rand.Read(h.nonce[:]); err != nil {
		return fail(err)
	}
	var b [shareHelloLen]byte
	h.put(b[:])
	if _, err := c.Write(b[:]); err != nil {
		return fail(fmt.Errorf("hello: %w", err))
	}
	var reply [shareReplyLen]byte
	if _, err := io.ReadFull(c, reply[:]); err != nil {
		return fail(fmt.Errorf("no answer to the hello (refused?): %w", err))
	}
	secret := ss.s.rv.Secret()
	if !hmac.Equal(reply[32:], shareMAC(secret, "gbshare-s\x00", &h, reply[:32])) {
		return fail(errors.New("the member's answer is not signed with the job's secret"))
	}
	if _, err := c.Write(shareMAC(secret, "gbshare-c\x00", &h, reply[:32])); err != nil {
		return fail(fmt.Errorf("proof: %w", err))
	}
	var ok [len(shareOK)]byte
	if _, err := io.ReadFull(c, ok[:]); err != nil || string(ok[:]) != shareOK {
		return fail(fmt.Errorf("the member did not confirm the connection: %v", err))
	}
	if !stop() {
		return fail(errors.New("the handshake ran out of time"))
	}
	_ = c.SetDeadline(time.Time{})
	return c, nil
}

// read handles what peer p sends until its connection ends.
func (sh *shmShare) read(p int, c *net.UnixConn) {
	var b [shareMsgSize]byte
	oob := make([]byte, unix.CmsgSpace(4*4))
	for {
		m, fds, err := readShareMsg(c, b[:], oob)
		if err == nil {
			err = sh.handle(p, m, fds)
		}
		if err != nil {
			if errors.Is(err, io.EOF) || errors.Is(err, net.ErrClosed) {
				err = errors.New("its shared-memory channel closed")
			}
			sh.tab.peerGone(p, err)
			_ = c.Close()
			return
		}
	}
}

func (sh *shmShare) handle(p int, m shareMsg, fds []int) error {
	defer func() {
		for _, fd := range fds {
			_ = unix.Close(fd)
		}
	}()
	switch m.typ {
	case shareMsgShare:
		if len(fds) != 1 {
			return fmt.Errorf("protocol error: region %d came with %d file descriptors, not 1", m.id, len(fds))
		}
		mem, err := MapMemfd(fds[0], m.size, MaxSharedBytes, sh.writable)
		return sh.tab.addPeer(p, m.id, mem, err, func(b []byte) { _ = unix.Munmap(b) })
	default:
		if len(fds) != 0 {
			return fmt.Errorf("protocol error: an unshare of region %d came with file descriptors", m.id)
		}
		sh.tab.dropPeer(p, m.id)
		return nil
	}
}

// readShareMsg reads one message and the descriptors that came with it.
func readShareMsg(c *net.UnixConn, b, oob []byte) (shareMsg, []int, error) {
	var fds []int
	for got := 0; got < len(b); {
		n, oobn, flags, _, err := c.ReadMsgUnix(b[got:], oob)
		if oobn > 0 {
			if cms, perr := unix.ParseSocketControlMessage(oob[:oobn]); perr == nil {
				for _, cm := range cms {
					if rights, rerr := unix.ParseUnixRights(&cm); rerr == nil {
						fds = append(fds, rights...)
					}
				}
			}
		}
		if err == nil && flags&unix.MSG_CTRUNC != 0 {
			err = errors.New("protocol error: too many file descriptors with one message")
		}
		if err == nil && n == 0 {
			err = io.EOF
		}
		if err != nil {
			for _, fd := range fds {
				_ = unix.Close(fd)
			}
			return shareMsg{}, nil, err
		}
		got += n
	}
	m, err := parseShareMsg(b)
	if err != nil {
		for _, fd := range fds {
			_ = unix.Close(fd)
		}
		return m, nil, fmt.Errorf("protocol error: %w", err)
	}
	return m, fds, nil
}

// send writes m (with fd when fd >= 0) to peer p.
func (sh *shmShare) send(p int, m shareMsg, fd int) error {
	var b [shareMsgSize]byte
	m.put(b[:])
	var oob []byte
	if fd >= 0 {
		oob = unix.UnixRights(fd)
	}
	sh.wmu[p].Lock()
	defer sh.wmu[p].Unlock()
	c := sh.conns[p]
	_ = c.SetWriteDeadline(time.Now().Add(shareWriteTimeout))
	n, _, err := c.WriteMsgUnix(b[:], oob, nil)
	if err == nil && n != len(b) {
		err = io.ErrShortWrite
	}
	return err
}

func (sh *shmShare) share(fd int, mem []byte) (uint64, error) {
	if err := CheckMemfd(fd, uint64(len(mem)), MaxSharedBytes); err != nil {
		return 0, fmt.Errorf("share: %w", err)
	}
	if sh.writable {
		// The peers (which write only where every member has PeerWrite on,
		// this one included) would fail to map it.
		if err := CheckWritableMemfd(fd); err != nil {
			return 0, fmt.Errorf("share: %w, and peers may write this member's shared buffers (PeerWrite)", err)
		}
	}
	id := sh.tab.newID()
	for p, c := range sh.conns {
		if c == nil {
			continue
		}
		if err := sh.send(p, shareMsg{typ: shareMsgShare, id: id, size: uint64(len(mem))}, fd); err != nil {
			sh.unshare(id)
			return 0, fmt.Errorf("share region %d with %s: %w", id, sh.tab.peerName(p), err)
		}
	}
	sh.tab.addOwn(id, mem)
	return id, nil
}

func (sh *shmShare) unshare(id uint64) {
	sh.tab.removeOwn(id)
	for p, c := range sh.conns {
		if c != nil {
			_ = sh.send(p, shareMsg{typ: shareMsgDrop, id: id}, -1)
		}
	}
}

// close ends every connection, waits for the readers and unmaps what no
// collective still holds.
func (sh *shmShare) close() {
	sh.closeOnce.Do(func() {
		for _, c := range sh.conns {
			if c != nil {
				_ = c.Close()
			}
		}
		sh.wg.Wait()
		sh.tab.close()
	})
}

func (m *shmMesh) Share(fd int, mem []byte) (uint64, error) {
	if m.closing.Load() {
		return 0, fmt.Errorf("share: %w", ErrClosed)
	}
	return m.share.share(fd, mem)
}

func (m *shmMesh) Unshare(id uint64) { m.share.unshare(id) }

// Locate implements Sharer. With CRCs on it finds nothing: the user asked
// for every byte between members to travel in checked frames, and a
// collective that reads a peer's memory moves none.
func (m *shmMesh) Locate(buf []byte) (uint64, uint64, bool) {
	if m.crc {
		return 0, 0, false
	}
	return m.share.tab.locate(buf)
}

// PeerWrite implements Sharer: Config.PeerWrite.
func (m *shmMesh) PeerWrite() bool { return m.share.writable }

func (m *shmMesh) PeerMem(ctx context.Context, peer int, id, off, n uint64) ([]byte, func(), error) {
	if peer == m.self || peer < 0 || peer >= m.size {
		return nil, nil, fmt.Errorf("member %d has no region of member %d", m.self, peer)
	}
	return m.share.tab.peerMem(ctx, m.done, peer, id, off, n)
}

var _ Sharer = (*shmMesh)(nil)
