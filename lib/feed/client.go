package feed

import (
	"context"
	"errors"
	"fmt"
	"io"
	"net"
	"os"
	"sync"
	"sync/atomic"
	"syscall"
	"time"

	"github.com/gpubridge/gpubridge/lib/reduce"
	"golang.org/x/sys/unix"
)

// Client is the reference implementation of the feed's client side: what
// the torch plugin does in Python, in Go, for tests, selftest and bench. It
// is safe for concurrent use.
type Client struct {
	conn    *net.UnixConn
	welcome WelcomeMsg

	wmu    sync.Mutex // serializes writes and request ids
	wbuf   []byte
	nextID uint64

	mu         sync.Mutex
	calls      map[uint64]*Call
	regions    map[uint32]*Region
	nextRegion uint32
	err        error         // fatal: the feed is unusable
	dead       chan struct{} // closed when err is set
	gotBye     bool

	// The read token: whichever goroutine holds it reads the socket and
	// dispatches what comes; the state below is its.
	rtok   chan struct{}
	rbuf   []byte
	rr, rw int
	rdone  DoneMsg
	raw    syscall.RawConn
	wait   WaitOptions
	// deadline is the read deadline a Wait's context set (kernel waits).
	deadline atomic.Int64

	callPool sync.Pool
}

// Region is a shared-memory region the client mapped and registered with the
// server. Mem is the client's view of it.
type Region struct {
	ID  uint32
	Mem []byte
	fd  int
}

// Span returns the bytes [off, off+n) of r as a request span.
func (r *Region) Span(off, n int) Span {
	return Span{Region: r.ID, Off: uint64(off), Len: uint64(n)}
}

// All returns the whole region as a span.
func (r *Region) All() Span { return r.Span(0, len(r.Mem)) }

// RequestError is a request that finished with a status other than OK.
type RequestError struct {
	Kind   MsgType
	ID     uint64
	Status Status
	Msg    string
}

func (e *RequestError) Error() string {
	return fmt.Sprintf("feed: %s %d: %s: %s", e.Kind, e.ID, e.Status, e.Msg)
}

// Call is a request in flight.
type Call struct {
	c          *Client
	kind       MsgType
	id         uint64
	onProgress func(off, n uint64)
	ch         chan struct{}
	done       DoneMsg
	err        error
}

// ID is the request id the client gave the call.
func (k *Call) ID() uint64 { return k.id }

// Dial connects to the feed socket at path and says HELLO. ctx bounds the
// connection and the handshake.
func Dial(ctx context.Context, path string) (*Client, error) {
	if _, ok := ctx.Deadline(); !ok {
		var cancel context.CancelFunc
		ctx, cancel = context.WithTimeout(ctx, DefaultHandshakeTimeout)
		defer cancel()
	}
	var d net.Dialer
	nc, err := d.DialContext(ctx, "unix", path)
	if err != nil {
		return nil, fmt.Errorf("feed: connect to %s: %w", path, err)
	}
	conn := nc.(*net.UnixConn)
	c := &Client{
		conn: conn, calls: map[uint64]*Call{}, regions: map[uint32]*Region{},
		dead: make(chan struct{}), wbuf: make([]byte, 0, 256),
		rtok: make(chan struct{}, 1), rbuf: make([]byte, 2*MaxMessage),
	}
	c.rtok <- struct{}{}
	c.raw, _ = conn.SyscallConn()
	c.callPool.New = func() any { return &Call{c: c} }
	if err := c.handshake(ctx); err != nil {
		_ = conn.Close()
		return nil, err
	}
	return c, nil
}

