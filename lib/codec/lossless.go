package codec

import (
	"encoding/binary"
	"sync"

	"github.com/gpubridge/gpubridge/lib/reduce"
	"github.com/klauspost/compress/s2"
	"github.com/klauspost/compress/zstd"
)

// zstd/v1 (docs/COMPRESSION.md): a chunk of raw bytes, split into byte
// planes (plane k holds byte k of every element; for floating dtypes the
// sign bit is first rotated into bit 0, so that the top plane is the
// exponent alone), each plane compressed with zstd or s2, or stored when
// that does not make it smaller. Results are exact. Layout:
//
//	off  size
//	 0    1   format version: 1
//	 1    1   element size P: 1, 2, 4 or 8 (the number of planes)
//	 2    1   transform: 0 none, 1 sign rotated into bit 0 (floating dtypes)
//	 3    1   0
//	 4    4   raw length n (u32, a multiple of P, at most MaxLosslessChunk)
//	 8   5P   per plane: method (0 stored, 1 zstd, 2 s2), u32 packed length
//	 ...      the planes' packed bytes, plane 0 first
const (
	losslessVersion  = 1
	losslessHeader   = 8
	MaxLosslessChunk = 64 << 20 // raw bytes of one chunk: one bridge frame's payload at most
)

// Method is how a plane of a zstd/v1 chunk is packed.
type Method uint8

// The methods of a plane.
const (
	Stored    Method = 0
	ZstdPlane Method = 1
	S2Plane   Method = 2
)

// LosslessOptions says how EncodeLossless compresses the planes.
type LosslessOptions struct {
	// S2 compresses the planes with s2 instead of zstd (faster, larger).
	// A plane that the compressor does not shrink is stored either way.
	S2 bool
}

// LosslessMaxLen returns the most bytes EncodeLossless writes for n raw
// bytes of dt: every plane stored, plus the header.
func LosslessMaxLen(dt reduce.DType, n int) int {
	return losslessHeader + 5*planes(dt) + n
}

// planes is the number of byte planes of dt (0: bytes, one plane).
func planes(dt reduce.DType) int { return max(dt.Size(), 1) }

// EncodeLossless packs src, raw bytes of dt (0: bytes without a dtype),
// into dst, which must hold LosslessMaxLen(dt, len(src)) bytes, and
// returns the packed length. src may be at most MaxLosslessChunk bytes.
func EncodeLossless(dst []byte, dt reduce.DType, src []byte, opt LosslessOptions) (int, error) {
	p := planes(dt)
	switch {
	case dt != 0 && dt.Size() == 0:
		return 0, errorf(Zstd, "encode", ErrDType, "%v: not a dtype", dt)
	case len(src)%p != 0:
		return 0, errorf(Zstd, "encode", ErrLength, "%d bytes are not whole %v values", len(src), dt)
	case len(src) > MaxLosslessChunk:
		return 0, errorf(Zstd, "encode", ErrLimit, "%d bytes in one chunk (at most %d)", len(src), MaxLosslessChunk)
	case len(dst) < LosslessMaxLen(dt, len(src)):
		return 0, errorf(Zstd, "encode", ErrLength, "room for %d packed bytes, want %d", len(dst), LosslessMaxLen(dt, len(src)))
	case overlap(dst, src):
		return 0, errorf(Zstd, "encode", ErrOverlap, "the packed buffer overlaps the values")
	}
	method := ZstdPlane
	if opt.S2 {
		method = S2Plane
	}
	rotate := dt.IsFloat()
	dst[0], dst[1], dst[2], dst[3] = losslessVersion, byte(p), 0, 0
	if rotate {
		dst[2] = 1
	}
	binary.LittleEndian.PutUint32(dst[4:], uint32(len(src)))
	table := dst[losslessHeader : losslessHeader+5*p]
	out := losslessHeader + 5*p
	share := len(src) / p
	plane, packed := scratch(share), scratch(max(s2.MaxEncodedLen(share), share+share>>10+1024))
	defer plane.free()
	defer packed.free()
	for k := range p {
		splitPlane(plane.b, src, p, k, rotate)
		m, z := compressPlane(packed.b, plane.b, method)
		if m == Stored {
			z = copy(dst[out:], plane.b)
		} else {
			copy(dst[out:], packed.b[:z])
		}
		table[5*k] = byte(m)
		binary.LittleEndian.PutUint32(table[5*k+1:], uint32(z))
		out += z
	}
	return out, nil
}

