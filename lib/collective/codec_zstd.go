package collective

import (
	"fmt"
	"time"

	"github.com/gpubridge/gpubridge/lib/codec"
	"github.com/gpubridge/gpubridge/lib/wire"
)

// The lossless codec on every pipe collective (docs/COMPRESSION.md, "On
// the wire"): the sender packs each chunk it would send into one zstd/v1
// chunk, the receiver unpacks each frame into exactly the chunk's bytes and
// hands that view to the collective's own consumer, so the results are
// raw's bit for bit whatever the collective does with them.

// zstdScratch is one data stream's buffers for a lossless call, kept by
// the Comm across calls: send holds the frame being sent (the stream's
// sender only), recv the chunk unpacked from the frame received (its
// consumer only).
type zstdScratch struct{ send, recv []byte }

// zstdFor returns data stream s's scratch (made by pipe.run before its
// goroutines start).
func (c *Comm) zstdFor(s int) *zstdScratch { return &c.zstd[s] }

// grow returns b resized to n bytes, reallocated only when too small.
func grow(b *[]byte, n int) []byte {
	if cap(*b) < n {
		*b = make([]byte, n)
	}
	return (*b)[:n]
}

// zpack packs the payload p that data stream s is about to send.
func (pp *pipe) zpack(s int, p []byte) ([]byte, error) {
	cl := pp.cl
	z := cl.c.zstdFor(s)
	dst := grow(&z.send, codec.LosslessMaxLen(cl.cdt, len(p)))
	t0 := time.Now()
	k, err := codec.EncodeLossless(dst, cl.cdt, p, codec.LosslessOptions{})
	cl.coded(s, t0)
	if err != nil {
		return nil, fmt.Errorf("packing chunk: %w", err)
	}
	return dst[:k], nil
}

// zunpack unpacks the frame p of chunk k received on data stream s into
// the stream's scratch and returns its k.n bytes. A frame that does not
// unpack to exactly that is corrupt: the error names the peer.
func (pp *pipe) zunpack(s int, k chunkAt, p []byte) ([]byte, error) {
	cl := pp.cl
	z := cl.c.zstdFor(s)
	dst := grow(&z.recv, k.n)
	t0 := time.Now()
	err := codec.DecodeLossless(dst, cl.cdt, p)
	cl.coded(s, t0)
	if err != nil {
		return nil, &corruptPacking{peer: cl.c.mesh.Peer(pp.prev), k: k, kind: cl.kind, seq: cl.seq, packed: len(p), err: err}
	}
	return dst, nil
}

// corruptPacking is a frame whose payload does not unpack to its chunk. It
// matches wire.ErrCorrupt (a corrupt frame, as a CRC mismatch is) and
// unwraps to the codec's error.
type corruptPacking struct {
	peer   string
	k      chunkAt
	kind   kind
	seq    uint64
	packed int
	err    error
}

func (e *corruptPacking) Error() string {
	return fmt.Sprintf("%s sent a corrupt frame (chunk %d of step %d of %s #%d: %d packed bytes for %d bytes of values): %v",
		e.peer, e.k.c, e.k.t, e.kind, e.seq, e.packed, e.k.n, e.err)
}

func (e *corruptPacking) Unwrap() error        { return e.err }
func (e *corruptPacking) Is(target error) bool { return target == wire.ErrCorrupt }
