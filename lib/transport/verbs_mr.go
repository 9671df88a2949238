package transport

import (
	"errors"
	"fmt"
	"sync"
	"sync/atomic"
	"unsafe"
)

// Registrar is implemented by meshes that can send from memory registered
// with their device without copying it (verbs). Memory that is sent from
// often (the feed's regions, a benchmark's buffers) is registered once;
// a frame whose payload lies in a registration is read by the device in
// place, and Send returns once it has been.
type Registrar interface {
	// Register registers b with the device until release is called
	// (exactly once; later calls do nothing). b must stay valid until
	// then: Go memory is pinned, memory mapped outside Go (a memfd
	// region) must not be unmapped before release. Registering memory
	// that a registration already covers takes a reference on it;
	// registering a larger range over it (a region that grew in place)
	// makes a new one. A registration in use by a send is freed when the
	// send is done.
	Register(b []byte) (release func(), err error)
}

// verbsRegs are a mesh's registrations of callers' memory.
type verbsRegs struct {
	dev vDev
	mu  sync.Mutex
	all []*verbsReg
	// What Send wrote in place and what it copied, in payload bytes
	// (tests and selftest read them).
	zeroCopied, copied atomic.Int64
}

// verbsReg is one registration.
type verbsReg struct {
	start, end uintptr
	mr         vMR
	lkey       uint32
	refs       int // Register calls not released
	inflight   int // sends reading it now
	buf        []byte
}

var errEmptyRegistration = errors.New("register: empty buffer")

func (r *verbsRegs) register(b []byte) (func(), error) {
	if len(b) == 0 {
		return nil, errEmptyRegistration
	}
	start := uintptr(unsafe.Pointer(unsafe.SliceData(b)))
	end := start + uintptr(len(b))
	r.mu.Lock()
	defer r.mu.Unlock()
	if r.dev == nil {
		return nil, fmt.Errorf("register: %w", ErrClosed)
	}
	var reg *verbsReg
	for _, g := range r.all {
		if g.start <= start && end <= g.end && g.refs > 0 {
			reg = g
			break
		}
	}
	if reg == nil {
		mr, err := r.dev.register(b, false)
		if err != nil {
			return nil, fmt.Errorf("register %d bytes: %w", len(b), err)
		}
		lk, _ := mr.keys()
		reg = &verbsReg{start: start, end: end, mr: mr, lkey: lk, buf: b}
		// The newest registration is found first: a region that grew in
		// place is read through its new one.
		r.all = append([]*verbsReg{reg}, r.all...)
	}
	reg.refs++
	var once sync.Once
	return func() { once.Do(func() { r.unref(reg) }) }, nil
}

func (r *verbsRegs) unref(g *verbsReg) {
	r.mu.Lock()
	defer r.mu.Unlock()
	g.refs--
	r.freeLocked(g)
}

// freeLocked deregisters g once nothing uses it.
func (r *verbsRegs) freeLocked(g *verbsReg) {
	if g.refs > 0 || g.inflight > 0 || g.mr == nil {
		return
	}
	_ = g.mr.close()
	g.mr, g.buf = nil, nil
	for i, x := range r.all {
		if x == g {
			r.all = append(r.all[:i], r.all[i+1:]...)
			break
		}
	}
}

// hold returns the registration that covers p, held until unhold, or nil.
func (r *verbsRegs) hold(p []byte) *verbsReg {
	start := uintptr(unsafe.Pointer(unsafe.SliceData(p)))
	end := start + uintptr(len(p))
	r.mu.Lock()
	defer r.mu.Unlock()
	for _, g := range r.all {
		if g.start <= start && end <= g.end && g.refs > 0 && g.mr != nil {
			g.inflight++
			return g
		}
	}
	return nil
}

func (r *verbsRegs) unhold(g *verbsReg) {
	r.mu.Lock()
	defer r.mu.Unlock()
	g.inflight--
	r.freeLocked(g)
}

// closeAll deregisters everything (the mesh is torn down: no send is in
// flight) and refuses new registrations.
func (r *verbsRegs) closeAll() {
	r.mu.Lock()
	defer r.mu.Unlock()
	for _, g := range r.all {
		if g.mr != nil {
			_ = g.mr.close()
			g.mr, g.buf = nil, nil
		}
	}
	r.all = nil
	r.dev = nil
}

// Register implements Registrar.
func (m *verbsMesh) Register(b []byte) (func(), error) { return m.regs.register(b) }