// DecodeLossless unpacks src into dst, the raw bytes of dt; the chunk must
// say it holds exactly len(dst) bytes of dt's element size. Every length in
// the chunk is checked before it is used, and no plane may decompress to
// more than its share, so a corrupt or hostile chunk costs at most
// len(dst) bytes of scratch.
func DecodeLossless(dst []byte, dt reduce.DType, src []byte) error {
	p := planes(dt)
	bad := func(format string, args ...any) error { return errorf(Zstd, "decode", ErrCorrupt, format, args...) }
	switch {
	case dt != 0 && dt.Size() == 0:
		return errorf(Zstd, "decode", ErrDType, "%v: not a dtype", dt)
	case len(dst) > MaxLosslessChunk:
		return errorf(Zstd, "decode", ErrLimit, "%d bytes in one chunk (at most %d)", len(dst), MaxLosslessChunk)
	case len(dst)%p != 0:
		return errorf(Zstd, "decode", ErrLength, "%d bytes are not whole %v values", len(dst), dt)
	case overlap(dst, src):
		return errorf(Zstd, "decode", ErrOverlap, "the packed buffer overlaps the values")
	case len(src) < losslessHeader:
		return bad("%d bytes, shorter than the %d-byte header", len(src), losslessHeader)
	case src[0] != losslessVersion:
		return bad("format version %d (this build reads %d)", src[0], losslessVersion)
	case int(src[1]) != p:
		return bad("element size %d, want %d (%v)", src[1], p, dt)
	case src[2] > 1 || src[3] != 0 || (src[2] == 1) != dt.IsFloat():
		return bad("transform bytes %d %d, want %d 0", src[2], src[3], map[bool]int{true: 1}[dt.IsFloat()])
	}
	if n := binary.LittleEndian.Uint32(src[4:]); uint64(n) != uint64(len(dst)) {
		return errorf(Zstd, "decode", ErrLength, "the chunk holds %d bytes, want %d", n, len(dst))
	}
	if len(src) < losslessHeader+5*p {
		return bad("%d bytes, shorter than the header and plane table (%d)", len(src), losslessHeader+5*p)
	}
	table := src[losslessHeader : losslessHeader+5*p]
	data := src[losslessHeader+5*p:]
	total := 0
	for k := range p {
		total += int(binary.LittleEndian.Uint32(table[5*k+1:]))
	}
	if total != len(data) {
		return bad("the planes say %d packed bytes, the chunk has %d", total, len(data))
	}
	share := len(dst) / p
	plane := scratch(share)
	defer plane.free()
	for k := range p {
		m, size := Method(table[5*k]), int(binary.LittleEndian.Uint32(table[5*k+1:]))
		in := data[:size]
		data = data[size:]
		if err := decompressPlane(plane.b, in, m); err != nil {
			return bad("plane %d: %v", k, err)
		}
		joinPlane(dst, plane.b, p, k, dt.IsFloat())
	}
	return nil
}

// rotl moves the sign of a p-byte little-endian element w into bit 0.
func rotl(w uint64, p int) uint64 {
	bitsN := uint(8 * p)
	mask := uint64(1)<<bitsN - 1
	if p == 8 {
		mask = ^uint64(0)
	}
	return (w<<1 | w>>(bitsN-1)) & mask
}

// rotr undoes rotl.
func rotr(w uint64, p int) uint64 {
	bitsN := uint(8 * p)
	mask := uint64(1)<<bitsN - 1
	if p == 8 {
		mask = ^uint64(0)
	}
	return (w>>1 | w<<(bitsN-1)) & mask
}

// splitPlane writes byte k of every p-byte element of src (rotated first
// when rotate) to plane.
func splitPlane(plane, src []byte, p, k int, rotate bool) {
	if p == 1 {
		copy(plane, src)
		return
	}
	if !rotate {
		for i := range plane {
			plane[i] = src[i*p+k]
		}
		return
	}
	switch p {
	case 2:
		for i := range plane {
			plane[i] = byte(rotl(uint64(binary.LittleEndian.Uint16(src[2*i:])), 2) >> (8 * k))
		}
	case 4:
		for i := range plane {
			plane[i] = byte(rotl(uint64(binary.LittleEndian.Uint32(src[4*i:])), 4) >> (8 * k))
		}
	default:
		for i := range plane {
			plane[i] = byte(rotl(binary.LittleEndian.Uint64(src[8*i:]), 8) >> (8 * k))
		}
	}
}

