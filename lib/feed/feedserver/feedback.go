package feedserver

import (
	"fmt"
	"sync"

	"github.com/gpubridge/gpubridge/lib/reduce"
)

// DefaultMaxFeedbackBytes caps a session's error-feedback residuals
// (ServerOptions.MaxFeedbackBytes).
const DefaultMaxFeedbackBytes = 64 << 30

// residualSize is the bytes of a residual per value: float32, whatever the
// dtype (docs/COMPRESSION.md, "Error feedback").
const residualSize = 4

// feedback holds a session's error-feedback residuals: one float32
// residual per bridge and key a lossy all_reduce carries (docs/FEED.md
// §3a, §3b): a key's calls on one bridge run in request order, those on
// two bridges would not, so each bridge has its own.
//
// A request takes its key's residual when it is accepted, in request
// order, so that the cap is checked before anything runs and a refusal
// changes nothing; collectives run one at a time in that order, so calls
// with the same key use its residual one after the other, each seeing the
// previous one's update. A key that comes with another dtype or length
// gets a new residual of zeros; the old one is dropped, and its memory is
// freed (and uncounted) once the calls accepted before, which hold it,
// have finished. A failed collective breaks the bridge, after which no
// call runs: the residuals are dropped then, and at the session's end.
type feedback struct {
	max uint64

	mu    sync.Mutex
	keys  map[fbKey]*residual
	bytes uint64 // residuals alive: in keys, or dropped but still held
}

// fbKey names a residual: the bridge the calls run on, and their key.
type fbKey struct {
	bridge uint32
	key    uint64
}

// residual is one key's state.
type residual struct {
	dt    reduce.DType
	n     uint64 // values
	mem   []byte // n float32s; made (zeros) when its first call runs
	refs  int    // accepted calls that hold it and have not finished
	alive bool   // in keys
}

func (r *residual) size() uint64 { return residualSize * r.n }

func newFeedback(max uint64) *feedback {
	return &feedback{max: max, keys: map[fbKey]*residual{}}
}

// take returns key's residual for a call on n values of dt and holds it
// for the call until release: the key's residual when it has that dtype
// and length, else a new one (zeros). It refuses, changing nothing, a new
// residual that would bring the residuals over the cap.
func (f *feedback) take(bridge uint32, key uint64, dt reduce.DType, n uint64) (*residual, error) {
	f.mu.Lock()
	defer f.mu.Unlock()
	old := f.keys[fbKey{bridge, key}]
	if old != nil && old.dt == dt && old.n == n {
		old.refs++
		return old, nil
	}
	r := &residual{dt: dt, n: n, refs: 1, alive: true}
	// f.bytes <= f.max: no sum below overflows.
	kept := f.bytes
	if old != nil && old.refs == 0 {
		kept -= old.size()
	}
	if n > f.max/residualSize || kept+r.size() > f.max {
		return nil, fmt.Errorf("feedback key %d: a residual of %d %s values takes %d bytes, and this feed's residuals would take %d, over the cap of %d bytes (gbbridge serve --max-feedback)",
			key, n, dt, residualSize*n, kept+residualSize*n, f.max)
	}
	if old != nil {
		f.drop(old)
	}
	f.keys[fbKey{bridge, key}] = r
	f.bytes += r.size()
	return r, nil
}

// drop takes r out of the keys; its memory goes with its last call.
func (f *feedback) drop(r *residual) {
	r.alive = false
	if r.refs == 0 {
		f.bytes -= r.size()
		r.mem = nil
	}
}

// memory returns r's values for the call that runs now, zeros the first
// time.
func (f *feedback) memory(r *residual) []byte {
	f.mu.Lock()
	defer f.mu.Unlock()
	if r.mem == nil {
		r.mem = make([]byte, r.size())
	}
	return r.mem
}

// release ends a call's hold on r.
func (f *feedback) release(r *residual) {
	if r == nil {
		return
	}
	f.mu.Lock()
	defer f.mu.Unlock()
	r.refs--
	if r.refs == 0 && !r.alive {
		f.bytes -= r.size()
		r.mem = nil
	}
}

// dropAll drops every residual: the session ended.
func (f *feedback) dropAll() {
	f.mu.Lock()
	defer f.mu.Unlock()
	for k, r := range f.keys {
		f.drop(r)
		delete(f.keys, k)
	}
}

// dropBridge drops the residuals of one bridge: it broke.
func (f *feedback) dropBridge(bridge uint32) {
	f.mu.Lock()
	defer f.mu.Unlock()
	for k, r := range f.keys {
		if k.bridge == bridge {
			f.drop(r)
			delete(f.keys, k)
		}
	}
}

// usage returns the residuals' keys and bytes (tests).
func (f *feedback) usage() (keys int, bytes uint64) {
	f.mu.Lock()
	defer f.mu.Unlock()
	return len(f.keys), f.bytes
}
