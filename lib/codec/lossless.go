package codec

import (
	"encoding/binary"
	"errors"
	"sync"

	"github.com/gpubridge/gpubridge/lib/reduce"
	"github.com/klauspost/compress/huff0"
	"github.com/klauspost/compress/s2"
	"github.com/klauspost/compress/zstd"
)

// zstd/v1 (docs/COMPRESSION.md): a chunk of raw bytes, split into byte
// planes (plane k holds byte k of every element; for floating dtypes the
// sign bit is first rotated into bit 0, so that the top plane is the
// exponent alone), each plane Huffman-coded (huff0, zstd's entropy coder),
// zstd- or s2-compressed, or stored when that does not make it smaller.
// Results are exact. Layout:
//
//	off  size
//	 0    1   format version: 1
//	 1    1   element size P: 1, 2, 4 or 8 (the number of planes)
//	 2    1   transform: 0 none, 1 sign rotated into bit 0 (floating dtypes)
//	 3    1   0
//	 4    4   raw length n (u32, a multiple of P, at most MaxLosslessChunk)
//	 8   5P   per plane: method (0 stored, 1 zstd, 2 s2, 3 huff0), u32 packed length
//	 ...      the planes' packed bytes, plane 0 first
//
// A huff0 plane is blocks of HuffBlock bytes (the last shorter), each a
// kind byte (0 stored, 1 huff0 4-stream with its table, 2 one byte
// repeated), a u32 packed length, and the packed bytes.
const (
	losslessVersion  = 1
	losslessHeader   = 8
	MaxLosslessChunk = 64 << 20  // raw bytes of one chunk: one bridge frame's payload at most
	HuffBlock        = 128 << 10 // bytes per huff0 block of a plane
)

// Method is how a plane of a zstd/v1 chunk is packed.
type Method uint8

// The methods of a plane.
const (
	Stored     Method = 0
	ZstdPlane  Method = 1
	S2Plane    Method = 2
	Huff0Plane Method = 3
	methods           = 4
)

