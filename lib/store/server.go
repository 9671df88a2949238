package store

import (
	"bufio"
	"bytes"
	"context"
	"encoding/binary"
	"encoding/hex"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"math"
	"net"
	"slices"
	"sync"
	"syscall"
	"time"
)

// ServerOptions configures a Server. Zero fields take the defaults noted.
type ServerOptions struct {
	// MaxKeyLen bounds a key in bytes, prefixes included (default 8 KiB,
	// like torch's libuv server).
	MaxKeyLen int
	// MaxValueLen bounds a value in bytes (default 8 MiB, like torch).
	MaxValueLen int
	// MaxKeysPerRequest bounds the key count of CHECK, WAIT, MULTI_GET and
	// MULTI_SET (default 131072, like torch).
	MaxKeysPerRequest int
	// MaxConns bounds concurrent connections (default 16384); connections
	// above it are closed at once.
	MaxConns int
	// MaxTotalBytes bounds the memory for stored keys, values and queue
	// items plus the requests being decoded, charged as their bytes arrive
	// (default 1 GiB). A request that would exceed it closes its
	// connection.
	MaxTotalBytes int64
	// MaxReplyBytes bounds one reply (default 64 MiB): a MULTI_GET,
	// LIST_KEYS or GET whose reply would be larger closes its connection.
	MaxReplyBytes int
	// MaxOutputBytes bounds the replies queued and not yet written, over all
	// connections (default 256 MiB). A reply that does not fit waits its
	// turn for room (at most twice WriteTimeout, else its connection is
	// closed).
	MaxOutputBytes int64
	// HandshakeTimeout bounds the wait for a new connection's VALIDATE
	// (default 30s).
	HandshakeTimeout time.Duration
	// RequestTimeout bounds the time from a request's first byte to its
	// last (default 30s); a client that starts a request and stalls is
	// closed. Idle connections between requests have no deadline.
	RequestTimeout time.Duration
	// WriteTimeout bounds the writing of queued replies (default 30s): a
	// client that does not read them is closed.
	WriteTimeout time.Duration
	// Logger receives one line per refused connection or request (default:
	// discard). Warnings are rate-limited: per kind, 5 lines in 10 s, then
	// one line summing up the rest.
	Logger *slog.Logger
}

// Defaults of the server's timeouts and output bounds.
const (
	DefaultMaxReplyBytes    = 64 << 20
	DefaultMaxOutputBytes   = int64(256) << 20
	DefaultHandshakeTimeout = 30 * time.Second
	DefaultRequestTimeout   = 30 * time.Second
	DefaultWriteTimeout     = 30 * time.Second
)

// Server is a c10d TCPStore server for torch >= 2.8 clients and Client.
type Server struct {
	opts ServerOptions
	log  *slog.Logger
	warn *logLimiter
	lim  limits
	mem  budget
	out  outBudget
	st   state

	mu        sync.Mutex
	listeners map[net.Listener]struct{}
	conns     map[*serverConn]struct{}
	addr      net.Addr
	shutdown  bool
	wg        sync.WaitGroup
}

const (
	serverReadBuf   = 8 << 10
	outHighWater    = 1 << 20 // reader stops decoding while this much reply data is queued
	maxWaitsPerConn = 1024
	smallBlob       = 4 << 10 // blobs above this go out without copying
)

// orDefault sets an option left at zero (or negative) to its default.
func orDefault[T int | int64 | time.Duration](v *T, d T) {
	if *v <= 0 {
		*v = d
	}
}

