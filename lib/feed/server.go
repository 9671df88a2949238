package feed

import (
	"context"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"net"
	"os"
	"sync"
	"sync/atomic"
	"syscall"
	"time"
	"unsafe"

	"github.com/gpubridge/gpubridge/lib/collective"
	"github.com/gpubridge/gpubridge/lib/reduce"
	"golang.org/x/sys/unix"
)

// Defaults of ServerOptions.
const (
	DefaultMaxRegions       = 256
	DefaultMaxRegionBytes   = 64 << 30
	DefaultMaxInflight      = 1024
	DefaultHandshakeTimeout = 10 * time.Second
	DefaultWriteTimeout     = 60 * time.Second
	DefaultHandoffDelay     = 100 * time.Microsecond
)

// maxPendingFDs bounds descriptors received ahead of their REGION messages.
const maxPendingFDs = 4

// ServerOptions configure Serve.
type ServerOptions struct {
	// Member is this bridge member's index, Members the number of members;
	// WELCOME tells the client, and roots and peers are checked against them.
	Member, Members int
	// Transport describes the bridge for WELCOME (Mesh.Describe()).
	Transport string
	// MaxRegions bounds the regions mapped at once; MaxRegionBytes one
	// region's size; MaxInflight the requests in flight.
	MaxRegions     int
	MaxRegionBytes uint64
	MaxInflight    int
	// HandshakeTimeout bounds the wait for HELLO; WriteTimeout one write to
	// a client that does not read.
	HandshakeTimeout time.Duration
	WriteTimeout     time.Duration
	// HandoffDelay is how long a collective runs before the goroutine
	// running it hands the reading of the socket to the standby goroutine
	// (streamed collectives hand it over at once). Default
	// DefaultHandoffDelay; negative: at once. Go timers may fire up to a
	// millisecond late, so messages behind a long collective (a send, a
	// recv, a READY of the next streamed request) wait about that long.
	HandoffDelay time.Duration
	Log          *slog.Logger
}

func (o *ServerOptions) defaults() {
	if o.MaxRegions <= 0 {
		o.MaxRegions = DefaultMaxRegions
	}
	if o.MaxRegionBytes == 0 {
		o.MaxRegionBytes = DefaultMaxRegionBytes
	}
	if o.MaxInflight <= 0 {
		o.MaxInflight = DefaultMaxInflight
	}
	if o.HandshakeTimeout <= 0 {
		o.HandshakeTimeout = DefaultHandshakeTimeout
	}
	if o.WriteTimeout <= 0 {
		o.WriteTimeout = DefaultWriteTimeout
	}
	if o.HandoffDelay == 0 {
		o.HandoffDelay = DefaultHandoffDelay
	}
	if o.Log == nil {
		o.Log = slog.New(slog.DiscardHandler)
	}
}

// ErrFeedLost is returned by Serve when the client went away (EOF or a
// broken socket) while requests were in flight, or could not be written to.
var ErrFeedLost = errors.New("feed lost")

// ProtocolError is a fatal violation of the feed protocol by the client; the
// server sent it as an ERROR message and closed the feed.
type ProtocolError struct {
	Code uint32
	Err  error
}

func (e *ProtocolError) Error() string { return "feed protocol error: " + e.Err.Error() }
func (e *ProtocolError) Unwrap() error { return e.Err }

// Server serves one feed connection for one bridge member.
type Server struct {
	o      ServerOptions
	bridge Bridge
	conn   *net.UnixConn

	ctx    context.Context // cancelled when the feed is lost or Serve's ctx ends
	cancel context.CancelCauseFunc
	// inputEnd is closed when no more READY can arrive (BYE, EOF, error).
	inputEnd chan struct{}

	wmu  sync.Mutex
	wbuf []byte
	werr error

	rmu     sync.Mutex
	regions map[uint32]*region

	smu     sync.Mutex
	streams map[uint64]*call // streamed requests in flight, for READY

	// Collectives run in request order, one at a time, on the goroutine
	// that read the first of them while none was running (the executor);
	// it hands the reading of the socket to a standby goroutine first
	// (role), so that no hand-off to another goroutine delays the call.
	emu       sync.Mutex
	pending   []*call // collectives accepted and not yet started, in order
	executing bool    // a goroutine is draining pending
	role      chan struct{}
	reader    *reader
	readErr   error // why reading ended; set before inputEnd is closed

	wg       sync.WaitGroup
	inflight atomic.Int64
	lastID   uint64
	fds      []int
	version  uint16

	bmu    sync.Mutex
	broken error

	callPool sync.Pool
}

type region struct {
	id       uint32
	mem      []byte
	refs     int
	released bool
	relID    uint64
	relAt    time.Time
}

