// Package errstat measures how far a reconstruction (a lossy round trip)
// is from the original, value by value, in a single streaming pass: the
// largest absolute and relative errors, the RMSE, the signal-to-noise
// ratio, and what became of zeros and non-finite values.
package errstat

import (
	"encoding/binary"
	"fmt"
	"math"

	"github.com/gpubridge/gpubridge/lib/reduce"
)

// Stats accumulates pairs (x, y): an original value and its
// reconstruction. The zero value is empty and ready.
type Stats struct {
	Values      int64   // pairs added
	Finite      int64   // pairs with a finite x: the ones the errors are over
	Differ      int64   // pairs whose bits differ (any x)
	NonFiniteIn int64   // x NaN or ±Inf
	KeptNaNs    int64   // x NaN and y NaN
	InfToNaN    int64   // x ±Inf and y NaN
	Overflowed  int64   // x finite, y ±Inf (rounded past the type's range)
	Flushed     int64   // x finite and not zero, y zero (underflow)
	MaxAbs      float64 // max |y - x| over finite x (and finite y)
	MaxRel      float64 // max |y - x| / |x| over finite x != 0 (and finite y)
	sumSqErr    float64
	sumSqSignal float64
}

// Add adds one pair, given as values and as their raw bits (so that equal
// NaNs and signed zeros can be told apart).
func (s *Stats) Add(x, y float64, xBits, yBits uint64) {
	s.Values++
	if xBits != yBits {
		s.Differ++
	}
	switch {
	case math.IsNaN(x):
		s.NonFiniteIn++
		if math.IsNaN(y) {
			s.KeptNaNs++
		}
		return
	case math.IsInf(x, 0):
		s.NonFiniteIn++
		if math.IsNaN(y) {
			s.InfToNaN++
		}
		return
	}
	s.Finite++
	if math.IsInf(y, 0) || math.IsNaN(y) {
		s.Overflowed++
		return
	}
	if x != 0 && y == 0 {
		s.Flushed++
	}
	e := math.Abs(y - x)
	s.MaxAbs = math.Max(s.MaxAbs, e)
	if x != 0 {
		s.MaxRel = math.Max(s.MaxRel, e/math.Abs(x))
	}
	s.sumSqErr += e * e
	s.sumSqSignal += x * x
}

// RMSE is the root of the mean squared error over finite pairs (0 if none).
func (s *Stats) RMSE() float64 {
	n := s.Finite - s.Overflowed
	if n <= 0 {
		return 0
	}
	return math.Sqrt(s.sumSqErr / float64(n))
}

// SNR is 10 log10(Σx² / Σ(y-x)²) over finite pairs, in dB; ok is false
// when there is no error (an infinite SNR) or no signal.
func (s *Stats) SNR() (db float64, ok bool) {
	if s.sumSqErr == 0 || s.sumSqSignal == 0 {
		return 0, false
	}
	return 10 * math.Log10(s.sumSqSignal/s.sumSqErr), true
}

// AddBuffers adds every pair of values of two buffers of dt (float16,
// bfloat16, float32 or float64, little-endian), x the original and y the
// reconstruction.
func (s *Stats) AddBuffers(dt reduce.DType, x, y []byte) error {
	if !dt.IsFloat() {
		return fmt.Errorf("errstat: %v is not a floating dtype", dt)
	}
	if len(x) != len(y) || len(x)%dt.Size() != 0 {
		return fmt.Errorf("errstat: buffers of %d and %d bytes are not equal whole %v values", len(x), len(y), dt)
	}
	size := dt.Size()
	for i := 0; i < len(x); i += size {
		xv, xb := value(dt, x[i:])
		yv, yb := value(dt, y[i:])
		s.Add(xv, yv, xb, yb)
	}
	return nil
}

// value reads one little-endian value of dt as a float64 and its bits.
func value(dt reduce.DType, b []byte) (float64, uint64) {
	switch dt {
	case reduce.Float16:
		h := binary.LittleEndian.Uint16(b)
		return float64(reduce.F16ToF32(h)), uint64(h)
	case reduce.BFloat16:
		h := binary.LittleEndian.Uint16(b)
		return float64(reduce.BF16ToF32(h)), uint64(h)
	case reduce.Float32:
		w := binary.LittleEndian.Uint32(b)
		return float64(math.Float32frombits(w)), uint64(w)
	}
	w := binary.LittleEndian.Uint64(b)
	return math.Float64frombits(w), w
}
