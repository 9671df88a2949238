package store

import (
	"bufio"
	"context"
	"errors"
	"fmt"
	"log/slog"
	"math/rand/v2"
	"net"
	"os"
	"strings"
	"sync"
	"time"
)

var (
	// ErrTimeout is wrapped by errors of operations that ran out of time:
	// Dial finding no server, Get/Wait/MultiGet on keys that did not appear.
	ErrTimeout = errors.New("store: timeout")
	// ErrClosed is wrapped by errors of operations on a closed Client.
	ErrClosed = errors.New("store: client closed")
)

// LimitError is the error of a request the client does not send because it
// exceeds the protocol's limits (those of torch's libuv TCPStore server and
// of Server's defaults): the server would close the connection on it, and
// the caller would see only "connection reset by peer".
type LimitError struct {
	Op    string // the operation: "set", "multi_set", ...
	Key   string // the key concerned, as the caller named it; "" for a key count
	What  string // "value", "key" or "key count"
	Size  int
	Limit int
}

func (e *LimitError) Error() string {
	var b strings.Builder
	fmt.Fprintf(&b, "store %s: ", e.Op)
	key := e.Key
	if len(key) > 64 {
		key = key[:61] + "..."
	}
	switch e.What {
	case "key count":
		fmt.Fprintf(&b, "%d keys in one request, over the store's limit of %d", e.Size, e.Limit)
	case "key":
		fmt.Fprintf(&b, "the key %q is %d bytes with its prefixes, over the store's %s limit", key, e.Size, sizeWords(e.Limit))
	default:
		fmt.Fprintf(&b, "the %s of key %q is %d bytes, over the store's %s limit", e.What, key, e.Size, sizeWords(e.Limit))
	}
	b.WriteString(" (torch's TCPStore has the same limit)")
	return b.String()
}

// sizeWords writes a byte count the way people say it: "8 MiB", "8 KiB".
func sizeWords(n int) string {
	switch {
	case n >= 1<<20 && n%(1<<20) == 0:
		return fmt.Sprintf("%d MiB", n>>20)
	case n >= 1<<10 && n%(1<<10) == 0:
		return fmt.Sprintf("%d KiB", n>>10)
	}
	return fmt.Sprintf("%d-byte", n)
}

// checkLimits returns a *LimitError when req exceeds the limits; names are
// the caller's names of req's keys.
func (cc *clientConn) checkLimits(op string, req *request, names []string) error {
	name := func(i int) string {
		if i < len(names) {
			return names[i]
		}
		return ""
	}
	if len(req.keys) > DefaultMaxKeysPerRequest && (req.cmd == cmdMultiGet || req.cmd == cmdMultiSet || req.cmd == cmdCheck) {
		return &LimitError{Op: op, What: "key count", Size: len(req.keys), Limit: DefaultMaxKeysPerRequest}
	}
	for i, k := range req.keys {
		if len(k) > DefaultMaxKeyLen {
			return &LimitError{Op: op, Key: name(i), What: "key", Size: len(k), Limit: DefaultMaxKeyLen}
		}
	}
	for i, v := range req.values {
		if len(v) > cc.opts.maxValueLen {
			ki := i
			if req.cmd == cmdCompareSet {
				ki = 0
			}
			return &LimitError{Op: op, Key: name(ki), What: "value", Size: len(v), Limit: cc.opts.maxValueLen}
		}
	}
	return nil
}

// Defaults of the client options.
const (
	DefaultConnectTimeout = 60 * time.Second
	DefaultTimeout        = 300 * time.Second // torch's default store timeout
)

const (
	maxReplyBlob   = 1 << 30 // largest value the client accepts from a server
	maxReplyKeys   = 1 << 26 // largest LIST_KEYS count the client accepts
	pollMinBackoff = time.Millisecond
	pollMaxBackoff = 100 * time.Millisecond
	checkBatch     = 4096 // CHECK requests pipelined per round trip
)

type options struct {
	connectTimeout time.Duration
	timeout        time.Duration
	maxValueLen    int
	log            *slog.Logger
}

// Option configures Dial.
type Option func(*options)

