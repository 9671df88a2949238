// Package npy reads and writes the header of NumPy's .npy files (format
// versions 1.0, 2.0 and 3.0), so that a tool can stream the array's data
// after it: the magic "\x93NUMPY", the version, the header's length, and
// the header itself, a Python dict literal with exactly the keys descr,
// fortran_order and shape. Headers are parsed within limits, and anything
// else (a structured dtype, a Python expression numpy would not write) is
// refused with an *Error.
package npy

import (
	"encoding/binary"
	"errors"
	"fmt"
	"io"
	"math"
	"strconv"
	"strings"
)

// Magic is how every .npy file begins.
const Magic = "\x93NUMPY"

// The kinds of Error.
var (
	ErrFormat = errors.New("not a valid .npy header")
	ErrLimit  = errors.New("over a limit")
)

// Error is a header that ReadHeader refuses.
type Error struct {
	Kind error // ErrFormat or ErrLimit
	Msg  string
}

func (e *Error) Error() string { return ".npy: " + e.Msg }

func (e *Error) Unwrap() error { return e.Kind }

func bad(format string, args ...any) error {
	return &Error{Kind: ErrFormat, Msg: fmt.Sprintf(format, args...)}
}

// Limits bound what ReadHeader accepts.
type Limits struct {
	MaxHeader int   // bytes of the dict literal (default 64 KiB; numpy itself writes a few hundred)
	MaxDims   int   // dimensions of the shape (default 64)
	MaxBytes  int64 // bytes of the array's data (default 1 TiB)
}

func (l Limits) orDefaults() Limits {
	if l.MaxHeader <= 0 {
		l.MaxHeader = 64 << 10
	}
	if l.MaxDims <= 0 {
		l.MaxDims = 64
	}
	if l.MaxBytes <= 0 {
		l.MaxBytes = 1 << 40
	}
	return l
}

// Header is what a .npy header says about its array.
type Header struct {
	Major, Minor int    // the format version
	Descr        string // the dtype: "<f4", "<f2", "|u1", "<V2", ...
	FortranOrder bool
	Shape        []int64
}

// ItemSize is the bytes of one element of Descr (its number: "<f4" is 4).
func (h Header) ItemSize() int {
	n, err := strconv.Atoi(h.Descr[2:])
	if err != nil {
		return 0
	}
	return n
}

// Elements is the product of the shape (1 for a scalar).
func (h Header) Elements() int64 {
	n := int64(1)
	for _, d := range h.Shape {
		n *= d
	}
	return n
}

// DataBytes is the size of the array's data, which follows the header.
func (h Header) DataBytes() int64 { return h.Elements() * int64(h.ItemSize()) }

// ReadHeader reads a .npy header from r, exactly: afterwards r is at the
// first byte of the data.
func ReadHeader(r io.Reader, lim Limits) (Header, error) {
	lim = lim.orDefaults()
	var pre [10]byte
	if _, err := io.ReadFull(r, pre[:8]); err != nil {
		return Header{}, readErr(err, "the magic and version")
	}
	if string(pre[:6]) != Magic {
		return Header{}, bad("does not begin with the .npy magic \\x93NUMPY")
	}
	h := Header{Major: int(pre[6]), Minor: int(pre[7])}
	var n int
	switch h.Major {
	case 1:
		if _, err := io.ReadFull(r, pre[8:10]); err != nil {
			return Header{}, readErr(err, "the header length")
		}
		n = int(binary.LittleEndian.Uint16(pre[8:10]))
	case 2, 3:
		var l [4]byte
		if _, err := io.ReadFull(r, l[:]); err != nil {
			return Header{}, readErr(err, "the header length")
		}
		v := binary.LittleEndian.Uint32(l[:])
		if uint64(v) > uint64(lim.MaxHeader) {
			return Header{}, &Error{Kind: ErrLimit, Msg: fmt.Sprintf("header of %d bytes (at most %d)", v, lim.MaxHeader)}
		}
		n = int(v)
	default:
		return Header{}, bad("format version %d.%d (this reader knows 1.0, 2.0 and 3.0)", h.Major, h.Minor)
	}
	if n > lim.MaxHeader {
		return Header{}, &Error{Kind: ErrLimit, Msg: fmt.Sprintf("header of %d bytes (at most %d)", n, lim.MaxHeader)}
	}
	text := make([]byte, n)
	if _, err := io.ReadFull(r, text); err != nil {
		return Header{}, readErr(err, "the header")
	}
	if err := parseDict(&h, string(text), lim); err != nil {
		return Header{}, err
	}
	return h, nil
}