// NewServer returns a Server; start it with Serve or ListenAndServe.
func NewServer(opts ServerOptions) *Server {
	orDefault(&opts.MaxKeyLen, DefaultMaxKeyLen)
	orDefault(&opts.MaxValueLen, DefaultMaxValueLen)
	orDefault(&opts.MaxKeysPerRequest, DefaultMaxKeysPerRequest)
	orDefault(&opts.MaxConns, DefaultMaxConns)
	orDefault(&opts.MaxTotalBytes, DefaultMaxTotalBytes)
	orDefault(&opts.MaxReplyBytes, DefaultMaxReplyBytes)
	orDefault(&opts.MaxOutputBytes, DefaultMaxOutputBytes)
	// A reply larger than the output bound could never be queued.
	opts.MaxReplyBytes = int(min(int64(opts.MaxReplyBytes), opts.MaxOutputBytes))
	orDefault(&opts.HandshakeTimeout, DefaultHandshakeTimeout)
	orDefault(&opts.RequestTimeout, DefaultRequestTimeout)
	orDefault(&opts.WriteTimeout, DefaultWriteTimeout)
	log := opts.Logger
	if log == nil {
		log = slog.New(slog.DiscardHandler)
	}
	s := &Server{
		opts:      opts,
		log:       log,
		warn:      newLogLimiter(log, logBurst, logWindow),
		lim:       limits{maxKeyLen: opts.MaxKeyLen, maxValueLen: opts.MaxValueLen, maxKeys: opts.MaxKeysPerRequest},
		listeners: make(map[net.Listener]struct{}),
		conns:     make(map[*serverConn]struct{}),
	}
	s.out.init(opts.MaxOutputBytes)
	s.mem.max = opts.MaxTotalBytes
	s.st.init(&s.mem)
	return s
}

// ListenAndServe listens on the TCP address addr and calls Serve.
func (s *Server) ListenAndServe(addr string) error {
	ln, err := net.Listen("tcp", addr)
	if err != nil {
		return fmt.Errorf("store server listen %s: %w", addr, err)
	}
	return s.Serve(ln)
}

// Addr returns the address of the (first) listener passed to Serve, or nil
// before Serve was called.
func (s *Server) Addr() net.Addr {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.addr
}

// Serve accepts connections on ln until Shutdown, then returns nil. ln is
// closed when Serve returns.
func (s *Server) Serve(ln net.Listener) error {
	s.mu.Lock()
	if s.shutdown {
		s.mu.Unlock()
		_ = ln.Close()
		return nil
	}
	s.listeners[ln] = struct{}{}
	if s.addr == nil {
		s.addr = ln.Addr()
	}
	s.wg.Add(1)
	s.mu.Unlock()
	defer s.wg.Done()
	defer func() {
		s.mu.Lock()
		delete(s.listeners, ln)
		s.mu.Unlock()
		_ = ln.Close()
	}()

	s.log.Info("store server listening", "addr", ln.Addr().String())
	var backoff time.Duration
	for {
		nc, err := ln.Accept()
		if err != nil {
			s.mu.Lock()
			down := s.shutdown
			s.mu.Unlock()
			if down {
				return nil
			}
			var ne net.Error
			if errors.As(err, &ne) && ne.Timeout() || errors.Is(err, syscall.EMFILE) || errors.Is(err, syscall.ENFILE) {
				backoff = min(max(2*backoff, 5*time.Millisecond), time.Second)
				s.warn.warn("store server accept failed; retrying", "err", err, "backoff", backoff)
				time.Sleep(backoff)
				continue
			}
			return fmt.Errorf("store server accept on %s: %w", ln.Addr(), err)
		}
		backoff = 0
		s.mu.Lock()
		if s.shutdown {
			s.mu.Unlock()
			_ = nc.Close()
			return nil
		}
		if len(s.conns) >= s.opts.MaxConns {
			s.mu.Unlock()
			s.warn.warn("store server refusing connection: MaxConns reached",
				"remote", nc.RemoteAddr().String(), "max_conns", s.opts.MaxConns)
			_ = nc.Close()
			continue
		}
		sc := newServerConn(nc, &s.out)
		s.conns[sc] = struct{}{}
		s.wg.Add(2)
		s.mu.Unlock()
		go func() {
			defer s.wg.Done()
			s.writeLoop(sc)
			s.mu.Lock()
			delete(s.conns, sc)
			s.mu.Unlock()
		}()
		go func() {
			defer s.wg.Done()
			s.serveConn(sc)
		}()
	}
}

// Shutdown stops accepting, closes every connection (clients blocked in WAIT
// see the connection close) and waits until all server goroutines have
// returned or ctx is done.
func (s *Server) Shutdown(ctx context.Context) error {
	s.mu.Lock()
	s.shutdown = true
	for ln := range s.listeners {
		_ = ln.Close()
	}
	for sc := range s.conns {
		sc.out.close()
		_ = sc.nc.Close()
	}
	s.mu.Unlock()

	done := make(chan struct{})
	go func() {
		s.wg.Wait()
		close(done)
	}()
	select {
	case <-done:
		s.warn.close()
		return nil
	case <-ctx.Done():
		return fmt.Errorf("store server shutdown: %w", ctx.Err())
	}
}

