//go:build !cgo || !linux

package ibverbs

import "fmt"

// Without cgo there is no libibverbs: every entry point says so.

var errNoCgo = fmt.Errorf("%w: this gpubridge was built without cgo (CGO_ENABLED=0)", ErrUnavailable)

// Load fails: the build has no cgo.
func Load(string) error { return errNoCgo }

// Devices fails: the build has no cgo.
func Devices() ([]string, error) { return nil, errNoCgo }

// Context is an open device (never, without cgo).
type Context struct{ Name string }

// Open fails: the build has no cgo.
func Open(string) (*Context, error) { return nil, errNoCgo }

// Close does nothing.
func (c *Context) Close() error { return nil }

// QueryDevice fails: the build has no cgo.
func (c *Context) QueryDevice() (DeviceAttr, error) { return DeviceAttr{}, errNoCgo }

// QueryPort fails: the build has no cgo.
func (c *Context) QueryPort(int) (PortAttr, error) { return PortAttr{}, errNoCgo }

// GIDs fails: the build has no cgo.
func (c *Context) GIDs(int) ([]GIDEntry, error) { return nil, errNoCgo }

// QP is a queue pair (never, without cgo).
type QP struct{}

// State fails: the build has no cgo.
func (qp *QP) State() (QPState, error) { return 0, errNoCgo }

// StatusString is a completion status as a number.
func StatusString(status int) string { return fmt.Sprintf("status %d", status) }