func readErr(err error, what string) error {
	if errors.Is(err, io.EOF) || errors.Is(err, io.ErrUnexpectedEOF) {
		return bad("input ends in %s", what)
	}
	return fmt.Errorf(".npy: reading %s: %w", what, err)
}

// parseDict parses the header's dict literal into h.
func parseDict(h *Header, text string, lim Limits) error {
	if h.Major < 3 {
		for i := 0; i < len(text); i++ {
			if text[i] >= 0x80 {
				return bad("header is not ASCII (byte %d)", i)
			}
		}
	}
	p := &parser{s: strings.TrimRight(text, " \n\x00")}
	if !p.eat('{') {
		return bad("header is not a dict: %q", clip(text))
	}
	seen := map[string]bool{}
	for {
		if p.eat('}') {
			break
		}
		key, err := p.str()
		if err != nil {
			return err
		}
		if seen[key] {
			return bad("key %q twice", key)
		}
		seen[key] = true
		if !p.eat(':') {
			return bad("no ':' after key %q", key)
		}
		switch key {
		case "descr":
			if p.peek() == '[' {
				return bad("structured dtypes (descr a list) are not supported")
			}
			d, err := p.str()
			if err != nil {
				return err
			}
			if err := checkDescr(d); err != nil {
				return err
			}
			h.Descr = d
		case "fortran_order":
			switch {
			case p.word("True"):
				h.FortranOrder = true
			case p.word("False"):
			default:
				return bad("fortran_order is not True or False")
			}
		case "shape":
			shape, err := p.shape(lim.MaxDims)
			if err != nil {
				return err
			}
			h.Shape = shape
		default:
			return bad("unknown key %q (a .npy header has descr, fortran_order and shape)", key)
		}
		if !p.eat(',') {
			if !p.eat('}') {
				return bad("expected ',' or '}' at %q", clip(p.s[p.i:]))
			}
			break
		}
	}
	if p.space(); p.i != len(p.s) {
		return bad("text after the dict: %q", clip(p.s[p.i:]))
	}
	for _, k := range []string{"descr", "fortran_order", "shape"} {
		if !seen[k] {
			return bad("no %q in the header", k)
		}
	}
	size := int64(h.ItemSize())
	total := size
	for _, d := range h.Shape {
		if d != 0 && total > math.MaxInt64/d {
			return &Error{Kind: ErrLimit, Msg: fmt.Sprintf("shape %v overflows", h.Shape)}
		}
		total *= d
	}
	if total > lim.MaxBytes {
		return &Error{Kind: ErrLimit, Msg: fmt.Sprintf("shape %v of %s is %d bytes (at most %d)", h.Shape, h.Descr, total, lim.MaxBytes)}
	}
	return nil
}

// checkDescr accepts a simple dtype string: a byte order (<, > or |), a
// kind letter and a size.
func checkDescr(d string) error {
	if len(d) < 3 || !strings.ContainsRune("<>|=", rune(d[0])) || !strings.ContainsRune("biufcVSUmM", rune(d[1])) {
		return bad("descr %q is not a simple dtype such as '<f4'", d)
	}
	n, err := strconv.Atoi(d[2:])
	if err != nil || n <= 0 || n > 1<<20 || d[2] == '0' || d[2] == '+' {
		return bad("descr %q has no valid item size", d)
	}
	return nil
}

