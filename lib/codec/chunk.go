package codec

import "github.com/gpubridge/gpubridge/lib/reduce"

// The chunk API: one entry point per operation for every codec, chosen by
// the ID a frame or a stream carries. Unknown IDs fail with *UnknownError.

// Supports returns nil if codec id can carry values of dt, else an error
// saying why not: fp8 takes float32, bfloat16 and float16; bf16 float32 and
// bfloat16; raw and zstd every dtype (0: bytes without a dtype).
func Supports(id ID, dt reduce.DType) error { return supports("encode", id, dt) }

func supports(op string, id ID, dt reduce.DType) error {
	if err := Check(id); err != nil {
		return err
	}
	if dt != 0 && dt.Size() == 0 {
		return errorf(id, op, ErrDType, "%v: not a dtype", dt)
	}
	switch id {
	case MXFP8:
		_, err := mxCheck(op, dt, nil, nil)
		return err
	case BF16:
		_, err := bfCheck(op, dt, nil, nil)
		return err
	}
	return nil
}

// ChunkAlign is the number of values a chunk boundary must be a multiple
// of for chunks to pack to consecutive pieces of a whole packing (fp8:
// GroupElems; the others: 1). zstd/v1 chunks are independent: each has its
// own header.
func ChunkAlign(id ID) int {
	if id == MXFP8 {
		return GroupElems
	}
	return 1
}

// MaxPackedLen returns the most bytes a chunk of n values of dt packs to:
// exactly that many for raw, bf16 and fp8.
func MaxPackedLen(id ID, dt reduce.DType, n int) (int, error) {
	if err := Supports(id, dt); err != nil {
		return 0, err
	}
	size := max(dt.Size(), 1)
	switch id {
	case BF16:
		return BF16Len(n), nil
	case MXFP8:
		return MXFP8Len(n), nil
	case Zstd:
		return LosslessMaxLen(dt, n*size), nil
	}
	return n * size, nil
}

// EncodeChunk packs src (values of dt) with codec id into dst, which must
// hold MaxPackedLen bytes, and returns the packed length.
func EncodeChunk(id ID, dst []byte, dt reduce.DType, src []byte, opt LosslessOptions) (int, error) {
	if err := Supports(id, dt); err != nil {
		return 0, err
	}
	size := max(dt.Size(), 1)
	if len(src)%size != 0 {
		return 0, errorf(id, "encode", ErrLength, "%d bytes are not whole %v values", len(src), dt)
	}
	want, _ := MaxPackedLen(id, dt, len(src)/size)
	if len(dst) < want {
		return 0, errorf(id, "encode", ErrLength, "room for %d packed bytes, want %d", len(dst), want)
	}
	switch id {
	case BF16:
		return want, EncodeBF16(dst[:want], dt, src)
	case MXFP8:
		return want, EncodeMXFP8(dst[:want], dt, src)
	case Zstd:
		return EncodeLossless(dst, dt, src, opt)
	}
	if overlap(dst, src) {
		return 0, errorf(id, "encode", ErrOverlap, "the packed buffer overlaps the values")
	}
	return copy(dst, src), nil
}

// DecodeChunk unpacks src, packed with codec id, into dst: exactly
// len(dst) bytes of values of dt.
func DecodeChunk(id ID, dst []byte, dt reduce.DType, src []byte) error {
	if err := supports("decode", id, dt); err != nil {
		return err
	}
	switch id {
	case BF16:
		return DecodeBF16(dst, dt, src)
	case MXFP8:
		return DecodeMXFP8(dst, dt, src)
	case Zstd:
		return DecodeLossless(dst, dt, src)
	}
	switch {
	case len(src) != len(dst):
		return errorf(id, "decode", ErrLength, "%d packed bytes for %d bytes", len(src), len(dst))
	case overlap(dst, src):
		return errorf(id, "decode", ErrOverlap, "the packed buffer overlaps the values")
	}
	copy(dst, src)
	return nil
}
