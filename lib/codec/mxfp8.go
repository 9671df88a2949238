package codec

import (
	"encoding/binary"
	"math"

	"github.com/gpubridge/gpubridge/lib/reduce"
)

// The packed layout of fp8/v1 (docs/COMPRESSION.md): values in blocks of
// 32, blocks in groups of 32; a group is its 32 scale bytes, then its 1024
// element codes. The last group of a buffer holds what is left: a scale per
// block (the last block may be short), then one code per value.
const (
	BlockElems  = 32                           // values per block (one scale)
	GroupBlocks = 32                           // blocks per group
	GroupElems  = BlockElems * GroupBlocks     // 1024 values per group
	GroupBytes  = GroupBlocks + GroupElems     // 1056 packed bytes per whole group
	maxPackedN  = (math.MaxInt - 31) / 33 * 32 // MXFP8Len cannot overflow below this
)

// MXFP8Len returns the packed size of n values: n + ceil(n/32) bytes.
// Chunks of a buffer that start at multiples of GroupElems values pack to
// consecutive pieces of the whole buffer's packing (MXFP8Offset).
func MXFP8Len(n int) int { return n + (n+BlockElems-1)/BlockElems }

// MXFP8Offset returns where the packing of value first (a multiple of
// GroupElems) starts in a buffer's packing.
func MXFP8Offset(first int) int { return first / GroupElems * GroupBytes }

// EncodeMXFP8 packs src, n values of dt (Float32, BFloat16 or Float16), into
// dst, which must be MXFP8Len(n) bytes and must not overlap src.
func EncodeMXFP8(dst []byte, dt reduce.DType, src []byte) error {
	n, err := mxCheck("encode", dt, src, dst)
	if err != nil {
		return err
	}
	if dt == reduce.Float32 {
		mxGroups(dst, n, func(first, m int, scales, codes []byte) {
			encF32(scales, codes, src[4*first:4*(first+m)])
		})
		return nil
	}
	var w [4 * GroupElems]byte
	mxGroups(dst, n, func(first, m int, scales, codes []byte) {
		widen(w[:4*m], dt, src[2*first:2*(first+m)])
		encF32(scales, codes, w[:4*m])
	})
	return nil
}

// DecodeMXFP8 unpacks src into dst, n values of dt (Float32, BFloat16 or
// Float16); src must be MXFP8Len(n) bytes. Every packed byte string of that
// length decodes. Values are decoded exactly to float32, then rounded to
// nearest even for the 16-bit dtypes.
func DecodeMXFP8(dst []byte, dt reduce.DType, src []byte) error {
	n, err := mxCheck("decode", dt, dst, src)
	if err != nil {
		return err
	}
	if dt == reduce.Float32 {
		mxGroups(src, n, func(first, m int, scales, codes []byte) {
			decF32(dst[4*first:4*(first+m)], scales, codes)
		})
		return nil
	}
	var w [4 * GroupElems]byte
	mxGroups(src, n, func(first, m int, scales, codes []byte) {
		decF32(w[:4*m], scales, codes)
		narrow(dst[2*first:2*(first+m)], dt, w[:4*m])
	})
	return nil
}

// DecodeAddMXFP8 adds the decoded values of src to acc, float32 values
// (little-endian): acc[i] = acc[i] + decoded[i], one float32 addition with
// lib/reduce's rules (acc is its first operand, so a NaN in acc wins).
func DecodeAddMXFP8(acc, src []byte) error {
	n, err := mxCheck("decode-add", reduce.Float32, acc, src)
	if err != nil {
		return err
	}
	mxGroups(src, n, func(first, m int, scales, codes []byte) {
		decAdd(acc[4*first:4*(first+m)], scales, codes)
	})
	return nil
}

// EncodeFeedbackMXFP8 packs src (n values of dt) with error feedback:
// residual (n float32 values) is added to each value before quantizing,
// and afterwards holds what quantizing lost:
//
//	u = x + r (float32); dst = encode(u); r = u - decode(dst)
//
// or +0 where u or its decoded value is not finite, so a NaN or an
// infinity in one step does not poison the next. residual must not overlap
// src or dst.
func EncodeFeedbackMXFP8(dst []byte, dt reduce.DType, src, residual []byte) error {
	n, err := mxCheck("encode-feedback", dt, src, dst)
	if err != nil {
		return err
	}
	return withFeedback(MXFP8, dt, src, dst, residual, n)
}