// NewServer returns a server that drives b for the feed on conn. Serve it
// once.
func NewServer(conn *net.UnixConn, b Bridge, o ServerOptions) *Server {
	o.defaults()
	if o.Members < 1 {
		o.Members = 1
	}
	s := &Server{
		o: o, bridge: b, conn: conn,
		inputEnd: make(chan struct{}),
		regions:  map[uint32]*region{},
		streams:  map[uint64]*call{},
		role:     make(chan struct{}, 1),
		wbuf:     make([]byte, 0, 512),
	}
	s.callPool.New = func() any { return &call{s: s} }
	return s
}

// Broken returns the error that broke the bridge during Serve, or nil.
func (s *Server) Broken() error {
	s.bmu.Lock()
	defer s.bmu.Unlock()
	return s.broken
}

// Serve runs the feed until the client says BYE or closes it, or ctx ends.
// It returns nil after BYE, or after EOF with no request in flight; an
// error wrapping ErrFeedLost when the client went away with requests in
// flight; a *ProtocolError when the client broke the protocol; ctx's cause
// when ctx ended. Every goroutine it started has ended when it returns, every
// region is unmapped and conn is closed. A bridge failure alone does not make
// Serve fail: the client learns it in DONE, and Broken reports it.
func (s *Server) Serve(ctx context.Context) (err error) {
	s.ctx, s.cancel = context.WithCancelCause(ctx)
	stop := context.AfterFunc(s.ctx, func() {
		// Unblock the reader: it then sees why the context ended.
		_ = s.conn.SetReadDeadline(time.Unix(1, 0))
	})
	defer func() {
		stop()
		s.cancel(err)
		_ = s.conn.Close()
		s.unmapAll()
	}()

	r := &reader{conn: s.conn, buf: make([]byte, 2*MaxMessage), oob: make([]byte, unix.CmsgSpace(4*maxPendingFDs)), s: s}
	if err := s.handshake(r); err != nil {
		return err
	}

	// Two workers take turns: one reads the socket while the other may be
	// running collectives.
	s.reader = r
	s.role <- struct{}{}
	s.wg.Add(2)
	go s.worker()
	go s.worker()
	<-s.inputEnd
	err = s.readErr
	var pe *ProtocolError
	switch {
	case errors.As(err, &pe):
		s.writeError(pe.Code, pe.Err.Error())
		s.cancel(err)
	case errors.Is(err, errBye):
		err = nil
	case errors.Is(err, io.EOF):
		if n := s.inflight.Load(); n > 0 {
			err = fmt.Errorf("%w: the client closed the feed with %d request(s) in flight", ErrFeedLost, n)
			s.cancel(err)
		} else {
			err = nil
		}
	default:
		s.cancel(err)
	}
	s.wg.Wait()
	if err == nil && r.bye {
		s.wmu.Lock()
		s.wbuf = (&ByeMsg{}).Append(s.wbuf[:0])
		_ = s.flushLocked()
		s.wmu.Unlock()
	}
	if err == nil {
		if werr := s.writeErr(); werr != nil {
			err = werr
		}
	}
	return err
}

var errBye = errors.New("bye")

// handshake reads HELLO and answers WELCOME, within HandshakeTimeout.
func (s *Server) handshake(r *reader) error {
	_ = s.conn.SetReadDeadline(time.Now().Add(s.o.HandshakeTimeout))
	h, body, err := r.next()
	if err != nil {
		if ctxErr := context.Cause(s.ctx); ctxErr != nil {
			return ctxErr
		}
		var ne net.Error
		if errors.As(err, &ne) && ne.Timeout() {
			return fmt.Errorf("%w: no HELLO within %s", ErrFeedLost, s.o.HandshakeTimeout)
		}
		if errors.Is(err, io.EOF) {
			return fmt.Errorf("%w: the client closed the feed before HELLO", ErrFeedLost)
		}
		return err
	}
	_ = s.conn.SetReadDeadline(time.Time{})
	// A cancellation that set its deadline before this was cleared.
	if cause := context.Cause(s.ctx); cause != nil {
		return cause
	}
	if h.Type != MsgHello {
		return s.protocolErr(ErrCodeProtocol, fmt.Errorf("first message is %s, want hello", h.Type))
	}
	m, err := DecodeBody(MsgHello, body)
	if err != nil {
		return s.protocolErr(ErrCodeProtocol, err)
	}
	hello := m.(*HelloMsg)
	if hello.MaxVersion < MinVersion || hello.MinVersion > Version {
		return s.protocolErr(ErrCodeVersion, fmt.Errorf("client speaks feed protocol %d..%d, this gbbridge speaks %d..%d", hello.MinVersion, hello.MaxVersion, MinVersion, Version))
	}
	s.version = min(hello.MaxVersion, Version)
	s.o.Log.Debug("feed client", "pid", hello.PID, "name", hello.Name, "version", s.version)
	w := &WelcomeMsg{
		Version: s.version, Member: uint32(s.o.Member), Members: uint32(s.o.Members),
		MaxMessage: MaxMessage, MaxRegions: uint32(s.o.MaxRegions), MaxInflight: uint32(s.o.MaxInflight),
		MaxRegionBytes: s.o.MaxRegionBytes, Transport: s.o.Transport,
	}
	s.wmu.Lock()
	s.wbuf = w.Append(s.wbuf[:0])
	err = s.flushLocked()
	s.wmu.Unlock()
	if err != nil {
		return err
	}
	return nil
}

