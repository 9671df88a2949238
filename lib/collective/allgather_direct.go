package collective

// directAllGather is the all-gather over shared memory (direct.go): every
// member's input is cut into pieces it owns; once a piece of its input is
// ready the owner announces it (copying it into its own slot of out first
// when in is not that slot) and every other member copies it from the
// owner's input into the owner's slot of its out: one copy per byte.
func (c *Comm) directAllGather(cl *call, out, in []byte, descs []desc) error {
	n, me, L := c.size, c.self, len(in)
	views, release, err := c.peerViews(cl, descs, L)
	if err != nil {
		return err
	}
	defer release()
	views[me] = in
	slot := out[me*L : (me+1)*L]
	alias := sameSlice(in, slot)
	P := c.pieceSize(n * L)
	cp := c.copier(n * L)
	var pieces []dpiece
	for off := 0; off < L; off += P {
		for k := range n {
			pieces = append(pieces, dpiece{owner: k, off: off, n: min(P, L-off)})
		}
	}
	pl := &directPlan{
		pieces: pieces,
		gather: true,
		copied: true,
		ownEnd: func(p *dpiece) int { return p.off + p.n },
		produce: func(p *dpiece) error {
			if !alias {
				cp(slot[p.off:p.off+p.n], in[p.off:p.off+p.n]) // the peers read in
			}
			cl.done(me*L+p.off, p.n)
			return nil
		},
		take: func(p *dpiece) error {
			at := p.owner*L + p.off
			cp(out[at:at+p.n], views[p.owner][p.off:p.off+p.n])
			cl.done(at, p.n)
			return nil
		},
	}
	return c.runDirect(cl, pl, descs)
}