// LosslessOptions says how EncodeLossless compresses the planes.
type LosslessOptions struct {
	// Method is tried on every plane. 0 (Stored) means the default: huff0
	// (Huffman alone: cheap, and it rejects a random mantissa plane after a
	// histogram), and zstd as well on a plane that huff0 shrinks below a
	// quarter (long runs, such as a sparse gradient's zeros, that an
	// entropy coder alone cannot see), the smaller kept. ZstdPlane packs a
	// little smaller on gradients at about half the speed, S2Plane is
	// faster and larger. A plane that does not shrink is stored.
	Method Method
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
	method := opt.Method
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
	case method >= methods:
		return 0, errorf(Zstd, "encode", ErrCorrupt, "unknown method %d", method)
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
	planesBuf := scratch(len(src))
	defer planesBuf.free()
	splitPlanes(planesBuf.b, src, p, rotate)
	room := scratch(max(s2.MaxEncodedLen(share), share+share>>10+1024))
	defer room.free()
	for k := range p {
		plane := planesBuf.b[k*share : (k+1)*share]
		m, z := compressPlane(dst[out:out+share], room.b, plane, method)
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
	planesBuf := scratch(len(dst))
	defer planesBuf.free()
	for k := range p {
		m, size := Method(table[5*k]), int(binary.LittleEndian.Uint32(table[5*k+1:]))
		in := data[:size]
		data = data[size:]
		if err := decompressPlane(planesBuf.b[k*share:(k+1)*share], in, m); err != nil {
			return bad("plane %d: %v", k, err)
		}
	}
	joinPlanes(dst, planesBuf.b, p, dt.IsFloat())
	return nil
}

// splitPlanes writes byte k of every p-byte element of src to plane k of
// planes (len(src)/p bytes at k*len(src)/p), after rotating each element's
// sign into bit 0 when rotate.
func splitPlanes(planes, src []byte, p int, rotate bool) {
	n := len(src) / p
	switch p {
	case 1:
		copy(planes, src)
	case 2:
		p0, p1 := planes[:n], planes[n:2*n]
		for i := range n {
			w := binary.LittleEndian.Uint16(src[2*i:])
			if rotate {
				w = w<<1 | w>>15
			}
			p0[i], p1[i] = byte(w), byte(w>>8)
		}
	case 4:
		p0, p1, p2, p3 := planes[:n], planes[n:2*n], planes[2*n:3*n], planes[3*n:4*n]
		for i := range n {
			w := binary.LittleEndian.Uint32(src[4*i:])
			if rotate {
				w = w<<1 | w>>31
			}
			p0[i], p1[i], p2[i], p3[i] = byte(w), byte(w>>8), byte(w>>16), byte(w>>24)
		}
	default:
		for i := range n {
			w := binary.LittleEndian.Uint64(src[8*i:])
			if rotate {
				w = w<<1 | w>>63
			}
			for k := range 8 {
				planes[k*n+i] = byte(w >> (8 * k))
			}
		}
	}
}

// joinPlanes undoes splitPlanes.
func joinPlanes(dst, planes []byte, p int, rotate bool) {
	n := len(dst) / p
	switch p {
	case 1:
		copy(dst, planes)
	case 2:
		p0, p1 := planes[:n], planes[n:2*n]
		for i := range n {
			w := uint16(p0[i]) | uint16(p1[i])<<8
			if rotate {
				w = w>>1 | w<<15
			}
			binary.LittleEndian.PutUint16(dst[2*i:], w)
		}
	case 4:
		p0, p1, p2, p3 := planes[:n], planes[n:2*n], planes[2*n:3*n], planes[3*n:4*n]
		for i := range n {
			w := uint32(p0[i]) | uint32(p1[i])<<8 | uint32(p2[i])<<16 | uint32(p3[i])<<24
			if rotate {
				w = w>>1 | w<<31
			}
			binary.LittleEndian.PutUint32(dst[4*i:], w)
		}
	default:
		for i := range n {
			var w uint64
			for k := range 8 {
				w |= uint64(planes[k*n+i]) << (8 * k)
			}
			if rotate {
				w = w>>1 | w<<63
			}
			binary.LittleEndian.PutUint64(dst[8*i:], w)
		}
	}
}

// compressPlane packs plane into out (len(plane) bytes) and returns the
// method used and the packed length; room is scratch for a compressor's
// worst case. m 0 is the default (huff0, and zstd too on a plane that
// huff0 shrinks below a quarter); a plane that does not shrink is stored.
func compressPlane(out, room, plane []byte, m Method) (Method, int) {
	if len(plane) == 0 {
		return Stored, 0
	}
	best, size := Stored, len(plane)
	try := func(m Method) {
		var packed []byte
		switch m {
		case ZstdPlane:
			packed = zstdEncoder().EncodeAll(plane, room[:0])
		case S2Plane:
			packed = s2.Encode(room, plane)
		case Huff0Plane:
			packed = room[:huffPlane(room, plane)]
		}
		if len(packed) < size {
			best, size = m, len(packed)
			copy(out, packed)
		}
	}
	if m == Stored {
		try(Huff0Plane)
		if size < len(plane)/4 {
			try(ZstdPlane)
		}
	} else {
		try(m)
	}
	if best == Stored {
		copy(out, plane)
	}
	return best, size
}

// huffPlane packs plane as huff0 blocks into room (at least len(plane)
// bytes) and returns the length, or len(plane) when it does not shrink.
func huffPlane(room, plane []byte) int {
	s := huffScratch.Get().(*huff0.Scratch)
	defer huffScratch.Put(s)
	out := 0
	for off := 0; off < len(plane); off += HuffBlock {
		blk := plane[off:min(len(plane), off+HuffBlock)]
		kind, data := byte(0), blk
		packed, _, err := huff0.Compress4X(blk, s)
		switch {
		case err == nil:
			kind, data = 1, packed
		case errors.Is(err, huff0.ErrUseRLE):
			kind, data = 2, blk[:1]
		}
		if out+5+len(data) >= len(plane) {
			return len(plane)
		}
		room[out] = kind
		binary.LittleEndian.PutUint32(room[out+1:], uint32(len(data)))
		out += 5 + copy(room[out+5:], data)
	}
	return out
}

// unhuffPlane decodes the huff0 blocks of in into plane, which they must
// fill exactly.
func unhuffPlane(plane, in []byte) error {
	s := huffScratch.Get().(*huff0.Scratch)
	defer huffScratch.Put(s)
	for off := 0; off < len(plane); off += HuffBlock {
		blk := plane[off:min(len(plane), off+HuffBlock)]
		if len(in) < 5 {
			return errorf(Zstd, "decode", ErrCorrupt, "huff0 block at %d: truncated", off)
		}
		kind, n := in[0], int(binary.LittleEndian.Uint32(in[1:]))
		if n > len(in)-5 {
			return errorf(Zstd, "decode", ErrCorrupt, "huff0 block at %d: %d bytes, %d left", off, n, len(in)-5)
		}
		data := in[5 : 5+n]
		in = in[5+n:]
		switch kind {
		case 0:
			if n != len(blk) {
				return errorf(Zstd, "decode", ErrCorrupt, "stored block at %d of %d bytes, want %d", off, n, len(blk))
			}
			copy(blk, data)
		case 1:
			t, rest, err := huff0.ReadTable(data, s)
			if err != nil {
				return errorf(Zstd, "decode", ErrCorrupt, "huff0 block at %d: %v", off, err)
			}
			s = t
			got, err := t.Decoder().Decompress4X(blk[:0:len(blk)], rest)
			if err != nil || len(got) != len(blk) {
				return errorf(Zstd, "decode", ErrCorrupt, "huff0 block at %d: %d bytes (want %d), %v", off, len(got), len(blk), err)
			}
		case 2:
			if n != 1 {
				return errorf(Zstd, "decode", ErrCorrupt, "repeated-byte block at %d of %d bytes", off, n)
			}
			for i := range blk {
				blk[i] = data[0]
			}
		default:
			return errorf(Zstd, "decode", ErrCorrupt, "huff0 block at %d: kind %d", off, kind)
		}
	}
	if len(in) != 0 {
		return errorf(Zstd, "decode", ErrCorrupt, "%d bytes after the last huff0 block", len(in))
	}
	return nil
}

var huffScratch = sync.Pool{New: func() any {
	return &huff0.Scratch{Reuse: huff0.ReusePolicyNone, MaxDecodedSize: HuffBlock}
}}

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
	case Huff0Plane:
		return unhuffPlane(plane, in)
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