func (s *Server) protocolErr(code uint32, err error) error {
	pe := &ProtocolError{Code: code, Err: err}
	s.writeError(code, err.Error())
	return pe
}

// ---- reading ----

type reader struct {
	conn  *net.UnixConn
	s     *Server
	buf   []byte
	oob   []byte
	r, w  int
	bye   bool
	total uint64
}

// next returns the next whole message; body is valid until the next call.
func (r *reader) next() (Header, []byte, error) {
	for {
		if r.w-r.r >= HeaderSize {
			h, err := ParseHeader(r.buf[r.r:r.w], MaxMessage)
			if err != nil {
				return Header{}, nil, &ProtocolError{Code: ErrCodeProtocol, Err: err}
			}
			if r.w-r.r >= int(h.Size) {
				body := r.buf[r.r+HeaderSize : r.r+int(h.Size)]
				r.r += int(h.Size)
				return h, body, nil
			}
		}
		if r.r == r.w {
			r.r, r.w = 0, 0
		} else if len(r.buf)-r.w < MaxMessage {
			r.w = copy(r.buf, r.buf[r.r:r.w])
			r.r = 0
		}
		n, oobn, flags, err := r.recv(r.buf[r.w:], r.oob)
		if oobn > 0 {
			if ferr := r.takeFDs(r.oob[:oobn]); ferr != nil {
				return Header{}, nil, ferr
			}
		}
		if flags&unix.MSG_CTRUNC != 0 {
			return Header{}, nil, &ProtocolError{Code: ErrCodeProtocol, Err: errors.New("control data truncated: more than one descriptor sent with a message")}
		}
		r.w += n
		r.total += uint64(n)
		if err != nil {
			if n > 0 {
				continue
			}
			if r.w != r.r && errors.Is(err, io.EOF) {
				return Header{}, nil, &ProtocolError{Code: ErrCodeProtocol, Err: fmt.Errorf("feed closed in the middle of a message (%d bytes)", r.w-r.r)}
			}
			return Header{}, nil, err
		}
		if n == 0 {
			return Header{}, nil, io.EOF
		}
	}
}

// recv reads from the socket, with its descriptors. The reader parks in the
// Go network poller; it does not spin: while a goroutine spins, no thread
// of the process waits in the poller, so the bridge's own socket events
// would be noticed late (measured: +100 µs per request; docs/FEED.md).
func (r *reader) recv(p, oob []byte) (n, oobn, flags int, err error) {
	n, oobn, flags, _, err = r.conn.ReadMsgUnix(p, oob)
	return n, oobn, flags, err
}

// recvSpin reads from a socket, polling it without blocking for up to spin
// before it parks in the poller: a message that comes within the spin is
// read without the wake-up of a parked thread. It honours the socket's read
// deadline once it parks.
func recvSpin(raw syscall.RawConn, p, oob []byte, spin time.Duration) (n, oobn, flags int, err error) {
	var until time.Time
	polled := false
	rerr := raw.Read(func(fd uintptr) bool {
		for {
			n, oobn, flags, err = recvmsg(int(fd), p, oob)
			if err != unix.EAGAIN {
				return true
			}
			if polled {
				return false // woken by the poller but nothing there: wait again
			}
			now := time.Now()
			if until.IsZero() {
				until = now.Add(spin)
			} else if now.After(until) {
				polled = true
				return false
			}
		}
	})
	if rerr != nil {
		return 0, 0, 0, rerr
	}
	if err == nil && n == 0 && len(p) > 0 {
		return 0, oobn, flags, io.EOF
	}
	if err != nil {
		err = os.NewSyscallError("recvmsg", err)
	}
	return n, oobn, flags, err
}

// recvmsg is recvmsg(2) without blocking and without the peer's address (so
// nothing is allocated); descriptors are received close-on-exec.
func recvmsg(fd int, p, oob []byte) (n, oobn, flags int, err error) {
	var iov unix.Iovec
	if len(p) > 0 {
		iov.Base = &p[0]
		iov.SetLen(len(p))
	}
	var msg unix.Msghdr
	msg.Iov = &iov
	msg.Iovlen = 1
	if len(oob) > 0 {
		msg.Control = &oob[0]
		msg.SetControllen(len(oob))
	}
	r, _, e := unix.Syscall(unix.SYS_RECVMSG, uintptr(fd), uintptr(unsafe.Pointer(&msg)), unix.MSG_DONTWAIT|unix.MSG_CMSG_CLOEXEC)
	if e != 0 {
		return 0, 0, 0, e
	}
	return int(r), int(msg.Controllen), int(msg.Flags), nil
}

