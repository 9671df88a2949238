package collective

import "github.com/gpubridge/gpubridge/lib/codec"

// ringSegmentsAligned is ringSegments with segments of a multiple of
// align values: segment j holds values [j*per, (j+1)*per), clipped, per
// being ceil(E/n) rounded up to a multiple of align (so small buffers
// leave the last segments empty).
func ringSegmentsAligned(L, es, n, align int) (off func(j int) int, length func(j int) int) {
	E := L / es
	per := ((E+n-1)/n + align - 1) / align * align * es
	off = func(j int) int { return min(j*per, L) }
	length = func(j int) int { return min(j*per+per, L) - off(j) }
	return off, length
}

// ring is the low-precision ring of docs/COMPRESSION.md for three or more
// members, on ringAllReduce's schedule over segments of multiples of 1024
// values (so every hop's chunks are whole fp8 groups):
//
//  1. at step 0 member j+1 sends segment j packed: Q(x[j+1] + r);
//  2. at each later hop member m decodes the received partial, adds its
//     input in float32 (the received partial first) and sends
//     Q(P + r);
//  3. the owner j adds its input, applies Finish over n members once, and
//     packs the sum once more, Q(S + r), and sets its result to that
//     packing's decoding;
//  4. the all-gather forwards those final bytes unchanged, and every
//     member sets its result to their decoding, in the dtype.
//
// Each member quantizes each value once per call (n-1 partials it sends
// on, the sum it owns), so one residual per value suffices. What it sends
// lives in lz.packed at the values' place: the packing made at step 0,
// the partials made as they arrive, the final sum, and in the all-gather
// the final bytes it forwards. The pipe's dependencies keep them apart: a
// partial of segment j is made at the receive before the send of j, and
// a segment's final bytes arrive n-1 steps after this member sent that
// segment's partial.
func (lz *lossy) ring(C int) error {
	c, cl, es := lz.c, lz.cl, lz.es
	n, r := c.size, c.self
	segOff, segLen := ringSegmentsAligned(len(lz.buf), es, n, codec.GroupElems)
	w := c.workersPer(min(c.streams, (segLen(0)+C-1)/C))
	span := func(j, off, m int) (v0, v1 int) {
		at := segOff(j) + off
		return at / es, (at + m) / es
	}
	pp := &pipe{
		cl: cl, next: mod(r+1, n), prev: mod(r-1, n), steps: 2*n - 2,
		sendSeg: func(t int) int { return mod(r-t-1, n) },
		recvSeg: func(t int) int { return mod(r-t-2, n) },
		segLen:  segLen,
		chunk:   C,
		sendLag: 1,
		// In the all-gather a segment's final bytes land where this
		// member's partial of it was sent from n-1 steps before.
		recvLag: n - 1, recvFrom: n - 1, recvTo: 2*n - 3,
		primary: true,
		payload: func(t, j, ch, off, m int) ([]byte, error) {
			v0, v1 := span(j, off, m)
			q := lz.pk(lz.packed, v0, v1)
			if t > 0 {
				return q, nil
			}
			if err := cl.ready(segOff(j) + off + m); err != nil {
				return nil, err
			}
			return q, lz.encode(ch, w, q, v0, v1)
		},
		prep: func(t, j, _, off, m int) error {
			if t <= n-2 {
				return cl.ready(segOff(j) + off + m)
			}
			return nil
		},
		recv: func(t, j, ch, off, m int, p []byte) error {
			v0, v1 := span(j, off, m)
			q := lz.pk(lz.packed, v0, v1)
			switch {
			case t < n-2:
				return lz.partial(ch, w, q, p, v0, v1)
			case t == n-2:
				return lz.final(ch, w, n, q, p, v0, v1)
			case t < 2*n-3:
				copy(q, p)
			}
			return lz.decode(ch, w, p, v0, v1)
		},
		// A result is final once decoded: the owner's at its last
		// reduce-scatter step, the others' as they arrive.
		received: func(t, j, _, off, m int) {
			if t >= n-2 {
				cl.done(segOff(j)+off, m)
			}
		},
	}
	return pp.run()
}
