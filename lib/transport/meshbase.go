package transport

import (
	"context"
	"fmt"
	"sync"
	"time"

	"github.com/gpubridge/gpubridge/lib/rendezvous"
)

const (
	// abortGrace bounds Abort's KindAbort frames.
	abortGrace = time.Second
	// maxAbortText bounds the error text an abort frame carries.
	maxAbortText = 4 << 10
)

// meshBase is what the TCP and shm meshes share: who this member is, how
// peers are named in errors, and the streams indexed by peer and stream
// (the data streams, then p2p point-to-point streams, then the control
// stream).
type meshBase[S Stream] struct {
	self, size, streams int
	p2p                 int
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

func (m *meshBase[S]) Control(peer int) Stream { return m.link(peer, m.streams+m.p2p) }

func (m *meshBase[S]) P2PStreams() int { return m.p2p }

func (m *meshBase[S]) P2PStream(peer, i int) Stream {
	if i < 0 || i >= m.p2p {
		panic(fmt.Sprintf("transport: point-to-point stream %d of %d", i, m.p2p))
	}
	return m.link(peer, m.streams+i)
}

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

// abortMessage is the text of the KindAbort frames that tell peers err.
func abortMessage(err error) []byte {
	msg := []byte(err.Error())
	return msg[:min(len(msg), maxAbortText)]
}

// abortText is the text of a peer's KindAbort frame, cut to maxAbortText
// bytes (a sender cuts it there too) and safe to log.
func abortText(p []byte) string { return rendezvous.PeerText(p, maxAbortText) }

// lockUntil takes mu, giving up at t.
func lockUntil(mu *sync.Mutex, t time.Time) bool {
	for !mu.TryLock() {
		if time.Now().After(t) {
			return false
		}
		time.Sleep(time.Millisecond)
	}
	return true
}

// takeHeld takes one of a stream's free RecvHold buffers (held), waiting
// for a release unless ctx ends or the mesh closes (done). peer and idx
// name the stream in errors.
func takeHeld(ctx context.Context, held chan []byte, done <-chan struct{}, peer string, idx int) ([]byte, error) {
	select {
	case b := <-held:
		return b, nil
	default:
	}
	select {
	case b := <-held:
		return b, nil
	case <-ctx.Done():
		return nil, fmt.Errorf("receive from %s on stream %d: %w", peer, idx, ctx.Err())
	case <-done:
		return nil, fmt.Errorf("receive from %s: %w", peer, ErrClosed)
	}
}

// crcWords says whether frames carry a CRC, for Describe.
func crcWords(crc bool) string {
	if crc {
		return "crc32c"
	}
	return "no crc"
}