// serverConn is one client connection. The reader goroutine (serveConn)
// decodes and executes requests in order; replies and asynchronous
// STOP_WAITING bytes go through out to the writer goroutine, so a slow
// client never blocks the store.
type serverConn struct {
	nc     net.Conn
	remote string
	out    outQueue
	waits  []*waiter // guarded by state.mu
}

func newServerConn(nc net.Conn, ob *outBudget) *serverConn {
	sc := &serverConn{nc: nc, remote: nc.RemoteAddr().String()}
	sc.out.cond.L = &sc.out.mu
	sc.out.budget = ob
	sc.out.done = make(chan struct{})
	return sc
}

var errConnClosed = errors.New("connection closed")

// errOutputFull: no room for a reply in MaxOutputBytes in time.
var errOutputFull = errors.New("no room for the reply in the server's output bound (MaxOutputBytes) within twice the write timeout")

// outQueue holds reply bytes not yet written. Every queued byte is charged
// to the server's output budget until it is written or dropped.
type outQueue struct {
	mu      sync.Mutex
	cond    sync.Cond
	bufs    net.Buffers
	pending int
	closed  bool
	done    chan struct{} // closed with the queue
	budget  *outBudget
}

// send queues a reply: it waits while more than outHighWater bytes of this
// connection are unwritten, then for room in the output budget until
// deadline.
func (q *outQueue) send(bufs [][]byte, n int, deadline time.Time) error {
	q.mu.Lock()
	for q.pending > outHighWater && !q.closed {
		q.cond.Wait()
	}
	closed := q.closed
	q.mu.Unlock()
	if closed {
		return errConnClosed
	}
	if err := q.budget.acquire(int64(n), deadline, q.done); err != nil {
		return err
	}
	q.mu.Lock()
	defer q.mu.Unlock()
	if q.closed {
		q.budget.release(int64(n))
		return errConnClosed
	}
	q.bufs = append(q.bufs, bufs...)
	q.pending += n
	q.cond.Broadcast()
	return nil
}

// sendNow queues b without waiting (used with state.mu held, for the
// one-byte STOP_WAITING); it is charged even above the output bound.
func (q *outQueue) sendNow(b []byte) {
	q.mu.Lock()
	defer q.mu.Unlock()
	if q.closed {
		return
	}
	q.budget.force(int64(len(b)))
	q.bufs = append(q.bufs, b)
	q.pending += len(b)
	q.cond.Broadcast()
}

func (q *outQueue) close() {
	q.mu.Lock()
	q.closeLocked()
	q.mu.Unlock()
}

func (q *outQueue) closeLocked() {
	if !q.closed {
		q.closed = true
		close(q.done)
	}
	q.cond.Broadcast()
}

// drop discards what is queued and releases its budget.
func (q *outQueue) drop() {
	q.mu.Lock()
	q.budget.release(int64(q.pending))
	q.bufs, q.pending = nil, 0
	q.cond.Broadcast()
	q.mu.Unlock()
}

// writeLoop writes queued replies until the queue is closed and drained or a
// write fails, then closes the connection. A batch not written within
// WriteTimeout (a client that does not read) closes the connection.
func (s *Server) writeLoop(sc *serverConn) {
	defer sc.nc.Close()
	q := &sc.out
	defer q.drop()
	for {
		q.mu.Lock()
		for len(q.bufs) == 0 && !q.closed {
			q.cond.Wait()
		}
		if len(q.bufs) == 0 {
			q.mu.Unlock()
			return
		}
		bufs, n := q.bufs, q.pending
		q.bufs = nil
		q.mu.Unlock()

		_ = sc.nc.SetWriteDeadline(time.Now().Add(s.opts.WriteTimeout))
		_, err := bufs.WriteTo(sc.nc)
		q.mu.Lock()
		q.pending -= n
		q.budget.release(int64(n))
		if err != nil {
			q.closeLocked()
		}
		q.cond.Broadcast()
		q.mu.Unlock()
		if err != nil {
			var ne net.Error
			if errors.As(err, &ne) && ne.Timeout() {
				s.warn.warn("store server closing connection: the client did not read its replies within the write timeout",
					"remote", sc.remote, "write_timeout", s.opts.WriteTimeout, "unwritten_bytes", n)
			} else {
				s.log.Debug("store server write failed", "remote", sc.remote, "err", err)
			}
			return // the deferred Close wakes the reader
		}
	}
}

