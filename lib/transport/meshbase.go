package transport

import "fmt"

// meshBase is what the TCP and shm meshes share: who this member is, how
// peers are named in errors, and the streams indexed by peer and stream
// (index streams is the control stream).
type meshBase[S Stream] struct {
	self, size, streams int
	crc                 bool
	desc                string
	peers               []string
	procs               []string // what runs each member, for messages
	links               [][]S    // [peer][stream]
}

func (m *meshBase[S]) Self() int        { return m.self }
func (m *meshBase[S]) Size() int        { return m.size }
func (m *meshBase[S]) Streams() int     { return m.streams }
func (m *meshBase[S]) Describe() string { return m.desc }
func (m *meshBase[S]) Peer(member int) string {
	if member < 0 || member >= len(m.peers) {
		return fmt.Sprintf("member %d", member)
	}
	return m.peers[member]
}

// process names member's process: "gbbridge serve of rank 2 (pid 1234)".
func (m *meshBase[S]) process(member int) string {
	if member < 0 || member >= len(m.procs) {
		return fmt.Sprintf("the process of member %d", member)
	}
	return m.procs[member]
}

func (m *meshBase[S]) Stream(peer, i int) Stream {
	if i < 0 || i >= m.streams {
		panic(fmt.Sprintf("transport: stream %d of %d", i, m.streams))
	}
	return m.link(peer, i)
}

func (m *meshBase[S]) Control(peer int) Stream { return m.link(peer, m.streams) }

func (m *meshBase[S]) link(peer, i int) S {
	if peer == m.self || peer < 0 || peer >= m.size {
		panic(fmt.Sprintf("transport: member %d has no stream to member %d", m.self, peer))
	}
	return m.links[peer][i]
}

// each calls f for every stream to every peer.
func (m *meshBase[S]) each(f func(s S)) {
	for _, ls := range m.links {
		for _, s := range ls {
			f(s)
		}
	}
}