// mxCheck checks the arguments of an MXFP8 call whose raw side holds
// values of dt and returns their number.
func mxCheck(op string, dt reduce.DType, raw, packed []byte) (int, error) {
	if dt != reduce.Float32 && dt != reduce.BFloat16 && dt != reduce.Float16 {
		return 0, errorf(MXFP8, op, ErrDType, "%v: fp8 takes float32, bfloat16 or float16", dt)
	}
	s := dt.Size()
	if len(raw)%s != 0 {
		return 0, errorf(MXFP8, op, ErrLength, "%d bytes are not whole %v values", len(raw), dt)
	}
	n := len(raw) / s
	if n > maxPackedN || len(packed) != MXFP8Len(n) {
		return 0, errorf(MXFP8, op, ErrLength, "%d packed bytes for %d values (want %d)", len(packed), n, MXFP8Len(n))
	}
	if overlap(raw, packed) {
		return 0, errorf(MXFP8, op, ErrOverlap, "the packed buffer overlaps the values")
	}
	return n, nil
}

// mxGroups calls f for each group of a packing of n values: the group's
// first value, its number of values, and its scale and code bytes.
func mxGroups(packed []byte, n int, f func(first, m int, scales, codes []byte)) {
	for first := 0; first < n; first += GroupElems {
		scales, codes := mxGroup(packed, n, first)
		f(first, len(codes), scales, codes)
	}
}

// mxGroup returns the scale and code bytes of the group of a packing of n
// values that starts at value first (a multiple of GroupElems).
func mxGroup(packed []byte, n, first int) (scales, codes []byte) {
	m := min(GroupElems, n-first)
	nb := (m + BlockElems - 1) / BlockElems
	p := packed[MXFP8Offset(first):]
	return p[:nb], p[nb : nb+m]
}

// encF32 encodes the float32 values of src (at most a group) into the
// group's scales and codes: whole blocks with the fastest kernel, a short
// last block in Go.
func encF32(scales, codes, src []byte) {
	m := len(src) / 4
	nb := m / BlockElems
	encBlocks(scales, codes, src, nb)
	if r := m - nb*BlockElems; r > 0 {
		var w [BlockElems]uint32
		for i := range r {
			w[i] = binary.LittleEndian.Uint32(src[4*(nb*BlockElems+i):])
		}
		encBlockGo(&scales[nb], codes[nb*BlockElems:], w[:r])
	}
}

// decF32 decodes a group's codes into float32 dst.
func decF32(dst, scales, codes []byte) {
	m := len(codes)
	nb := m / BlockElems
	decBlocks(dst, scales, codes, nb)
	if k := nb * BlockElems; k < m {
		decGo(dst[4*k:], scales, codes, k, m-k)
	}
}

// widen converts 16-bit values of dt to little-endian float32 bits, exactly
// (bfloat16 with bf16/v1's decoder, which is that widening).
func widen(dst []byte, dt reduce.DType, src []byte) {
	if dt == reduce.BFloat16 {
		bfDecode(dst, src)
		return
	}
	for i := range len(src) / 2 {
		h := binary.LittleEndian.Uint16(src[2*i:])
		var w uint32
		if dt == reduce.BFloat16 {
			w = uint32(h) << 16
		} else {
			w = math.Float32bits(reduce.F16ToF32(h))
		}
		binary.LittleEndian.PutUint32(dst[4*i:], w)
	}
}

// narrow rounds float32 values to the 16-bit dt, to nearest even
// (lib/reduce's conversions; bfloat16 with bf16/v1's encoder, which is
// F32ToBF16).
func narrow(dst []byte, dt reduce.DType, src []byte) {
	if dt == reduce.BFloat16 {
		bfEncode(dst, src)
		return
	}
	for i := range len(dst) / 2 {
		f := math.Float32frombits(binary.LittleEndian.Uint32(src[4*i:]))
		var h uint16
		if dt == reduce.BFloat16 {
			h = reduce.F32ToBF16(f)
		} else {
			h = reduce.F32ToF16(f)
		}
		binary.LittleEndian.PutUint16(dst[2*i:], h)
	}
}