// outBudget bounds the reply bytes queued and not yet written over all
// connections (ServerOptions.MaxOutputBytes). Replies that find no room are
// served first come, first served, so a steady stream of clients that do not
// read cannot starve one that does.
type outBudget struct {
	max     int64
	mu      sync.Mutex
	used    int64
	waiters []*outWaiter
}

type outWaiter struct {
	n       int64
	granted chan struct{}
}

func (b *outBudget) init(max int64) { b.max = max }

// acquire charges n bytes, waiting in line for room until deadline or until
// cancel is closed.
func (b *outBudget) acquire(n int64, deadline time.Time, cancel <-chan struct{}) error {
	b.mu.Lock()
	w := &outWaiter{n: n, granted: make(chan struct{})}
	b.waiters = append(b.waiters, w)
	b.grantLocked()
	b.mu.Unlock()
	select {
	case <-w.granted:
		return nil
	default:
	}

	timer := time.NewTimer(time.Until(deadline))
	defer timer.Stop()
	var err error
	select {
	case <-w.granted:
		return nil
	case <-timer.C:
		err = errOutputFull
	case <-cancel:
		err = errConnClosed
	}
	b.mu.Lock()
	defer b.mu.Unlock()
	select {
	case <-w.granted: // granted meanwhile: give it back
		b.used -= n
	default:
		b.waiters = slices.DeleteFunc(b.waiters, func(x *outWaiter) bool { return x == w })
	}
	b.grantLocked()
	return err
}

// grantLocked serves the waiters in order while the first one fits; with
// nothing in use the first one is served whatever its size (a reply may
// exceed the bound by its few bytes of counts).
func (b *outBudget) grantLocked() {
	for len(b.waiters) > 0 {
		w := b.waiters[0]
		if b.used+w.n > b.max && b.used > 0 {
			return
		}
		b.used += w.n
		close(w.granted)
		b.waiters = b.waiters[1:]
	}
}

// force charges n bytes even above the bound (a one-byte STOP_WAITING).
func (b *outBudget) force(n int64) {
	b.mu.Lock()
	b.used += n
	b.mu.Unlock()
}

func (b *outBudget) release(n int64) {
	if n <= 0 {
		return
	}
	b.mu.Lock()
	b.used -= n
	b.grantLocked()
	b.mu.Unlock()
}

func (b *outBudget) inUse() int64 {
	b.mu.Lock()
	defer b.mu.Unlock()
	return b.used
}

// reply accumulates one reply: small fields are copied into a buffer, large
// blobs are referenced (stored values are never modified in place).
type reply struct {
	e    enc
	segs [][]byte
	n    int
}

func (r *reply) flushSmall() {
	if len(r.e.b) > 0 {
		r.segs = append(r.segs, r.e.b)
		r.n += len(r.e.b)
		r.e.b = nil
	}
}

func (r *reply) blob(v []byte) {
	if len(v) <= smallBlob {
		r.e.bytes(v)
		return
	}
	r.e.u64(uint64(len(v)))
	r.flushSmall()
	r.segs = append(r.segs, v)
	r.n += len(v)
}

// connReader is the connection as the decoder reads it: while a request is
// being decoded, the first read from the network sets the request's
// deadline. Between requests there is none, so idle clients (a training job
// between rendezvous) stay connected.
type connReader struct {
	nc      net.Conn
	timeout time.Duration
	dl      time.Time // deadline of the request being decoded; zero between requests
	armed   bool      // dl is set on nc
}

func (r *connReader) Read(p []byte) (int, error) {
	if !r.dl.IsZero() && !r.armed {
		_ = r.nc.SetReadDeadline(r.dl)
		r.armed = true
	}
	return r.nc.Read(p)
}

func (r *connReader) begin() { r.dl = time.Now().Add(r.timeout) }

func (r *connReader) end() {
	r.dl = time.Time{}
	if r.armed {
		_ = r.nc.SetReadDeadline(time.Time{})
		r.armed = false
	}
}