func (r *reader) takeFDs(oob []byte) error {
	msgs, err := unix.ParseSocketControlMessage(oob)
	if err != nil {
		return &ProtocolError{Code: ErrCodeProtocol, Err: fmt.Errorf("bad control data: %v", err)}
	}
	var bad error
	for _, m := range msgs {
		if m.Header.Level != unix.SOL_SOCKET || m.Header.Type != unix.SCM_RIGHTS {
			continue
		}
		fds, err := unix.ParseUnixRights(&m)
		if err != nil {
			bad = err
			continue
		}
		// One read returns the descriptors of at most one sendmsg (Linux
		// stops a read after a message that carried some): more than one
		// means a message came with several.
		if len(fds) > 1 {
			for _, fd := range fds {
				_ = unix.Close(fd)
			}
			bad = fmt.Errorf("%d descriptors came with one message (a REGION carries exactly one)", len(fds))
			continue
		}
		for _, fd := range fds {
			if len(r.s.fds) >= maxPendingFDs {
				_ = unix.Close(fd)
				bad = fmt.Errorf("more than %d descriptors sent ahead of their REGION messages", maxPendingFDs)
				continue
			}
			r.s.fds = append(r.s.fds, fd)
		}
	}
	if bad != nil {
		return &ProtocolError{Code: ErrCodeProtocol, Err: bad}
	}
	return nil
}

// worker alternates between reading the socket (while it holds the reader
// role) and running collectives (after it read one while none was running).
// While it runs collectives it hands the reader role to the standby worker:
// at once before a streamed collective (which needs its READYs), else once
// the collectives have run for HandoffDelay, so that a short collective
// costs no thread wake-up and a long one does not keep later messages (a
// send, a recv, a READY) waiting.
func (s *Server) worker() {
	defer s.wg.Done()
	w := &worker{s: s}
	w.timer = time.AfterFunc(time.Hour, w.handOff)
	w.timer.Stop()
	defer w.timer.Stop()
	for {
		select {
		case <-s.role:
		case <-s.inputEnd:
			return
		}
		for {
			exec, err := s.readLoop(s.reader)
			if !exec {
				s.readErr = err
				close(s.inputEnd)
				return
			}
			w.handed.Store(false)
			if s.o.HandoffDelay > 0 {
				w.timer.Reset(s.o.HandoffDelay)
			} else {
				w.handOff()
			}
			s.drain(w)
			w.timer.Stop()
			if !w.handed.CompareAndSwap(false, true) {
				break // the other worker reads now
			}
			// Still the reader: read on.
		}
	}
}

// worker is one of the two goroutines that take turns reading and running
// collectives.
type worker struct {
	s      *Server
	timer  *time.Timer
	handed atomic.Bool
}

// handOff gives the reader role to the other worker, once.
func (w *worker) handOff() {
	if w.handed.CompareAndSwap(false, true) {
		w.s.role <- struct{}{} // wakes the standby worker: it reads on
	}
}

// drain runs the pending collectives in order until there are none.
func (s *Server) drain(w *worker) {
	for {
		s.emu.Lock()
		if len(s.pending) == 0 {
			s.pending = s.pending[:0]
			s.executing = false
			s.emu.Unlock()
			return
		}
		c := s.pending[0]
		s.pending[0] = nil
		s.pending = s.pending[1:]
		s.emu.Unlock()
		if c.req.Flags&FlagStreamed != 0 {
			w.handOff()
		}
		s.run(c)
	}
}

// readLoop handles messages until BYE, EOF, an error or the end of the
// server's context (exec false, and why), or until it accepted a collective
// while none was running (exec true): then the caller runs it.
func (s *Server) readLoop(r *reader) (exec bool, err error) {
	var req Request
	for {
		h, body, err := r.next()
		if err != nil {
			if cause := context.Cause(s.ctx); cause != nil {
				return false, cause
			}
			var pe *ProtocolError
			if errors.As(err, &pe) || errors.Is(err, io.EOF) {
				return false, err
			}
			return false, fmt.Errorf("%w: read: %v", ErrFeedLost, err)
		}
		arrived := time.Now()
		switch {
		case h.Type.IsRequest():
			if err := DecodeRequest(h.Type, body, &req); err != nil {
				if len(body) < 8 {
					return false, &ProtocolError{Code: ErrCodeProtocol, Err: err}
				}
				if err := s.checkID(req.ID); err != nil {
					return false, err
				}
				s.refuse(&req, StatusBadRequest, err.Error(), arrived)
				continue
			}
			exec, err := s.accept(&req, arrived)
			if err != nil {
				return false, err
			}
			if exec {
				return true, nil
			}
		case h.Type == MsgReady:
			m, err := DecodeReady(body)
			if err != nil {
				return false, &ProtocolError{Code: ErrCodeProtocol, Err: err}
			}
			if err := s.ready(m); err != nil {
				return false, err
			}
		case h.Type == MsgRegion:
			m, err := DecodeBody(MsgRegion, body)
			if err != nil {
				s.closeFD(s.popFD())
				if len(body) < 8 {
					return false, &ProtocolError{Code: ErrCodeProtocol, Err: err}
				}
				id := leU64(body)
				if err := s.checkID(id); err != nil {
					return false, err
				}
				s.reply(id, StatusBadRequest, err.Error(), arrived)
				continue
			}
			if err := s.addRegion(m.(*RegionMsg), arrived); err != nil {
				return false, err
			}
		case h.Type == MsgRelease:
			m, err := DecodeBody(MsgRelease, body)
			if err != nil {
				return false, &ProtocolError{Code: ErrCodeProtocol, Err: err}
			}
			if err := s.release(m.(*ReleaseMsg), arrived); err != nil {
				return false, err
			}
		case h.Type == MsgBye:
			if len(body) != 0 {
				return false, &ProtocolError{Code: ErrCodeProtocol, Err: malformed("bye: body of %d bytes", len(body))}
			}
			r.bye = true
			return false, errBye
		default:
			return false, &ProtocolError{Code: ErrCodeProtocol, Err: fmt.Errorf("unexpected %s message from the client", h.Type)}
		}
	}
}

