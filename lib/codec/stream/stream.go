// Package stream is gbcompress's file format (docs/COMPRESSION.md, "The
// gbcompress stream"): a 16-byte header naming the codec, the dtype and the
// chunk size, an optional .npy shape, then records of one packed chunk each
// with its CRC32C, and an end record with the number of values. A Writer
// packs raw values as they come; a Reader checks every field against the
// limits before it allocates or decodes, and fails on a truncated stream.
package stream

import (
	"bufio"
	"encoding/binary"
	"errors"
	"fmt"
	"hash/crc32"
	"io"

	"github.com/gpubridge/gpubridge/lib/codec"
	"github.com/gpubridge/gpubridge/lib/reduce"
)

// Magic begins every stream.
const Magic = "GBCZ"

const (
	version     = 1
	headerSize  = 16
	recordSize  = 12
	flagShape   = 1
	maxDims     = 32
	endPayload  = 8
	defaultVals = 1 << 20
)

// MaxChunkValues bounds the values of one chunk (and so what a Reader
// allocates: a chunk's values and its packing).
const MaxChunkValues = 16 << 20

// ErrFormat is wrapped by every error about a stream that no Writer wrote.
var ErrFormat = errors.New("not a valid gbcompress stream")

// FormatError is a stream a Reader refuses.
type FormatError struct{ Msg string }

func (e *FormatError) Error() string { return "gbcompress stream: " + e.Msg }

func (e *FormatError) Unwrap() error { return ErrFormat }

func bad(format string, args ...any) error { return &FormatError{Msg: fmt.Sprintf(format, args...)} }

var castagnoli = crc32.MakeTable(crc32.Castagnoli)

// Header is what a stream says about its values.
type Header struct {
	Codec       codec.ID
	DType       reduce.DType
	ChunkValues int     // values per record (the last may hold fewer)
	Shape       []int64 // the .npy shape the values came with; nil without one
	Fortran     bool    // the .npy data was in Fortran order
}

// Options are a Writer's settings beyond its Header.
type Options struct {
	Lossless codec.LosslessOptions
}

// Writer packs raw values, written to it in any pieces, into a stream.
type Writer struct {
	w      *bufio.Writer
	h      Header
	opt    Options
	size   int
	buf    []byte // raw bytes of the chunk being filled
	packed []byte
	total  uint64
	err    error
}

// NewWriter writes h's header to w and returns a Writer for the values.
// ChunkValues 0 means 1 Mi values; it must be a multiple of
// codec.ChunkAlign(h.Codec) and at most MaxChunkValues.
func NewWriter(w io.Writer, h Header, opt Options) (*Writer, error) {
	if h.ChunkValues == 0 {
		h.ChunkValues = defaultVals
	}
	if err := codec.Supports(h.Codec, h.DType); err != nil {
		return nil, err
	}
	if a := codec.ChunkAlign(h.Codec); h.ChunkValues < 0 || h.ChunkValues > MaxChunkValues || h.ChunkValues%a != 0 {
		return nil, fmt.Errorf("chunk of %d values: it must be a multiple of %d, at most %d", h.ChunkValues, a, MaxChunkValues)
	}
	if len(h.Shape) > maxDims {
		return nil, fmt.Errorf("shape of %d dimensions (at most %d)", len(h.Shape), maxDims)
	}
	size := max(h.DType.Size(), 1)
	if h.Codec == codec.Zstd && h.ChunkValues*size > codec.MaxLosslessChunk {
		return nil, fmt.Errorf("chunk of %d bytes: zstd chunks are at most %d", h.ChunkValues*size, codec.MaxLosslessChunk)
	}
	maxPacked, _ := codec.MaxPackedLen(h.Codec, h.DType, h.ChunkValues)
	sw := &Writer{w: bufio.NewWriterSize(w, 1<<20), h: h, opt: opt, size: size,
		buf: make([]byte, 0, h.ChunkValues*size), packed: make([]byte, maxPacked)}
	hdr := make([]byte, headerSize, headerSize+1+1+8*len(h.Shape))
	copy(hdr, Magic)
	hdr[4], hdr[5], hdr[6] = version, byte(h.Codec), byte(h.DType)
	binary.LittleEndian.PutUint32(hdr[8:], uint32(h.ChunkValues))
	if h.Shape != nil {
		hdr[7] = flagShape
		hdr = append(hdr, byte(len(h.Shape)), map[bool]byte{true: 1}[h.Fortran])
		for _, d := range h.Shape {
			hdr = binary.LittleEndian.AppendUint64(hdr, uint64(d))
		}
	}
	if _, err := sw.w.Write(hdr); err != nil {
		return nil, err
	}
	return sw, nil
}