func (s *Server) serveConn(sc *serverConn) {
	defer func() {
		s.st.mu.Lock()
		s.st.dropWaits(sc)
		s.st.mu.Unlock()
		// The writer flushes what is queued (replies to the requests before
		// a refused one, say), then closes the connection.
		sc.out.close()
	}()

	cr := &connReader{nc: sc.nc, timeout: s.opts.RequestTimeout}
	br := bufio.NewReaderSize(cr, serverReadBuf)
	if !s.handshake(sc, br) {
		return
	}
	dec := newDecoder(br, s.lim, &s.mem)
	dec.begin, dec.end = cr.begin, cr.end
	for {
		req, err := dec.next()
		if err != nil {
			var ne net.Error
			switch {
			case errors.Is(err, io.EOF):
				s.log.Debug("store client disconnected", "remote", sc.remote)
			case errors.Is(err, net.ErrClosed):
				// Shutdown or failed write.
			case errors.As(err, &ne) && ne.Timeout():
				s.warn.warn("store server closing connection: a request was not completed within the request timeout (a stalled or hostile client?)",
					"remote", sc.remote, "request_timeout", s.opts.RequestTimeout)
			case errors.Is(err, errOverBudget):
				s.warn.warn("store server closing connection: request refused, the memory budget (MaxTotalBytes) is exhausted",
					"remote", sc.remote, "max_total_bytes", s.opts.MaxTotalBytes)
			default:
				s.warn.warn("store server closing connection: bad request", "remote", sc.remote, "reason", err.Error())
			}
			return
		}
		if err := s.handle(sc, req); err != nil {
			if !errors.Is(err, errConnClosed) {
				s.warn.warn("store server closing connection: request refused", "remote", sc.remote,
					"command", cmdName(req.cmd), "reason", err.Error())
			}
			return
		}
	}
}

// handshake checks that the connection starts with VALIDATE + magic, as
// every torch >= 2.x client does. Older clients (torch 1.13 starts with a
// SET, ADD or GET, or opens an idle second socket) are refused.
func (s *Server) handshake(sc *serverConn, br *bufio.Reader) bool {
	_ = sc.nc.SetReadDeadline(time.Now().Add(s.opts.HandshakeTimeout))
	var hs [5]byte
	n, err := io.ReadFull(br, hs[:])
	if n == len(hs) && hs[0] == cmdValidate && binary.LittleEndian.Uint32(hs[1:]) == validationMagic {
		_ = sc.nc.SetReadDeadline(time.Time{})
		return true
	}
	var ne net.Error
	switch {
	case n == 0 && errors.Is(err, io.EOF):
		s.log.Debug("store client closed before handshake", "remote", sc.remote)
	case errors.As(err, &ne) && ne.Timeout():
		s.warn.warn("store server refusing connection: no TCPStore VALIDATE handshake within the handshake timeout (torch 1.x client?); gpubridge needs torch >= 2.8",
			"remote", sc.remote, "timeout", s.opts.HandshakeTimeout, "first_bytes", hex.EncodeToString(hs[:n]))
	default:
		s.warn.warn("store server refusing connection: it does not start with TCPStore VALIDATE (torch 1.x client?); gpubridge needs torch >= 2.8",
			"remote", sc.remote, "first_bytes", hex.EncodeToString(hs[:n]))
	}
	return false
}

// replyTooLarge is the error of a request whose reply would exceed
// MaxReplyBytes.
func (s *Server) replyTooLarge(cmd byte, size int64) error {
	return protoErrorf("%s reply of at least %d bytes exceeds MaxReplyBytes %d", cmdName(cmd), size, s.opts.MaxReplyBytes)
}

// handle executes one request and queues its reply. Only the state change
// and the lookups happen under the state lock (apply); the values a reply
// carries are collected there as references (stored values are never
// modified in place) and encoded after the lock is released (queueReply),
// so a large MULTI_GET or LIST_KEYS does not hold up other clients.
func (s *Server) handle(sc *serverConn, r *request) error {
	p := pending{limit: int64(s.opts.MaxReplyBytes)}
	s.st.mu.Lock()
	if r.cmd != cmdWait {
		// The request's bytes now either become stored data (charged again
		// by state.put) or are garbage.
		s.mem.release(r.cost)
	}
	err := s.apply(sc, r, &p)
	s.st.mu.Unlock()
	if err != nil {
		return err
	}
	return s.queueReply(sc, r.cmd, &p)
}

// pending is a reply being built: its fixed-size fields, encoded under the
// state lock, and the blobs and keys that follow them, encoded after.
type pending struct {
	rep   reply
	blobs [][]byte
	keys  []string // LIST_KEYS: sorted and encoded after
	size  int64    // size of blobs and keys on the wire
	limit int64    // MaxReplyBytes
}

