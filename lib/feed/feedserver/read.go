package feedserver

import (
	"context"
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
}

// next returns the next whole message; body is valid until the next call.
func (r *reader) next() (feed.Header, []byte, error) {
	for {
		if r.w-r.r >= feed.HeaderSize {
			h, err := feed.ParseHeader(r.buf[r.r:r.w], feed.MaxMessage)
			if err != nil {
				return feed.Header{}, nil, &ProtocolError{Code: feed.ErrCodeProtocol, Err: err}
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
			return feed.Header{}, nil, &ProtocolError{Code: feed.ErrCodeProtocol, Err: errors.New("control data truncated: more than one descriptor sent with a message")}
		}
		r.w += n
		r.total += uint64(n)
		if err != nil {
			if n > 0 {
				continue
			}
			if r.w != r.r && errors.Is(err, io.EOF) {
				return feed.Header{}, nil, &ProtocolError{Code: feed.ErrCodeProtocol, Err: fmt.Errorf("feed closed in the middle of a message (%d bytes)", r.w-r.r)}
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
		return &ProtocolError{Code: feed.ErrCodeProtocol, Err: fmt.Errorf("bad control data: %v", err)}
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
		return &ProtocolError{Code: feed.ErrCodeProtocol, Err: bad}
	}
	return nil
}

// readLoop handles messages until BYE, EOF, an error or the end of the
// server's context (exec false, and why), or until it accepted a collective
// while none was running (exec true): then the caller runs it.
func (s *Server) readLoop(r *reader) (exec bool, err error) {
	var req feed.Request
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
			if err := feed.DecodeRequest(h.Type, body, &req); err != nil {
				if len(body) < 8 {
					return false, &ProtocolError{Code: feed.ErrCodeProtocol, Err: err}
				}
				if err := s.checkID(req.ID); err != nil {
					return false, err
				}
				s.refuse(&req, feed.StatusBadRequest, err.Error(), arrived)
				continue
			}
			exec, err := s.accept(&req, arrived)
			if err != nil {
				return false, err
			}
			if exec {
				return true, nil
			}
		case h.Type == feed.MsgReady:
			m, err := feed.DecodeReady(body)
			if err != nil {
				return false, &ProtocolError{Code: feed.ErrCodeProtocol, Err: err}
			}
			if err := s.ready(m); err != nil {
				return false, err
			}
		case h.Type == feed.MsgRegion:
			m, err := feed.DecodeBody(feed.MsgRegion, body)
			if err != nil {
				s.closeFD(s.popFD())
				if len(body) < 8 {
					return false, &ProtocolError{Code: feed.ErrCodeProtocol, Err: err}
				}
				id := leU64(body)
				if err := s.checkID(id); err != nil {
					return false, err
				}
				s.reply(id, feed.StatusBadRequest, err.Error(), arrived)
				continue
			}
			if err := s.addRegion(m.(*feed.RegionMsg), arrived); err != nil {
				return false, err
			}
		case h.Type == feed.MsgRelease:
			m, err := feed.DecodeBody(feed.MsgRelease, body)
			if err != nil {
				return false, &ProtocolError{Code: feed.ErrCodeProtocol, Err: err}
			}
			if err := s.release(m.(*feed.ReleaseMsg), arrived); err != nil {
				return false, err
			}
		case h.Type == feed.MsgBye:
			if len(body) != 0 {
				return false, &ProtocolError{Code: feed.ErrCodeProtocol, Err: fmt.Errorf("%w: bye: body of %d bytes", feed.ErrMalformed, len(body))}
			}
			r.bye = true
			return false, errBye
		default:
			return false, &ProtocolError{Code: feed.ErrCodeProtocol, Err: fmt.Errorf("unexpected %s message from the client", h.Type)}
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
		return &ProtocolError{Code: feed.ErrCodeProtocol, Err: fmt.Errorf("request id %d is not above the previous one (%d): ids must increase", id, s.lastID)}
	}
	s.lastID = id
	return nil
}
