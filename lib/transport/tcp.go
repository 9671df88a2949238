package transport

import (
	"bufio"
	"context"
	"errors"
	"fmt"
	"hash/crc32"
	"io"
	"log/slog"
	"net"
	"os"
	"sync"
	"sync/atomic"
	"syscall"
	"time"

	"github.com/gpubridge/gpubridge/lib/wire"
	"golang.org/x/sys/unix"
)

// Socket settings of bridge connections.
const (
	// sockBuf is SO_SNDBUF and SO_RCVBUF of every bridge connection (set
	// with the FORCE variants as root, so rmem_max does not cap them).
	sockBuf = 4 << 20
	// readBuf is the receive buffer in front of each connection: frame
	// headers and small frames are read in one system call; large
	// payloads bypass it.
	readBuf = 64 << 10
	// closeGrace bounds the KindClose frames Close sends.
	closeGrace = 100 * time.Millisecond
	// crcPiece is how much of a payload Recv reads before checksumming it.
	crcPiece = 512 << 10
)

// tcpPiece is the piece of RecvPieces and SendProgress: small enough to
// stay in a core's L2 cache (1 MiB on AMD Zen 4, 2 MiB on Intel Sapphire
// Rapids) between the kernel's copy and the consumer's pass over it, large
// enough that a system call costs little next to the copy (Recv reads
// pieces of this size too, crcPiece). A variable for the tests.
var tcpPiece = 512 << 10

type tcpMesh struct {
	meshBase[*tcpStream]
	log *slog.Logger

	closed    atomic.Bool
	aborting  atomic.Bool
	closeOnce sync.Once
	done      chan struct{} // closed by Close
}

type tcpStream struct {
	m         *tcpMesh
	peer, idx int
	conn      *net.TCPConn

	// send side, serialized by smu (Abort and Close take it too)
	smu     sync.Mutex
	wg      guard
	whdr    [wire.HeaderSize]byte
	vec     [2][]byte
	bufs    net.Buffers
	sbroken error
	corrupt atomic.Bool // test hook: flip a payload byte of the next frame on the wire

	// receive side, used by one receiver at a time
	rg      guard
	br      *bufio.Reader
	buf     []byte
	rbroken error
	// held holds the free RecvHold buffers (MaxHeld of them, grown on
	// demand); a held frame's buffer returns here on release.
	held   chan []byte
	piece  []byte     // RecvPieces' buffer
	pieces *piecePool // RecvPiecesHold's buffers
}

// newTCPMesh takes ownership of conns[peer][stream] (nil for self).
// procs[i] names member i's process ("gbbridge serve of rank 2 (pid 1234
// on host-b)").
func newTCPMesh(self, streams, p2p int, crc bool, desc string, peers, procs []string, conns [][]*net.TCPConn, log *slog.Logger) *tcpMesh {
	m := &tcpMesh{meshBase: meshBase[*tcpStream]{self: self, size: len(conns), streams: streams, p2p: p2p, crc: crc, desc: desc, peers: peers, procs: procs},
		log: log, done: make(chan struct{})}
	m.links = make([][]*tcpStream, len(conns))
	for p, cs := range conns {
		if p == self {
			continue
		}
		m.links[p] = make([]*tcpStream, len(cs))
		for i, c := range cs {
			s := &tcpStream{m: m, peer: p, idx: i, conn: c, br: bufio.NewReaderSize(c, readBuf), held: make(chan []byte, MaxHeld), pieces: newPiecePool()}
			for range MaxHeld {
				s.held <- nil
			}
			s.wg.set = c.SetWriteDeadline
			s.rg.set = c.SetReadDeadline
			m.links[p][i] = s
		}
	}
	return m
}

// Abort sends a KindAbort frame with err's text on every stream whose
// sender is free within abortGrace (in-flight sends get that long to
// finish), then closes the mesh.
func (m *tcpMesh) Abort(err error) {
	if m.closed.Load() {
		return
	}
	m.aborting.Store(true)
	msg := abortMessage(err)
	until := time.Now().Add(abortGrace)
	m.each(func(s *tcpStream) { s.wg.setLimit(until) })
	var wg sync.WaitGroup
	m.each(func(s *tcpStream) {
		wg.Add(1)
		go func() {
			defer wg.Done()
			if !lockUntil(&s.smu, until) {
				return
			}
			defer s.smu.Unlock()
			if s.sbroken == nil {
				s.wg.detach(until)
				_ = s.writeFrame(wire.Header{Kind: wire.KindAbort}, msg)
			}
		}()
	})
	wg.Wait()
	m.log.Debug("bridge aborted", "err", err)
	_ = m.Close()
}

