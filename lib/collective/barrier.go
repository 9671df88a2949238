package collective

import (
	"context"
	"fmt"

	"github.com/gpubridge/gpubridge/lib/wire"
)

// token is a barrier frame received from a peer.
type token struct {
	seq   uint64
	round int
}

// Barrier returns once every member has entered it (and fails, like any
// collective, when one does not within the deadline). It runs on the
// control streams: a dissemination barrier of ceil(log2 Size) rounds, where
// in round k member r signals member r+2^k and waits for member r-2^k.
func (c *Comm) Barrier(ctx context.Context) error {
	cl, err := c.begin(ctx, kBarrier, "", 0, nil)
	if err != nil {
		return err
	}
	return c.run(cl, func() error {
		n, r := c.size, c.self
		for k := 0; 1<<k < n; k++ {
			to, from := mod(r+1<<k, n), mod(r-1<<k, n)
			h := wire.Header{Kind: wire.KindBarrier, Seq: cl.seq, Step: encodeStep(kBarrier, k, 0)}
			if err := c.sendControl(cl.ctx, to, h, nil); err != nil {
				return c.classify(cl.ctx, err, to, cl.limit, false, "it is not reading")
			}
			tok, err := c.takeToken(cl, from, k)
			if err != nil {
				return err
			}
			if tok.seq != cl.seq || tok.round != k {
				return fmt.Errorf("%s sent barrier #%d round %d, this member is in barrier #%d round %d: members called collectives in different orders", c.mesh.Peer(from), tok.seq, tok.round, cl.seq, k)
			}
		}
		return nil
	})
}

// takeToken waits for the next barrier token from peer, for round k.
func (c *Comm) takeToken(cl *call, peer, k int) (token, error) {
	for {
		c.mu.Lock()
		if q := c.bq[peer]; len(q) > 0 {
			tok := q[0]
			c.bq[peer] = q[1:]
			c.mu.Unlock()
			return tok, nil
		}
		note := c.bnote[peer]
		c.mu.Unlock()
		select {
		case <-note:
		case <-c.peers[peer].gone:
			c.mu.Lock()
			queued := len(c.bq[peer]) > 0
			c.mu.Unlock()
			if !queued {
				return token{}, c.peers[peer].lost
			}
		case <-cl.ctx.Done():
			// Round 0 tokens are sent on entry: missing one means the
			// peer has not entered. Later ones wait on other members.
			hint := "it has not entered the barrier"
			if k > 0 {
				hint = "it may be waiting for another member"
			}
			return token{}, c.classify(cl.ctx, cl.ctx.Err(), peer, cl.limit, k == 0, hint)
		}
	}
}

// barrierFrame files a barrier token from peer (on the dispatcher). A token
// for a collective this member runs or ran as something else is a mismatch:
// it fails that collective, or breaks the communicator when none runs.
func (c *Comm) barrierFrame(peer int, h wire.Header) error {
	k, round, _ := decodeStep(h.Step)
	if k != kBarrier {
		return fmt.Errorf("a barrier frame for %s #%d: protocol error", k, h.Seq)
	}
	c.mu.Lock()
	cur := c.cur
	switch {
	case cur != nil && (h.Seq < cur.seq || h.Seq == cur.seq && cur.kind != kBarrier):
		c.mu.Unlock()
		cur.cancel(fmt.Errorf("%s sent barrier #%d, this member is in %s #%d: members called collectives in different orders", c.mesh.Peer(peer), h.Seq, cur.kind, cur.seq))
		return nil
	case cur == nil && h.Seq <= c.finished:
		c.mu.Unlock()
		return fmt.Errorf("%s sent barrier #%d, but this member's collective #%d was no barrier: members called collectives in different orders", c.mesh.Peer(peer), h.Seq, h.Seq)
	}
	c.bq[peer] = append(c.bq[peer], token{h.Seq, round})
	c.mu.Unlock()
	select {
	case c.bnote[peer] <- struct{}{}:
	default:
	}
	return nil
}
