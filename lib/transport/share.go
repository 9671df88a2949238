package transport

import (
	"context"
	"errors"
	"fmt"
	"sync"
	"unsafe"
)

// Sharer is implemented by meshes whose members can read each other's
// memory in place: the shm mesh (the members are processes of one host; at
// set-up each pair opens a Unix socket, authenticated by the job's secret
// and the peer's pid, over which they pass sealed memfds) and the
// in-memory mesh of tests. The collectives use it to reduce straight from
// the peers' buffers instead of copying them through the rings
// (lib/collective). Peers' regions are mapped read-only, unless the mesh
// was built with Config.PeerWrite: then they are mapped writable, and a
// collective may write its results into a peer's buffer, within the range
// [off, off+n) of the peer's region that the peer announced for the call
// (PeerMem returns exactly that range, its capacity included, so no write
// through it lands outside). Whoever can write a member's memory this way
// is a member of the same job: the memfds travel only over sockets whose
// other end proved the job's secret and is, by SO_PEERCRED, the member's
// process of this user (shm_share.go).
type Sharer interface {
	// Share offers mem, the mapping of bytes [0, len(mem)) of the memfd
	// fd (sealed against shrinking: CheckMemfd), to every peer and returns
	// its id. It returns once every peer has been sent its own descriptor;
	// a peer maps it as its reader gets it. fd stays the caller's. The
	// in-memory mesh takes fd -1.
	Share(fd int, mem []byte) (id uint64, err error)
	// Unshare withdraws region id: Locate no longer finds it, and the
	// peers unmap it once no collective of theirs uses it. The caller
	// unmaps its own mapping after Unshare, and only between collectives.
	Unshare(id uint64)
	// Locate returns the shared region that holds all of buf, and buf's
	// offset in it; ok is false when buf is not wholly in one.
	Locate(buf []byte) (id, off uint64, ok bool)
	// PeerMem returns bytes [off, off+n) of peer's region id (capacity n),
	// waiting (within ctx) until the region has arrived. They are
	// read-only, unless PeerWrite says the mesh maps peers writable: then
	// they may be written (the peer's own mapping sees the writes). The
	// view stays valid until release is called (once; further calls do
	// nothing), even after the mesh is closed.
	PeerMem(ctx context.Context, peer int, id, off, n uint64) (mem []byte, release func(), err error)
	// PeerWrite reports whether the mesh was built with Config.PeerWrite:
	// the bytes PeerMem returns may be written, and this member lets its
	// peers write its shared buffers.
	PeerWrite() bool
}

// Limits of sharing.
const (
	// MaxSharedRegions bounds the regions one peer may have shared with a
	// member at once.
	MaxSharedRegions = 4096
	// MaxSharedBytes bounds one shared region.
	MaxSharedBytes = 1 << 40
)

// ErrNotShared is what PeerMem returns (wrapped) for a region the peer
// never offered or withdrew, or a range outside it.
var ErrNotShared = errors.New("not shared")

// shareTable is one member's side of sharing: the regions it offers and
// those its peers offered, with their references. The shm and in-memory
// meshes share it; how regions travel is theirs.
type shareTable struct {
	peerName func(int) string

	mu     sync.Mutex
	nextID uint64
	own    map[uint64][]byte
	peers  []*peerShares
	closed bool
	live   int // peer regions mapped here, for tests
}

// peerShares are the regions one peer offered.
type peerShares struct {
	regions map[uint64]*peerRegion
	gone    error         // the peer's channel ended: no more regions come
	change  chan struct{} // closed and replaced when regions or gone change
}

type peerRegion struct {
	mem     []byte
	err     error // the region could not be mapped
	refs    int
	dropped bool
	unmap   func([]byte) // lets go of mem; nil: nothing to do
}

func newShareTable(size int, peerName func(int) string) *shareTable {
	t := &shareTable{peerName: peerName, own: map[uint64][]byte{}, peers: make([]*peerShares, size)}
	for i := range t.peers {
		t.peers[i] = &peerShares{regions: map[uint64]*peerRegion{}, change: make(chan struct{})}
	}
	return t
}

// newID returns the id of a region about to be offered.
func (t *shareTable) newID() uint64 {
	t.mu.Lock()
	defer t.mu.Unlock()
	t.nextID++
	return t.nextID
}

// addOwn makes mem findable by Locate under id (once every peer was sent it).
func (t *shareTable) addOwn(id uint64, mem []byte) {
	t.mu.Lock()
	defer t.mu.Unlock()
	t.own[id] = mem
}

func (t *shareTable) removeOwn(id uint64) bool {
	t.mu.Lock()
	defer t.mu.Unlock()
	_, ok := t.own[id]
	delete(t.own, id)
	return ok
}

func (t *shareTable) locate(buf []byte) (id, off uint64, ok bool) {
	if len(buf) == 0 {
		return 0, 0, false
	}
	p := uintptr(unsafe.Pointer(unsafe.SliceData(buf)))
	t.mu.Lock()
	defer t.mu.Unlock()
	for id, mem := range t.own {
		base := uintptr(unsafe.Pointer(unsafe.SliceData(mem)))
		if p >= base && p+uintptr(len(buf)) <= base+uintptr(len(mem)) {
			return id, uint64(p - base), true
		}
	}
	return 0, 0, false
}