// WithConnectTimeout bounds how long Dial keeps retrying (default 60s; ctx's
// deadline wins when earlier).
func WithConnectTimeout(d time.Duration) Option {
	return func(o *options) {
		if d > 0 {
			o.connectTimeout = d
		}
	}
}

// WithTimeout sets the deadline of every operation whose ctx has no earlier
// one, in particular of the blocking Get, Wait and MultiGet (default 300s,
// like torch).
func WithTimeout(d time.Duration) Option {
	return func(o *options) {
		if d > 0 {
			o.timeout = d
		}
	}
}

// WithMaxValueLen sets the largest value the client sends (default
// DefaultMaxValueLen, 8 MiB: the limit of torch's libuv TCPStore server and
// of Server's default). Raise it only for a Server configured with a larger
// ServerOptions.MaxValueLen.
func WithMaxValueLen(n int) Option {
	return func(o *options) {
		if n > 0 {
			o.maxValueLen = n
		}
	}
}

// WithLogger sets the logger for connection events (default: discard).
func WithLogger(l *slog.Logger) Option {
	return func(o *options) {
		if l != nil {
			o.log = l
		}
	}
}

// Client talks to a c10d store server (torch's TCPStore or Server) over one
// TCP connection. It is safe for concurrent use: requests are serialized on
// the connection. After an I/O error the connection is dropped and the next
// operation reconnects; the failed operation is not retried.
//
// Keys are mapped like torch's Python client does (see WireKey), so values
// written through a Client are visible to torch code under the same
// (prefixed) names and vice versa. The internal key "init/" (torch's worker
// counter) can never be produced by that mapping; raw protocol users must
// not ADD it, since a torch master counts it to world_size.
type Client struct {
	cc       *clientConn
	prefixes []string
}

// clientConn is the connection shared by a Client and its Prefix views.
type clientConn struct {
	addr string
	opts options

	op sync.Mutex // serializes requests; guards r

	mu     sync.Mutex // guards nc and closed
	nc     net.Conn
	r      *bufio.Reader
	closed bool
	done   chan struct{} // closed by Close
}

// Dial connects to a c10d store server at addr ("host:port"), retrying with
// backoff until ctx's deadline or the connect timeout (default 60s),
// whichever comes first. It performs the VALIDATE+PING handshake of torch
// 2.x clients. An address without a host or port, or with port 0, fails at
// once with an *AddrError.
func Dial(ctx context.Context, addr string, opts ...Option) (*Client, error) {
	o := options{connectTimeout: DefaultConnectTimeout, timeout: DefaultTimeout, maxValueLen: DefaultMaxValueLen,
		log: slog.New(slog.DiscardHandler)}
	for _, opt := range opts {
		opt(&o)
	}
	if err := CheckAddr(addr); err != nil {
		return nil, fmt.Errorf("store dial: %w", err)
	}
	start := time.Now()
	dctx, cancel := context.WithTimeout(ctx, o.connectTimeout)
	defer cancel()

	backoff := 50 * time.Millisecond
	var lastErr error
	for attempt := 1; ; attempt++ {
		nc, r, err := connect(dctx, addr)
		if err == nil {
			cc := &clientConn{addr: addr, opts: o, nc: nc, r: r, done: make(chan struct{})}
			o.log.Debug("store connected", "addr", addr, "attempts", attempt)
			return &Client{cc: cc}, nil
		}
		lastErr = err
		o.log.Debug("store dial failed; retrying", "addr", addr, "attempt", attempt, "err", err)
		t := time.NewTimer(jitter(backoff))
		select {
		case <-dctx.Done():
			t.Stop()
			if ctx.Err() != nil && !errors.Is(ctx.Err(), context.DeadlineExceeded) {
				return nil, fmt.Errorf("store dial %s: %w (last error: %w)", addr, ctx.Err(), lastErr)
			}
			return nil, fmt.Errorf("store dial %s: no server after %v and %d attempts: %w (last error: %w)",
				addr, time.Since(start).Round(time.Millisecond), attempt, ErrTimeout, lastErr)
		case <-t.C:
		}
		backoff = min(2*backoff, time.Second)
	}
}