func (c *Client) handshake(ctx context.Context) error {
	dl, _ := ctx.Deadline()
	_ = c.conn.SetDeadline(dl)
	stop := context.AfterFunc(ctx, func() { _ = c.conn.SetDeadline(time.Unix(1, 0)) })
	defer stop()
	hello := HelloMsg{MinVersion: MinVersion, MaxVersion: Version, PID: uint32(os.Getpid()), Name: "gpubridge/lib/feed"}
	if _, err := c.conn.Write(hello.Append(nil)); err != nil {
		return fmt.Errorf("feed: send hello: %w", err)
	}
	buf := make([]byte, MaxMessage)
	if _, err := io.ReadFull(c.conn, buf[:HeaderSize]); err != nil {
		return fmt.Errorf("feed: read welcome: %w", err)
	}
	h, err := ParseHeader(buf, MaxMessage)
	if err != nil {
		return fmt.Errorf("feed: welcome: %w", err)
	}
	if _, err := io.ReadFull(c.conn, buf[HeaderSize:h.Size]); err != nil {
		return fmt.Errorf("feed: read welcome: %w", err)
	}
	m, err := DecodeBody(h.Type, buf[HeaderSize:h.Size])
	if err != nil {
		return fmt.Errorf("feed: welcome: %w", err)
	}
	switch m := m.(type) {
	case *WelcomeMsg:
		if m.Version < MinVersion || m.Version > Version {
			return fmt.Errorf("feed: server chose protocol version %d, outside %d..%d", m.Version, MinVersion, Version)
		}
		c.welcome = *m
	case *ErrorMsg:
		return fmt.Errorf("feed: server refused the feed: %s", m.Text)
	default:
		return fmt.Errorf("feed: server answered hello with %s", m.Type())
	}
	_ = c.conn.SetDeadline(time.Time{})
	return nil
}

// Welcome returns the server's WELCOME: protocol version, member index and
// count, limits, transport.
func (c *Client) Welcome() WelcomeMsg { return c.welcome }

// fail makes the feed unusable with err and finishes every call in flight
// with it.
func (c *Client) fail(err error) {
	c.mu.Lock()
	if c.err != nil {
		c.mu.Unlock()
		return
	}
	c.err = err
	calls := c.calls
	c.calls = map[uint64]*Call{}
	close(c.dead)
	c.mu.Unlock()
	for _, k := range calls {
		k.err = err
		close(k.ch)
	}
}

// pump reads the socket once, blocking (after polling it for up to the
// client's spin), and handles every whole message it has. The caller holds
// the read token. It returns a deadline error untouched (a Wait whose
// context ended); any other failure fails the feed.
func (c *Client) pump() error {
	if c.rr == c.rw {
		c.rr, c.rw = 0, 0
	} else if len(c.rbuf)-c.rw < MaxMessage {
		c.rw = copy(c.rbuf, c.rbuf[c.rr:c.rw])
		c.rr = 0
	}
	var n int
	var err error
	switch {
	case c.wait.Kernel && c.raw != nil:
		n, err = c.recvKernel(c.rbuf[c.rw:])
	case c.wait.Spin > 0 && c.raw != nil:
		n, _, _, err = recvSpin(c.raw, c.rbuf[c.rw:], nil, c.wait.Spin)
	default:
		n, err = c.conn.Read(c.rbuf[c.rw:])
	}
	c.rw += n
	if err != nil && n == 0 {
		if errors.Is(err, os.ErrDeadlineExceeded) {
			return err
		}
		c.mu.Lock()
		bye := c.gotBye
		c.mu.Unlock()
		switch {
		case bye && errors.Is(err, io.EOF):
			c.fail(errClosed)
		case errors.Is(err, io.EOF):
			c.fail(errors.New("feed: the server closed the feed"))
		default:
			c.fail(fmt.Errorf("feed: read: %w", err))
		}
		return err
	}
	for c.rw-c.rr >= HeaderSize {
		h, err := ParseHeader(c.rbuf[c.rr:c.rw], MaxMessage)
		if err != nil {
			c.fail(fmt.Errorf("feed: from the server: %w", err))
			return err
		}
		if c.rw-c.rr < int(h.Size) {
			break
		}
		body := c.rbuf[c.rr+HeaderSize : c.rr+int(h.Size)]
		c.rr += int(h.Size)
		if err := c.handle(h.Type, body); err != nil {
			c.fail(err)
			return err
		}
	}
	return nil
}

