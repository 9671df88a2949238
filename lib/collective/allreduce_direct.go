package collective

import (
	"sync"
	"time"

	"github.com/gpubridge/gpubridge/lib/reduce"
)

// directAllReduce is the all-reduce over shared memory (direct.go): the
// buffer is cut into the ring's segments and each segment into pieces;
// piece i belongs to member i mod n, which reduces it from every member's
// buffer into its own, in the order of the piece's segment (x0 op x1 for
// two members; x[j+1], x[j+2], ..., x[j] for segment j of three or more,
// the partial always the earlier operand), applies Finish and announces it;
// the others copy it. So every member ends with ReferenceAllReduce's bits
// after one reduction pass over its share and one copy of the rest.
func (c *Comm) directAllReduce(cl *call, buf []byte, dt reduce.DType, op reduce.Op, descs []desc) error {
	n, L := c.size, len(buf)
	views, release, err := c.peerViews(cl, descs, L)
	if err != nil {
		return err
	}
	defer release()
	views[c.self] = buf
	segOff, segLen := ringSegments(L, dt.Size(), n)
	P := c.pieceSize(L)
	var pieces []dpiece
	for j := range n {
		for off := 0; off < segLen(j); off += P {
			pieces = append(pieces, dpiece{owner: len(pieces) % n, off: segOff(j) + off, n: min(P, segLen(j)-off), seg: j})
		}
	}
	w := c.workersPer(min(c.streams, (len(pieces)+n-1)/n))
	cp := c.copier(L)
	pl := &directPlan{
		pieces: pieces,
		ownEnd: func(p *dpiece) int { return p.off + p.n },
		produce: func(p *dpiece) error {
			dst := buf[p.off : p.off+p.n]
			t0 := time.Now()
			var err error
			if n == 2 {
				err = reduce.CombineParallel(op, dt, dst, views[0][p.off:p.off+p.n], views[1][p.off:p.off+p.n], w)
			} else {
				order := make([][]byte, n)
				for k := range n {
					m := mod(p.seg+1+k, n)
					order[k] = views[m][p.off : p.off+p.n]
				}
				err = chainParallel(op, dt, dst, order, w)
			}
			if err == nil {
				err = reduce.Finish(op, dt, dst, n)
			}
			cl.reduced(p.seg, t0)
			if err != nil {
				return err
			}
			cl.done(p.off, p.n)
			return nil
		},
		take: func(p *dpiece) error {
			cp(buf[p.off:p.off+p.n], views[p.owner][p.off:p.off+p.n])
			cl.done(p.off, p.n)
			return nil
		},
	}
	return c.runDirect(cl, pl, descs)
}

// chainBlock is the block chainParallel keeps in cache while it folds the
// operands into it.
const chainBlock = 32 << 10

var chainPool = sync.Pool{New: func() any { b := make([]byte, chainBlock); return &b }}

// chainParallel sets dst to ((srcs[0] op srcs[1]) op srcs[2]) op ... block
// by block, the partial in a cache-resident scratch block and always the
// earlier operand, over up to w goroutines (ranges of whole 64-byte
// blocks). dst may be any one of srcs: a block of dst is written only by
// the last step of that block, after every operand's block was read.
func chainParallel(op reduce.Op, dt reduce.DType, dst []byte, srcs [][]byte, w int) error {
	n := len(dst)
	w = min(w, n/(64<<10))
	if w <= 1 {
		return chain(op, dt, dst, srcs, 0, n)
	}
	per := (n/w + 63) &^ 63
	errs := make([]error, w)
	var wg sync.WaitGroup
	lo := 0
	for k := 0; k < w && lo < n; k++ {
		hi := min(lo+per, n)
		if k == w-1 {
			hi = n
		}
		from := lo
		wg.Go(func() { errs[k] = chain(op, dt, dst, srcs, from, hi) })
		lo = hi
	}
	wg.Wait()
	for _, err := range errs {
		if err != nil {
			return err
		}
	}
	return nil
}

// chain is chainParallel's work on bytes [lo, hi).
func chain(op reduce.Op, dt reduce.DType, dst []byte, srcs [][]byte, lo, hi int) error {
	bp := chainPool.Get().(*[]byte)
	defer chainPool.Put(bp)
	blk := chainBlock - chainBlock%dt.Size()
	last := len(srcs) - 1
	for a := lo; a < hi; a += blk {
		b := min(a+blk, hi)
		acc := (*bp)[:b-a]
		if err := reduce.Combine(op, dt, acc, srcs[0][a:b], srcs[1][a:b]); err != nil {
			return err
		}
		for _, s := range srcs[2:last] {
			if err := reduce.Combine(op, dt, acc, acc, s[a:b]); err != nil {
				return err
			}
		}
		if err := reduce.Combine(op, dt, dst[a:b], acc, srcs[last][a:b]); err != nil {
			return err
		}
	}
	return nil
}
