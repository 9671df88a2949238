package feedserver

import (
	"context"
	"errors"
	"fmt"
	"net"
	"os"
	"time"

	"golang.org/x/sys/unix"
)

// Listener is the feed socket: a Unix stream socket that accepts exactly one
// connection.
type Listener struct {
	ln   *net.UnixListener
	path string
}

// Listen creates the feed socket at path, readable and writable by this
// user only. The path must not exist: the plugin names a fresh path in a
// private directory.
func Listen(path string) (*Listener, error) {
	if path == "" {
		return nil, errors.New("feed: no socket path")
	}
	if len(path) >= len(unix.RawSockaddrUnix{}.Path) {
		return nil, fmt.Errorf("feed: socket path %q is %d bytes, the limit is %d", path, len(path), len(unix.RawSockaddrUnix{}.Path)-1)
	}
	if _, err := os.Lstat(path); err == nil {
		return nil, fmt.Errorf("feed: %s already exists", path)
	}
	ln, err := net.ListenUnix("unix", &net.UnixAddr{Name: path, Net: "unix"})
	if err != nil {
		return nil, fmt.Errorf("feed: listen on %s: %w", path, err)
	}
	ln.SetUnlinkOnClose(true)
	// Connections are also checked by uid (SO_PEERCRED) on accept.
	if err := os.Chmod(path, 0o600); err != nil {
		_ = ln.Close()
		return nil, fmt.Errorf("feed: chmod %s: %w", path, err)
	}
	return &Listener{ln: ln, path: path}, nil
}

// Path is the socket's path.
func (l *Listener) Path() string { return l.path }

// Close closes the socket and removes its path.
func (l *Listener) Close() error { return l.ln.Close() }

// Accept waits, within timeout and ctx, for the one feed connection, checks
// that it comes from this user (or root), then closes the listener (which
// removes the path) so that nobody else can connect.
func (l *Listener) Accept(ctx context.Context, timeout time.Duration) (*net.UnixConn, error) {
	defer l.ln.Close()
	if timeout > 0 {
		_ = l.ln.SetDeadline(time.Now().Add(timeout))
	}
	stop := context.AfterFunc(ctx, func() { _ = l.ln.SetDeadline(time.Unix(1, 0)) })
	defer stop()
	for {
		conn, err := l.ln.AcceptUnix()
		if err != nil {
			if cause := context.Cause(ctx); cause != nil {
				return nil, cause
			}
			if errors.Is(err, os.ErrDeadlineExceeded) {
				return nil, fmt.Errorf("feed: no client connected to %s within %s", l.path, timeout)
			}
			return nil, fmt.Errorf("feed: accept on %s: %w", l.path, err)
		}
		if err := checkPeer(conn); err != nil {
			_ = conn.Close()
			continue
		}
		return conn, nil
	}
}

// checkPeer accepts a peer of this user or root (SO_PEERCRED).
func checkPeer(conn *net.UnixConn) error {
	rc, err := conn.SyscallConn()
	if err != nil {
		return err
	}
	var cred *unix.Ucred
	var cerr error
	if err := rc.Control(func(fd uintptr) {
		cred, cerr = unix.GetsockoptUcred(int(fd), unix.SOL_SOCKET, unix.SO_PEERCRED)
	}); err != nil {
		return err
	}
	if cerr != nil {
		return cerr
	}
	if uid := uint32(os.Geteuid()); cred.Uid != uid && cred.Uid != 0 {
		return fmt.Errorf("feed: peer uid %d is not %d", cred.Uid, uid)
	}
	return nil
}