// addBlob adds a value to the reply; false when the reply grew too large.
func (p *pending) addBlob(v []byte) bool {
	p.size += 8 + int64(len(v))
	p.blobs = append(p.blobs, v)
	return p.size <= p.limit
}

// apply executes r on the state (whose lock the caller holds) and puts
// what the reply carries into p.
func (s *Server) apply(sc *serverConn, r *request, p *pending) error {
	st := &s.st
	rep := &p.rep
	switch r.cmd {
	case cmdValidate:
	case cmdPing:
		rep.e.u32(r.nonce)
	case cmdSet:
		return st.set(r.keys[0], r.values[0])
	case cmdCompareSet:
		v, err := st.compareSet(r.keys[0], r.values[0], r.values[1])
		if err == nil && !p.addBlob(v) {
			return s.replyTooLarge(r.cmd, p.size)
		}
		return err
	case cmdGet:
		if !p.addBlob(st.kv[r.keys[0]]) {
			return s.replyTooLarge(r.cmd, p.size)
		}
	case cmdAdd:
		v, err := st.add(r.keys[0], r.delta)
		rep.e.i64(v)
		return err
	case cmdCheck:
		if st.present(r.keys) {
			rep.e.byte1(checkReady)
		} else {
			rep.e.byte1(checkNotReady)
		}
	case cmdWait:
		switch {
		case st.present(r.keys):
			s.mem.release(r.cost)
			rep.e.byte1(waitStop)
		case len(sc.waits) >= maxWaitsPerConn:
			s.mem.release(r.cost)
			return protoErrorf("more than %d concurrent WAITs on one connection", maxWaitsPerConn)
		default:
			st.addWaiter(sc, r.keys, r.cost)
		}
	case cmdGetNumKeys:
		rep.e.i64(int64(len(st.kv)))
	case cmdDeleteKey:
		if st.del(r.keys[0]) {
			rep.e.i64(1)
		} else {
			rep.e.i64(0)
		}
	case cmdAppend:
		return st.append(r.keys[0], r.values[0])
	case cmdMultiGet:
		p.blobs = make([][]byte, 0, len(r.keys))
		for _, k := range r.keys {
			if !p.addBlob(st.kv[k]) {
				return s.replyTooLarge(r.cmd, p.size)
			}
		}
	case cmdMultiSet:
		for i, k := range r.keys {
			if err := st.set(k, r.values[i]); err != nil {
				return err
			}
		}
	case cmdCancelWait:
		st.dropWaits(sc)
		rep.e.byte1(waitCanceled)
	case cmdQueuePush:
		return st.queuePush(r.keys[0], r.values[0])
	case cmdQueuePop:
		// The item is popped only if its reply can be sent.
		if v, ok := st.queuePeek(r.keys[0]); ok && 8+8+int64(len(v)) > p.limit {
			return s.replyTooLarge(r.cmd, 8+8+int64(len(v)))
		}
		n, v := st.queuePop(r.keys[0])
		rep.e.i64(n)
		if n > 0 {
			p.addBlob(v)
		}
	case cmdQueueLen:
		rep.e.i64(st.queueLen(r.keys[0]))
	case cmdListKeys:
		p.keys = make([]string, 0, len(st.kv))
		for k := range st.kv {
			p.keys = append(p.keys, k)
			if p.size += 8 + int64(len(k)); p.size > p.limit {
				return s.replyTooLarge(r.cmd, p.size)
			}
		}
		rep.e.i64(int64(len(p.keys)))
	default:
		// The decoder refuses unknown commands; keep the invariant local.
		return protoErrorf("unknown command %d", r.cmd)
	}
	return nil
}

// queueReply encodes what p collected and queues it on sc's output.
func (s *Server) queueReply(sc *serverConn, cmd byte, p *pending) error {
	rep := &p.rep
	for _, v := range p.blobs {
		rep.blob(v)
	}
	if p.keys != nil {
		slices.Sort(p.keys)
		for _, k := range p.keys {
			rep.e.str(k)
		}
	}
	rep.flushSmall()
	if rep.n == 0 {
		return nil
	}
	// Every byte charged to the output bound is written or dropped within
	// about WriteTimeout of its turn; twice that is a guard against hangs.
	if err := sc.out.send(rep.segs, rep.n, time.Now().Add(2*s.opts.WriteTimeout)); err != nil {
		if errors.Is(err, errOutputFull) {
			return fmt.Errorf("%s reply of %d bytes: %w", cmdName(cmd), rep.n, err)
		}
		return err
	}
	return nil
}

