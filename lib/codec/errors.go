package codec

import (
	"errors"
	"fmt"
	"unsafe"
)

// The kinds of Error, for errors.Is.
var (
	// ErrLength: a buffer's length does not fit the others (a packed
	// buffer not of the length its element count gives, a raw buffer not
	// of whole elements).
	ErrLength = errors.New("wrong length")
	// ErrDType: the codec does not take this dtype.
	ErrDType = errors.New("unsupported dtype")
	// ErrCorrupt: a packed buffer that no encoder of the format writes.
	ErrCorrupt = errors.New("corrupt packed data")
	// ErrLimit: a packed buffer announces more than the limits allow.
	ErrLimit = errors.New("over a limit")
	// ErrOverlap: buffers that must be apart overlap.
	ErrOverlap = errors.New("overlapping buffers")
)

// Error is what every function of the package returns on bad arguments or
// bad packed data; nothing is written to dst when one is returned, except
// where the function says otherwise.
type Error struct {
	Codec ID
	Op    string // encode, decode, decode-add, encode-feedback
	Kind  error  // ErrLength, ErrDType, ErrCorrupt, ErrLimit or ErrOverlap
	Msg   string
}

func (e *Error) Error() string { return fmt.Sprintf("%s %s: %s", e.Codec.Versioned(), e.Op, e.Msg) }

func (e *Error) Unwrap() error { return e.Kind }

func errorf(id ID, op string, kind error, format string, args ...any) error {
	return &Error{Codec: id, Op: op, Kind: kind, Msg: fmt.Sprintf(format, args...)}
}

// overlap reports whether a and b share a byte.
func overlap(a, b []byte) bool {
	if len(a) == 0 || len(b) == 0 {
		return false
	}
	pa, pb := uintptr(unsafe.Pointer(unsafe.SliceData(a))), uintptr(unsafe.Pointer(unsafe.SliceData(b)))
	return pa < pb+uintptr(len(b)) && pb < pa+uintptr(len(a))
}