// handle dispatches one message from the server.
func (c *Client) handle(t MsgType, body []byte) error {
	switch t {
	case MsgDone:
		if err := DecodeDone(body, &c.rdone); err != nil {
			return fmt.Errorf("feed: from the server: %w", err)
		}
		c.mu.Lock()
		k := c.calls[c.rdone.ID]
		delete(c.calls, c.rdone.ID)
		c.mu.Unlock()
		if k == nil {
			return fmt.Errorf("feed: the server finished request %d, which is not in flight", c.rdone.ID)
		}
		k.done = c.rdone
		close(k.ch)
	case MsgProgress:
		p, err := DecodeProgress(body)
		if err != nil {
			return fmt.Errorf("feed: from the server: %w", err)
		}
		c.mu.Lock()
		k := c.calls[p.ID]
		c.mu.Unlock()
		if k != nil && k.onProgress != nil {
			k.onProgress(p.Off, p.N)
		}
	case MsgError:
		m, err := DecodeBody(MsgError, body)
		if err != nil {
			return fmt.Errorf("feed: from the server: %w", err)
		}
		return fmt.Errorf("feed: the server closed the feed: %s", m.(*ErrorMsg).Text)
	case MsgBye:
		c.mu.Lock()
		c.gotBye = true
		c.mu.Unlock()
	default:
		return fmt.Errorf("feed: unexpected %s message from the server", t)
	}
	return nil
}

// await returns once done is closed or ctx ends, reading the socket
// meanwhile whenever no other goroutine does: the goroutine that waits is
// the one that reads, as the plugin's thread does with a blocking recv, so
// no hand-off between goroutines delays a reply.
func (c *Client) await(ctx context.Context, done <-chan struct{}) error {
	var stop func() bool
	defer func() {
		if stop != nil {
			stop()
		}
	}()
	for {
		select {
		case <-done:
			return nil
		default:
		}
		select {
		case <-done:
			return nil
		case <-ctx.Done():
			return ctx.Err()
		case <-c.rtok:
		}
		// This goroutine reads until done is closed.
		if stop == nil && ctx.Done() != nil {
			stop = context.AfterFunc(ctx, func() {
				c.deadline.Store(1)
				_ = c.conn.SetReadDeadline(time.Unix(1, 0))
			})
		}
		for {
			select {
			case <-done:
				c.rtok <- struct{}{}
				return nil
			case <-c.dead:
				c.rtok <- struct{}{}
				<-done
				return nil
			default:
			}
			if err := c.pump(); errors.Is(err, os.ErrDeadlineExceeded) {
				c.deadline.Store(0)
				_ = c.conn.SetReadDeadline(time.Time{})
				if ctx.Err() != nil {
					c.rtok <- struct{}{}
					return ctx.Err()
				}
				// A deadline meant for an earlier reader: read on.
			}
		}
	}
}

var errClosed = errors.New("feed: client closed")

// Err returns why the feed is unusable, or nil.
func (c *Client) Err() error {
	c.mu.Lock()
	defer c.mu.Unlock()
	return c.err
}

// send writes a message built by enc with the next request id; fds travel
// with it. The call, if any, is registered before the write so that its
// DONE finds it.
func (c *Client) send(k *Call, fds []int, enc func(b []byte, id uint64) []byte) (uint64, error) {
	c.wmu.Lock()
	defer c.wmu.Unlock()
	c.nextID++
	id := c.nextID
	if k != nil {
		k.id = id
		c.mu.Lock()
		if c.err != nil {
			err := c.err
			c.mu.Unlock()
			return 0, err
		}
		c.calls[id] = k
		c.mu.Unlock()
	}
	c.wbuf = enc(c.wbuf[:0], id)
	var err error
	if len(fds) > 0 {
		_, _, err = c.conn.WriteMsgUnix(c.wbuf, unix.UnixRights(fds...), nil)
	} else {
		_, err = c.conn.Write(c.wbuf)
	}
	if err != nil {
		err = fmt.Errorf("feed: write: %w", err)
		if k != nil {
			c.mu.Lock()
			delete(c.calls, id)
			c.mu.Unlock()
		}
	}
	return id, err
}