// Write adds raw values (any number of bytes; a value may span calls).
func (sw *Writer) Write(p []byte) (int, error) {
	if sw.err != nil {
		return 0, sw.err
	}
	n := len(p)
	for len(p) > 0 {
		k := min(len(p), cap(sw.buf)-len(sw.buf))
		sw.buf = append(sw.buf, p[:k]...)
		p = p[k:]
		if len(sw.buf) == cap(sw.buf) {
			if sw.err = sw.flush(); sw.err != nil {
				return n - len(p), sw.err
			}
		}
	}
	return n, nil
}

// flush packs and writes the chunk in buf.
func (sw *Writer) flush() error {
	if len(sw.buf) == 0 {
		return nil
	}
	m := len(sw.buf) / sw.size
	k, err := codec.EncodeChunk(sw.h.Codec, sw.packed, sw.h.DType, sw.buf, sw.opt.Lossless)
	if err != nil {
		return err
	}
	if err := sw.record(uint32(m), sw.packed[:k]); err != nil {
		return err
	}
	sw.total += uint64(m)
	sw.buf = sw.buf[:0]
	return nil
}

func (sw *Writer) record(m uint32, payload []byte) error {
	var r [recordSize]byte
	binary.LittleEndian.PutUint32(r[0:], m)
	binary.LittleEndian.PutUint32(r[4:], uint32(len(payload)))
	binary.LittleEndian.PutUint32(r[8:], crc32.Checksum(payload, castagnoli))
	if _, err := sw.w.Write(r[:]); err != nil {
		return err
	}
	_, err := sw.w.Write(payload)
	return err
}

// Close packs what is left and writes the end record; it fails if the
// values written end in the middle of a value, or do not fill the shape.
func (sw *Writer) Close() error {
	if sw.err != nil {
		return sw.err
	}
	if r := len(sw.buf) % sw.size; r != 0 {
		return fmt.Errorf("the input ends in the middle of a %v value (%d bytes left over)", sw.h.DType, r)
	}
	if err := sw.flush(); err != nil {
		return err
	}
	if sw.h.Shape != nil {
		if want := elements(sw.h.Shape); uint64(want) != sw.total {
			return fmt.Errorf("%d values written for shape %v (%d values)", sw.total, sw.h.Shape, want)
		}
	}
	var end [endPayload]byte
	binary.LittleEndian.PutUint64(end[:], sw.total)
	if err := sw.record(0, end[:]); err != nil {
		return err
	}
	return sw.w.Flush()
}

// Values is the number of values written so far.
func (sw *Writer) Values() uint64 { return sw.total }

func elements(shape []int64) int64 {
	n := int64(1)
	for _, d := range shape {
		n *= d
	}
	return n
}

// Reader decodes a stream, chunk by chunk, as raw values of OutDType.
type Reader struct {
	r       *bufio.Reader
	h       Header
	out     reduce.DType
	outSize int
	packed  []byte
	chunk   []byte // decoded values not yet read
	data    []byte // chunk's backing array
	total   uint64
	done    bool
}

