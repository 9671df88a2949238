package transport

import (
	"context"
	"fmt"
	"sync"
	"sync/atomic"
)

// piecePool is a stream's buffers for the pieces its receiver holds
// (PieceHolder): at most MaxHeldPieces, each made on first need and kept.
// The buffer released last is taken first: it is the likeliest to be in
// cache still, and a receiver that keeps up with the wire cycles through
// two of them. One goroutine takes (the stream's receiver); any may
// release.
type piecePool struct {
	mu    sync.Mutex
	free  [][]byte
	made  int
	freed chan struct{} // a taker waiting is woken by the next release
}

func newPiecePool() *piecePool { return &piecePool{freed: make(chan struct{}, 1)} }

// take returns a buffer of at least size bytes (made of size bytes, or
// remade when the pieces grew) and the function that releases it
// (once; further calls do nothing), waiting while MaxHeldPieces are held
// unless ctx ends or the mesh closes (done). peer and idx name the stream
// in errors.
func (pp *piecePool) take(ctx context.Context, size int, done <-chan struct{}, peer string, idx int) ([]byte, func(), error) {
	for {
		b, ok := pp.grab()
		if ok {
			if len(b) < size {
				b = make([]byte, size)
			}
			var once atomic.Bool
			return b, func() {
				if once.CompareAndSwap(false, true) {
					pp.put(b)
				}
			}, nil
		}
		select {
		case <-pp.freed:
		case <-ctx.Done():
			return nil, nil, fmt.Errorf("receive from %s on stream %d: %w", peer, idx, ctx.Err())
		case <-done:
			return nil, nil, fmt.Errorf("receive from %s: %w", peer, ErrClosed)
		}
	}
}

// grab pops the buffer released last, or counts a new one (nil: the caller
// makes it); false when MaxHeldPieces are held.
func (pp *piecePool) grab() ([]byte, bool) {
	pp.mu.Lock()
	defer pp.mu.Unlock()
	if n := len(pp.free); n > 0 {
		b := pp.free[n-1]
		pp.free = pp.free[:n-1]
		return b, true
	}
	if pp.made < MaxHeldPieces {
		pp.made++
		return nil, true
	}
	return nil, false
}

func (pp *piecePool) put(b []byte) {
	pp.mu.Lock()
	pp.free = append(pp.free, b)
	pp.mu.Unlock()
	select {
	case pp.freed <- struct{}{}:
	default:
	}
}