// state is the key-value store shared by all connections.
type state struct {
	mem     *budget
	mu      sync.Mutex
	kv      map[string][]byte
	queues  map[string]*itemQueue
	waiters map[string][]*waiter // missing key -> connections waiting for it
}

type itemQueue struct {
	items [][]byte
	head  int
}

type waiter struct {
	sc        *serverConn
	keys      []string // keys registered in state.waiters
	remaining int      // registered keys that have not appeared yet
	cost      int64    // budget held by the WAIT request
	done      bool
}

var stopWaitingReply = []byte{waitStop}

func (st *state) init(mem *budget) {
	st.mem = mem
	st.kv = make(map[string][]byte)
	st.queues = make(map[string]*itemQueue)
	st.waiters = make(map[string][]*waiter)
}

func entryCost(k string, v []byte) int64 {
	return int64(len(k)+cap(v)) + 2*entryOverhead
}

// put stores v under k, charging the difference to the budget.
func (st *state) put(k string, v []byte) error {
	old, ok := st.kv[k]
	delta := entryCost(k, v)
	if ok {
		delta -= entryCost(k, old)
	}
	if delta > 0 && !st.mem.reserve(delta) {
		return errOverBudget
	}
	st.mem.release(-delta)
	st.kv[k] = v
	st.wake(k)
	return nil
}

func (st *state) set(k string, v []byte) error {
	return st.put(k, v)
}

// compareSet implements COMPARE_SET as both torch servers do: a missing key
// is created only when expected is empty (the reply is then desired, else
// expected); an existing key is swapped only when it equals expected, and
// the reply is the value now stored.
func (st *state) compareSet(k string, expected, desired []byte) ([]byte, error) {
	cur, ok := st.kv[k]
	switch {
	case !ok && len(expected) == 0:
		if err := st.put(k, desired); err != nil {
			return nil, err
		}
		return desired, nil
	case !ok:
		return expected, nil
	case bytes.Equal(cur, expected):
		if err := st.put(k, desired); err != nil {
			return nil, err
		}
		return desired, nil
	default:
		return cur, nil
	}
}

// add implements ADD: the value is kept as ASCII decimal.
func (st *state) add(k string, delta int64) (int64, error) {
	if old, ok := st.kv[k]; ok {
		n, ok := parseStoll(old)
		if !ok {
			return 0, protoErrorf("ADD on key %q whose value %q is not an integer", k, truncate(old, 32))
		}
		delta += n
	}
	return delta, st.put(k, fmt.Appendf(nil, "%d", delta))
}

func (st *state) append(k string, v []byte) error {
	old, ok := st.kv[k]
	if !ok {
		return st.put(k, v)
	}
	nv := make([]byte, len(old)+len(v)) // exact size: the budget counts capacity
	copy(nv, old)
	copy(nv[len(old):], v)
	return st.put(k, nv)
}

func (st *state) del(k string) bool {
	v, ok := st.kv[k]
	if ok {
		delete(st.kv, k)
		st.mem.release(entryCost(k, v))
	}
	return ok
}

// present reports whether every key holds a value or a non-empty queue.
func (st *state) present(keys []string) bool {
	for _, k := range keys {
		if !st.has(k) {
			return false
		}
	}
	return true
}

func (st *state) has(k string) bool {
	if _, ok := st.kv[k]; ok {
		return true
	}
	q := st.queues[k]
	return q != nil && len(q.items) > q.head
}

func (st *state) addWaiter(sc *serverConn, keys []string, cost int64) {
	w := &waiter{sc: sc, cost: cost}
	for _, k := range keys {
		if st.has(k) || slices.Contains(w.keys, k) {
			continue
		}
		w.keys = append(w.keys, k)
		st.waiters[k] = append(st.waiters[k], w)
	}
	w.remaining = len(w.keys)
	sc.waits = append(sc.waits, w)
}

// finish completes w: STOP_WAITING goes out (queued while state.mu is held,
// so it precedes any WAIT_CANCELED for the same connection).
func (st *state) finish(w *waiter) {
	w.done = true
	st.mem.release(w.cost)
	w.sc.waits = slices.DeleteFunc(w.sc.waits, func(x *waiter) bool { return x == w })
	w.sc.out.sendNow(stopWaitingReply)
}