// ReaderOptions choose what a Reader gives.
type ReaderOptions struct {
	// OutDType is the dtype of the values read: 0 for the stream's own;
	// float32, bfloat16 or float16 for fp8 streams; float32 or bfloat16
	// for bf16 ones.
	OutDType reduce.DType
}

// NewReader reads and checks a stream's header.
func NewReader(r io.Reader, opt ReaderOptions) (*Reader, error) {
	br := bufio.NewReaderSize(r, 1<<20)
	var hdr [headerSize]byte
	if _, err := io.ReadFull(br, hdr[:]); err != nil {
		return nil, ends(err, "the header")
	}
	if string(hdr[:4]) != Magic {
		return nil, bad("does not begin with %q", Magic)
	}
	if hdr[4] != version {
		return nil, bad("version %d (this gbcompress reads %d)", hdr[4], version)
	}
	h := Header{Codec: codec.ID(hdr[5]), DType: reduce.DType(hdr[6]), ChunkValues: int(binary.LittleEndian.Uint32(hdr[8:]))}
	if err := codec.Check(h.Codec); err != nil {
		return nil, err
	}
	if err := codec.Supports(h.Codec, h.DType); err != nil {
		return nil, bad("codec %s with dtype %d: %v", h.Codec, hdr[6], err)
	}
	switch {
	case hdr[7]&^flagShape != 0:
		return nil, bad("unknown flags %#02x", hdr[7])
	case hdr[12] != 0 || hdr[13] != 0 || hdr[14] != 0 || hdr[15] != 0:
		return nil, bad("reserved header bytes are not zero")
	case h.ChunkValues < 1 || h.ChunkValues > MaxChunkValues:
		return nil, bad("chunks of %d values (1 to %d)", h.ChunkValues, MaxChunkValues)
	case h.ChunkValues%codec.ChunkAlign(h.Codec) != 0:
		return nil, bad("chunks of %d values: %s needs a multiple of %d", h.ChunkValues, h.Codec, codec.ChunkAlign(h.Codec))
	case h.Codec == codec.Zstd && h.ChunkValues*max(h.DType.Size(), 1) > codec.MaxLosslessChunk:
		return nil, bad("zstd chunks of %d bytes (at most %d)", h.ChunkValues*max(h.DType.Size(), 1), codec.MaxLosslessChunk)
	}
	if hdr[7]&flagShape != 0 {
		var d [2]byte
		if _, err := io.ReadFull(br, d[:]); err != nil {
			return nil, ends(err, "the shape")
		}
		if d[0] > maxDims || d[1] > 1 {
			return nil, bad("shape of %d dimensions, fortran byte %d", d[0], d[1])
		}
		h.Fortran = d[1] == 1
		h.Shape = make([]int64, d[0])
		for i := range h.Shape {
			var v [8]byte
			if _, err := io.ReadFull(br, v[:]); err != nil {
				return nil, ends(err, "the shape")
			}
			x := binary.LittleEndian.Uint64(v[:])
			if x > 1<<48 {
				return nil, bad("shape dimension %d", x)
			}
			h.Shape[i] = int64(x)
		}
		if elements(h.Shape) < 0 || elements(h.Shape) > 1<<48 {
			return nil, bad("shape %v is too large", h.Shape)
		}
	}
	out := opt.OutDType
	if out == 0 {
		out = h.DType
	}
	if out != h.DType {
		ok := h.Codec == codec.MXFP8 && (out == reduce.Float32 || out == reduce.BFloat16 || out == reduce.Float16) ||
			h.Codec == codec.BF16 && (out == reduce.Float32 || out == reduce.BFloat16)
		if !ok {
			return nil, fmt.Errorf("a %s stream of %v decodes to %v only", h.Codec, h.DType, h.DType)
		}
	}
	maxPacked, _ := codec.MaxPackedLen(h.Codec, h.DType, h.ChunkValues)
	osz := max(out.Size(), 1)
	return &Reader{r: br, h: h, out: out, outSize: osz, packed: make([]byte, maxPacked), data: make([]byte, h.ChunkValues*osz)}, nil
}

