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
	// items plus the requests being decoded (default 1 GiB). A request that
	// would exceed it closes its connection.
	MaxTotalBytes int64
	// HandshakeTimeout bounds the wait for a new connection's VALIDATE
	// (default 30s).
	HandshakeTimeout time.Duration
	// Logger receives one line per refused connection or request (default:
	// discard).
	Logger *slog.Logger
}

// Server is a c10d TCPStore server for torch >= 2.8 clients and Client.
type Server struct {
	opts ServerOptions
	log  *slog.Logger
	lim  limits
	mem  budget
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
	writeTimeout    = 60 * time.Second
	maxWaitsPerConn = 1024
	smallBlob       = 4 << 10 // blobs above this go out without copying
)

// NewServer returns a Server; start it with Serve or ListenAndServe.
func NewServer(opts ServerOptions) *Server {
	if opts.MaxKeyLen <= 0 {
		opts.MaxKeyLen = DefaultMaxKeyLen
	}
	if opts.MaxValueLen <= 0 {
		opts.MaxValueLen = DefaultMaxValueLen
	}
	if opts.MaxKeysPerRequest <= 0 {
		opts.MaxKeysPerRequest = DefaultMaxKeysPerRequest
	}
	if opts.MaxConns <= 0 {
		opts.MaxConns = DefaultMaxConns
	}
	if opts.MaxTotalBytes <= 0 {
		opts.MaxTotalBytes = DefaultMaxTotalBytes
	}
	if opts.HandshakeTimeout <= 0 {
		opts.HandshakeTimeout = 30 * time.Second
	}
	log := opts.Logger
	if log == nil {
		log = slog.New(slog.DiscardHandler)
	}
	s := &Server{
		opts:      opts,
		log:       log,
		lim:       limits{maxKeyLen: opts.MaxKeyLen, maxValueLen: opts.MaxValueLen, maxKeys: opts.MaxKeysPerRequest},
		listeners: make(map[net.Listener]struct{}),
		conns:     make(map[*serverConn]struct{}),
	}
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
				s.log.Warn("store server accept failed; retrying", "err", err, "backoff", backoff)
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
			s.log.Warn("store server refusing connection: MaxConns reached",
				"remote", nc.RemoteAddr().String(), "max_conns", s.opts.MaxConns)
			_ = nc.Close()
			continue
		}
		sc := newServerConn(nc)
		s.conns[sc] = struct{}{}
		s.wg.Add(2)
		s.mu.Unlock()
		go func() {
			defer s.wg.Done()
			sc.writeLoop()
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

func newServerConn(nc net.Conn) *serverConn {
	sc := &serverConn{nc: nc, remote: nc.RemoteAddr().String()}
	sc.out.cond.L = &sc.out.mu
	return sc
}

var errConnClosed = errors.New("connection closed")

// outQueue holds reply bytes not yet written.
type outQueue struct {
	mu      sync.Mutex
	cond    sync.Cond
	bufs    net.Buffers
	pending int
	closed  bool
}

// send queues a reply, waiting while more than outHighWater bytes are
// pending.
func (q *outQueue) send(bufs [][]byte, n int) error {
	q.mu.Lock()
	defer q.mu.Unlock()
	for q.pending > outHighWater && !q.closed {
		q.cond.Wait()
	}
	if q.closed {
		return errConnClosed
	}
	q.bufs = append(q.bufs, bufs...)
	q.pending += n
	q.cond.Broadcast()
	return nil
}

// sendNow queues b without waiting (used with state.mu held).
func (q *outQueue) sendNow(b []byte) {
	q.mu.Lock()
	defer q.mu.Unlock()
	if q.closed {
		return
	}
	q.bufs = append(q.bufs, b)
	q.pending += len(b)
	q.cond.Broadcast()
}

func (q *outQueue) close() {
	q.mu.Lock()
	q.closed = true
	q.cond.Broadcast()
	q.mu.Unlock()
}

// writeLoop writes queued replies until the queue is closed and drained or a
// write fails, then closes the connection.
func (sc *serverConn) writeLoop() {
	defer sc.nc.Close()
	q := &sc.out
	for {
		q.mu.Lock()
		for len(q.bufs) == 0 && !q.closed {
			q.cond.Wait()
		}
		if len(q.bufs) == 0 {
			q.mu.Unlock()
			return
		}
		bufs := q.bufs
		q.bufs, q.pending = nil, 0
		q.mu.Unlock()

		_ = sc.nc.SetWriteDeadline(time.Now().Add(writeTimeout))
		_, err := bufs.WriteTo(sc.nc)
		q.mu.Lock()
		if err != nil {
			q.closed = true
			q.bufs, q.pending = nil, 0
		}
		q.cond.Broadcast()
		q.mu.Unlock()
		if err != nil {
			return // the deferred Close wakes the reader
		}
	}
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

func (s *Server) serveConn(sc *serverConn) {
	defer func() {
		s.st.mu.Lock()
		s.st.dropWaits(sc)
		s.st.mu.Unlock()
		// The writer flushes what is queued (replies to the requests before
		// a refused one, say), then closes the connection.
		sc.out.close()
	}()

	br := bufio.NewReaderSize(sc.nc, serverReadBuf)
	if !s.handshake(sc, br) {
		return
	}
	dec := newDecoder(br, s.lim, &s.mem)
	for {
		req, err := dec.next()
		if err != nil {
			switch {
			case errors.Is(err, io.EOF):
				s.log.Debug("store client disconnected", "remote", sc.remote)
			case errors.Is(err, net.ErrClosed):
				// Shutdown or failed write.
			default:
				s.log.Warn("store server closing connection: bad request", "remote", sc.remote, "reason", err.Error())
			}
			return
		}
		if err := s.handle(sc, req); err != nil {
			if !errors.Is(err, errConnClosed) {
				s.log.Warn("store server closing connection", "remote", sc.remote,
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
		s.log.Warn("store server refusing connection: no TCPStore VALIDATE handshake within the handshake timeout (torch 1.x client?); gpubridge needs torch >= 2.8",
			"remote", sc.remote, "timeout", s.opts.HandshakeTimeout, "first_bytes", hex.EncodeToString(hs[:n]))
	default:
		s.log.Warn("store server refusing connection: it does not start with TCPStore VALIDATE (torch 1.x client?); gpubridge needs torch >= 2.8",
			"remote", sc.remote, "first_bytes", hex.EncodeToString(hs[:n]))
	}
	return false
}

// handle executes one request and queues its reply.
func (s *Server) handle(sc *serverConn, r *request) error {
	st := &s.st
	var rep reply
	var err error
	st.mu.Lock()
	if r.cmd != cmdWait {
		// The request's bytes now either become stored data (charged again
		// by state.put) or are garbage.
		s.mem.release(r.cost)
	}
	switch r.cmd {
	case cmdValidate:
	case cmdPing:
		rep.e.u32(r.nonce)
	case cmdSet:
		err = st.set(r.keys[0], r.values[0])
	case cmdCompareSet:
		var v []byte
		v, err = st.compareSet(r.keys[0], r.values[0], r.values[1])
		rep.blob(v)
	case cmdGet:
		rep.blob(st.kv[r.keys[0]])
	case cmdAdd:
		var v int64
		v, err = st.add(r.keys[0], r.delta)
		rep.e.i64(v)
	case cmdCheck:
		if st.present(r.keys) {
			rep.e.byte1(checkReady)
		} else {
			rep.e.byte1(checkNotReady)
		}
	case cmdWait:
		if st.present(r.keys) {
			s.mem.release(r.cost)
			rep.e.byte1(waitStop)
		} else if len(sc.waits) >= maxWaitsPerConn {
			s.mem.release(r.cost)
			err = protoErrorf("more than %d concurrent WAITs on one connection", maxWaitsPerConn)
		} else {
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
		err = st.append(r.keys[0], r.values[0])
	case cmdMultiGet:
		for _, k := range r.keys {
			rep.blob(st.kv[k])
		}
	case cmdMultiSet:
		for i, k := range r.keys {
			if err = st.set(k, r.values[i]); err != nil {
				break
			}
		}
	case cmdCancelWait:
		st.dropWaits(sc)
		rep.e.byte1(waitCanceled)
	case cmdQueuePush:
		err = st.queuePush(r.keys[0], r.values[0])
	case cmdQueuePop:
		n, v := st.queuePop(r.keys[0])
		rep.e.i64(n)
		if n > 0 {
			rep.blob(v)
		}
	case cmdQueueLen:
		rep.e.i64(st.queueLen(r.keys[0]))
	case cmdListKeys:
		keys := make([]string, 0, len(st.kv))
		for k := range st.kv {
			keys = append(keys, k)
		}
		slices.Sort(keys)
		rep.e.i64(int64(len(keys)))
		for _, k := range keys {
			rep.e.str(k)
		}
	default:
		// The decoder refuses unknown commands; keep the invariant local.
		err = protoErrorf("unknown command %d", r.cmd)
	}
	st.mu.Unlock()
	if err != nil {
		return err
	}
	rep.flushSmall()
	if rep.n == 0 {
		return nil
	}
	return sc.out.send(rep.segs, rep.n)
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
