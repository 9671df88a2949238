package feedserver

import (
	"context"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"net"
	"sync"
	"sync/atomic"
	"time"

	"github.com/gpubridge/gpubridge/lib/feed"
	"github.com/gpubridge/gpubridge/lib/transport"
	"golang.org/x/sys/unix"
)

// Defaults of ServerOptions.
const (
	DefaultMaxRegions       = 256
	DefaultMaxRegionBytes   = 64 << 30
	DefaultMaxInflight      = 1024
	DefaultHandshakeTimeout = feed.HandshakeTimeout
	DefaultWriteTimeout     = 60 * time.Second
	DefaultHandoffDelay     = 100 * time.Microsecond
)

// ServerOptions configure Serve.
type ServerOptions struct {
	// Member is this member's index in bridge 0, Members the number of its
	// members; WELCOME tells the client, and roots and peers are checked
	// against them. Without bridge 0 (NewServer's b nil) WELCOME says 0
	// members.
	Member, Members int
	// Rank is this rank's global rank and WorldSize the job's ranks: a JOIN
	// must name this rank among its members, and ranks of the job only
	// (WorldSize 0: not checked).
	Rank, WorldSize int
	// Joiner sets up the bridges JOIN asks for (feed protocol 4); nil:
	// JOIN is refused.
	Joiner Joiner
	// Transport describes the bridge for WELCOME (Mesh.Describe()).
	Transport string
	// MaxRegions bounds the regions mapped at once; MaxRegionBytes one
	// region's size; MaxInflight the requests in flight.
	MaxRegions     int
	MaxRegionBytes uint64
	MaxInflight    int
	// MaxFeedbackBytes caps the error-feedback residuals the feed keeps
	// (FEEDBACK_KEY: 4 bytes per value of each key's buffer); a request
	// whose new residual would pass it is refused. Default
	// DefaultMaxFeedbackBytes.
	MaxFeedbackBytes uint64
	// HandshakeTimeout bounds the wait for HELLO; WriteTimeout one write to
	// a client that does not read.
	HandshakeTimeout time.Duration
	WriteTimeout     time.Duration
	// TinySpin, when positive, is how long the shm waiters of a collective
	// of at most TinyCallBytes spin before they sleep (transport.WithSpin)
	// instead of the mesh's Config.Spin: such a call's time is mostly
	// wake-ups, while a large call's waiters spinning that long hold the
	// cores its reduction needs. 0: the mesh's spin for every call.
	TinySpin time.Duration
	// HandoffDelay is how long a collective runs before the goroutine
	// running it hands the reading of the socket to the standby goroutine
	// (streamed collectives hand it over at once). Default
	// DefaultHandoffDelay; negative: at once. Go timers may fire up to a
	// millisecond late, so messages behind a long collective (a send, a
	// recv, a READY of the next streamed request) wait about that long.
	HandoffDelay time.Duration
	// Share offers every region to the other members, so that the
	// collectives read it in place (transport.Sharer; the shm transport).
	// nil: the bridge's mesh, when the bridge is a *collective.Comm whose
	// mesh shares memory. A region that cannot be shared is still served
	// (the collectives then copy it through the transport).
	Share transport.Sharer
	// NoShare turns sharing off (on every bridge).
	NoShare bool
	// Register registers every region with the mesh's device while it is
	// mapped, so that sends from it go out without a copy
	// (transport.Registrar; the verbs transport). nil: the bridge's mesh,
	// when it is a *collective.Comm whose mesh registers memory. A region
	// that cannot be registered is still served (its sends are staged).
	Register transport.Registrar
	Log      *slog.Logger

	// goP2P runs the wait of a posted SEND or RECV (default: a goroutine
	// of its own); tests start them in another order.
	goP2P func(func())
}

func (o *ServerOptions) defaults() {
	if o.goP2P == nil {
		o.goP2P = func(f func()) { go f() }
	}
	orDefault(&o.MaxRegions, DefaultMaxRegions)
	orDefault(&o.MaxRegionBytes, DefaultMaxRegionBytes)
	orDefault(&o.MaxInflight, DefaultMaxInflight)
	orDefault(&o.MaxFeedbackBytes, DefaultMaxFeedbackBytes)
	orDefault(&o.HandshakeTimeout, DefaultHandshakeTimeout)
	orDefault(&o.WriteTimeout, DefaultWriteTimeout)
	if o.HandoffDelay == 0 { // negative: at once
		o.HandoffDelay = DefaultHandoffDelay
	}
	if o.Log == nil {
		o.Log = slog.New(slog.DiscardHandler)
	}
}

