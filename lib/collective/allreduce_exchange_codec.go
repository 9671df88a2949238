package collective

// exchange is the two-member compressed all-reduce (docs/COMPRESSION.md):
// each member packs its chunk, Q(x + r), keeps the packing and sends it;
// as the peer's packing of the chunk arrives, both compute dec(q0) +
// dec(q1) in float32 — member 0's packing the earlier operand, and each
// member its own packing's decoding, not its exact input, so both hold
// the same sum — then Finish for 2 members, then the dtype. Chunks are
// multiples of codec.ChunkAlign values, so the packed chunks are
// consecutive pieces of the buffer's packing (lz.packed).
func (lz *lossy) exchange(C int) error {
	c, cl, es := lz.c, lz.cl, lz.es
	L := len(lz.buf)
	w := c.workersPer(min(c.streams, (L+C-1)/C))
	zero := func(int) int { return 0 }
	pp := &pipe{
		cl: cl, next: 1 - c.self, prev: 1 - c.self, steps: 1,
		sendSeg: zero, recvSeg: zero,
		segLen:  func(int) int { return L },
		chunk:   C,
		sendLag: -1,
		// The result overwrites the chunk's input, which its packing was
		// made from before it was sent.
		recvLag: 0, recvFrom: 0, recvTo: 0,
		primary: true,
		payload: func(_, _, ch, off, n int) ([]byte, error) {
			if err := cl.ready(off + n); err != nil {
				return nil, err
			}
			v0, v1 := off/es, (off+n)/es
			q := lz.pk(lz.packed, v0, v1)
			return q, lz.encode(ch, w, q, v0, v1)
		},
		recv: func(_, _, ch, off, n int, p []byte) error {
			v0, v1 := off/es, (off+n)/es
			own := lz.pk(lz.packed, v0, v1)
			if c.self == 0 {
				return lz.sum2(ch, w, own, p, v0, v1)
			}
			return lz.sum2(ch, w, p, own, v0, v1)
		},
		received: func(_, _, _, off, n int) { cl.done(off, n) },
	}
	return pp.run()
}