func (c *Client) newCall(kind MsgType, onProgress func(off, n uint64)) *Call {
	k := c.callPool.Get().(*Call)
	k.kind, k.onProgress, k.err, k.done = kind, onProgress, nil, DoneMsg{}
	k.ch = make(chan struct{})
	return k
}

// Start sends a request and returns its call. The request's ID is assigned
// here; Kind, spans and the other fields are the caller's. onProgress, if
// not nil, receives the PROGRESS ranges of a streamed request, on the
// client's reader goroutine: it must not block.
func (c *Client) Start(req Request, onProgress func(off, n uint64)) (*Call, error) {
	if !req.Kind.IsRequest() {
		return nil, fmt.Errorf("feed: %s is not a request", req.Kind)
	}
	k := c.newCall(req.Kind, onProgress)
	_, err := c.send(k, nil, func(b []byte, id uint64) []byte {
		req.ID = id
		return req.Append(b)
	})
	if err != nil {
		return nil, err
	}
	return k, nil
}

// Ready tells the server that input bytes [0,end) of a streamed call are in
// the region.
func (k *Call) Ready(end int) error {
	c := k.c
	c.wmu.Lock()
	defer c.wmu.Unlock()
	m := ReadyMsg{ID: k.id, End: uint64(end)}
	c.wbuf = m.Append(c.wbuf[:0])
	if _, err := c.conn.Write(c.wbuf); err != nil {
		return fmt.Errorf("feed: write: %w", err)
	}
	return nil
}

// Wait waits for the call's DONE. A status other than OK is a
// *RequestError. If ctx ends first the request stays in flight on the
// server; Wait returns ctx's error and may be called again.
func (k *Call) Wait(ctx context.Context) (DoneMsg, error) {
	if err := k.c.await(ctx, k.ch); err != nil {
		return DoneMsg{}, err
	}
	if k.err != nil {
		return DoneMsg{}, k.err
	}
	d := k.done
	if d.Status != StatusOK {
		return d, &RequestError{Kind: k.kind, ID: k.id, Status: d.Status, Msg: d.Error}
	}
	return d, nil
}

// Finished returns a channel closed when the call's DONE was read (or the
// feed failed). The socket is read only by goroutines in Wait (and Close):
// with nobody waiting, DONE and PROGRESS messages wait in the socket.
func (k *Call) Finished() <-chan struct{} { return k.ch }

// Do sends a request and waits for its DONE.
func (c *Client) Do(ctx context.Context, req Request) (DoneMsg, error) {
	k, err := c.Start(req, nil)
	if err != nil {
		return DoneMsg{}, err
	}
	d, err := k.Wait(ctx)
	if err == nil || !errors.Is(err, ctx.Err()) {
		k.recycle()
	}
	return d, err
}

// recycle returns a finished call to the pool.
func (k *Call) recycle() {
	k.onProgress, k.ch = nil, nil
	k.c.callPool.Put(k)
}