func leU64(b []byte) uint64 {
	_ = b[7]
	return uint64(b[0]) | uint64(b[1])<<8 | uint64(b[2])<<16 | uint64(b[3])<<24 |
		uint64(b[4])<<32 | uint64(b[5])<<40 | uint64(b[6])<<48 | uint64(b[7])<<56
}

// checkID enforces strictly increasing request ids.
func (s *Server) checkID(id uint64) error {
	if id <= s.lastID {
		return &ProtocolError{Code: ErrCodeProtocol, Err: fmt.Errorf("request id %d is not above the previous one (%d): ids must increase", id, s.lastID)}
	}
	s.lastID = id
	return nil
}

// ---- regions ----

func (s *Server) popFD() int {
	if len(s.fds) == 0 {
		return -1
	}
	fd := s.fds[0]
	s.fds = s.fds[1:]
	return fd
}

func (s *Server) addRegion(m *RegionMsg, arrived time.Time) error {
	if err := s.checkID(m.ID); err != nil {
		s.closeFD(s.popFD())
		return err
	}
	fd := s.popFD()
	if fd < 0 {
		s.reply(m.ID, StatusBadRequest, fmt.Sprintf("region %d: no file descriptor came with the message (send it with SCM_RIGHTS)", m.Region), arrived)
		return nil
	}
	defer s.closeFD(fd)
	fail := func(format string, args ...any) error {
		s.reply(m.ID, StatusBadRequest, fmt.Sprintf("region %d: ", m.Region)+fmt.Sprintf(format, args...), arrived)
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
	s.rmu.Lock()
	s.regions[m.Region] = &region{id: m.Region, mem: mem}
	s.rmu.Unlock()
	s.o.Log.Debug("region mapped", "region", m.Region, "bytes", m.Size)
	s.reply(m.ID, StatusOK, "", arrived)
	return nil
}

func (s *Server) closeFD(fd int) {
	if fd >= 0 {
		_ = unix.Close(fd)
	}
}

func (s *Server) release(m *ReleaseMsg, arrived time.Time) error {
	if err := s.checkID(m.ID); err != nil {
		return err
	}
	s.rmu.Lock()
	r, ok := s.regions[m.Region]
	if !ok || r.released {
		s.rmu.Unlock()
		s.reply(m.ID, StatusBadRequest, fmt.Sprintf("release: region %d is not mapped", m.Region), arrived)
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

// unmap unmaps a released region and answers its RELEASE.
func (s *Server) unmap(r *region) {
	err := unix.Munmap(r.mem)
	r.mem = nil
	if err != nil {
		s.reply(r.relID, StatusBadRequest, fmt.Sprintf("release: munmap region %d: %v", r.id, err), r.relAt)
	} else {
		s.reply(r.relID, StatusOK, "", r.relAt)
	}
	s.inflight.Add(-1)
}

// span resolves a request's span to memory and takes a reference on its
// region.
func (s *Server) span(what string, sp Span) (*region, []byte, error) {
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
			_ = unix.Munmap(r.mem)
		}
		delete(s.regions, id)
	}
	for _, fd := range s.fds {
		_ = unix.Close(fd)
	}
	s.fds = nil
}

// ---- requests ----

// call is one request in flight.
type call struct {
	s       *Server
	req     Request
	buf     []byte
	out     []byte
	regs    [2]*region
	arrived time.Time
	started time.Time
	inLen   uint64
	done    DoneMsg

	// streaming
	mu       sync.Mutex
	readyEnd uint64
	wake     chan struct{}
	prog     Progress
}

// validate checks a request against the protocol and the bridge.
func (s *Server) validate(r *Request) error {
	if r.Codec != CodecRaw {
		return fmt.Errorf("codec %d is not supported (this gbbridge knows only 0, raw)", r.Codec)
	}
	if r.Flags&^knownFlags != 0 {
		return fmt.Errorf("unknown flags %#x", r.Flags&^knownFlags)
	}
	if r.DType != 0 && r.DType.Size() == 0 {
		return fmt.Errorf("unknown dtype %d", r.DType)
	}
	reduces := r.Kind == MsgAllReduce || r.Kind == MsgReduceScatter
	if reduces {
		if r.DType == 0 {
			return errors.New("a reduction needs a dtype")
		}
		if err := reduce.Supported(r.Op, r.DType); err != nil {
			return err
		}
	} else if r.Op != 0 {
		return fmt.Errorf("op %d given, but %s does not reduce", r.Op, r.Kind)
	}
	if r.Flags&FlagStreamed != 0 {
		switch r.Kind {
		case MsgBarrier, MsgSend, MsgRecv:
			return fmt.Errorf("%s cannot be streamed", r.Kind)
		}
	}
	n := uint64(s.o.Members)
	member := func(what string) error {
		if r.Peer < 0 || int64(r.Peer) >= int64(s.o.Members) {
			return fmt.Errorf("%s %d is not a member (0..%d)", what, r.Peer, s.o.Members-1)
		}
		return nil
	}
	noOut := func() error {
		if r.Out != (Span{}) {
			return fmt.Errorf("%s takes no output span", r.Kind)
		}
		return nil
	}
	noPeer := func() error {
		if r.Peer != -1 || r.Tag != 0 {
			return fmt.Errorf("%s takes no root, peer or tag (want -1 and 0)", r.Kind)
		}
		return nil
	}
	var err error
	switch r.Kind {
	case MsgAllReduce:
		err = errors.Join(noOut(), noPeer())
	case MsgBroadcast:
		err = errors.Join(noOut(), member("root"))
		if err == nil && r.Tag != 0 {
			err = errors.New("broadcast takes no tag")
		}
	case MsgAllGather:
		err = noPeer()
		if err == nil && (r.Out.Len/n != r.Buf.Len || r.Out.Len%n != 0) {
			err = fmt.Errorf("all_gather: output of %d bytes, want %d members × %d input bytes", r.Out.Len, n, r.Buf.Len)
		}
	case MsgReduceScatter:
		err = noPeer()
		if err == nil && (r.Buf.Len/n != r.Out.Len || r.Buf.Len%n != 0) {
			err = fmt.Errorf("reduce_scatter: input of %d bytes, want %d members × %d output bytes", r.Buf.Len, n, r.Out.Len)
		}
	case MsgBarrier:
		err = errors.Join(noOut(), noPeer())
		if err == nil && r.Buf != (Span{}) {
			err = errors.New("barrier takes no buffer")
		}
		if err == nil && r.DType != 0 {
			err = errors.New("barrier takes no dtype")
		}
	case MsgSend, MsgRecv:
		err = errors.Join(noOut(), member("peer"))
		if err == nil && int(r.Peer) == s.o.Member {
			err = fmt.Errorf("peer %d is this member", r.Peer)
		}
	}
	if err != nil {
		return err
	}
	if sz := uint64(r.DType.Size()); sz > 1 {
		if r.Buf.Len%sz != 0 {
			return fmt.Errorf("buffer of %d bytes is not a whole number of %s elements (%d bytes each)", r.Buf.Len, r.DType, sz)
		}
		if r.Out.Len%sz != 0 {
			return fmt.Errorf("output of %d bytes is not a whole number of %s elements (%d bytes each)", r.Out.Len, r.DType, sz)
		}
	}
	if r.Buf.Region != 0 && r.Buf.Region == r.Out.Region &&
		r.Buf.Off < r.Out.Off+r.Out.Len && r.Out.Off < r.Buf.Off+r.Buf.Len && r.Buf.Len > 0 && r.Out.Len > 0 {
		// The in-place forms: all_gather's input is this member's slot of
		// the output; reduce_scatter's output is this member's segment of
		// the input.
		me := uint64(s.o.Member)
		inPlace := r.Kind == MsgAllGather && r.Buf.Off == r.Out.Off+me*r.Buf.Len ||
			r.Kind == MsgReduceScatter && r.Out.Off == r.Buf.Off+me*r.Out.Len
		if !inPlace {
			return errors.New("input and output overlap (only the in-place forms are allowed: all_gather's input as this member's slot of the output, reduce_scatter's output as this member's segment of the input)")
		}
	}
	return nil
}

func (s *Server) refuse(r *Request, st Status, msg string, arrived time.Time) {
	s.reply(r.ID, st, fmt.Sprintf("%s %d: %s", r.Kind, r.ID, msg), arrived)
}

// accept validates a request and starts it: point-to-point requests run at
// once on their own goroutine; collectives are queued in order, and exec
// says that none was running, so the caller is to run them.
func (s *Server) accept(r *Request, arrived time.Time) (exec bool, err error) {
	if err := s.checkID(r.ID); err != nil {
		return false, err
	}
	if b := s.Broken(); b != nil {
		s.reply(r.ID, StatusBroken, brokenText(b), arrived)
		return false, nil
	}
	if err := s.validate(r); err != nil {
		s.refuse(r, StatusBadRequest, err.Error(), arrived)
		return false, nil
	}
	if n := s.inflight.Load(); n >= int64(s.o.MaxInflight) {
		s.refuse(r, StatusBadRequest, fmt.Sprintf("%d requests are in flight, the limit is %d", n, s.o.MaxInflight), arrived)
		return false, nil
	}
	s.rmu.Lock()
	rb, buf, err := s.span("buffer", r.Buf)
	var ro *region
	var out []byte
	if err == nil {
		ro, out, err = s.span("output", r.Out)
		if err != nil && rb != nil {
			rb.refs--
		}
	}
	s.rmu.Unlock()
	if err != nil {
		s.refuse(r, StatusBadRequest, err.Error(), arrived)
		return false, nil
	}
	c := s.callPool.Get().(*call)
	c.req, c.buf, c.out, c.regs, c.arrived = *r, buf, out, [2]*region{rb, ro}, arrived
	c.inLen = r.Buf.Len
	s.inflight.Add(1)
	if r.Flags&FlagStreamed != 0 {
		c.prog = Progress{Ready: c.waitReady, Done: c.progress}
		s.smu.Lock()
		s.streams[r.ID] = c
		s.smu.Unlock()
	}
	if r.Kind == MsgSend || r.Kind == MsgRecv {
		s.wg.Add(1)
		go func() {
			defer s.wg.Done()
			s.run(c)
		}()
		return false, nil
	}
	s.emu.Lock()
	s.pending = append(s.pending, c)
	exec = !s.executing
	s.executing = true
	s.emu.Unlock()
	return exec, nil
}

// run executes one request and answers it.
func (s *Server) run(c *call) {
	c.started = time.Now()
	d := &c.done
	*d = DoneMsg{ID: c.req.ID}
	var err error
	if cause := context.Cause(s.ctx); cause != nil {
		d.Status, d.Error = StatusAborted, "feed server stopping: "+cause.Error()
	} else if b := s.Broken(); b != nil {
		d.Status, d.Error = StatusBroken, brokenText(b)
	} else {
		var p *Progress
		if c.req.Flags&FlagStreamed != 0 {
			p = &c.prog
		}
		br := s.bridge
		switch c.req.Kind {
		case MsgAllReduce:
			err = br.AllReduce(s.ctx, c.buf, c.req.DType, c.req.Op, p)
			d.Bytes = uint64(len(c.buf))
		case MsgBroadcast:
			err = br.Broadcast(s.ctx, c.buf, int(c.req.Peer), p)
			d.Bytes = uint64(len(c.buf))
		case MsgAllGather:
			err = br.AllGather(s.ctx, c.out, c.buf, p)
			d.Bytes = uint64(len(c.out))
		case MsgReduceScatter:
			err = br.ReduceScatter(s.ctx, c.out, c.buf, c.req.DType, c.req.Op, p)
			d.Bytes = uint64(len(c.out))
		case MsgBarrier:
			err = br.Barrier(s.ctx)
		case MsgSend:
			err = br.Send(s.ctx, int(c.req.Peer), c.req.Tag, c.buf)
			d.Bytes = uint64(len(c.buf))
		case MsgRecv:
			var n int
			n, err = br.Recv(s.ctx, int(c.req.Peer), c.req.Tag, c.buf)
			d.Bytes = uint64(n)
		}
		p2p := c.req.Kind == MsgSend || c.req.Kind == MsgRecv
		if !p2p {
			d.Seq = br.Seq()
		}
		if err != nil {
			d.Error = err.Error()
			switch {
			case context.Cause(s.ctx) != nil:
				d.Status, d.Error = StatusAborted, "feed server stopping ("+context.Cause(s.ctx).Error()+"): "+err.Error()
			case errors.Is(err, collective.ErrInvalid):
				// Refused by the bridge before anything was sent.
				d.Status = StatusBadRequest
			case errors.Is(err, collective.ErrBroken):
				d.Status = StatusBroken
			default:
				d.Status = StatusBridgeError
			}
			// A collective that failed broke the bridge. A failed send or
			// recv may not have (a recv that timed out, a message too
			// long): the bridge says so on the next call if it did.
			if d.Status != StatusBadRequest && (!p2p || errors.Is(err, collective.ErrBroken)) {
				s.breakBridge(err)
			}
		}
	}
	if c.req.Flags&FlagStreamed != 0 {
		s.smu.Lock()
		delete(s.streams, c.req.ID)
		s.smu.Unlock()
	}
	s.unref(c.regs[0])
	s.unref(c.regs[1])
	now := time.Now()
	d.QueueUS = uint64(c.started.Sub(c.arrived).Microseconds())
	d.TotalUS = uint64(now.Sub(c.arrived).Microseconds())
	s.wmu.Lock()
	s.wbuf = d.Append(s.wbuf[:0])
	_ = s.flushLocked()
	s.wmu.Unlock()
	s.inflight.Add(-1)
	c.mu.Lock()
	c.wake, c.readyEnd = nil, 0
	c.mu.Unlock()
	c.buf, c.out, c.regs, c.prog, c.done.Error = nil, nil, [2]*region{}, Progress{}, ""
	s.callPool.Put(c)
}

// brokenText is the error of a request refused because the bridge broke
// earlier: the original cause, in the words of collective.ErrBroken.
func brokenText(cause error) string {
	if errors.Is(cause, collective.ErrBroken) {
		return cause.Error()
	}
	return collective.ErrBroken.Error() + ": " + cause.Error()
}

func (s *Server) breakBridge(err error) {
	s.bmu.Lock()
	if s.broken == nil {
		s.broken = err
		s.o.Log.Error("bridge broken", "err", err)
	}
	s.bmu.Unlock()
}

// ---- streaming ----

func (s *Server) ready(m ReadyMsg) error {
	s.smu.Lock()
	c := s.streams[m.ID]
	s.smu.Unlock()
	if c == nil {
		if m.ID > s.lastID {
			return &ProtocolError{Code: ErrCodeProtocol, Err: fmt.Errorf("ready for request %d, which was never sent", m.ID)}
		}
		return nil // finished already (a broadcast's non-root needs no input)
	}
	if m.End > c.inLen {
		return &ProtocolError{Code: ErrCodeProtocol, Err: fmt.Errorf("ready for request %d up to byte %d, past its input of %d bytes", m.ID, m.End, c.inLen)}
	}
	c.mu.Lock()
	if m.End > c.readyEnd {
		c.readyEnd = m.End
		if c.wake != nil {
			close(c.wake)
			c.wake = nil
		}
	}
	c.mu.Unlock()
	return nil
}

// waitReady is Progress.Ready of a streamed call.
func (c *call) waitReady(ctx context.Context, end int) error {
	if end < 0 || uint64(end) > c.inLen {
		return fmt.Errorf("feed: ready wait for byte %d of a %d-byte input", end, c.inLen)
	}
	for {
		c.mu.Lock()
		if c.readyEnd >= uint64(end) {
			c.mu.Unlock()
			return nil
		}
		if c.wake == nil {
			c.wake = make(chan struct{})
		}
		w := c.wake
		c.mu.Unlock()
		select {
		case <-w:
		case <-ctx.Done():
			return context.Cause(ctx)
		case <-c.s.inputEnd:
			// BYE or EOF: no READY can come any more.
			c.mu.Lock()
			ok := c.readyEnd >= uint64(end)
			c.mu.Unlock()
			if ok {
				return nil
			}
			return fmt.Errorf("feed: the client closed the feed before input bytes [0,%d) of %s %d were ready (%d were)", end, c.req.Kind, c.req.ID, c.readyEnd)
		}
	}
}

// progress is Progress.Done of a streamed call.
func (c *call) progress(off, n int) {
	s := c.s
	p := ProgressMsg{ID: c.req.ID, Off: uint64(off), N: uint64(n)}
	s.wmu.Lock()
	s.wbuf = p.Append(s.wbuf[:0])
	_ = s.flushLocked()
	s.wmu.Unlock()
}

// ---- writing ----

// reply sends a DONE with no bridge work behind it.
func (s *Server) reply(id uint64, st Status, msg string, arrived time.Time) {
	us := uint64(time.Since(arrived).Microseconds())
	d := DoneMsg{ID: id, Status: st, Error: msg, TotalUS: us}
	s.wmu.Lock()
	s.wbuf = d.Append(s.wbuf[:0])
	_ = s.flushLocked()
	s.wmu.Unlock()
}

func (s *Server) writeError(code uint32, text string) {
	m := ErrorMsg{Code: code, Text: text}
	s.wmu.Lock()
	s.wbuf = m.Append(s.wbuf[:0])
	_ = s.flushLocked()
	s.wmu.Unlock()
}

// flushLocked writes wbuf; the caller holds wmu. After a failed write
// nothing more is written and the server stops.
func (s *Server) flushLocked() error {
	if s.werr != nil {
		return s.werr
	}
	_ = s.conn.SetWriteDeadline(time.Now().Add(s.o.WriteTimeout))
	_, err := s.conn.Write(s.wbuf)
	if err != nil {
		if errors.Is(err, os.ErrDeadlineExceeded) {
			err = fmt.Errorf("%w: the client did not read for %s", ErrFeedLost, s.o.WriteTimeout)
		} else {
			err = fmt.Errorf("%w: write: %v", ErrFeedLost, err)
		}
		s.werr = err
		s.cancel(err)
	}
	return err
}

func (s *Server) writeErr() error {
	s.wmu.Lock()
	defer s.wmu.Unlock()
	return s.werr
}
