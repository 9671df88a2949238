package feedtest

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

	"github.com/gpubridge/gpubridge/lib/feed"
	"github.com/gpubridge/gpubridge/lib/reduce"
	"golang.org/x/sys/unix"
)

// Client is the reference implementation of the feed's client side: what
// the torch plugin does in Python, in Go, for tests, selftest and bench. It
// is safe for concurrent use. Its Broadcast, AllGather, ReduceScatter,
// Barrier, Send and Recv are OnBridge's on bridge 0.
type Client struct {
	OnBridge // the requests on bridge 0

	conn    *net.UnixConn
	welcome feed.WelcomeMsg

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
	rdone  feed.DoneMsg
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
}

// Span returns the bytes [off, off+n) of r as a request span.
func (r *Region) Span(off, n int) feed.Span {
	return feed.Span{Region: r.ID, Off: uint64(off), Len: uint64(n)}
}

// All returns the whole region as a span.
func (r *Region) All() feed.Span { return r.Span(0, len(r.Mem)) }

// RequestError is a request that finished with a status other than OK.
type RequestError struct {
	Kind   feed.MsgType
	ID     uint64
	Status feed.Status
	Msg    string
}

func (e *RequestError) Error() string {
	return fmt.Sprintf("feed: %s %d: %s: %s", e.Kind, e.ID, e.Status, e.Msg)
}

// Call is a request in flight.
type Call struct {
	c          *Client
	kind       feed.MsgType
	id         uint64
	onProgress func(off, n uint64)
	ch         chan struct{}
	done       feed.DoneMsg
	err        error
}

// ID is the request id the client gave the call.
func (k *Call) ID() uint64 { return k.id }

// Dial connects to the feed socket at path and says HELLO. ctx bounds the
// connection and the handshake.
func Dial(ctx context.Context, path string) (*Client, error) {
	return DialVersion(ctx, path, feed.Version)
}

// DialVersion is Dial for a client that speaks feed protocol versions up
// to max only (tests of older clients).
func DialVersion(ctx context.Context, path string, max uint16) (*Client, error) {
	if _, ok := ctx.Deadline(); !ok {
		var cancel context.CancelFunc
		ctx, cancel = context.WithTimeout(ctx, feed.HandshakeTimeout)
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
		rtok: make(chan struct{}, 1), rbuf: make([]byte, 2*feed.MaxMessage),
	}
	c.OnBridge = OnBridge{c: c}
	c.rtok <- struct{}{}
	c.raw, _ = conn.SyscallConn()
	c.callPool.New = func() any { return &Call{c: c} }
	if err := c.handshake(ctx, max); err != nil {
		_ = conn.Close()
		return nil, err
	}
	return c, nil
}

func (c *Client) handshake(ctx context.Context, max uint16) error {
	dl, _ := ctx.Deadline()
	_ = c.conn.SetDeadline(dl)
	stop := context.AfterFunc(ctx, func() { _ = c.conn.SetDeadline(time.Unix(1, 0)) })
	defer stop()
	hello := feed.HelloMsg{MinVersion: feed.MinVersion, MaxVersion: max, PID: uint32(os.Getpid()), Name: "gpubridge/lib/feed"}
	if _, err := c.conn.Write(hello.Append(nil)); err != nil {
		return fmt.Errorf("feed: send hello: %w", err)
	}
	buf := make([]byte, feed.MaxMessage)
	if _, err := io.ReadFull(c.conn, buf[:feed.HeaderSize]); err != nil {
		return fmt.Errorf("feed: read welcome: %w", err)
	}
	h, err := feed.ParseHeader(buf, feed.MaxMessage)
	if err != nil {
		return fmt.Errorf("feed: welcome: %w", err)
	}
	if _, err := io.ReadFull(c.conn, buf[feed.HeaderSize:h.Size]); err != nil {
		return fmt.Errorf("feed: read welcome: %w", err)
	}
	m, err := feed.DecodeBody(h.Type, buf[feed.HeaderSize:h.Size])
	if err != nil {
		return fmt.Errorf("feed: welcome: %w", err)
	}
	switch m := m.(type) {
	case *feed.WelcomeMsg:
		if m.Version < feed.MinVersion || m.Version > max {
			return fmt.Errorf("feed: server chose protocol version %d, outside %d..%d", m.Version, feed.MinVersion, max)
		}
		c.welcome = *m
	case *feed.ErrorMsg:
		return fmt.Errorf("feed: server refused the feed: %s", m.Text)
	default:
		return fmt.Errorf("feed: server answered hello with %s", m.Type())
	}
	_ = c.conn.SetDeadline(time.Time{})
	return nil
}

// Welcome returns the server's WELCOME: protocol version, member index and
// count, limits, transport.
func (c *Client) Welcome() feed.WelcomeMsg { return c.welcome }

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

