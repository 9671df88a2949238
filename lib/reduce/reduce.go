package reduce

import (
	"errors"
	"fmt"
	"sync"
	"unsafe"
)

// ParallelThreshold is the buffer size (in bytes) below which CombineParallel
// runs inline: under it the cost of starting goroutines exceeds the gain.
const ParallelThreshold = 256 << 10

// The inline threshold and the least number of bytes given to one worker of
// CombineParallel; variables so that the tests can split small buffers.
var (
	parallelThreshold = ParallelThreshold
	parallelChunkMin  = 64 << 10
)

// Combine sets dst[i] = a[i] op b[i] for every element i. dst, a and b are
// raw little-endian elements of type dt, of equal length, a multiple of
// dt.Size(). dst may be the very same slice as a or as b (same start, same
// length); any other overlap between dst and an input is refused. a and b may
// overlap each other freely. For Avg, Combine sums (dividing is Finish's
// job). The arithmetic is specified in the package documentation.
func Combine(op Op, dt DType, dst, a, b []byte) error {
	if err := check(op, dt, dst, a, b); err != nil {
		return err
	}
	combine(op, dt, dst, a, b)
	return nil
}

// CombineParallel is Combine spread over up to workers goroutines, each on a
// disjoint range of whole elements (range boundaries are multiples of 64
// bytes). Its result is identical, bit for bit, to Combine's. workers <= 1,
// or a buffer smaller than ParallelThreshold, runs inline on the calling
// goroutine.
func CombineParallel(op Op, dt DType, dst, a, b []byte, workers int) error {
	if err := check(op, dt, dst, a, b); err != nil {
		return err
	}
	n := len(dst)
	workers = min(workers, n/parallelChunkMin)
	if workers <= 1 || n < parallelThreshold {
		combine(op, dt, dst, a, b)
		return nil
	}
	// Split into workers ranges of whole 64-byte blocks (64 is a multiple
	// of every element size), the last range taking the remainder.
	per := (n/workers + 63) &^ 63
	var wg sync.WaitGroup
	lo := 0
	for w := 0; w < workers-1 && lo+per < n; w++ {
		hi := lo + per
		wg.Add(1)
		go func(lo, hi int) {
			defer wg.Done()
			combine(op, dt, dst[lo:hi], a[lo:hi], b[lo:hi])
		}(lo, hi)
		lo = hi
	}
	combine(op, dt, dst[lo:], a[lo:], b[lo:])
	wg.Wait()
	return nil
}

// Finish applies the post-step of op to buf, the result of combining n
// contributions: for Avg it divides every element by n (see the package
// documentation for the precision); for every other op it does nothing. n
// must be at least 1; n == 1 leaves buf unchanged.
func Finish(op Op, dt DType, buf []byte, n int) error {
	if err := Supported(op, dt); err != nil {
		return err
	}
	if len(buf)%dt.Size() != 0 {
		return fmt.Errorf("reduce: finish %s %s: length %d is not a multiple of the element size %d", op, dt, len(buf), dt.Size())
	}
	if n < 1 {
		return fmt.Errorf("reduce: finish %s %s: member count %d, want at least 1", op, dt, n)
	}
	if op != Avg || n == 1 || len(buf) == 0 {
		return nil
	}
	finishAvg(dt, buf, n)
	return nil
}

// Reference reduces inputs (one buffer per member, all of one length) in the
// fixed order ((in[0] op in[1]) op in[2]) op ... and then applies Finish with
// n = len(inputs). It returns a new buffer. It is the bit-exact reference
// the collectives are tested against: every algorithm that combines in this
// order produces exactly these bytes.
func Reference(op Op, dt DType, inputs [][]byte) ([]byte, error) {
	if err := Supported(op, dt); err != nil {
		return nil, err
	}
	if len(inputs) == 0 {
		return nil, errors.New("reduce: reference: no inputs")
	}
	out := append([]byte(nil), inputs[0]...)
	if len(out)%dt.Size() != 0 {
		return nil, fmt.Errorf("reduce: reference %s %s: input 0: length %d is not a multiple of the element size %d", op, dt, len(out), dt.Size())
	}
	for i, in := range inputs[1:] {
		if len(in) != len(out) {
			return nil, fmt.Errorf("reduce: reference %s %s: input %d has length %d, input 0 has %d", op, dt, i+1, len(in), len(out))
		}
		combine(op, dt, out, out, in)
	}
	if err := Finish(op, dt, out, len(inputs)); err != nil {
		return nil, err
	}
	return out, nil
}

// check validates the arguments of Combine.
func check(op Op, dt DType, dst, a, b []byte) error {
	if err := Supported(op, dt); err != nil {
		return err
	}
	if len(a) != len(dst) || len(b) != len(dst) {
		return fmt.Errorf("reduce: combine %s %s: lengths differ: dst %d, a %d, b %d bytes", op, dt, len(dst), len(a), len(b))
	}
	if len(dst)%dt.Size() != 0 {
		return fmt.Errorf("reduce: combine %s %s: length %d is not a multiple of the element size %d", op, dt, len(dst), dt.Size())
	}
	if partialOverlap(dst, a) {
		return fmt.Errorf("reduce: combine %s %s: dst overlaps a without being the same slice", op, dt)
	}
	if partialOverlap(dst, b) {
		return fmt.Errorf("reduce: combine %s %s: dst overlaps b without being the same slice", op, dt)
	}
	return nil
}

// partialOverlap reports whether x and y (of equal length) share memory
// without starting at the same address.
func partialOverlap(x, y []byte) bool {
	if len(x) == 0 {
		return false
	}
	px := uintptr(unsafe.Pointer(unsafe.SliceData(x)))
	py := uintptr(unsafe.Pointer(unsafe.SliceData(y)))
	n := uintptr(len(x))
	return px != py && px < py+n && py < px+n
}
