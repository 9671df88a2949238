package feedserver

import (
	"context"
	"fmt"

	"github.com/gpubridge/gpubridge/lib/feed"
)

func (s *Server) ready(m feed.ReadyMsg) error {
	s.smu.Lock()
	c := s.streams[m.ID]
	s.smu.Unlock()
	if c == nil {
		if m.ID > s.lastID {
			return protocolError(fmt.Errorf("ready for request %d, which was never sent", m.ID))
		}
		return nil // finished already (a broadcast's non-root needs no input)
	}
	if m.End > c.inLen {
		return protocolError(fmt.Errorf("ready for request %d up to byte %d, past its input of %d bytes", m.ID, m.End, c.inLen))
	}
	c.mu.Lock()
	if m.End > c.readyEnd {
		c.readyEnd = m.End
		if c.wake != nil {
			close(c.wake)
			c.wake = nil
		}
	}
	c.mu.Unlock()
	return nil
}

// waitReady is Progress.Ready of a streamed call.
func (c *call) waitReady(ctx context.Context, end int) error {
	if end < 0 || uint64(end) > c.inLen {
		return fmt.Errorf("feed: ready wait for byte %d of a %d-byte input", end, c.inLen)
	}
	for {
		c.mu.Lock()
		if c.readyEnd >= uint64(end) {
			c.mu.Unlock()
			return nil
		}
		if c.wake == nil {
			c.wake = make(chan struct{})
		}
		w := c.wake
		c.mu.Unlock()
		select {
		case <-w:
		case <-ctx.Done():
			return context.Cause(ctx)
		case <-c.s.inputEnd:
			// BYE or EOF: no READY can come any more.
			c.mu.Lock()
			ok := c.readyEnd >= uint64(end)
			c.mu.Unlock()
			if ok {
				return nil
			}
			return fmt.Errorf("feed: the client closed the feed before input bytes [0,%d) of %s %d were ready (%d were)", end, c.req.Kind, c.req.ID, c.readyEnd)
		}
	}
}

// progress is Progress.Done of a streamed call.
func (c *call) progress(off, n int) {
	p := feed.ProgressMsg{ID: c.req.ID, Off: uint64(off), N: uint64(n)}
	_ = c.s.write(p.Append)
}
