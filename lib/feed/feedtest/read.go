package feedtest

import (
	"context"
	"errors"
	"fmt"
	"io"
	"net"
	"os"
	"syscall"
	"time"
	"unsafe"

	"github.com/gpubridge/gpubridge/lib/feed"
	"golang.org/x/sys/unix"
)

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
	} else if len(c.rbuf)-c.rw < feed.MaxMessage {
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
	for c.rw-c.rr >= feed.HeaderSize {
		h, err := feed.ParseHeader(c.rbuf[c.rr:c.rw], feed.MaxMessage)
		if err != nil {
			c.fail(fmt.Errorf("feed: from the server: %w", err))
			return err
		}
		if c.rw-c.rr < int(h.Size) {
			break
		}
		body := c.rbuf[c.rr+feed.HeaderSize : c.rr+int(h.Size)]
		c.rr += int(h.Size)
		if err := c.handle(h.Type, body); err != nil {
			c.fail(err)
			return err
		}
	}
	return nil
}

// handle dispatches one message from the server.
func (c *Client) handle(t feed.MsgType, body []byte) error {
	switch t {
	case feed.MsgDone:
		if err := feed.DecodeDone(body, &c.rdone); err != nil {
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
	case feed.MsgProgress:
		p, err := feed.DecodeProgress(body)
		if err != nil {
			return fmt.Errorf("feed: from the server: %w", err)
		}
		c.mu.Lock()
		k := c.calls[p.ID]
		c.mu.Unlock()
		if k != nil && k.onProgress != nil {
			k.onProgress(p.Off, p.N)
		}
	case feed.MsgError:
		m, err := feed.DecodeBody(feed.MsgError, body)
		if err != nil {
			return fmt.Errorf("feed: from the server: %w", err)
		}
		return fmt.Errorf("feed: the server closed the feed: %s", m.(*feed.ErrorMsg).Text)
	case feed.MsgBye:
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

// recvSpin reads from a socket, polling it without blocking for up to spin
// before it parks in the poller: a message that comes within the spin is
// read without the wake-up of a parked thread. It honours the socket's read
// deadline once it parks.
func recvSpin(raw syscall.RawConn, p, oob []byte, spin time.Duration) (n, oobn, flags int, err error) {
	var until time.Time
	polled := false
	rerr := raw.Read(func(fd uintptr) bool {
		for {
			n, oobn, flags, err = recvmsg(int(fd), p, oob)
			if err != unix.EAGAIN {
				return true
			}
			if polled {
				return false // woken by the poller but nothing there: wait again
			}
			now := time.Now()
			if until.IsZero() {
				until = now.Add(spin)
			} else if now.After(until) {
				polled = true
				return false
			}
		}
	})
	if rerr != nil {
		return 0, 0, 0, rerr
	}
	if err == nil && n == 0 && len(p) > 0 {
		return 0, oobn, flags, io.EOF
	}
	if err != nil {
		err = os.NewSyscallError("recvmsg", err)
	}
	return n, oobn, flags, err
}

// recvmsg is recvmsg(2) without blocking and without the peer's address (so
// nothing is allocated); descriptors are received close-on-exec.
func recvmsg(fd int, p, oob []byte) (n, oobn, flags int, err error) {
	var iov unix.Iovec
	if len(p) > 0 {
		iov.Base = &p[0]
		iov.SetLen(len(p))
	}
	var msg unix.Msghdr
	msg.Iov = &iov
	msg.Iovlen = 1
	if len(oob) > 0 {
		msg.Control = &oob[0]
		msg.SetControllen(len(oob))
	}
	r, _, e := unix.Syscall(unix.SYS_RECVMSG, uintptr(fd), uintptr(unsafe.Pointer(&msg)), unix.MSG_DONTWAIT|unix.MSG_CMSG_CLOEXEC)
	if e != 0 {
		return 0, 0, 0, e
	}
	return int(r), int(msg.Controllen), int(msg.Flags), nil
}