// connect makes one connection attempt and performs the handshake.
func connect(ctx context.Context, addr string) (net.Conn, *bufio.Reader, error) {
	var d net.Dialer
	nc, err := d.DialContext(ctx, "tcp", addr)
	if err != nil {
		return nil, nil, err
	}
	if tc, ok := nc.(*net.TCPConn); ok {
		_ = tc.SetNoDelay(true)
	}
	if dl, ok := ctx.Deadline(); ok {
		_ = nc.SetDeadline(dl)
	}
	stop := context.AfterFunc(ctx, func() { _ = nc.SetDeadline(time.Unix(1, 0)) })
	defer stop()

	nonce := uint32(os.Getpid())<<8 ^ rand.Uint32()
	var e enc
	e.byte1(cmdValidate)
	e.u32(validationMagic)
	e.byte1(cmdPing)
	e.u32(nonce)
	r := bufio.NewReader(nc)
	if _, err := nc.Write(e.b); err != nil {
		_ = nc.Close()
		return nil, nil, fmt.Errorf("handshake: %w", err)
	}
	echo, err := readU32(r)
	if err != nil {
		_ = nc.Close()
		return nil, nil, fmt.Errorf("handshake: no PING reply (not a torch >= 2.x TCPStore server?): %w", err)
	}
	if echo != nonce {
		_ = nc.Close()
		return nil, nil, fmt.Errorf("handshake: PING echoed %#x, sent %#x", echo, nonce)
	}
	if !stop() {
		_ = nc.Close()
		return nil, nil, ctx.Err()
	}
	_ = nc.SetDeadline(time.Time{})
	return nc, r, nil
}

func jitter(d time.Duration) time.Duration {
	return d/2 + rand.N(d/2+1)
}

// Prefix returns a view of c whose keys are prefixed like a torch
// PrefixStore(p, store): c.Prefix("a").Prefix("b").Set(ctx, "k", v) writes
// the wire key "/a/b/k". The view shares c's connection; closing any view
// closes it for all.
func (c *Client) Prefix(p string) *Client {
	pf := make([]string, len(c.prefixes), len(c.prefixes)+1)
	copy(pf, c.prefixes)
	return &Client{cc: c.cc, prefixes: append(pf, p)}
}

// Addr returns the server address passed to Dial.
func (c *Client) Addr() string { return c.cc.addr }

// Close closes the connection; operations in flight or later fail with
// ErrClosed.
func (c *Client) Close() error {
	cc := c.cc
	cc.mu.Lock()
	defer cc.mu.Unlock()
	if cc.closed {
		return nil
	}
	cc.closed = true
	close(cc.done)
	if cc.nc != nil {
		err := cc.nc.Close()
		cc.nc = nil
		if err != nil {
			return fmt.Errorf("store close %s: %w", cc.addr, err)
		}
	}
	return nil
}

func (c *Client) key(k string) string { return WireKey(c.prefixes, k) }

func (c *Client) keys(ks []string) []string {
	out := make([]string, len(ks))
	for i, k := range ks {
		out[i] = c.key(k)
	}
	return out
}

// deadline is the deadline of an operation started now: ctx's, or the
// client timeout, whichever is earlier.
func (cc *clientConn) deadline(ctx context.Context, timeout time.Duration) time.Time {
	dl := time.Now().Add(timeout)
	if d, ok := ctx.Deadline(); ok && d.Before(dl) {
		dl = d
	}
	return dl
}

// roundTrip sends req (already encoded) and, when read is not nil, reads the
// reply with it. The connection's I/O deadline is dl, and ctx cancellation
// interrupts the I/O. Any failure drops the connection, since the stream
// position is then unknown; the next call reconnects.
func (cc *clientConn) roundTrip(ctx context.Context, dl time.Time, req []byte, read func(r *bufio.Reader) error) error {
	cc.op.Lock()
	defer cc.op.Unlock()
	if err := ctx.Err(); err != nil {
		return err
	}
	nc, err := cc.conn(ctx, dl)
	if err != nil {
		return err
	}
	_ = nc.SetDeadline(dl)
	fired := make(chan struct{})
	stop := context.AfterFunc(ctx, func() {
		_ = nc.SetDeadline(time.Unix(1, 0))
		close(fired)
	})
	_, err = nc.Write(req)
	if err == nil && read != nil {
		err = read(cc.r)
	}
	if !stop() {
		<-fired
		if err == nil {
			_ = nc.SetDeadline(time.Time{})
			return nil
		}
		err = fmt.Errorf("%w (%w)", ctx.Err(), err)
	}
	if err != nil {
		cc.drop(nc, err)
		return cc.closedErr(err)
	}
	return nil
}