// Close sends KindClose on every idle stream (bounded by closeGrace), then
// closes every connection. Blocked calls return ErrClosed.
func (m *tcpMesh) Close() error {
	m.closeOnce.Do(func() {
		m.closed.Store(true)
		close(m.done)
		until := time.Now().Add(closeGrace)
		m.each(func(s *tcpStream) {
			if s.smu.TryLock() {
				if s.sbroken == nil {
					s.wg.detach(until)
					_ = s.writeFrame(wire.Header{Kind: wire.KindClose}, nil)
				}
				s.smu.Unlock()
			}
		})
		m.each(func(s *tcpStream) {
			_ = s.conn.Close()
			s.wg.release()
			s.rg.release()
		})
	})
	return nil
}

// writeFrame writes one frame with a single writev. Callers hold smu.
func (s *tcpStream) writeFrame(hdr wire.Header, payload []byte) error {
	return s.writeFramePieces(hdr, payload, nil)
}

// writeFramePieces writes one frame: with progress, the payload in pieces
// of tcpPiece bytes (the header with the first), calling progress with the
// bytes out after each; else with a single writev. Callers hold smu.
func (s *tcpStream) writeFramePieces(hdr wire.Header, payload []byte, progress func(int)) error {
	hdr.Seal(payload, s.m.crc)
	if s.corrupt.Load() && len(payload) > 0 {
		s.corrupt.Store(false)
		payload = append([]byte(nil), payload...)
		payload[len(payload)/2] ^= 0x40
	}
	hdr.Put(s.whdr[:])
	first := len(payload)
	if progress != nil {
		first = min(first, tcpPiece)
	}
	s.vec[0], s.vec[1] = s.whdr[:], payload[:first]
	s.bufs = s.vec[:]
	n, err := s.bufs.WriteTo(s.conn)
	s.vec[1] = nil
	for off := first; err == nil && off < len(payload); off += tcpPiece {
		progress(off)
		var k int
		k, err = s.conn.Write(payload[off:min(off+tcpPiece, len(payload))])
		n += int64(k)
	}
	if err != nil && n > 0 {
		// A partial frame is on the wire: the stream is out of step.
		s.sbroken = err
	}
	if err == nil && progress != nil {
		progress(len(payload))
	}
	return err
}

func (s *tcpStream) Send(ctx context.Context, hdr wire.Header, payload []byte) error {
	return s.SendProgress(ctx, hdr, payload, nil)
}

// SendProgress implements ProgressSender: with progress, a large payload
// is written in pieces, and progress hears after each how much is out.
func (s *tcpStream) SendProgress(ctx context.Context, hdr wire.Header, payload []byte, progress func(n int)) error {
	if len(payload) > wire.MaxPayload {
		return fmt.Errorf("send to %s: payload of %d bytes is over the %d-byte frame limit", s.m.Peer(s.peer), len(payload), wire.MaxPayload)
	}
	s.smu.Lock()
	defer s.smu.Unlock()
	if s.sbroken != nil {
		return s.sbroken
	}
	if s.m.closed.Load() || s.m.aborting.Load() {
		return fmt.Errorf("send to %s: %w", s.m.Peer(s.peer), ErrClosed)
	}
	if err := s.wg.arm(ctx); err != nil {
		return fmt.Errorf("send to %s on stream %d: %w", s.m.Peer(s.peer), s.idx, err)
	}
	if err := s.writeFramePieces(hdr, payload, progress); err != nil {
		e := s.m.ioErr(ctx, "send to", s, err)
		if s.sbroken != nil {
			// Part of the frame is on the wire.
			s.sbroken = e
			var pe *PeerError
			if !errors.As(e, &pe) {
				s.sbroken = fmt.Errorf("send to %s on stream %d: stream out of step after a frame was interrupted: %w", s.m.Peer(s.peer), s.idx, err)
			}
		}
		return e
	}
	return nil
}

func (s *tcpStream) Recv(ctx context.Context, fn func(wire.Header, []byte) error) error {
	h, p, err := s.read(ctx, &s.buf)
	if err != nil {
		return err
	}
	return fn(h, p)
}

