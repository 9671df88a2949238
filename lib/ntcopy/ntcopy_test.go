package ntcopy

import (
	"math/rand/v2"
	"strconv"
	"testing"

	"github.com/stretchr/testify/require"
)

// TestCopyMatchesCopy compares Copy with the built-in copy over lengths
// around the streaming threshold, the 64-byte head and the 128-byte step,
// every start offset of dst and src within a cache line, and dst and src of
// different lengths; the bytes around dst's copied range must stay as they
// were.
func TestCopyMatchesCopy(t *testing.T) {
	var lens []int
	for _, base := range []int{0, 64, 128, minBytes, minBytes + 4096, 64 << 10} {
		for _, d := range []int{-129, -128, -127, -65, -64, -63, -1, 0, 1, 31, 32, 63, 64, 65, 127, 128, 129} {
			if base+d >= 0 {
				lens = append(lens, base+d)
			}
		}
	}
	rng := rand.New(rand.NewPCG(1, 2))
	const guard = 64
	for _, n := range lens {
		for _, offs := range [][2]int{{0, 0}, {1, 0}, {0, 1}, {7, 13}, {31, 32}, {32, 0}, {63, 1}, {rng.IntN(64), rng.IntN(64)}} {
			for _, extra := range [][2]int{{0, 0}, {5, 0}, {0, 5}} {
				src := make([]byte, offs[1]+n+extra[1]+guard)
				for i := range src {
					src[i] = byte(rng.Uint32())
				}
				s := src[offs[1] : offs[1]+n+extra[1]]
				want := make([]byte, guard+offs[0]+n+extra[0]+guard)
				for i := range want {
					want[i] = byte(rng.Uint32())
				}
				got := append([]byte(nil), want...)
				wn := copy(want[guard+offs[0]:guard+offs[0]+n+extra[0]], s)
				gn := Copy(got[guard+offs[0]:guard+offs[0]+n+extra[0]], s)
				require.Equal(t, wn, gn, "n %d offsets %v extra %v", n, offs, extra)
				require.Equal(t, want, got, "n %d offsets %v extra %v", n, offs, extra)
			}
		}
	}
}

// TestCopyOverlapping: overlapping buffers take the built-in copy, which
// moves them as if through a temporary.
func TestCopyOverlapping(t *testing.T) {
	for _, shift := range []int{-4097, -64, -1, 1, 64, 4097} {
		n := 3 * minBytes
		buf := make([]byte, n+16384)
		for i := range buf {
			buf[i] = byte(i * 7)
		}
		want := append([]byte(nil), buf...)
		at := 8192
		copy(want[at+shift:at+shift+n], want[at:at+n])
		require.Equal(t, n, Copy(buf[at+shift:at+shift+n], buf[at:at+n]))
		require.Equal(t, want, buf, "shift %d", shift)
	}
}

func BenchmarkCopy(b *testing.B) {
	for _, mb := range []int{4, 64, 256} {
		src, dst := make([]byte, mb<<20), make([]byte, mb<<20)
		for _, c := range []struct {
			name string
			fn   func(d, s []byte) int
		}{{"copy", func(d, s []byte) int { return copy(d, s) }}, {"ntcopy", Copy}} {
			b.Run(c.name+"/"+strconv.Itoa(mb)+"MiB", func(b *testing.B) {
				b.SetBytes(int64(len(src)))
				for b.Loop() {
					c.fn(dst, src)
				}
			})
		}
	}
}