// notify wakes the waiters on ps. Callers hold t.mu.
func (ps *peerShares) notify() {
	close(ps.change)
	ps.change = make(chan struct{})
}

// addPeer records region id of peer: mem mapped (unmap lets go of it), or
// the error that kept it from being mapped. It fails when the peer offers
// too many regions or an id twice; then nothing is kept.
func (t *shareTable) addPeer(peer int, id uint64, mem []byte, err error, unmap func([]byte)) error {
	t.mu.Lock()
	defer t.mu.Unlock()
	ps := t.peers[peer]
	refuse := func(e error) error {
		if mem != nil && unmap != nil {
			unmap(mem)
		}
		return e
	}
	switch {
	case t.closed:
		return refuse(ErrClosed)
	case ps.regions[id] != nil:
		return refuse(fmt.Errorf("%s offered region %d twice", t.peerName(peer), id))
	case len(ps.regions) >= MaxSharedRegions:
		return refuse(fmt.Errorf("%s offered more than %d regions at once", t.peerName(peer), MaxSharedRegions))
	}
	ps.regions[id] = &peerRegion{mem: mem, err: err, unmap: unmap}
	if mem != nil {
		t.live++
	}
	ps.notify()
	return nil
}

// dropPeer withdraws peer's region id; it is unmapped once unreferenced.
func (t *shareTable) dropPeer(peer int, id uint64) {
	t.mu.Lock()
	defer t.mu.Unlock()
	ps := t.peers[peer]
	r := ps.regions[id]
	if r == nil {
		return
	}
	delete(ps.regions, id)
	r.dropped = true
	if r.refs == 0 {
		t.free(r)
	}
	ps.notify()
}

// free lets go of r's mapping. Callers hold t.mu.
func (t *shareTable) free(r *peerRegion) {
	if r.mem != nil {
		if r.unmap != nil {
			r.unmap(r.mem)
		}
		t.live--
	}
	r.mem = nil
}

// peerGone records that no more regions come from peer (its channel
// ended with err) and lets go of what it shared, once unreferenced.
func (t *shareTable) peerGone(peer int, err error) {
	t.mu.Lock()
	defer t.mu.Unlock()
	ps := t.peers[peer]
	if ps.gone != nil {
		return
	}
	ps.gone = err
	for id, r := range ps.regions {
		r.dropped = true
		if r.refs == 0 {
			t.free(r)
		}
		delete(ps.regions, id)
	}
	ps.notify()
}

// peerMem implements Sharer.PeerMem; done is closed with the mesh.
func (t *shareTable) peerMem(ctx context.Context, done <-chan struct{}, peer int, id, off, n uint64) ([]byte, func(), error) {
	who := t.peerName(peer)
	for {
		t.mu.Lock()
		if t.closed {
			t.mu.Unlock()
			return nil, nil, fmt.Errorf("region %d of %s: %w", id, who, ErrClosed)
		}
		ps := t.peers[peer]
		r := ps.regions[id]
		gone, change := ps.gone, ps.change
		if r != nil {
			defer t.mu.Unlock()
			if r.err != nil {
				return nil, nil, &PeerError{Peer: who, Err: fmt.Errorf("its shared region %d could not be mapped here: %w", id, r.err)}
			}
			if off > uint64(len(r.mem)) || n > uint64(len(r.mem))-off {
				return nil, nil, &PeerError{Peer: who, Err: fmt.Errorf("bytes [%d, %d+%d) are outside its shared region %d of %d bytes: %w", off, off, n, id, len(r.mem), ErrNotShared)}
			}
			r.refs++
			var once sync.Once
			return r.mem[off : off+n : off+n], func() { once.Do(func() { t.unref(r) }) }, nil
		}
		t.mu.Unlock()
		if gone != nil {
			return nil, nil, &PeerError{Peer: who, Err: fmt.Errorf("its shared region %d never arrived: %w", id, gone)}
		}
		select {
		case <-change:
		case <-ctx.Done():
			return nil, nil, fmt.Errorf("waiting for region %d of %s: %w", id, who, ctx.Err())
		case <-done:
			return nil, nil, fmt.Errorf("region %d of %s: %w", id, who, ErrClosed)
		}
	}
}

func (t *shareTable) unref(r *peerRegion) {
	t.mu.Lock()
	defer t.mu.Unlock()
	r.refs--
	if r.refs == 0 && (r.dropped || t.closed) {
		t.free(r)
	}
}

// close unmaps every peer region nobody references (the others go when
// released) and forgets the own ones.
func (t *shareTable) close() {
	t.mu.Lock()
	defer t.mu.Unlock()
	if t.closed {
		return
	}
	t.closed = true
	clear(t.own)
	for _, ps := range t.peers {
		for id, r := range ps.regions {
			if r.refs == 0 {
				t.free(r)
			}
			delete(ps.regions, id)
		}
		ps.notify()
	}
}

// mapped counts the peer regions still mapped here (tests).
func (t *shareTable) mapped() int {
	t.mu.Lock()
	defer t.mu.Unlock()
	return t.live
}