// RecvHold implements Holder: the frame is read into one of MaxHeld
// buffers of the stream, which returns to the stream on release.
func (s *tcpStream) RecvHold(ctx context.Context) (wire.Header, []byte, func(), error) {
	b, err := takeHeld(ctx, s.held, s.m.done, s.m.Peer(s.peer), s.idx)
	if err != nil {
		return wire.Header{}, nil, nil, err
	}
	h, p, err := s.read(ctx, &b)
	if err != nil {
		s.held <- b
		return wire.Header{}, nil, nil, err
	}
	var once atomic.Bool
	return h, p, func() {
		if once.CompareAndSwap(false, true) {
			s.held <- b
		}
	}, nil
}

// PieceSize implements PieceReceiver: pieces of tcpPiece bytes, none when
// the mesh checks CRCs.
func (s *tcpStream) PieceSize() int {
	if s.m.crc {
		return 0
	}
	return tcpPiece
}

// RecvPieces implements PieceReceiver: the payload is read piece by piece
// into one buffer of the stream and handed to fn as it comes.
func (s *tcpStream) RecvPieces(ctx context.Context, check func(wire.Header) error, fn func(off int, p []byte) error) error {
	return s.recvPieces(ctx, check, false, func(off int, p []byte, _ func()) error { return fn(off, p) })
}

// RecvPiecesHold implements PieceHolder: each piece is read into a buffer
// of the stream's piecePool, which returns there on release.
func (s *tcpStream) RecvPiecesHold(ctx context.Context, check func(wire.Header) error, fn func(off int, p []byte, release func()) error) error {
	return s.recvPieces(ctx, check, true, fn)
}

// RecvInto implements IntoReceiver: the payload is read off the socket
// straight into dst (bufio hands reads of its size and more to the
// connection).
func (s *tcpStream) RecvInto(ctx context.Context, check func(wire.Header) error, dst []byte) error {
	h, p, whole, err := s.frameStart(ctx, check)
	if err != nil {
		return err
	}
	if whole {
		if len(p) != len(dst) {
			return fmt.Errorf("receive from %s on stream %d: a payload of %d bytes, want %d", s.m.Peer(s.peer), s.idx, len(p), len(dst))
		}
		copy(dst, p)
		return nil
	}
	if int(h.Len) != len(dst) {
		s.rbroken = fmt.Errorf("receive from %s on stream %d: stream out of step after a frame of %d bytes where %d were expected", s.m.Peer(s.peer), s.idx, h.Len, len(dst))
		return s.rbroken
	}
	if _, err := io.ReadFull(s.br, dst); err != nil {
		return s.brokenRead(ctx, err)
	}
	return nil
}

// frameStart reads the next frame's header for RecvPieces and RecvInto
// and has check see it. Rare (or checked) frames, an abort, a close or one
// with a CRC, are read whole first and returned with whole set (a check
// refusing one leaves the stream in step); for the rest the payload is
// still in the socket, and a check refusing it leaves the stream out of
// step.
func (s *tcpStream) frameStart(ctx context.Context, check func(wire.Header) error) (h wire.Header, p []byte, whole bool, err error) {
	if h, err = s.header(ctx); err != nil {
		return h, nil, false, err
	}
	if h.Kind == wire.KindAbort || h.Kind == wire.KindClose || h.Flags&wire.FlagCRC != 0 {
		if _, p, err = s.payload(ctx, h, &s.buf); err != nil {
			return h, nil, false, err
		}
		if err := check(h); err != nil {
			return h, nil, false, err
		}
		return h, p, true, nil
	}
	if err := check(h); err != nil {
		s.rbroken = fmt.Errorf("receive from %s on stream %d: stream out of step after a refused frame: %w", s.m.Peer(s.peer), s.idx, err)
		return h, nil, false, err
	}
	return h, nil, false, nil
}

// noRelease is the release of a piece that is not held.
func noRelease() {}

