package errstat

import (
	"math"
	"testing"

	"github.com/gpubridge/gpubridge/lib/reduce"
	"github.com/stretchr/testify/assert"
)

func add(s *Stats, x, y float64) { s.Add(x, y, math.Float64bits(x), math.Float64bits(y)) }

func TestStats(t *testing.T) {
	var s Stats
	add(&s, 1, 1.25)  // abs 0.25, rel 0.25
	add(&s, -4, -4.5) // abs 0.5, rel 0.125
	add(&s, 2, 2)
	add(&s, 1e-30, 0) // flushed
	add(&s, math.NaN(), math.NaN())
	add(&s, math.Inf(-1), math.NaN())
	add(&s, 1e300, math.Inf(1))
	add(&s, 0, math.Copysign(0, -1))
	assert.Equal(t, Stats{Values: 8, Finite: 6, Differ: 6, NonFiniteIn: 2, KeptNaNs: 1, InfToNaN: 1, Overflowed: 1, Flushed: 1,
		MaxAbs: 0.5, MaxRel: 1, sumSqErr: 0.0625 + 0.25 + 1e-60, sumSqSignal: 1 + 16 + 4 + 1e-60}, s)
	assert.InDelta(t, math.Sqrt((0.0625+0.25)/5), s.RMSE(), 1e-15)
	db, ok := s.SNR()
	assert.True(t, ok)
	assert.InDelta(t, 10*math.Log10(21/0.3125), db, 1e-12)
}

func TestExact(t *testing.T) {
	var s Stats
	add(&s, 3, 3)
	_, ok := s.SNR()
	assert.False(t, ok)
	assert.Zero(t, s.RMSE())
	assert.Zero(t, s.Differ)
	var empty Stats
	assert.Zero(t, empty.RMSE())
}

func TestAddBuffers(t *testing.T) {
	x := []byte{0x00, 0x3c, 0x00, 0x7e} // float16 1, NaN
	y := []byte{0x01, 0x3c, 0x00, 0x7e}
	var s Stats
	assert.NoError(t, s.AddBuffers(reduce.Float16, x, y))
	assert.Equal(t, int64(2), s.Values)
	assert.Equal(t, int64(1), s.KeptNaNs)
	assert.InDelta(t, 1.0/1024, s.MaxRel, 1e-12)
	assert.EqualError(t, s.AddBuffers(reduce.Int32, x, y), "errstat: int32 is not a floating dtype")
	assert.EqualError(t, s.AddBuffers(reduce.Float32, x, y[:2]), "errstat: buffers of 4 and 2 bytes are not equal whole float32 values")
}