// Header is the stream's header.
func (sr *Reader) Header() Header { return sr.h }

// OutDType is the dtype Read gives.
func (sr *Reader) OutDType() reduce.DType { return sr.out }

// Read reads decoded values; io.EOF after the end record.
func (sr *Reader) Read(p []byte) (int, error) {
	for len(sr.chunk) == 0 {
		if sr.done {
			return 0, io.EOF
		}
		if err := sr.next(); err != nil {
			return 0, err
		}
	}
	n := copy(p, sr.chunk)
	sr.chunk = sr.chunk[n:]
	return n, nil
}

// next reads and decodes one record.
func (sr *Reader) next() error {
	var rec [recordSize]byte
	if _, err := io.ReadFull(sr.r, rec[:]); err != nil {
		return ends(err, "a record (no end record: truncated?)")
	}
	m := binary.LittleEndian.Uint32(rec[0:])
	l := binary.LittleEndian.Uint32(rec[4:])
	crc := binary.LittleEndian.Uint32(rec[8:])
	if m == 0 {
		if l != endPayload {
			return bad("end record of %d bytes (want %d)", l, endPayload)
		}
		var end [endPayload]byte
		if _, err := io.ReadFull(sr.r, end[:]); err != nil {
			return ends(err, "the end record")
		}
		if crc32.Checksum(end[:], castagnoli) != crc {
			return bad("the end record's CRC32C does not match")
		}
		if t := binary.LittleEndian.Uint64(end[:]); t != sr.total {
			return bad("the end record says %d values, the records hold %d", t, sr.total)
		}
		if sr.h.Shape != nil && uint64(elements(sr.h.Shape)) != sr.total {
			return bad("%d values for shape %v", sr.total, sr.h.Shape)
		}
		if _, err := sr.r.ReadByte(); err != io.EOF {
			if err == nil {
				return bad("bytes after the end record")
			}
			return err
		}
		sr.done = true
		return nil
	}
	if int(m) > sr.h.ChunkValues {
		return bad("a record of %d values in chunks of %d", m, sr.h.ChunkValues)
	}
	if sr.total%uint64(sr.h.ChunkValues) != 0 {
		return bad("a record after a short one (only the last may hold fewer than %d values)", sr.h.ChunkValues)
	}
	maxPacked, _ := codec.MaxPackedLen(sr.h.Codec, sr.h.DType, int(m))
	if int(l) > maxPacked {
		return bad("a record of %d packed bytes for %d values (at most %d)", l, m, maxPacked)
	}
	packed := sr.packed[:l]
	if _, err := io.ReadFull(sr.r, packed); err != nil {
		return ends(err, "a record's packed bytes")
	}
	if crc32.Checksum(packed, castagnoli) != crc {
		return bad("record %d (values from %d): CRC32C does not match", sr.total/uint64(sr.h.ChunkValues), sr.total)
	}
	out := sr.data[:int(m)*sr.outSize]
	if err := sr.decode(out, packed, int(m)); err != nil {
		return fmt.Errorf("gbcompress stream: values from %d: %w", sr.total, err)
	}
	sr.total += uint64(m)
	sr.chunk = out
	return nil
}

// decode unpacks a record into out, values of the Reader's dtype.
func (sr *Reader) decode(out, packed []byte, m int) error {
	if sr.out == sr.h.DType {
		return codec.DecodeChunk(sr.h.Codec, out, sr.out, packed)
	}
	if sr.h.Codec == codec.BF16 {
		return codec.DecodeBF16(out, sr.out, packed)
	}
	return codec.DecodeMXFP8(out, sr.out, packed)
}

// Values is the number of values decoded so far.
func (sr *Reader) Values() uint64 { return sr.total }

func ends(err error, what string) error {
	if errors.Is(err, io.EOF) || errors.Is(err, io.ErrUnexpectedEOF) {
		return bad("input ends in %s", what)
	}
	return err
}