// conn returns the live connection, reconnecting once if an earlier error
// dropped it.
func (cc *clientConn) conn(ctx context.Context, dl time.Time) (net.Conn, error) {
	cc.mu.Lock()
	nc, closed := cc.nc, cc.closed
	cc.mu.Unlock()
	if closed {
		return nil, ErrClosed
	}
	if nc != nil {
		return nc, nil
	}
	cc.opts.log.Info("store reconnecting", "addr", cc.addr)
	dctx, cancel := context.WithDeadline(ctx, dl)
	defer cancel()
	nc, r, err := connect(dctx, cc.addr)
	if err != nil {
		return nil, fmt.Errorf("reconnect to %s: %w", cc.addr, err)
	}
	cc.mu.Lock()
	defer cc.mu.Unlock()
	if cc.closed {
		_ = nc.Close()
		return nil, ErrClosed
	}
	cc.nc, cc.r = nc, r
	return nc, nil
}

func (cc *clientConn) drop(nc net.Conn, err error) {
	cc.mu.Lock()
	defer cc.mu.Unlock()
	if cc.nc == nc && nc != nil {
		if !cc.closed {
			cc.opts.log.Warn("store connection dropped after error", "addr", cc.addr, "err", err)
		}
		_ = nc.Close()
		cc.nc = nil
	}
}

// closedErr turns the I/O error caused by Close into ErrClosed.
func (cc *clientConn) closedErr(err error) error {
	cc.mu.Lock()
	closed := cc.closed
	cc.mu.Unlock()
	if closed && !errors.Is(err, ErrClosed) {
		return fmt.Errorf("%w (%w)", ErrClosed, err)
	}
	return err
}

// opErr wraps an operation's error with its name and key; a *LimitError
// names them already.
func opErr(err error, format string, args ...any) error {
	var le *LimitError
	if errors.As(err, &le) {
		return err
	}
	return fmt.Errorf(format+": %w", append(args, err)...)
}

// do runs a non-blocking request with the default deadline; names are the
// caller's names of req's keys (for a *LimitError).
func (c *Client) do(ctx context.Context, op string, names []string, req *request, read func(r *bufio.Reader) error) error {
	if err := c.cc.checkLimits(op, req, names); err != nil {
		return err
	}
	var e enc
	encodeRequest(&e, req)
	return c.cc.roundTrip(ctx, c.cc.deadline(ctx, c.cc.opts.timeout), e.b, read)
}

// Set stores value under key.
func (c *Client) Set(ctx context.Context, key string, value []byte) error {
	err := c.do(ctx, "set", []string{key}, &request{cmd: cmdSet, keys: []string{c.key(key)}, values: [][]byte{value}}, nil)
	if err != nil {
		return opErr(err, "store set %q", key)
	}
	return nil
}

// Get waits until key exists (polling CHECK with backoff, never a
// server-side WAIT) and returns its value. It gives up at ctx's deadline or
// after the client timeout with an error wrapping ErrTimeout.
func (c *Client) Get(ctx context.Context, key string) ([]byte, error) {
	wk := c.key(key)
	if err := c.cc.checkLimits("get", &request{cmd: cmdGet, keys: []string{wk}}, []string{key}); err != nil {
		return nil, err
	}
	dl := c.cc.deadline(ctx, c.cc.opts.timeout)
	if err := c.cc.awaitKeys(ctx, dl, []string{key}, []string{wk}); err != nil {
		return nil, fmt.Errorf("store get %q: %w", key, err)
	}
	v, err := c.get(ctx, dl, wk)
	if err != nil {
		return nil, fmt.Errorf("store get %q: %w", key, err)
	}
	return v, nil
}

