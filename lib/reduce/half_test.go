package reduce

import (
	"fmt"
	"math"
	"math/rand/v2"
	"os"
	"runtime"
	"sync"
	"sync/atomic"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

func TestF16ToF32Exhaustive(t *testing.T) {
	for i := 0; i < 1<<16; i++ {
		h := uint16(i)
		f := F16ToF32(h)
		if refF16.isNaN(h) {
			// NaN: sign and payload kept (shifted up), quiet bit as it was
			w := math.Float32bits(f)
			require.True(t, f != f, "%#04x", h)
			require.Equal(t, uint32(h&0x8000)<<16|0x7f800000|uint32(h&0x3ff)<<13, w, "%#04x", h)
			continue
		}
		want := refF16.decode(h)
		require.Equal(t, want, float64(f), "%#04x", h)
		require.Equal(t, math.Signbit(want), math.Signbit(float64(f)), "%#04x", h)
	}
}

func TestF16RoundTripExhaustive(t *testing.T) {
	for i := 0; i < 1<<16; i++ {
		h := uint16(i)
		want := h
		if refF16.isNaN(h) {
			want = h | 0x0200 // signalling NaNs come back quiet, payload kept
		}
		require.Equal(t, want, F32ToF16(F16ToF32(h)), "%#04x", h)
	}
}

func TestBF16Exhaustive(t *testing.T) {
	for i := 0; i < 1<<16; i++ {
		h := uint16(i)
		f := BF16ToF32(h)
		require.Equal(t, uint32(h)<<16, math.Float32bits(f), "%#04x", h)
		if refBF16.isNaN(h) {
			require.Equal(t, h|0x0040, F32ToBF16(f), "%#04x", h)
			continue
		}
		require.Equal(t, refBF16.decode(h), float64(f), "%#04x", h)
		require.Equal(t, h, F32ToBF16(f), "%#04x", h)
	}
}

// edgeF32 returns, for every finite non-negative pattern of f, the float32
// values where rounding changes: the value itself, its float32 neighbours,
// the midpoint to the next pattern and the midpoint's neighbours.
func edgeF32(f *halfFmt) []float32 {
	var out []float32
	for i, v := range f.pos {
		next := f.infValue
		if i+1 < len(f.pos) {
			next = f.pos[i+1]
		}
		mid := float32((v + next) / 2)
		require32(float64(mid) == (v+next)/2)
		for _, x := range []float32{float32(v), mid} {
			out = append(out, x, math.Nextafter32(x, 0), math.Nextafter32(x, float32(math.Inf(1))))
		}
	}
	return out
}

func require32(ok bool) {
	if !ok {
		panic("midpoint not representable in float32")
	}
}

func checkRound(t *testing.T, f *halfFmt, conv func(float32) uint16, xs []float32) {
	t.Helper()
	bad := 0
	for _, x := range xs {
		for _, v := range []float32{x, -x} {
			if v != v {
				continue
			}
			if got, want := conv(v), f.round(float64(v)); got != want {
				t.Errorf("%g (%#08x): got %#04x, want %#04x", v, math.Float32bits(v), got, want)
				if bad++; bad > 10 {
					t.FailNow()
				}
			}
		}
	}
}

func TestF32ToF16Rounding(t *testing.T) {
	checkRound(t, refF16, F32ToF16, edgeF32(refF16))
	// A sweep over the whole float32 range.
	var xs []float32
	for w := uint64(0); w < 1<<31; w += 1999 {
		xs = append(xs, math.Float32frombits(uint32(w)))
	}
	checkRound(t, refF16, F32ToF16, xs)
	// Named cases: ties to even, overflow, the denormal boundary.
	for _, tc := range []struct {
		in   float32
		want uint16
	}{
		{1 + 1.0/2048, 0x3c00},                     // tie between 1 and 1+2⁻¹⁰: even (1)
		{1 + 3.0/2048, 0x3c02},                     // tie between 1+2⁻¹⁰ and 1+2·2⁻¹⁰: even
		{65504, 0x7bff},                            // largest finite
		{65519.996, 0x7bff},                        // just below the overflow tie
		{65520, 0x7c00},                            // the tie rounds to even: Inf
		{1e10, 0x7c00},                             // overflow
		{float32(math.Inf(-1)), 0xfc00},            //
		{float32(math.Ldexp(1, -24)), 1},           // least denormal
		{float32(math.Ldexp(1, -25)), 0},           // half of it: tie to even 0
		{float32(math.Ldexp(1.5, -25)), 1},         // above the tie
		{float32(math.Ldexp(3, -25)), 2},           // tie between 1 and 2: even
		{float32(math.Ldexp(1, -14)), 0x0400},      // least normal
		{float32(math.Ldexp(1023.5, -24)), 0x0400}, // tie between largest denormal and least normal
		{float32(math.Copysign(0, -1)), 0x8000},
		{math.Float32frombits(1), 0}, // a float32 denormal
		{-math.Float32frombits(1), 0x8000},
	} {
		assert.Equal(t, tc.want, F32ToF16(tc.in), "%g", tc.in)
	}
	// NaN: quiet, sign and top payload bits kept.
	for _, w := range []uint32{0x7fc00000, 0xffc00000, 0x7f800001, 0x7fa00000, 0xff812345, 0x7fffffff} {
		want := uint16(w>>16)&0x8000 | 0x7e00 | uint16(w>>13)&0x3ff
		assert.Equal(t, want, F32ToF16(math.Float32frombits(w)), "%#08x", w)
	}
}

func TestF32ToBF16Rounding(t *testing.T) {
	checkRound(t, refBF16, F32ToBF16, edgeF32(refBF16))
	var xs []float32
	for w := uint64(0); w < 1<<31; w += 1999 {
		xs = append(xs, math.Float32frombits(uint32(w)))
	}
	checkRound(t, refBF16, F32ToBF16, xs)
	for _, tc := range []struct {
		in   uint32
		want uint16
	}{
		{0x3f808000, 0x3f80}, // tie: even
		{0x3f818000, 0x3f82}, // tie: even (up)
		{0x3f808001, 0x3f81}, // above the tie
		{0x3f807fff, 0x3f80}, // below the tie
		{0x7f7f8000, 0x7f80}, // tie above the largest finite: even is Inf
		{0x7f7fffff, 0x7f80}, // largest float32 rounds to Inf
		{0x7f7f7fff, 0x7f7f},
		{0x00008000, 0x0000}, // denormal tie: even
		{0x00018000, 0x0002},
		{0x80000001, 0x8000},
		{0x7f800000, 0x7f80},
		{0xff800000, 0xff80},
		{0x7f800001, 0x7fc0}, // signalling NaN: quieted, sign kept
		{0xff810000, 0xffc1},
		{0x7fc00000, 0x7fc0},
		{0x7fffffff, 0x7fff},
	} {
		assert.Equal(t, tc.want, F32ToBF16(math.Float32frombits(tc.in)), "%#08x", tc.in)
	}
}

// TestF32ToHalfAllFloat32 checks every float32 against the references, the
// range split over the CPUs. It takes about 80 CPU-seconds without -race, so
// it runs only with GPUBRIDGE_EXHAUSTIVE=1: make test sets it in its run
// without the race detector (under -race it would take many minutes).
func TestF32ToHalfAllFloat32(t *testing.T) {
	if os.Getenv("GPUBRIDGE_EXHAUSTIVE") != "1" {
		t.Skip("opt-in: checks every float32 conversion (about 80 CPU-seconds); GPUBRIDGE_EXHAUSTIVE=1 runs it (make test does, without -race)")
	}
	for _, tc := range []struct {
		name string
		f    *halfFmt
		conv func(float32) uint16
	}{{"float16", refF16, F32ToF16}, {"bfloat16", refBF16, F32ToBF16}} {
		t.Run(tc.name, func(t *testing.T) {
			const words = uint64(1) << 31 // the non-negative bit patterns; each is also checked negated
			parts := uint64(runtime.GOMAXPROCS(0))
			var failed atomic.Bool
			var wg sync.WaitGroup
			for p := range parts {
				wg.Go(func() {
					for w := words * p / parts; w < words*(p+1)/parts && !failed.Load(); w++ {
						v := math.Float32frombits(uint32(w))
						if v != v {
							continue
						}
						if got, want := tc.conv(v), tc.f.round(float64(v)); got != want {
							t.Errorf("%#08x: got %#04x, want %#04x", w, got, want)
							failed.Store(true)
						}
						if got, want := tc.conv(-v), tc.f.round(float64(-v)); got != want {
							t.Errorf("-%#08x: got %#04x, want %#04x", w, got, want)
							failed.Store(true)
						}
					}
				})
			}
			wg.Wait()
		})
	}
}

func TestF32ToF16Random(t *testing.T) {
	r := rand.New(rand.NewPCG(7, 7))
	for range 200000 {
		w := r.Uint32()
		v := math.Float32frombits(w)
		if v != v {
			continue
		}
		require.Equal(t, refF16.round(float64(v)), F32ToF16(v), fmt.Sprintf("%#08x", w))
		require.Equal(t, refBF16.round(float64(v)), F32ToBF16(v), fmt.Sprintf("%#08x", w))
	}
}
