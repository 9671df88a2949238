package codec

import (
	"errors"
	"fmt"
	"strings"
)

// ID names a codec on the wire: the codec byte of a bridge frame and of a
// feed request, and the codec field of a gbcompress stream. An ID names one
// version of one format forever; a changed format gets a new ID, so a member
// that does not know an ID refuses it instead of misreading it.
type ID uint8

// The codecs. 0 ... 127 are gpubridge's; 128 ... 255 are never assigned
// (left for experiments outside the project, refused like unknown ones).
const (
	Raw   ID = 0 // the bytes as they are
	BF16  ID = 1 // bf16/v1: float32 rounded to bfloat16; bfloat16 unchanged
	MXFP8 ID = 2 // fp8/v1: OCP MX v1.0 MXFP8, E4M3 elements, E8M0 scales, groups of 32 blocks
	Zstd  ID = 3 // zstd/v1: lossless, byte planes, each zstd, s2 or stored
)

var idNames = [...]string{Raw: "raw", BF16: "bf16", MXFP8: "fp8", Zstd: "zstd"}

// Known reports whether this build knows id.
func (id ID) Known() bool { return int(id) < len(idNames) }

// String returns the name of id ("raw", "bf16", "fp8", "zstd") or
// "codec(N)" for an unknown one.
func (id ID) String() string {
	if !id.Known() {
		return fmt.Sprintf("codec(%d)", uint8(id))
	}
	return idNames[id]
}

// Versioned returns the name with its format version: "fp8/v1".
func (id ID) Versioned() string {
	if !id.Known() || id == Raw {
		return id.String()
	}
	return idNames[id] + "/v1"
}

// Lossy reports whether id rounds values (bf16, fp8): such a codec is used
// only for floating sums and averages.
func (id ID) Lossy() bool { return id == BF16 || id == MXFP8 }

// IDs lists the known codecs in numeric order.
func IDs() []ID { return []ID{Raw, BF16, MXFP8, Zstd} }

// ErrUnknown is wrapped by every error about a codec this build does not
// know.
var ErrUnknown = errors.New("unknown codec")

// UnknownError is a codec byte or name this build does not know.
type UnknownError struct {
	ID   ID     // the byte, when it came from the wire
	Name string // the name, when it came from a setting
}

func (e *UnknownError) Error() string {
	var known []string
	for _, id := range IDs() {
		known = append(known, fmt.Sprintf("%d %s", uint8(id), id.Versioned()))
	}
	what := fmt.Sprintf("codec %d", uint8(e.ID))
	if e.Name != "" {
		what = fmt.Sprintf("codec %q", e.Name)
	}
	return fmt.Sprintf("%s is unknown to this gpubridge (it knows %s): every member must run a gpubridge that knows the job's codec", what, strings.Join(known, ", "))
}

func (e *UnknownError) Unwrap() error { return ErrUnknown }

// Check returns nil for a known id, else an *UnknownError.
func Check(id ID) error {
	if id.Known() {
		return nil
	}
	return &UnknownError{ID: id}
}

// Parse returns the codec of a name: "raw" (also "none"), "bf16", "fp8"
// (also "mxfp8"), "zstd" (also "lossless"), with or without "/v1", in any
// case.
func Parse(name string) (ID, error) {
	s := strings.ToLower(strings.TrimSpace(name))
	s = strings.TrimSuffix(s, "/v1")
	switch s {
	case "raw", "none":
		return Raw, nil
	case "bf16", "bfloat16":
		return BF16, nil
	case "fp8", "mxfp8":
		return MXFP8, nil
	case "zstd", "lossless":
		return Zstd, nil
	}
	return 0, &UnknownError{Name: name}
}
