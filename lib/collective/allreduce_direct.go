package collective

import (
	"context"
	"sync"
	"time"

	"github.com/gpubridge/gpubridge/lib/reduce"
)

// directAllReduce is the all-reduce over shared memory (direct.go): the
// buffer is cut into the ring's segments and each segment into pieces;
// piece i belongs to member i mod n, which reduces it from every member's
// buffer in the order of the piece's segment (x0 op x1 for two members;
// x[j+1], x[j+2], ..., x[j] for segment j of three or more, the partial
// always the earlier operand), applies Finish and announces it. So every
// member ends with ReferenceAllReduce's bits.
//
// With write (every member's descriptor has descWritable) the owner
// writes each finished block of the piece into every member's buffer, its
// own and each peer's, at the piece's offsets: one reduction pass over its
// share and one write of every result, nothing for the others to do but
// report the piece done when its final comes. Without, it writes its own
// buffer only and the others copy the piece from it: one more read and
// write of the rest of the buffer on every member.
func (c *Comm) directAllReduce(cl *call, buf []byte, dt reduce.DType, op reduce.Op, descs []desc, write bool) error {
	n, L := c.size, len(buf)
	views, release, err := c.peerViews(cl, descs, L)
	if err != nil {
		return err
	}
	defer release()
	views[c.self] = buf
	pieces := c.allReducePieces(L, dt.Size())
	w := c.workersPer(min(c.streams, (len(pieces)+n-1)/n))
	cp := c.copier(L)
	// order is piece p's operands in the order of its segment.
	order := func(p *dpiece) [][]byte {
		srcs := make([][]byte, n)
		for k := range n {
			m := k
			if n > 2 {
				m = mod(p.seg+1+k, n)
			}
			srcs[k] = views[m][p.off : p.off+p.n]
		}
		return srcs
	}
	pl := &directPlan{
		pieces: pieces,
		copied: !write,
		ownEnd: func(p *dpiece) int { return p.off + p.n },
		produce: func(p *dpiece) error {
			t0 := time.Now()
			var err error
			switch {
			case write:
				dsts := make([][]byte, n)
				for m := range n {
					dsts[m] = views[m][p.off : p.off+p.n]
				}
				err = foldParallel(cl.ctx, op, dt, n, dsts, order(p), plainCopy, w)
			case n == 2:
				dst := buf[p.off : p.off+p.n]
				err = reduce.CombineParallel(op, dt, dst, views[0][p.off:p.off+p.n], views[1][p.off:p.off+p.n], w)
				if err == nil {
					err = reduce.Finish(op, dt, dst, n)
				}
			default:
				dst := buf[p.off : p.off+p.n]
				err = chainParallel(op, dt, dst, order(p), w)
				if err == nil {
					err = reduce.Finish(op, dt, dst, n)
				}
			}
			cl.reduced(p.seg, t0)
			if err != nil {
				return err
			}
			cl.done(p.off, p.n)
			return nil
		},
		take: func(p *dpiece) error {
			if !write {
				cp(buf[p.off:p.off+p.n], views[p.owner][p.off:p.off+p.n])
			}
			cl.done(p.off, p.n)
			return nil
		},
	}
	return c.runDirect(cl, pl, descs)
}

// plainCopy is the write-through's store of a finished block into each
// member's buffer: ordinary stores, not lib/ntcopy's, at every size. The
// owner has just read those lines (every operand of the block), so they
// are in cache and need no read for ownership; streaming them out evicts
// them and fences every block. Measured on the 16-core H200 host at
// 8c7c059, 256 MiB and 1 GiB: 2 members 26.8 and 31.7 GB/s against 22.3
// and 24.9 non-temporal, 4 members 12.9 and 13.9 against 11.5 and 11.9
// (docs/BENCHMARKS.md).
func plainCopy(dst, src []byte) int { return copy(dst, src) }

// allReducePieces cuts a direct all_reduce's buffer of L bytes (elements
// of es bytes) into its pieces: the ring's segments, each in pieces of
// pieceSize, owned by members in turn.
func (c *Comm) allReducePieces(L, es int) []dpiece {
	n := c.size
	segOff, segLen := ringSegments(L, es, n)
	P := c.pieceSize(L)
	var pieces []dpiece
	for j := range n {
		for off := 0; off < segLen(j); off += P {
			pieces = append(pieces, dpiece{owner: len(pieces) % n, off: segOff(j) + off, n: min(P, segLen(j)-off), seg: j})
		}
	}
	return pieces
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
	return inRanges(len(dst), w, func(lo, hi int) error { return chain(op, dt, dst, srcs, lo, hi) })
}

// foldParallel sets every one of dsts to ((srcs[0] op srcs[1]) op ...)
// finished for members (reduce.Finish), block by block: each block is
// folded in a cache-resident scratch block, the partial always the
// earlier operand (chainParallel's order and bits, for two operands
// too), finished there, then written into every dst with cp, over up to
// w goroutines (ranges of whole 64-byte blocks). dsts may be srcs: a
// block is written only after every operand's block was read. It stops
// between blocks once ctx is done (errSibling), so that a member no
// longer writes into its peers' buffers long after the call failed.
func foldParallel(ctx context.Context, op reduce.Op, dt reduce.DType, members int, dsts, srcs [][]byte, cp func(dst, src []byte) int, w int) error {
	return inRanges(len(dsts[0]), w, func(lo, hi int) error {
		bp := chainPool.Get().(*[]byte)
		defer chainPool.Put(bp)
		blk := chainBlock - chainBlock%dt.Size()
		for a := lo; a < hi; a += blk {
			if ctx.Err() != nil {
				return errSibling
			}
			b := min(a+blk, hi)
			acc := (*bp)[:b-a]
			if err := reduce.Combine(op, dt, acc, srcs[0][a:b], srcs[1][a:b]); err != nil {
				return err
			}
			for _, s := range srcs[2:] {
				if err := reduce.Combine(op, dt, acc, acc, s[a:b]); err != nil {
					return err
				}
			}
			if err := reduce.Finish(op, dt, acc, members); err != nil {
				return err
			}
			for _, d := range dsts {
				cp(d[a:b], acc)
			}
		}
		return nil
	})
}

// inRanges runs f over [0, n) in up to w ranges of whole 64-byte blocks
// (one goroutine each, from 64 KiB per range) and returns the first
// error.
func inRanges(n, w int, f func(lo, hi int) error) error {
	w = min(w, n/(64<<10))
	if w <= 1 {
		return f(0, n)
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
		wg.Go(func() { errs[k] = f(from, hi) })
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