// joinPlane puts plane back as byte k of every element of dst; after the
// top plane (the last one) of a rotated dtype it rotates the elements back.
func joinPlane(dst, plane []byte, p, k int, rotate bool) {
	for i, b := range plane {
		dst[i*p+k] = b
	}
	if !rotate || k != p-1 {
		return
	}
	for i := range plane {
		e := dst[i*p : i*p+p]
		switch p {
		case 2:
			binary.LittleEndian.PutUint16(e, uint16(rotr(uint64(binary.LittleEndian.Uint16(e)), 2)))
		case 4:
			binary.LittleEndian.PutUint32(e, uint32(rotr(uint64(binary.LittleEndian.Uint32(e)), 4)))
		default:
			binary.LittleEndian.PutUint64(e, rotr(binary.LittleEndian.Uint64(e), 8))
		}
	}
}

// compressPlane packs plane into room, which is large enough for the
// compressor's worst case, with m and returns the method used and the
// packed length: Stored (and 0) when m does not make it smaller.
func compressPlane(room, plane []byte, m Method) (Method, int) {
	if len(plane) == 0 {
		return Stored, 0
	}
	var out []byte
	switch m {
	case ZstdPlane:
		out = zstdEncoder().EncodeAll(plane, room[:0])
	case S2Plane:
		out = s2.Encode(room, plane)
	}
	if len(out) >= len(plane) {
		return Stored, 0
	}
	return m, len(out)
}

// decompressPlane unpacks in (packed with m) into plane, which it must
// fill exactly.
func decompressPlane(plane, in []byte, m Method) error {
	switch m {
	case Stored:
		if len(in) != len(plane) {
			return errorf(Zstd, "decode", ErrCorrupt, "stored plane of %d bytes, want %d", len(in), len(plane))
		}
		copy(plane, in)
		return nil
	case ZstdPlane:
		hdr := zstd.Header{}
		if err := hdr.Decode(in); err != nil {
			return err
		}
		if !hdr.HasFCS || hdr.FrameContentSize != uint64(len(plane)) {
			return errorf(Zstd, "decode", ErrCorrupt, "zstd frame of %d bytes (content size given: %v), want %d", hdr.FrameContentSize, hdr.HasFCS, len(plane))
		}
		out, err := zstdDecoder().DecodeAll(in, plane[:0:len(plane)])
		if err != nil {
			return err
		}
		if len(out) != len(plane) || (len(out) > 0 && &out[0] != &plane[0]) {
			return errorf(Zstd, "decode", ErrCorrupt, "zstd gave %d bytes, want %d", len(out), len(plane))
		}
		return nil
	case S2Plane:
		n, err := s2.DecodedLen(in)
		if err != nil {
			return err
		}
		if n != len(plane) {
			return errorf(Zstd, "decode", ErrCorrupt, "s2 block of %d bytes, want %d", n, len(plane))
		}
		_, err = s2.Decode(plane, in)
		return err
	}
	return errorf(Zstd, "decode", ErrCorrupt, "unknown method %d", m)
}

// The zstd coder objects are shared: EncodeAll and DecodeAll may be called
// concurrently, and neither starts goroutines.
var (
	zstdEncoder = sync.OnceValue(func() *zstd.Encoder {
		e, err := zstd.NewWriter(nil, zstd.WithEncoderLevel(zstd.SpeedFastest), zstd.WithEncoderCRC(false), zstd.WithLowerEncoderMem(true))
		if err != nil {
			panic(err) // the options are constant
		}
		return e
	})
	zstdDecoder = sync.OnceValue(func() *zstd.Decoder {
		d, err := zstd.NewReader(nil, zstd.WithDecoderConcurrency(0), zstd.WithDecodeAllCapLimit(true),
			zstd.WithDecoderMaxMemory(MaxLosslessChunk), zstd.WithDecoderMaxWindow(MaxLosslessChunk))
		if err != nil {
			panic(err)
		}
		return d
	})
)

// buf is a pooled scratch buffer.
type buf struct{ b []byte }

var bufPool sync.Pool

func scratch(n int) *buf {
	if v, ok := bufPool.Get().(*buf); ok && cap(v.b) >= n {
		v.b = v.b[:n]
		return v
	}
	return &buf{b: make([]byte, n)}
}

func (p *buf) free() { bufPool.Put(p) }
