package transport

import (
	"context"
	"fmt"
	"sync"

	"github.com/gpubridge/gpubridge/lib/wire"
)

// memQueue frames a directed in-memory stream may hold before Send blocks.
const memQueue = 4

type memFrame struct {
	hdr     wire.Header
	payload []byte
}

type memLink struct {
	ch   chan memFrame
	held chan struct{} // one token per frame held by the receiver (RecvHold)
}

type memMesh struct {
	self, size, streams int
	p2p                 int
	crc                 bool
	peerWrite           bool
	links               [][][]*memLink // links[from][to][stream]: data, then p2p point-to-point, then control
	done                []chan struct{}
	closeOnce           []*sync.Once
	shares              []*shareTable // by member: what it shares and what it was offered
}

// NewMem returns the meshes of size members joined in memory, with streams
// data streams per pair, for tests. Send copies the payload, as a real
// transport does.
func NewMem(size, streams int, crc bool) []Mesh { return NewMemP2P(size, streams, 0, crc) }

// NewMemP2P is NewMem with p2p point-to-point streams per pair
// (Mesh.P2PStream) besides the data streams.
func NewMemP2P(size, streams, p2p int, crc bool) []Mesh {
	return NewMemWith(size, MemOptions{Streams: streams, P2PStreams: p2p, CRC: crc})
}

// MemOptions are NewMemWith's: Config's fields that the in-memory mesh
// has.
type MemOptions struct {
	Streams, P2PStreams int
	CRC                 bool
	// PeerWrite is Config.PeerWrite: Sharer.PeerWrite says true (peers'
	// memory is the peers' own Go memory either way).
	PeerWrite bool
}

// NewMemWith returns the meshes of size members joined in memory (NewMem).
func NewMemWith(size int, o MemOptions) []Mesh {
	streams, p2p, crc := o.Streams, o.P2PStreams, o.CRC
	links := make([][][]*memLink, size)
	for a := range links {
		links[a] = make([][]*memLink, size)
		for b := range links[a] {
			if a == b {
				continue
			}
			links[a][b] = make([]*memLink, streams+p2p+1)
			for s := range links[a][b] {
				links[a][b][s] = &memLink{ch: make(chan memFrame, memQueue), held: make(chan struct{}, MaxHeld)}
			}
		}
	}
	done := make([]chan struct{}, size)
	once := make([]*sync.Once, size)
	for i := range done {
		done[i] = make(chan struct{})
		once[i] = &sync.Once{}
	}
	shares := make([]*shareTable, size)
	for i := range shares {
		shares[i] = newShareTable(size, func(p int) string { return fmt.Sprintf("member %d", p) })
	}
	out := make([]Mesh, size)
	for i := range out {
		out[i] = &memMesh{self: i, size: size, streams: streams, p2p: p2p, crc: crc, peerWrite: o.PeerWrite, links: links, done: done, closeOnce: once, shares: shares}
	}
	return out
}

func (m *memMesh) Self() int    { return m.self }
func (m *memMesh) Size() int    { return m.size }
func (m *memMesh) Streams() int { return m.streams }
func (m *memMesh) Peer(member int) string {
	return fmt.Sprintf("member %d", member)
}
func (m *memMesh) Describe() string {
	return fmt.Sprintf("%s, %d streams per peer%s, %s", Mem, m.streams, p2pWords(m.p2p), crcWords(m.crc))
}

func (m *memMesh) Stream(peer, i int) Stream {
	if i < 0 || i >= m.streams {
		panic(fmt.Sprintf("transport: stream %d of %d", i, m.streams))
	}
	return m.stream(peer, i)
}

func (m *memMesh) Control(peer int) Stream { return m.stream(peer, m.streams+m.p2p) }

func (m *memMesh) P2PStreams() int { return m.p2p }

func (m *memMesh) P2PStream(peer, i int) Stream {
	if i < 0 || i >= m.p2p {
		panic(fmt.Sprintf("transport: point-to-point stream %d of %d", i, m.p2p))
	}
	return m.stream(peer, m.streams+i)
}

func (m *memMesh) stream(peer, i int) Stream {
	if peer == m.self || peer < 0 || peer >= m.size {
		panic(fmt.Sprintf("transport: member %d has no stream to member %d", m.self, peer))
	}
	return &memStream{m: m, peer: peer, out: m.links[m.self][peer][i], in: m.links[peer][m.self][i]}
}

// Abort queues an abort frame on every stream to every peer (where there is
// room) and closes the mesh.
func (m *memMesh) Abort(err error) {
	var h wire.Header
	h.Kind = wire.KindAbort
	msg := []byte(err.Error())
	h.Seal(msg, m.crc)
	for p := 0; p < m.size; p++ {
		if p == m.self {
			continue
		}
		for _, l := range m.links[m.self][p] {
			select {
			case l.ch <- memFrame{h, msg}:
			default:
			}
		}
	}
	_ = m.Close()
}