func (c *Client) newCall(kind feed.MsgType, onProgress func(off, n uint64)) *Call {
	k := c.callPool.Get().(*Call)
	k.kind, k.onProgress, k.err, k.done = kind, onProgress, nil, feed.DoneMsg{}
	k.ch = make(chan struct{})
	return k
}

// Start sends a request and returns its call. The request's ID is assigned
// here; Kind, spans and the other fields are the caller's. onProgress, if
// not nil, receives the PROGRESS ranges of a streamed request, on the
// client's reader goroutine: it must not block.
func (c *Client) Start(req feed.Request, onProgress func(off, n uint64)) (*Call, error) {
	if !req.Kind.IsRequest() {
		return nil, fmt.Errorf("feed: %s is not a request", req.Kind)
	}
	return c.start(req.Kind, onProgress, nil, func(b []byte, id uint64) []byte {
		req.ID = id
		return req.Append(b)
	})
}

// StartMsg sends the message enc builds with the next request id, with
// fds, and returns the call its DONE finishes: for tests that send what a
// good client would not (any descriptor as a REGION, a malformed request).
func (c *Client) StartMsg(kind feed.MsgType, fds []int, enc func(b []byte, id uint64) []byte) (*Call, error) {
	return c.start(kind, nil, fds, enc)
}

func (c *Client) start(kind feed.MsgType, onProgress func(off, n uint64), fds []int, enc func(b []byte, id uint64) []byte) (*Call, error) {
	k := c.newCall(kind, onProgress)
	if _, err := c.send(k, fds, enc); err != nil {
		return nil, err
	}
	return k, nil
}

// roundTrip sends a message as StartMsg does and waits for its DONE.
func (c *Client) roundTrip(ctx context.Context, kind feed.MsgType, fds []int, enc func(b []byte, id uint64) []byte) error {
	k, err := c.StartMsg(kind, fds, enc)
	if err == nil {
		_, err = k.Wait(ctx)
	}
	return err
}

// Ready tells the server that input bytes [0,end) of a streamed call are in
// the region.
func (k *Call) Ready(end int) error {
	c := k.c
	c.wmu.Lock()
	defer c.wmu.Unlock()
	m := feed.ReadyMsg{ID: k.id, End: uint64(end)}
	c.wbuf = m.Append(c.wbuf[:0])
	if _, err := c.conn.Write(c.wbuf); err != nil {
		return fmt.Errorf("feed: write: %w", err)
	}
	return nil
}

// Wait waits for the call's DONE. A status other than OK is a
// *RequestError. If ctx ends first the request stays in flight on the
// server; Wait returns ctx's error and may be called again.
func (k *Call) Wait(ctx context.Context) (feed.DoneMsg, error) {
	if err := k.c.await(ctx, k.ch); err != nil {
		return feed.DoneMsg{}, err
	}
	if k.err != nil {
		return feed.DoneMsg{}, k.err
	}
	d := k.done
	if d.Status != feed.StatusOK {
		return d, &RequestError{Kind: k.kind, ID: k.id, Status: d.Status, Msg: d.Error}
	}
	return d, nil
}

// Finished returns a channel closed when the call's DONE was read (or the
// feed failed). The socket is read only by goroutines in Wait (and Close):
// with nobody waiting, DONE and PROGRESS messages wait in the socket.
func (k *Call) Finished() <-chan struct{} { return k.ch }

