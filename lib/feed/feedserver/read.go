package feedserver

import (
	"context"
	"encoding/binary"
	"errors"
	"fmt"
	"io"
	"net"
	"time"

	"github.com/gpubridge/gpubridge/lib/feed"
	"golang.org/x/sys/unix"
)

// maxPendingFDs bounds descriptors received ahead of their REGION messages.
const maxPendingFDs = 4

type reader struct {
	conn  *net.UnixConn
	s     *Server
	buf   []byte
	oob   []byte
	r, w  int
	bye   bool
	total uint64
	req   feed.Request // the request being decoded, reused
}

// next returns the next whole message; body is valid until the next call.
func (r *reader) next() (feed.Header, []byte, error) {
	for {
		if r.w-r.r >= feed.HeaderSize {
			h, err := feed.ParseHeader(r.buf[r.r:r.w], feed.MaxMessage)
			if err != nil {
				return feed.Header{}, nil, protocolError(err)
			}
			if r.w-r.r >= int(h.Size) {
				body := r.buf[r.r+feed.HeaderSize : r.r+int(h.Size)]
				r.r += int(h.Size)
				return h, body, nil
			}
		}
		if r.r == r.w {
			r.r, r.w = 0, 0
		} else if len(r.buf)-r.w < feed.MaxMessage {
			r.w = copy(r.buf, r.buf[r.r:r.w])
			r.r = 0
		}
		n, oobn, flags, err := r.recv(r.buf[r.w:], r.oob)
		if oobn > 0 {
			if ferr := r.takeFDs(r.oob[:oobn]); ferr != nil {
				return feed.Header{}, nil, ferr
			}
		}
		if flags&unix.MSG_CTRUNC != 0 {
			return feed.Header{}, nil, protocolError(errors.New("control data truncated: more than one descriptor sent with a message"))
		}
		r.w += n
		r.total += uint64(n)
		if err != nil {
			if n > 0 {
				continue
			}
			if r.w != r.r && errors.Is(err, io.EOF) {
				return feed.Header{}, nil, protocolError(fmt.Errorf("feed closed in the middle of a message (%d bytes)", r.w-r.r))
			}
			return feed.Header{}, nil, err
		}
		if n == 0 {
			return feed.Header{}, nil, io.EOF
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

func (r *reader) takeFDs(oob []byte) error {
	msgs, err := unix.ParseSocketControlMessage(oob)
	if err != nil {
		return protocolError(fmt.Errorf("bad control data: %v", err))
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
		return protocolError(bad)
	}
	return nil
}

// readLoop handles messages until BYE, EOF, an error or the end of the
// server's context (exec false, and why), or until it accepted a collective
// while none was running (exec true): then the caller runs it.
func (s *Server) readLoop(r *reader) (exec bool, err error) {
	for {
		h, body, err := r.next()
		if err != nil {
			return false, s.readEnd(err)
		}
		if exec, err = s.handle(r, h.Type, body, time.Now()); exec || err != nil {
			return exec, err
		}
	}
}

// readEnd says why reading ended: the server's context, the client (a
// *ProtocolError, or EOF), or the feed was lost.
func (s *Server) readEnd(err error) error {
	if cause := context.Cause(s.ctx); cause != nil {
		return cause
	}
	var pe *ProtocolError
	if errors.As(err, &pe) || errors.Is(err, io.EOF) {
		return err
	}
	return fmt.Errorf("%w: read: %v", ErrFeedLost, err)
}

// handle handles one message from the client; exec as readLoop's.
func (s *Server) handle(r *reader, t feed.MsgType, body []byte, arrived time.Time) (exec bool, err error) {
	switch {
	case t.IsRequest():
		if err := feed.DecodeRequest(t, body, &r.req); err != nil {
			return false, s.refuseMalformed(t, body, err, arrived)
		}
		return s.accept(&r.req, arrived)
	case t == feed.MsgReady:
		m, err := feed.DecodeReady(body)
		if err != nil {
			return false, protocolError(err)
		}
		return false, s.ready(m)
	case t == feed.MsgRegion:
		m, err := feed.DecodeBody(feed.MsgRegion, body)
		if err != nil {
			s.closeFD(s.popFD())
			return false, s.refuseMalformed(t, body, err, arrived)
		}
		return false, s.addRegion(m.(*feed.RegionMsg), arrived)
	case t == feed.MsgRelease:
		m, err := feed.DecodeBody(feed.MsgRelease, body)
		if err != nil {
			return false, protocolError(err)
		}
		return false, s.release(m.(*feed.ReleaseMsg), arrived)
	case t == feed.MsgJoin:
		if s.version < feed.BridgesVersion {
			return false, s.refuseMalformed(t, body, fmt.Errorf("join is feed protocol %d; this feed speaks version %d", feed.BridgesVersion, s.version), arrived)
		}
		m, err := feed.DecodeBody(feed.MsgJoin, body)
		if err != nil {
			return false, s.refuseMalformed(t, body, err, arrived)
		}
		return false, s.join(m.(*feed.JoinMsg), arrived)
	case t == feed.MsgBye:
		if len(body) != 0 {
			return false, protocolError(fmt.Errorf("%w: bye: body of %d bytes", feed.ErrMalformed, len(body)))
		}
		r.bye = true
		return false, errBye
	}
	return false, protocolError(fmt.Errorf("unexpected %s message from the client", t))
}

// refuseMalformed answers a request or REGION whose body is malformed:
// one too short to hold its request id breaks the protocol; else the id
// must still increase, and the message gets a DONE with StatusBadRequest.
func (s *Server) refuseMalformed(t feed.MsgType, body []byte, err error, arrived time.Time) error {
	if len(body) < 8 {
		return protocolError(err)
	}
	id := binary.LittleEndian.Uint64(body)
	if err := s.checkID(id); err != nil {
		return err
	}
	text := err.Error()
	if t.IsRequest() || t == feed.MsgJoin {
		text = fmt.Sprintf("%s %d: %s", t, id, text)
	}
	s.reply(id, feed.StatusBadRequest, text, arrived)
	return nil
}

// protocolError is a violation of the protocol by the client.
func protocolError(err error) *ProtocolError {
	return &ProtocolError{Code: feed.ErrCodeProtocol, Err: err}
}

// checkID enforces strictly increasing request ids.
func (s *Server) checkID(id uint64) error {
	if id <= s.lastID {
		return protocolError(fmt.Errorf("request id %d is not above the previous one (%d): ids must increase", id, s.lastID))
	}
	s.lastID = id
	return nil
}
