package collective

import (
	"errors"
	"math/bits"
	"time"

	"github.com/gpubridge/gpubridge/lib/reduce"
)

// rdShape is the schedule of a recursive-doubling all-reduce over n
// members: the core is the first p = 2^k members (the largest power of two
// at most n), each of the other n-p "extra" members r is folded into its
// partner r-p before the core's k rounds and gets the result back after.
type rdShape struct{ n, p, k, extra int }

func newRDShape(n int) rdShape {
	k := bits.Len(uint(n)) - 1
	p := 1 << k
	return rdShape{n: n, p: p, k: k, extra: n - p}
}

// Frame steps: the fold, the rounds, the unfold.
func (s rdShape) foldStep() int       { return 0 }
func (s rdShape) roundStep(i int) int { return 1 + i }
func (s rdShape) unfoldStep() int     { return 1 + s.k }

// recursiveDoubling is the small-message all-reduce (doc.go, "Recursive
// doubling"): every step moves the whole buffer between two members. An
// extra member r >= p sends its input to r-p (step 0), which reduces
// x[r-p] op x[r] into its buffer; in round i (step 1+i) core member r
// exchanges its buffer with r XOR 2^i and both reduce the lower member's
// partial op the higher one's, so after round k-1 every core member holds
// the same bits; they apply Finish, and each partner of an extra sends it
// the result (step k+1). Every step is one pipe of one step through the
// transport (chunks of C bytes over the streams, as the exchange), run one
// after the other.
func (c *Comm) recursiveDoubling(cl *call, buf []byte, dt reduce.DType, op reduce.Op, C int) error {
	sh := newRDShape(c.size)
	r := c.self
	whole := func(int) int { return len(buf) }
	zero := func(int) int { return 0 }
	w := c.workersPer(min(c.streams, (len(buf)+C-1)/C))
	input := func(_, _, _, off, n int) ([]byte, error) {
		if err := cl.ready(off + n); err != nil {
			return nil, err
		}
		return buf[off : off+n], nil
	}
	// one returns a pipe of one step with peer: sends when send, receives
	// when recv.
	one := func(step, peer int, send, recv bool) *pipe {
		pp := &pipe{
			cl: cl, next: -1, prev: -1, steps: 1,
			sendSeg: zero, recvSeg: zero, segLen: whole,
			chunk: C, sendLag: -1, recvLag: 0, recvFrom: 1, recvTo: 0,
			stepOff: step, payload: input,
		}
		if send {
			pp.next = peer
		}
		if recv {
			pp.prev = peer
		}
		return pp
	}
	// combine reduces a received partial p into own, the lower member's
	// value the earlier operand.
	combine := func(ch int, own, p []byte, peerLower bool) error {
		t0 := time.Now()
		defer cl.reduced(ch, t0)
		if peerLower {
			return reduce.CombineParallel(op, dt, own, p, own, w)
		}
		return reduce.CombineParallel(op, dt, own, own, p, w)
	}

	if r >= sh.p {
		// An extra member: its input to the partner, the result back.
		partner := r - sh.p
		if err := one(sh.foldStep(), partner, true, false).run(); err != nil {
			return err
		}
		back := one(sh.unfoldStep(), partner, false, true)
		back.recv = func(_, _, _, off, n int, p []byte) error {
			copy(buf[off:off+n], p)
			return nil
		}
		back.received = func(_, _, _, off, n int) { cl.done(off, n) }
		return back.run()
	}
	hasExtra := r < sh.extra
	if hasExtra {
		fold := one(sh.foldStep(), r+sh.p, false, true)
		fold.primary = true
		fold.prep = func(_, _, _, off, n int) error { return cl.ready(off + n) }
		fold.recv = func(_, _, ch, off, n int, p []byte) error {
			return combine(ch, buf[off:off+n], p, false)
		}
		if err := fold.run(); err != nil {
			return err
		}
	}
	for i := range sh.k {
		peer := r ^ 1<<i
		last := i == sh.k-1
		rd := one(sh.roundStep(i), peer, true, true)
		// Own chunk c is overwritten by the reduction only once sent.
		rd.recvFrom, rd.recvTo = 0, 0
		// The peer sends at once in the first round, unless it waits
		// for an extra member of its own first; later it sends what
		// it received from another.
		rd.primary = i == 0 && peer >= sh.extra
		rd.recv = func(_, _, ch, off, n int, p []byte) error {
			own := buf[off : off+n]
			if err := combine(ch, own, p, peer < r); err != nil {
				return err
			}
			if last {
				return reduce.Finish(op, dt, own, sh.n)
			}
			return nil
		}
		if last {
			rd.received = func(_, _, _, off, n int) { cl.done(off, n) }
		}
		if err := rd.run(); err != nil {
			var te *timeoutError
			if i == 0 && !rd.primary && errors.As(err, &te) && !cl.heard[peer].Load() {
				// The peer sent nothing: it never came, or it waits
				// for its extra member, who is then the one its own
				// fold names (a primary timeout, reported at once).
				// Reported before the members further off, who wait
				// the whole grace, so they all name the same member.
				te.likely = true
			}
			return err
		}
	}
	if hasExtra {
		back := one(sh.unfoldStep(), r+sh.p, true, false)
		back.payload = func(_, _, _, off, n int) ([]byte, error) { return buf[off : off+n], nil }
		return back.run()
	}
	return nil
}