// recvPieces is RecvPieces (hold false: one buffer, release does nothing)
// and RecvPiecesHold (hold: a buffer of the pool per piece).
func (s *tcpStream) recvPieces(ctx context.Context, check func(wire.Header) error, hold bool, fn func(off int, p []byte, release func()) error) error {
	h, p, whole, err := s.frameStart(ctx, check)
	if err != nil {
		return err
	}
	if whole {
		for off := 0; off < len(p); off += tcpPiece {
			q, release := p[off:min(off+tcpPiece, len(p))], noRelease
			if hold {
				// A held piece outlives the call: copy it out of the
				// frame's buffer, which the next frame reuses. (The
				// frame is wholly read: the stream stays in step.)
				b, r, err := s.pieces.take(ctx, tcpPiece, s.m.done, s.m.Peer(s.peer), s.idx)
				if err != nil {
					return err
				}
				q, release = b[:copy(b, q)], r
			}
			if err := fn(off, q, release); err != nil {
				return err
			}
		}
		return nil
	}
	if !hold && len(s.piece) < tcpPiece {
		s.piece = make([]byte, tcpPiece)
	}
	n := int(h.Len)
	for off := 0; off < n; off += tcpPiece {
		b, release := s.piece, noRelease
		if hold {
			if b, release, err = s.pieces.take(ctx, tcpPiece, s.m.done, s.m.Peer(s.peer), s.idx); err != nil {
				s.rbroken = fmt.Errorf("receive from %s on stream %d: stream out of step after a frame was given up: %w", s.m.Peer(s.peer), s.idx, err)
				return err
			}
		}
		p := b[:min(tcpPiece, n-off)]
		if _, err := io.ReadFull(s.br, p); err != nil {
			release()
			return s.brokenRead(ctx, err)
		}
		if err := fn(off, p, release); err != nil {
			s.rbroken = fmt.Errorf("receive from %s on stream %d: stream out of step after a frame was given up: %w", s.m.Peer(s.peer), s.idx, err)
			return err
		}
	}
	return nil
}

// brokenRead is the error of a read that failed inside a frame: the stream
// is out of step.
func (s *tcpStream) brokenRead(ctx context.Context, err error) error {
	e := s.m.ioErr(ctx, "receive from", s, err)
	s.rbroken = e
	var pe *PeerError
	if !errors.As(e, &pe) {
		s.rbroken = fmt.Errorf("receive from %s on stream %d: stream out of step after a frame was interrupted: %w", s.m.Peer(s.peer), s.idx, err)
	}
	return e
}

// header reads and consumes the next frame's header.
func (s *tcpStream) header(ctx context.Context) (wire.Header, error) {
	if s.rbroken != nil {
		return wire.Header{}, s.rbroken
	}
	if s.m.closed.Load() {
		return wire.Header{}, fmt.Errorf("receive from %s: %w", s.m.Peer(s.peer), ErrClosed)
	}
	if err := s.rg.arm(ctx); err != nil {
		return wire.Header{}, fmt.Errorf("receive from %s on stream %d: %w", s.m.Peer(s.peer), s.idx, err)
	}
	// Peek consumes nothing until the whole header is there: a Recv that
	// times out or is cancelled while waiting for a frame leaves the stream
	// in step.
	b, err := s.br.Peek(wire.HeaderSize)
	if err != nil {
		e := s.m.ioErr(ctx, "receive from", s, err)
		if !errors.Is(err, os.ErrDeadlineExceeded) {
			s.rbroken = e
		}
		return wire.Header{}, e
	}
	h, err := wire.Parse(b)
	if err != nil {
		s.rbroken = &PeerError{Peer: s.m.Peer(s.peer), Err: fmt.Errorf("stream %d: %w", s.idx, err)}
		return wire.Header{}, s.rbroken
	}
	_, _ = s.br.Discard(wire.HeaderSize)
	return h, nil
}

// read reads the next frame into *buf (grown as needed) and checks it.
func (s *tcpStream) read(ctx context.Context, buf *[]byte) (wire.Header, []byte, error) {
	h, err := s.header(ctx)
	if err != nil {
		return wire.Header{}, nil, err
	}
	return s.payload(ctx, h, buf)
}