// Do sends a request and waits for its DONE.
func (c *Client) Do(ctx context.Context, req feed.Request) (feed.DoneMsg, error) {
	k, err := c.Start(req, nil)
	if err != nil {
		return feed.DoneMsg{}, err
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
	reg := &Region{ID: rid, Mem: mem}
	err = c.roundTrip(ctx, feed.MsgRegion, []int{fd}, func(b []byte, id uint64) []byte {
		return (&feed.RegionMsg{ID: id, Region: rid, Size: uint64(size)}).Append(b)
	})
	// The server holds its own mapping now; the descriptor is not needed.
	_ = unix.Close(fd)
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
	err := c.roundTrip(ctx, feed.MsgRelease, nil, func(b []byte, id uint64) []byte {
		return (&feed.ReleaseMsg{ID: id, Region: r.ID}).Append(b)
	})
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
	_, err := c.send(nil, nil, func(b []byte, _ uint64) []byte { return (&feed.ByeMsg{}).Append(b) })
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

func (c *Client) do(ctx context.Context, r feed.Request) (feed.DoneMsg, error) {
	if r.Peer == 0 && r.Kind != feed.MsgBroadcast && r.Kind != feed.MsgSend && r.Kind != feed.MsgRecv {
		r.Peer = -1
	}
	return c.Do(ctx, r)
}

// AllReduce reduces buf in place across the bridge members.
func (c *Client) AllReduce(ctx context.Context, buf feed.Span, dt reduce.DType, op reduce.Op) error {
	_, err := c.OnBridge.AllReduce(ctx, buf, dt, op)
	return err
}

// AllReduceCodec is AllReduce with the bridged transfers packed by codec (a
// lib/codec id, feed protocol 3: docs/FEED.md §3a) and, with key, the
// buffer's error-feedback key (FEEDBACK_KEY; lossy codecs). A session of
// an older version refuses it here, as the plugin does, before sending.
func (c *Client) AllReduceCodec(ctx context.Context, buf feed.Span, dt reduce.DType, op reduce.Op, codec uint8, key *uint64) (feed.DoneMsg, error) {
	r := feed.Request{Kind: feed.MsgAllReduce, Buf: buf, DType: dt, Op: op, Codec: codec}
	if key != nil {
		r.FeedbackKey, r.HasFeedbackKey = *key, true
	}
	if v := c.welcome.Version; v < feed.CodecVersion && (codec != feed.CodecRaw || key != nil) {
		return feed.DoneMsg{}, fmt.Errorf("feed: codec %d and feedback keys need feed protocol %d; the server chose %d", codec, feed.CodecVersion, v)
	}
	return c.do(ctx, r)
}

// ---- more bridges (feed protocol 4) ----

// Join asks the server to join bridge id, name, of the given global ranks
// in member order, and waits until it is set up (docs/FEED.md §3b).
func (c *Client) Join(ctx context.Context, id uint32, name string, ranks []uint32) error {
	return c.roundTrip(ctx, feed.MsgJoin, nil, func(b []byte, rid uint64) []byte {
		return (&feed.JoinMsg{ID: rid, Bridge: id, Name: name, Members: ranks}).Append(b)
	})
}

// OnBridge is the client's requests on one bridge: bridge 0 (the Client's
// own, embedded; no BRIDGE extension) or a joined one (On; each request
// carries the BRIDGE extension with its id).
type OnBridge struct {
	c      *Client
	id     uint32
	joined bool
}

// On returns the client's requests on bridge id (a joined one; 0 names
// bridge 0, with the extension).
func (c *Client) On(id uint32) *OnBridge { return &OnBridge{c: c, id: id, joined: true} }

func (b *OnBridge) do(ctx context.Context, r feed.Request) (feed.DoneMsg, error) {
	if b.joined {
		r.Bridge, r.HasBridge = b.id, true
	}
	return b.c.do(ctx, r)
}

// Do sends a request on the bridge and waits for its DONE.
func (b *OnBridge) Do(ctx context.Context, r feed.Request) (feed.DoneMsg, error) {
	if b.joined {
		r.Bridge, r.HasBridge = b.id, true
	}
	return b.c.Do(ctx, r)
}

// AllReduce is Client.AllReduce on the bridge, with its DONE.
func (b *OnBridge) AllReduce(ctx context.Context, buf feed.Span, dt reduce.DType, op reduce.Op) (feed.DoneMsg, error) {
	return b.do(ctx, feed.Request{Kind: feed.MsgAllReduce, Buf: buf, DType: dt, Op: op})
}

// Broadcast copies root's buf into every member's buf.
func (b *OnBridge) Broadcast(ctx context.Context, buf feed.Span, root int) error {
	_, err := b.do(ctx, feed.Request{Kind: feed.MsgBroadcast, Buf: buf, Peer: int32(root)})
	return err
}

// AllGather concatenates every member's in into out, in member order.
func (b *OnBridge) AllGather(ctx context.Context, out, in feed.Span) error {
	_, err := b.do(ctx, feed.Request{Kind: feed.MsgAllGather, Buf: in, Out: out})
	return err
}

// ReduceScatter reduces in across members and leaves this member's share in
// out.
func (b *OnBridge) ReduceScatter(ctx context.Context, out, in feed.Span, dt reduce.DType, op reduce.Op) error {
	_, err := b.do(ctx, feed.Request{Kind: feed.MsgReduceScatter, Buf: in, Out: out, DType: dt, Op: op})
	return err
}

// Barrier returns once every member has entered the barrier.
func (b *OnBridge) Barrier(ctx context.Context) error {
	_, err := b.do(ctx, feed.Request{Kind: feed.MsgBarrier})
	return err
}

// Send sends buf to member peer (a member index of the bridge) with tag.
func (b *OnBridge) Send(ctx context.Context, peer int, tag uint32, buf feed.Span) error {
	_, err := b.do(ctx, feed.Request{Kind: feed.MsgSend, Buf: buf, Peer: int32(peer), Tag: tag})
	return err
}

// Recv receives the next message from member peer with tag into buf and
// returns its length.
func (b *OnBridge) Recv(ctx context.Context, peer int, tag uint32, buf feed.Span) (int, error) {
	d, err := b.do(ctx, feed.Request{Kind: feed.MsgRecv, Buf: buf, Peer: int32(peer), Tag: tag})
	return int(d.Bytes), err
}