// wake is called after k got a value: every waiter for which k was the last
// missing key is released.
func (st *state) wake(k string) {
	ws, ok := st.waiters[k]
	if !ok {
		return
	}
	delete(st.waiters, k)
	for _, w := range ws {
		if w.done {
			continue
		}
		w.remaining--
		if w.remaining == 0 {
			st.finish(w)
		}
	}
}

// wakeOne is called after an item was pushed on queue k: like torch's libuv
// server it releases only the first waiter for which k was the last missing
// key, so that one blocked queue_pop gets the item.
func (st *state) wakeOne(k string) {
	ws := st.waiters[k]
	i := 0
	for i < len(ws) {
		w := ws[i]
		i++
		if w.done {
			continue
		}
		w.remaining--
		if w.remaining == 0 {
			st.finish(w)
			break
		}
	}
	if i >= len(ws) {
		delete(st.waiters, k)
	} else {
		st.waiters[k] = ws[i:]
	}
}

// dropWaits cancels every WAIT of sc (CANCEL_WAIT or connection close).
func (st *state) dropWaits(sc *serverConn) {
	for _, w := range sc.waits {
		w.done = true
		st.mem.release(w.cost)
		for _, k := range w.keys {
			ws := slices.DeleteFunc(st.waiters[k], func(x *waiter) bool { return x == w })
			if len(ws) == 0 {
				delete(st.waiters, k)
			} else {
				st.waiters[k] = ws
			}
		}
	}
	sc.waits = nil
}

func (st *state) queuePush(k string, v []byte) error {
	if !st.mem.reserve(int64(cap(v)) + entryOverhead) {
		return errOverBudget
	}
	q := st.queues[k]
	if q == nil {
		if !st.mem.reserve(int64(len(k)) + entryOverhead) {
			st.mem.release(int64(cap(v)) + entryOverhead)
			return errOverBudget
		}
		q = &itemQueue{}
		st.queues[k] = q
	}
	q.items = append(q.items, v)
	st.wakeOne(k)
	return nil
}

// queuePeek returns the item queuePop would pop.
func (st *state) queuePeek(k string) ([]byte, bool) {
	q := st.queues[k]
	if q == nil || len(q.items) == q.head {
		return nil, false
	}
	return q.items[q.head], true
}

// queuePop returns the queue length before the pop and the popped item.
func (st *state) queuePop(k string) (int64, []byte) {
	q := st.queues[k]
	if q == nil || len(q.items) == q.head {
		return 0, nil
	}
	n := int64(len(q.items) - q.head)
	v := q.items[q.head]
	q.items[q.head] = nil
	q.head++
	st.mem.release(int64(cap(v)) + entryOverhead)
	if q.head == len(q.items) {
		delete(st.queues, k)
		st.mem.release(int64(len(k)) + entryOverhead)
	} else if q.head > 64 && q.head*2 > len(q.items) {
		q.items = slices.Clip(append(q.items[:0:0], q.items[q.head:]...))
		q.head = 0
	}
	return n, v
}

func (st *state) queueLen(k string) int64 {
	q := st.queues[k]
	if q == nil {
		return 0
	}
	return int64(len(q.items) - q.head)
}

// parseStoll parses the leading integer of b the way std::stoll does (which
// torch's servers use for ADD): optional leading whitespace and sign, then
// decimal digits; trailing bytes are ignored. It fails when there are no
// digits or the number overflows int64.
func parseStoll(b []byte) (int64, bool) {
	i := 0
	for i < len(b) && (b[i] == ' ' || (b[i] >= '\t' && b[i] <= '\r')) {
		i++
	}
	neg := false
	if i < len(b) && (b[i] == '+' || b[i] == '-') {
		neg = b[i] == '-'
		i++
	}
	start := i
	var u uint64
	limit := uint64(math.MaxInt64)
	if neg {
		limit++ // -2^63 is representable
	}
	for i < len(b) && b[i] >= '0' && b[i] <= '9' {
		d := uint64(b[i] - '0')
		if u > (limit-d)/10 {
			return 0, false
		}
		u = u*10 + d
		i++
	}
	if i == start {
		return 0, false
	}
	if neg {
		return int64(-u), true
	}
	return int64(u), true
}

func truncate(b []byte, n int) []byte {
	if len(b) > n {
		return b[:n]
	}
	return b
}