// payload reads the payload of the frame whose header h was read into
// *buf and checks it.
func (s *tcpStream) payload(ctx context.Context, h wire.Header, buf *[]byte) (wire.Header, []byte, error) {
	if int(h.Len) > cap(*buf) {
		*buf = make([]byte, min(max(int(h.Len), 2*cap(*buf)), wire.MaxPayload))
	}
	p := (*buf)[:h.Len]
	// Read in pieces and checksum each while it is still in cache.
	check := h.Flags&wire.FlagCRC != 0
	var sum uint32
	for off := 0; off < len(p); {
		end := min(off+crcPiece, len(p))
		if _, err := io.ReadFull(s.br, p[off:end]); err != nil {
			return wire.Header{}, nil, s.brokenRead(ctx, err)
		}
		if check {
			sum = crc32.Update(sum, castagnoli, p[off:end])
		}
		off = end
	}
	if check && sum != h.CRC {
		return wire.Header{}, nil, &PeerError{Peer: s.m.Peer(s.peer), Err: fmt.Errorf("stream %d: %w", s.idx, &wire.CorruptError{Header: h, Got: sum})}
	}
	switch h.Kind {
	case wire.KindAbort:
		s.rbroken = &PeerError{Peer: s.m.Peer(s.peer), Err: fmt.Errorf("failed: %s", abortText(p))}
		return wire.Header{}, nil, s.rbroken
	case wire.KindClose:
		s.rbroken = &PeerError{Peer: s.m.Peer(s.peer), Err: ErrPeerClosed}
		return wire.Header{}, nil, s.rbroken
	}
	return h, p, nil
}

// ioErr turns an I/O error on s into the error the caller sees.
func (m *tcpMesh) ioErr(ctx context.Context, op string, s *tcpStream, err error) error {
	peer := m.Peer(s.peer)
	if m.closed.Load() || m.aborting.Load() {
		return fmt.Errorf("%s %s: %w", op, peer, ErrClosed)
	}
	if cerr := ctx.Err(); cerr != nil {
		return fmt.Errorf("%s %s on stream %d: %w", op, peer, s.idx, cerr)
	}
	if errors.Is(err, os.ErrDeadlineExceeded) {
		if dl, ok := ctx.Deadline(); ok && !time.Now().Before(dl.Add(-time.Millisecond)) {
			return fmt.Errorf("%s %s on stream %d: %w", op, peer, s.idx, context.DeadlineExceeded)
		}
		return fmt.Errorf("%s %s on stream %d: %w", op, peer, s.idx, err)
	}
	if errors.Is(err, io.EOF) || errors.Is(err, io.ErrUnexpectedEOF) || errors.Is(err, syscall.ECONNRESET) ||
		errors.Is(err, syscall.EPIPE) || errors.Is(err, syscall.ECONNABORTED) || errors.Is(err, net.ErrClosed) {
		return &PeerError{Peer: peer, Err: fmt.Errorf("%w (stream %d: %v): did %s die?", ErrConnClosed, s.idx, err, m.process(s.peer))}
	}
	return &PeerError{Peer: peer, Err: fmt.Errorf("%s stream %d: %w", op, s.idx, err)}
}

// keepAlive probes idle connections, so that a peer host that vanished
// (no FIN, no RST) is noticed in about 11 s even by a member only waiting
// to receive. (TCP_USER_TIMEOUT would bound unacknowledged sends too, but
// on older kernels it also kills connections to a live peer that merely
// stops reading for that long; a stalled peer is left to the caller's
// deadlines.)
var keepAlive = net.KeepAliveConfig{Enable: true, Idle: 5 * time.Second, Interval: 2 * time.Second, Count: 3}

var castagnoli = crc32.MakeTable(crc32.Castagnoli)

// sockBufSize is SO_SNDBUF and SO_RCVBUF of bridge sockets where
// Config.SockBuf is 0; 0 leaves the kernel's autotuning alone (benchmarks
// compare both).
var sockBufSize = sockBuf

// sockBufFor is the socket buffer size of cfg (0: autotuning).
func sockBufFor(cfg *Config) int {
	switch {
	case cfg.SockBuf < 0:
		return 0
	case cfg.SockBuf > 0:
		return cfg.SockBuf
	}
	return sockBufSize
}

// sockControl returns the Control that sets the socket buffers to n bytes
// (0: leaves them alone) before connect/listen, so that the window scale
// is negotiated for them. Listening sockets pass them on to accepted
// ones.
func sockControl(n int) func(_, _ string, c syscall.RawConn) error {
	return func(_, _ string, c syscall.RawConn) error {
		if n <= 0 {
			return nil
		}
		return c.Control(func(fd uintptr) {
			for _, o := range [][2]int{{unix.SO_SNDBUFFORCE, unix.SO_SNDBUF}, {unix.SO_RCVBUFFORCE, unix.SO_RCVBUF}} {
				if unix.SetsockoptInt(int(fd), unix.SOL_SOCKET, o[0], n) != nil {
					_ = unix.SetsockoptInt(int(fd), unix.SOL_SOCKET, o[1], n)
				}
			}
		})
	}
}
