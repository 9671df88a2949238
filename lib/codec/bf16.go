package codec

import (
	"encoding/binary"
	"math"

	"github.com/gpubridge/gpubridge/lib/reduce"
)

// bf16/v1 (docs/COMPRESSION.md): a float32 value becomes its bfloat16,
// rounded to nearest even, a NaN a quiet NaN with its sign and the top of
// its payload (lib/reduce's F32ToBF16); a bfloat16 value is sent as it is.
// Any chunk of whole values packs to its piece of the whole packing.

// BF16Len returns the packed size of n values: 2n bytes.
func BF16Len(n int) int { return 2 * n }

// EncodeBF16 packs src, n values of dt (Float32 or BFloat16), into dst (2n
// bytes, not overlapping src).
func EncodeBF16(dst []byte, dt reduce.DType, src []byte) error {
	if _, err := bfCheck("encode", dt, src, dst); err != nil {
		return err
	}
	if dt == reduce.BFloat16 {
		copy(dst, src)
		return nil
	}
	bfEncode(dst, src)
	return nil
}

// DecodeBF16 unpacks src into dst, n values of dt (Float32: exact
// widening; BFloat16: the bytes as they are); src must be 2n bytes.
func DecodeBF16(dst []byte, dt reduce.DType, src []byte) error {
	if _, err := bfCheck("decode", dt, dst, src); err != nil {
		return err
	}
	if dt == reduce.BFloat16 {
		copy(dst, src)
		return nil
	}
	bfDecode(dst, src)
	return nil
}

// DecodeAddBF16 adds the decoded values of src to acc, float32 values:
// acc[i] = acc[i] + decoded[i] with lib/reduce's rules (acc first).
func DecodeAddBF16(acc, src []byte) error {
	n, err := bfCheck("decode-add", reduce.Float32, acc, src)
	if err != nil {
		return err
	}
	var w [4 * GroupElems]byte
	for first := 0; first < n; first += GroupElems {
		m := min(GroupElems, n-first)
		bfDecode(w[:4*m], src[2*first:2*(first+m)])
		a := acc[4*first : 4*(first+m)]
		if err := reduce.Combine(reduce.Sum, reduce.Float32, a, a, w[:4*m]); err != nil {
			panic(err) // lengths were checked
		}
	}
	return nil
}

// EncodeFeedbackBF16 is EncodeBF16 with error feedback, as
// EncodeFeedbackMXFP8: u = x + r; dst = bf16(u); r = u - float32(dst), or +0
// where either is not finite.
func EncodeFeedbackBF16(dst []byte, dt reduce.DType, src, residual []byte) error {
	n, err := bfCheck("encode-feedback", dt, src, dst)
	if err != nil {
		return err
	}
	return withFeedback(BF16, dt, src, dst, residual, n)
}

func bfCheck(op string, dt reduce.DType, raw, packed []byte) (int, error) {
	if dt != reduce.Float32 && dt != reduce.BFloat16 {
		return 0, errorf(BF16, op, ErrDType, "%v: bf16 takes float32 or bfloat16 (float16 is already 2 bytes a value: use fp8 or zstd)", dt)
	}
	if len(raw)%dt.Size() != 0 {
		return 0, errorf(BF16, op, ErrLength, "%d bytes are not whole %v values", len(raw), dt)
	}
	n := len(raw) / dt.Size()
	if len(packed) != BF16Len(n) {
		return 0, errorf(BF16, op, ErrLength, "%d packed bytes for %d values (want %d)", len(packed), n, BF16Len(n))
	}
	if overlap(raw, packed) {
		return 0, errorf(BF16, op, ErrOverlap, "the packed buffer overlaps the values")
	}
	return n, nil
}

// bfEncode rounds float32 src to bfloat16 dst: the assembly kernel for
// whole runs of 16 values, Go for the rest.
func bfEncode(dst, src []byte) {
	k := bfEncodeAsm(dst, src)
	for i := k; i < len(dst)/2; i++ {
		f := math.Float32frombits(binary.LittleEndian.Uint32(src[4*i:]))
		binary.LittleEndian.PutUint16(dst[2*i:], reduce.F32ToBF16(f))
	}
}

// bfDecode widens bfloat16 src to float32 dst.
func bfDecode(dst, src []byte) {
	k := bfDecodeAsm(dst, src)
	for i := k; i < len(src)/2; i++ {
		binary.LittleEndian.PutUint32(dst[4*i:], uint32(binary.LittleEndian.Uint16(src[2*i:]))<<16)
	}
}
