package feedserver

import (
	"errors"
	"fmt"
	"os"
	"time"

	"github.com/gpubridge/gpubridge/lib/feed"
)

// write sends the message that appendMsg (a message's Append) encodes, from
// whichever goroutine has it, under wmu. After a failed write nothing more
// is written and the server stops.
func (s *Server) write(appendMsg func(b []byte) []byte) error {
	s.wmu.Lock()
	defer s.wmu.Unlock()
	s.wbuf = appendMsg(s.wbuf[:0])
	return s.flush()
}

// reply sends a DONE with no bridge work behind it.
func (s *Server) reply(id uint64, st feed.Status, msg string, arrived time.Time) {
	us := uint64(time.Since(arrived).Microseconds())
	d := feed.DoneMsg{ID: id, Status: st, Error: msg, TotalUS: us}
	_ = s.write(d.Append)
}

func (s *Server) writeError(code uint32, text string) {
	m := feed.ErrorMsg{Code: code, Text: text}
	_ = s.write(m.Append)
}

// flush writes wbuf; the caller holds wmu.
func (s *Server) flush() error {
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