// Map creates a shared-memory region of size bytes (a sealed memfd, mapped
// here), sends it to the server and waits until the server has mapped it.
func (c *Client) Map(ctx context.Context, size int) (*Region, error) {
	c.mu.Lock()
	c.nextRegion++
	rid := c.nextRegion
	c.mu.Unlock()
	fd, mem, err := NewMemfd(fmt.Sprintf("gpubridge-feed-%d", rid), size)
	if err != nil {
		return nil, err
	}
	reg := &Region{ID: rid, Mem: mem, fd: fd}
	k := c.newCall(MsgRegion, nil)
	_, err = c.send(k, []int{fd}, func(b []byte, id uint64) []byte {
		return (&RegionMsg{ID: id, Region: rid, Size: uint64(size)}).Append(b)
	})
	if err == nil {
		_, err = k.Wait(ctx)
	}
	// The server holds its own mapping now; the descriptor is not needed.
	_ = unix.Close(fd)
	reg.fd = -1
	if err != nil {
		_ = unix.Munmap(mem)
		return nil, err
	}
	c.mu.Lock()
	c.regions[rid] = reg
	c.mu.Unlock()
	return reg, nil
}

// Release asks the server to unmap r (once no request uses it), waits for
// it, and unmaps the client's view.
func (c *Client) Release(ctx context.Context, r *Region) error {
	k := c.newCall(MsgRelease, nil)
	_, err := c.send(k, nil, func(b []byte, id uint64) []byte {
		return (&ReleaseMsg{ID: id, Region: r.ID}).Append(b)
	})
	if err == nil {
		_, err = k.Wait(ctx)
	}
	if err != nil {
		return err
	}
	c.mu.Lock()
	delete(c.regions, r.ID)
	c.mu.Unlock()
	err = unix.Munmap(r.Mem)
	r.Mem = nil
	return err
}

// Close says BYE, waits (within ctx) for the server's BYE, which comes once
// every request in flight is DONE, and closes the feed and the client's
// mappings.
func (c *Client) Close(ctx context.Context) error {
	_, err := c.send(nil, nil, func(b []byte, _ uint64) []byte { return (&ByeMsg{}).Append(b) })
	if err == nil {
		_ = c.conn.CloseWrite()
		if werr := c.await(ctx, c.dead); werr != nil {
			err = fmt.Errorf("feed: waiting for the server's bye: %w", werr)
		}
	}
	c.fail(errClosed)
	_ = c.conn.CloseRead()
	_ = c.conn.Close()
	c.unmapAll()
	if err != nil {
		return err
	}
	c.mu.Lock()
	defer c.mu.Unlock()
	if !c.gotBye {
		if c.err != nil && c.err != errClosed {
			return c.err
		}
		return errors.New("feed: the server closed the feed without bye")
	}
	return nil
}

// Abort closes the feed at once, without BYE, as a crashing client would.
// Calls in flight fail.
func (c *Client) Abort() {
	c.fail(errClosed)
	_ = c.conn.CloseRead() // wakes a goroutine blocked in poll(2) or the poller
	_ = c.conn.Close()
	// Wait for a goroutine that is reading to let go of the buffers.
	<-c.rtok
	c.rtok <- struct{}{}
	c.unmapAll()
}

// WaitOptions say how the goroutine that waits for a reply waits.
type WaitOptions struct {
	// Kernel makes it block in poll(2) on the socket, so that the kernel
	// wakes its thread directly when a reply comes, as a Python client's
	// blocking recv does, instead of parking in Go's network poller (where
	// a reply may wait for a thread of the Go scheduler to notice it).
	// Best for a process whose only work is this client.
	Kernel bool
	// Spin polls the socket without blocking for up to this long before
	// waiting. It saves a wake-up when replies come quickly and costs a
	// core meanwhile. Without Kernel, other goroutines of the process that
	// wait for network events may be noticed late while it spins.
	Spin time.Duration
}

// SetWait sets how the client waits for replies (the default: parked in the
// Go network poller, no spinning).
func (c *Client) SetWait(w WaitOptions) {
	<-c.rtok
	c.wait = w
	c.rtok <- struct{}{}
}