func (c *Client) get(ctx context.Context, dl time.Time, wk string) ([]byte, error) {
	var e enc
	encodeRequest(&e, &request{cmd: cmdGet, keys: []string{wk}})
	var v []byte
	err := c.cc.roundTrip(ctx, dl, e.b, func(r *bufio.Reader) (err error) {
		v, err = readBlob(r, maxReplyBlob)
		return err
	})
	return v, err
}

// TryGet returns key's value without waiting: ok is false when the key does
// not exist (CHECK, then GET).
func (c *Client) TryGet(ctx context.Context, key string) (value []byte, ok bool, err error) {
	wk := c.key(key)
	if err := c.cc.checkLimits("tryget", &request{cmd: cmdGet, keys: []string{wk}}, []string{key}); err != nil {
		return nil, false, err
	}
	dl := c.cc.deadline(ctx, c.cc.opts.timeout)
	ready, err := c.cc.check(ctx, dl, []string{wk})
	if err != nil {
		return nil, false, fmt.Errorf("store tryget %q: %w", key, err)
	}
	if !ready {
		return nil, false, nil
	}
	v, err := c.get(ctx, dl, wk)
	if err != nil {
		return nil, false, fmt.Errorf("store tryget %q: %w", key, err)
	}
	return v, true, nil
}

// Add adds delta to the integer stored under key (a missing key counts as
// 0) and returns the new value. The server keeps it as ASCII decimal, so Get
// returns e.g. "3". Adding to a non-numeric value makes the server close the
// connection. Never ADD torch's internal "init/" key with a raw client.
func (c *Client) Add(ctx context.Context, key string, delta int64) (int64, error) {
	var n int64
	err := c.do(ctx, "add", []string{key}, &request{cmd: cmdAdd, keys: []string{c.key(key)}, delta: delta}, func(r *bufio.Reader) (err error) {
		n, err = readI64(r)
		return err
	})
	if err != nil {
		return 0, opErr(err, "store add %q", key)
	}
	return n, nil
}

// CompareSet atomically replaces key's value with desired when it equals
// expected, and returns the value the server now holds, with torch's
// semantics: on a missing key, an empty expected creates the key (desired
// is returned); a non-empty expected stores nothing and returns expected.
func (c *Client) CompareSet(ctx context.Context, key string, expected, desired []byte) ([]byte, error) {
	var v []byte
	err := c.do(ctx, "compare_set", []string{key}, &request{cmd: cmdCompareSet, keys: []string{c.key(key)}, values: [][]byte{expected, desired}},
		func(r *bufio.Reader) (err error) {
			v, err = readBlob(r, maxReplyBlob)
			return err
		})
	if err != nil {
		return nil, opErr(err, "store compare_set %q", key)
	}
	return v, nil
}

// Check reports whether all keys exist (without waiting).
func (c *Client) Check(ctx context.Context, keys ...string) (bool, error) {
	wkeys := c.keys(keys)
	if err := c.cc.checkLimits("check", &request{cmd: cmdCheck, keys: wkeys}, keys); err != nil {
		return false, err
	}
	ok, err := c.cc.check(ctx, c.cc.deadline(ctx, c.cc.opts.timeout), wkeys)
	if err != nil {
		return false, fmt.Errorf("store check %q: %w", keys, err)
	}
	return ok, nil
}

func (cc *clientConn) check(ctx context.Context, dl time.Time, wkeys []string) (bool, error) {
	var e enc
	encodeRequest(&e, &request{cmd: cmdCheck, keys: wkeys})
	var ok bool
	err := cc.roundTrip(ctx, dl, e.b, func(r *bufio.Reader) error {
		b, err := readU8(r)
		if err != nil {
			return err
		}
		switch b {
		case checkReady:
			ok = true
		case checkNotReady:
		default:
			return fmt.Errorf("bad CHECK reply %d", b)
		}
		return nil
	})
	return ok, err
}

