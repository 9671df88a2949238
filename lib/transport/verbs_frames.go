package transport

import (
	"fmt"
	"unsafe"

	"github.com/gpubridge/gpubridge/lib/wire"
)

// The receive side's bookkeeping of a verbs stream, apart from the ring:
// frames that arrive in segments, and frames held in place.

// frameAsm reassembles a frame that arrives in segments into a buffer the
// receiver supplies. A receive interrupted mid-frame (its deadline)
// leaves it in progress; the next receive carries on in its own buffer.
type frameAsm struct {
	hdr    wire.Header
	into   []byte // the frame's buffer, len hdr.Len
	filled int
	active bool
}

// start begins a frame of hdr.Len bytes in *dst.
func (a *frameAsm) start(hdr wire.Header, dst *[]byte) {
	*a = frameAsm{hdr: hdr, active: true}
	a.use(dst)
}

// use moves the frame in progress into *dst (grown as needed).
func (a *frameAsm) use(dst *[]byte) {
	want := int(a.hdr.Len)
	if cap(*dst) < want {
		*dst = make([]byte, want)
	}
	next := (*dst)[:want]
	if a.filled > 0 && unsafe.SliceData(next) != unsafe.SliceData(a.into) {
		copy(next, a.into[:a.filled])
	}
	a.into = next
}

// add appends a segment.
func (a *frameAsm) add(seg []byte) error {
	if a.filled+len(seg) > int(a.hdr.Len) {
		return fmt.Errorf("split frame longer than its header says (%d bytes)", a.hdr.Len)
	}
	a.filled += copy(a.into[a.filled:], seg)
	return nil
}

// done ends the frame and returns it.
func (a *frameAsm) done() (wire.Header, []byte, error) {
	a.active = false
	if a.filled != int(a.hdr.Len) {
		return wire.Header{}, nil, fmt.Errorf("split frame of %d bytes, header says %d", a.filled, a.hdr.Len)
	}
	frame := a.into[:a.filled]
	a.into = nil
	return a.hdr, frame, nil
}

// verbsPin is a frame held in place in the inbound ring.
type verbsPin struct {
	start    uint64
	released bool
}

// ringHolds are the frames held in place, in ring order: the ring is free
// only up to the first of them still held.
type ringHolds struct{ held []*verbsPin }

func (r *ringHolds) hold(at uint64) *verbsPin {
	p := &verbsPin{start: at}
	r.held = append(r.held, p)
	return p
}

func (r *ringHolds) drop(p *verbsPin) {
	p.released = true
	for len(r.held) > 0 && r.held[0].released {
		r.held[0] = nil
		r.held = r.held[1:]
	}
}

// freeUpTo is how far the ring is free when read up to rd.
func (r *ringHolds) freeUpTo(rd uint64) uint64 {
	if len(r.held) > 0 {
		return r.held[0].start
	}
	return rd
}