// orDefault sets *v to d when it is not positive.
func orDefault[T int | uint64 | time.Duration](v *T, d T) {
	if *v <= 0 {
		*v = d
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

// Server serves one feed connection for one rank: bridge 0 (when it is a
// leader) and the bridges the client joins.
type Server struct {
	o     ServerOptions
	lane0 *lane // bridge 0; nil: none (gbbridge serve --no-bridge)
	conn  *net.UnixConn

	lmu   sync.Mutex
	lanes map[uint32]*lane      // joined bridges, by id
	joins map[uint32]*joinState // JOINs being set up, or failed
	// shareMu orders the offers of regions to lanes: a region mapped while
	// a lane is added is offered to it exactly once.
	shareMu sync.Mutex

	ctx    context.Context // cancelled when the feed is lost or Serve's ctx ends
	tiny   context.Context // ctx, or ctx with the tiny calls' spin (ServerOptions.TinySpin)
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

	// Collectives of a lane run in request order, one at a time; bridge
	// 0's on the goroutine that read the first of them while none was
	// running (the executor), which hands the reading of the socket to a
	// standby goroutine first (role), so that no hand-off to another
	// goroutine delays the call; a joined bridge's on a goroutine of its
	// own. emu guards the lanes' queues.
	emu     sync.Mutex
	role    chan struct{}
	reader  *reader
	readErr error // why reading ended; set before inputEnd is closed

	wg       sync.WaitGroup
	inflight atomic.Int64
	lastID   uint64
	fds      []int
	version  uint16
	fb       *feedback // error-feedback residuals, by bridge and key

	callPool sync.Pool
}

// NewServer returns a server that drives b, bridge 0, for the feed on
// conn (b nil: no bridge 0, only the bridges the client joins). Serve it
// once.
func NewServer(conn *net.UnixConn, b Bridge, o ServerOptions) *Server {
	o.defaults()
	s := &Server{
		o: o, conn: conn,
		lanes:    map[uint32]*lane{},
		joins:    map[uint32]*joinState{},
		inputEnd: make(chan struct{}),
		regions:  map[uint32]*region{},
		streams:  map[uint64]*call{},
		role:     make(chan struct{}, 1),
		wbuf:     make([]byte, 0, 512),
		fb:       newFeedback(o.MaxFeedbackBytes),
	}
	if b != nil {
		s.o.Members = max(s.o.Members, 1)
		s.lane0 = newLane(0, "", b, s.o.Member, s.o.Members, s.o.Transport, s.o.Share, s.o.Register, s.o.NoShare)
	} else {
		s.o.Member, s.o.Members = 0, 0
	}
	s.callPool.New = func() any { return &call{s: s} }
	return s
}

// Broken returns the error that broke a bridge during Serve, or nil:
// bridge 0's, else the first joined bridge's that broke, naming it.
func (s *Server) Broken() error { return s.brokenLanes() }

// Serve runs the feed until the client says BYE or closes it, or ctx ends.
// It returns nil after BYE, or after EOF with no request in flight; an
// error wrapping ErrFeedLost when the client went away with requests in
// flight; a *ProtocolError when the client broke the protocol; ctx's cause
// when ctx ended. Every goroutine it started has ended when it returns, every
// region is unmapped and conn is closed. A bridge failure alone does not make
// Serve fail: the client learns it in DONE, and Broken reports it.
func (s *Server) Serve(ctx context.Context) (err error) {
	s.ctx, s.cancel = context.WithCancelCause(ctx)
	s.tiny = s.ctx
	if s.o.TinySpin > 0 {
		s.tiny = transport.WithSpin(s.ctx, s.o.TinySpin)
	}
	stop := context.AfterFunc(s.ctx, func() {
		// Unblock the reader: it then sees why the context ended.
		_ = s.conn.SetReadDeadline(time.Unix(1, 0))
	})
	defer func() {
		stop()
		s.cancel(err)
		_ = s.conn.Close()
		s.unmapAll()
		s.closeLanes(err)
		s.fb.dropAll()
	}()

	r := &reader{conn: s.conn, buf: make([]byte, 2*feed.MaxMessage), oob: make([]byte, unix.CmsgSpace(4*maxPendingFDs)), s: s}
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
		_ = s.write((&feed.ByeMsg{}).Append)
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
	if h.Type != feed.MsgHello {
		return s.protocolErr(feed.ErrCodeProtocol, fmt.Errorf("first message is %s, want hello", h.Type))
	}
	m, err := feed.DecodeBody(feed.MsgHello, body)
	if err != nil {
		return s.protocolErr(feed.ErrCodeProtocol, err)
	}
	hello := m.(*feed.HelloMsg)
	if hello.MaxVersion < feed.MinVersion || hello.MinVersion > feed.Version {
		return s.protocolErr(feed.ErrCodeVersion, fmt.Errorf("client speaks feed protocol %d..%d, this gbbridge speaks %d..%d", hello.MinVersion, hello.MaxVersion, feed.MinVersion, feed.Version))
	}
	s.version = min(hello.MaxVersion, feed.Version)
	desc := s.o.Transport
	if s.lane0 == nil {
		desc = "none (no bridge 0: gbbridge serve --no-bridge)"
	}
	s.o.Log.Debug("feed client", "pid", hello.PID, "name", hello.Name, "version", s.version)
	w := &feed.WelcomeMsg{
		Version: s.version, Member: uint32(s.o.Member), Members: uint32(s.o.Members),
		MaxMessage: feed.MaxMessage, MaxRegions: uint32(s.o.MaxRegions), MaxInflight: uint32(s.o.MaxInflight),
		MaxRegionBytes: s.o.MaxRegionBytes, Transport: desc,
	}
	return s.write(w.Append)
}

func (s *Server) protocolErr(code uint32, err error) error {
	pe := &ProtocolError{Code: code, Err: err}
	s.writeError(code, err.Error())
	return pe
}