// Wait blocks until all keys exist, polling CHECK with backoff. timeout <= 0
// means the client timeout; ctx's deadline wins when earlier. On timeout the
// error wraps ErrTimeout and names the keys still missing.
func (c *Client) Wait(ctx context.Context, keys []string, timeout time.Duration) error {
	if timeout <= 0 {
		timeout = c.cc.opts.timeout
	}
	wkeys := c.keys(keys)
	// Wait sends one CHECK per key: only the key lengths matter.
	if err := c.cc.checkLimits("wait", &request{cmd: cmdWait, keys: wkeys}, keys); err != nil {
		return err
	}
	dl := c.cc.deadline(ctx, timeout)
	if err := c.cc.awaitKeys(ctx, dl, keys, wkeys); err != nil {
		return fmt.Errorf("store wait %q: %w", keys, err)
	}
	return nil
}

// awaitKeys polls until every wire key exists or dl passes. Each round
// pipelines one CHECK per pending key, so the keys still missing at the end
// are known and named in the error.
func (cc *clientConn) awaitKeys(ctx context.Context, dl time.Time, names, wkeys []string) error {
	type pend struct {
		name, wire string
		found      bool
	}
	var pending []pend
	seen := make(map[string]bool, len(wkeys))
	for i, w := range wkeys {
		if !seen[w] {
			seen[w] = true
			pending = append(pending, pend{name: names[i], wire: w})
		}
	}
	start := time.Now()
	backoff := pollMinBackoff
	for len(pending) > 0 {
		var err error
		for lo := 0; lo < len(pending) && err == nil; lo += checkBatch {
			batch := pending[lo:min(lo+checkBatch, len(pending))]
			var e enc
			for _, p := range batch {
				encodeRequest(&e, &request{cmd: cmdCheck, keys: []string{p.wire}})
			}
			err = cc.roundTrip(ctx, dl, e.b, func(r *bufio.Reader) error {
				for i := range batch {
					b, err := readU8(r)
					if err != nil {
						return err
					}
					switch b {
					case checkReady:
						batch[i].found = true
					case checkNotReady:
					default:
						return fmt.Errorf("bad CHECK reply %d", b)
					}
				}
				return nil
			})
		}
		pending = deleteFound(pending, func(p pend) bool { return p.found })
		if len(pending) == 0 {
			return nil
		}
		timedOut := !time.Now().Before(dl)
		if err != nil && !timedOut {
			return err
		}
		if timedOut {
			names := make([]string, len(pending))
			for i, p := range pending {
				names[i] = p.name
			}
			msg := fmt.Errorf("keys %q still missing after %v: %w", names, time.Since(start).Round(time.Millisecond), ErrTimeout)
			if cdl, ok := ctx.Deadline(); ok && !cdl.After(dl) {
				// ctx's deadline is the one that passed.
				return fmt.Errorf("%w: %w", msg, context.DeadlineExceeded)
			}
			return msg
		}
		sleep := min(jitter(backoff), time.Until(dl))
		t := time.NewTimer(sleep)
		select {
		case <-ctx.Done():
			t.Stop()
			if errors.Is(ctx.Err(), context.DeadlineExceeded) {
				continue // reported as a timeout with the missing keys above
			}
			return ctx.Err()
		case <-cc.done:
			t.Stop()
			return ErrClosed
		case <-t.C:
		}
		backoff = min(2*backoff, pollMaxBackoff)
	}
	return nil
}

func deleteFound[T any](s []T, found func(T) bool) []T {
	out := s[:0]
	for _, v := range s {
		if !found(v) {
			out = append(out, v)
		}
	}
	return out
}

// MultiGet waits for all keys (like Wait with the client timeout) and then
// returns their values in order.
func (c *Client) MultiGet(ctx context.Context, keys []string) ([][]byte, error) {
	if len(keys) == 0 {
		return [][]byte{}, nil
	}
	wkeys := c.keys(keys)
	if err := c.cc.checkLimits("multi_get", &request{cmd: cmdMultiGet, keys: wkeys}, keys); err != nil {
		return nil, err
	}
	dl := c.cc.deadline(ctx, c.cc.opts.timeout)
	if err := c.cc.awaitKeys(ctx, dl, keys, wkeys); err != nil {
		return nil, fmt.Errorf("store multi_get %q: %w", keys, err)
	}
	var e enc
	encodeRequest(&e, &request{cmd: cmdMultiGet, keys: wkeys})
	vals := make([][]byte, len(keys))
	err := c.cc.roundTrip(ctx, dl, e.b, func(r *bufio.Reader) (err error) {
		for i := range vals {
			if vals[i], err = readBlob(r, maxReplyBlob); err != nil {
				return err
			}
		}
		return nil
	})
	if err != nil {
		return nil, fmt.Errorf("store multi_get %q: %w", keys, err)
	}
	return vals, nil
}