// recvKernel reads the socket, blocking the thread in poll(2) until it is
// readable (after spinning for up to wait.Spin). A Wait's context ends the
// wait through the deadline it stores.
func (c *Client) recvKernel(p []byte) (n int, err error) {
	var until time.Time
	cerr := c.raw.Control(func(fd uintptr) {
		pfd := []unix.PollFd{{Fd: int32(fd), Events: unix.POLLIN}}
		for {
			n, _, _, err = recvmsg(int(fd), p, nil)
			if err != unix.EAGAIN {
				return
			}
			now := time.Now()
			if dl := c.deadline.Load(); dl != 0 && now.UnixNano() >= dl {
				err = os.ErrDeadlineExceeded
				return
			}
			if c.wait.Spin > 0 {
				if until.IsZero() {
					until = now.Add(c.wait.Spin)
				}
				if now.Before(until) {
					continue
				}
			}
			// Block in the kernel; wake now and then to see whether the
			// client was closed or the context ended.
			if _, perr := unix.Poll(pfd, 50); perr != nil && perr != unix.EINTR {
				err = perr
				return
			}
			if c.Err() != nil {
				err = net.ErrClosed
				return
			}
		}
	})
	if cerr != nil {
		return 0, cerr
	}
	if err == nil && n == 0 && len(p) > 0 {
		return 0, io.EOF
	}
	if err != nil && err != os.ErrDeadlineExceeded && err != net.ErrClosed {
		err = os.NewSyscallError("recvmsg", err)
	}
	return n, err
}

func (c *Client) unmapAll() {
	c.mu.Lock()
	defer c.mu.Unlock()
	for id, r := range c.regions {
		_ = unix.Munmap(r.Mem)
		r.Mem = nil
		delete(c.regions, id)
	}
}

// ---- convenience ----

func (c *Client) do(ctx context.Context, r Request) (DoneMsg, error) {
	if r.Peer == 0 && r.Kind != MsgBroadcast && r.Kind != MsgSend && r.Kind != MsgRecv {
		r.Peer = -1
	}
	return c.Do(ctx, r)
}

// AllReduce reduces buf in place across the bridge members.
func (c *Client) AllReduce(ctx context.Context, buf Span, dt reduce.DType, op reduce.Op) error {
	_, err := c.do(ctx, Request{Kind: MsgAllReduce, Buf: buf, DType: dt, Op: op})
	return err
}

// Broadcast copies root's buf into every member's buf.
func (c *Client) Broadcast(ctx context.Context, buf Span, root int) error {
	_, err := c.do(ctx, Request{Kind: MsgBroadcast, Buf: buf, Peer: int32(root)})
	return err
}

// AllGather concatenates every member's in into out, in member order.
func (c *Client) AllGather(ctx context.Context, out, in Span) error {
	_, err := c.do(ctx, Request{Kind: MsgAllGather, Buf: in, Out: out})
	return err
}

// ReduceScatter reduces in across members and leaves this member's share in
// out.
func (c *Client) ReduceScatter(ctx context.Context, out, in Span, dt reduce.DType, op reduce.Op) error {
	_, err := c.do(ctx, Request{Kind: MsgReduceScatter, Buf: in, Out: out, DType: dt, Op: op})
	return err
}

// Barrier returns once every member has entered the barrier.
func (c *Client) Barrier(ctx context.Context) error {
	_, err := c.do(ctx, Request{Kind: MsgBarrier})
	return err
}

// Send sends buf to member peer with tag.
func (c *Client) Send(ctx context.Context, peer int, tag uint32, buf Span) error {
	_, err := c.do(ctx, Request{Kind: MsgSend, Buf: buf, Peer: int32(peer), Tag: tag})
	return err
}

// Recv receives the next message from member peer with tag into buf and
// returns its length.
func (c *Client) Recv(ctx context.Context, peer int, tag uint32, buf Span) (int, error) {
	d, err := c.do(ctx, Request{Kind: MsgRecv, Buf: buf, Peer: int32(peer), Tag: tag})
	return int(d.Bytes), err
}