func clip(s string) string {
	if len(s) > 40 {
		return s[:40] + "..."
	}
	return s
}

// parser reads the Python literal subset numpy writes.
type parser struct {
	s string
	i int
}

func (p *parser) space() {
	for p.i < len(p.s) && (p.s[p.i] == ' ' || p.s[p.i] == '\t' || p.s[p.i] == '\n') {
		p.i++
	}
}

func (p *parser) peek() byte {
	p.space()
	if p.i < len(p.s) {
		return p.s[p.i]
	}
	return 0
}

func (p *parser) eat(c byte) bool {
	if p.peek() == c {
		p.i++
		return true
	}
	return false
}

func (p *parser) word(w string) bool {
	p.space()
	if strings.HasPrefix(p.s[p.i:], w) {
		p.i += len(w)
		return true
	}
	return false
}

// str reads a quoted string without escapes (numpy's keys and descrs have
// none).
func (p *parser) str() (string, error) {
	q := p.peek()
	if q != '\'' && q != '"' {
		return "", bad("expected a quoted string at %q", clip(p.s[p.i:]))
	}
	end := strings.IndexByte(p.s[p.i+1:], q)
	if end < 0 {
		return "", bad("unterminated string at %q", clip(p.s[p.i:]))
	}
	v := p.s[p.i+1 : p.i+1+end]
	if strings.ContainsRune(v, '\\') {
		return "", bad("escapes in string %q", clip(v))
	}
	p.i += end + 2
	return v, nil
}

// shape reads a tuple of non-negative integers: (), (3,), (3, 4).
func (p *parser) shape(maxDims int) ([]int64, error) {
	if !p.eat('(') {
		return nil, bad("shape is not a tuple")
	}
	shape := []int64{}
	for !p.eat(')') {
		if len(shape) == maxDims {
			return nil, &Error{Kind: ErrLimit, Msg: fmt.Sprintf("shape of more than %d dimensions", maxDims)}
		}
		p.space()
		j := p.i
		for j < len(p.s) && p.s[j] >= '0' && p.s[j] <= '9' {
			j++
		}
		if j == p.i || j-p.i > 18 {
			return nil, bad("shape has a bad dimension at %q", clip(p.s[p.i:]))
		}
		d, _ := strconv.ParseInt(p.s[p.i:j], 10, 64)
		p.i = j
		p.word("L") // Python 2 longs
		shape = append(shape, d)
		if !p.eat(',') {
			if !p.eat(')') {
				return nil, bad("shape: expected ',' or ')' at %q", clip(p.s[p.i:]))
			}
			break
		}
	}
	return shape, nil
}

// WriteHeader writes a version 1.0 header for h (version 2.0 if the header
// needs more than 65535 bytes), padded as numpy pads it: the data starts at
// a multiple of 64 bytes.
func WriteHeader(w io.Writer, h Header) error {
	if err := checkDescr(h.Descr); err != nil {
		return err
	}
	var dims []string
	for _, d := range h.Shape {
		dims = append(dims, strconv.FormatInt(d, 10))
	}
	shape := "(" + strings.Join(dims, ", ")
	if len(dims) == 1 {
		shape += ","
	}
	shape += ")"
	order := "False"
	if h.FortranOrder {
		order = "True"
	}
	dict := fmt.Sprintf("{'descr': '%s', 'fortran_order': %s, 'shape': %s, }", h.Descr, order, shape)
	pre := 10
	if len(dict)+1+pre > 0xffff {
		pre = 12
	}
	pad := 64 - (pre+len(dict)+1)%64
	if pad == 64 {
		pad = 0
	}
	text := dict + strings.Repeat(" ", pad) + "\n"
	b := []byte(Magic)
	if pre == 10 {
		b = append(b, 1, 0)
		b = binary.LittleEndian.AppendUint16(b, uint16(len(text)))
	} else {
		b = append(b, 2, 0)
		b = binary.LittleEndian.AppendUint32(b, uint32(len(text)))
	}
	_, err := w.Write(append(b, text...))
	return err
}