// MultiSet stores values[i] under keys[i] in one request.
func (c *Client) MultiSet(ctx context.Context, keys []string, values [][]byte) error {
	if len(keys) != len(values) {
		return fmt.Errorf("store multi_set: %d keys but %d values", len(keys), len(values))
	}
	if len(keys) == 0 {
		return nil
	}
	if err := c.do(ctx, "multi_set", keys, &request{cmd: cmdMultiSet, keys: c.keys(keys), values: values}, nil); err != nil {
		return opErr(err, "store multi_set %q", keys)
	}
	return nil
}

// Delete removes key and reports whether it existed.
func (c *Client) Delete(ctx context.Context, key string) (bool, error) {
	var n int64
	err := c.do(ctx, "delete", []string{key}, &request{cmd: cmdDeleteKey, keys: []string{c.key(key)}}, func(r *bufio.Reader) (err error) {
		n, err = readI64(r)
		return err
	})
	if err != nil {
		return false, opErr(err, "store delete %q", key)
	}
	return n == 1, nil
}

// NumKeys returns the number of keys on the server, all prefixes included
// (torch counts its own "init/" key too).
func (c *Client) NumKeys(ctx context.Context) (int64, error) {
	var n int64
	err := c.do(ctx, "num_keys", nil, &request{cmd: cmdGetNumKeys}, func(r *bufio.Reader) (err error) {
		n, err = readI64(r)
		return err
	})
	if err != nil {
		return 0, fmt.Errorf("store num_keys: %w", err)
	}
	return n, nil
}

// Append appends value to key's value (creating the key when missing).
func (c *Client) Append(ctx context.Context, key string, value []byte) error {
	err := c.do(ctx, "append", []string{key}, &request{cmd: cmdAppend, keys: []string{c.key(key)}, values: [][]byte{value}}, nil)
	if err != nil {
		return opErr(err, "store append %q", key)
	}
	return nil
}

// ListKeys returns every key on the server as raw wire keys (e.g. "/a/b/k"),
// whatever the view's prefix. Only servers with LIST_KEYS answer it: this
// package's Server and torch >= 2.10 (libuv and legacy); older torch
// servers close the connection.
func (c *Client) ListKeys(ctx context.Context) ([]string, error) {
	var keys []string
	err := c.do(ctx, "list_keys", nil, &request{cmd: cmdListKeys}, func(r *bufio.Reader) error {
		n, err := readI64(r)
		if err != nil {
			return err
		}
		if n < 0 || n > maxReplyKeys {
			return fmt.Errorf("bad LIST_KEYS count %d", n)
		}
		keys = make([]string, 0, min(n, 1024))
		for range n {
			b, err := readBlob(r, maxReplyBlob)
			if err != nil {
				return err
			}
			keys = append(keys, string(b))
		}
		return nil
	})
	if err != nil {
		return nil, fmt.Errorf("store list_keys: %w", err)
	}
	return keys, nil
}

// Ping checks that the server answers.
func (c *Client) Ping(ctx context.Context) error {
	nonce := rand.Uint32()
	err := c.do(ctx, "ping", nil, &request{cmd: cmdPing, nonce: nonce}, func(r *bufio.Reader) error {
		echo, err := readU32(r)
		if err != nil {
			return err
		}
		if echo != nonce {
			return fmt.Errorf("PING echoed %#x, sent %#x", echo, nonce)
		}
		return nil
	})
	if err != nil {
		return fmt.Errorf("store ping %s: %w", c.cc.addr, err)
	}
	return nil
}

// String describes the client for logs.
func (c *Client) String() string {
	if len(c.prefixes) == 0 {
		return "store.Client(" + c.cc.addr + ")"
	}
	return "store.Client(" + c.cc.addr + ", prefix " + strings.Join(c.prefixes, "/") + ")"
}