func (m *memMesh) Close() error {
	m.closeOnce[m.self].Do(func() {
		close(m.done[m.self])
		m.shares[m.self].close()
		for p, t := range m.shares {
			if p != m.self {
				t.peerGone(m.self, ErrPeerClosed)
			}
		}
	})
	return nil
}

// Share implements Sharer in memory: the peers see mem itself (fd is not
// used).
func (m *memMesh) Share(_ int, mem []byte) (uint64, error) {
	t := m.shares[m.self]
	id := t.newID()
	for p, pt := range m.shares {
		if p != m.self {
			if err := pt.addPeer(m.self, id, mem, nil, nil); err != nil {
				m.Unshare(id)
				return 0, err
			}
		}
	}
	t.addOwn(id, mem)
	return id, nil
}

func (m *memMesh) Unshare(id uint64) {
	m.shares[m.self].removeOwn(id)
	for p, pt := range m.shares {
		if p != m.self {
			pt.dropPeer(m.self, id)
		}
	}
}

func (m *memMesh) Locate(buf []byte) (uint64, uint64, bool) { return m.shares[m.self].locate(buf) }

// PeerWrite implements Sharer: MemOptions.PeerWrite.
func (m *memMesh) PeerWrite() bool { return m.peerWrite }

func (m *memMesh) PeerMem(ctx context.Context, peer int, id, off, n uint64) ([]byte, func(), error) {
	if peer == m.self || peer < 0 || peer >= m.size {
		return nil, nil, fmt.Errorf("member %d has no region of member %d", m.self, peer)
	}
	return m.shares[m.self].peerMem(ctx, m.done[m.self], peer, id, off, n)
}

var _ Sharer = (*memMesh)(nil)

type memStream struct {
	m       *memMesh
	peer    int
	out, in *memLink
}

func (s *memStream) Send(ctx context.Context, hdr wire.Header, payload []byte) error {
	hdr.Seal(payload, s.m.crc)
	f := memFrame{hdr, append([]byte(nil), payload...)}
	select {
	case s.out.ch <- f:
		return nil
	case <-ctx.Done():
		return fmt.Errorf("send to %s: %w", s.m.Peer(s.peer), ctx.Err())
	case <-s.m.done[s.m.self]:
		return fmt.Errorf("send to %s: %w", s.m.Peer(s.peer), ErrClosed)
	case <-s.m.done[s.peer]:
		return &PeerError{Peer: s.m.Peer(s.peer), Err: ErrPeerClosed}
	}
}

func (s *memStream) Recv(ctx context.Context, fn func(wire.Header, []byte) error) error {
	f, err := s.recv(ctx)
	if err != nil {
		return err
	}
	return fn(f.hdr, f.payload)
}

// RecvHold implements Holder; the payload is the private copy Send made.
func (s *memStream) RecvHold(ctx context.Context) (wire.Header, []byte, func(), error) {
	select {
	case s.in.held <- struct{}{}:
	case <-ctx.Done():
		return wire.Header{}, nil, nil, fmt.Errorf("receive from %s: %w", s.m.Peer(s.peer), ctx.Err())
	case <-s.m.done[s.m.self]:
		return wire.Header{}, nil, nil, fmt.Errorf("receive from %s: %w", s.m.Peer(s.peer), ErrClosed)
	}
	f, err := s.recv(ctx)
	if err != nil {
		<-s.in.held
		return wire.Header{}, nil, nil, err
	}
	var once sync.Once
	return f.hdr, f.payload, func() { once.Do(func() { <-s.in.held }) }, nil
}

func (s *memStream) recv(ctx context.Context) (memFrame, error) {
	var f memFrame
	select {
	case f = <-s.in.ch:
	case <-ctx.Done():
		return f, fmt.Errorf("receive from %s: %w", s.m.Peer(s.peer), ctx.Err())
	case <-s.m.done[s.m.self]:
		return f, fmt.Errorf("receive from %s: %w", s.m.Peer(s.peer), ErrClosed)
	case <-s.m.done[s.peer]:
		// Frames the peer sent before it closed are still delivered.
		select {
		case f = <-s.in.ch:
		default:
			return f, &PeerError{Peer: s.m.Peer(s.peer), Err: ErrPeerClosed}
		}
	}
	if err := f.hdr.Verify(f.payload); err != nil {
		return f, &PeerError{Peer: s.m.Peer(s.peer), Err: err}
	}
	if f.hdr.Kind == wire.KindAbort {
		return f, &PeerError{Peer: s.m.Peer(s.peer), Err: fmt.Errorf("failed: %s", f.payload)}
	}
	return f, nil
}
