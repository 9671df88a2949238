// Package transport carries bridge frames between the members of a bridge
// (the island leaders): TCP with several connections per pair of members,
// same-host shared memory, and an in-memory transport for tests. The
// interface is narrow — framed, ordered, reliable streams between pairs —
// so that RDMA verbs can stand behind it too.
//
// Establish joins a bridge: the members meet through the job's store
// (lib/rendezvous: the per-job secret, signed endpoint records, a
// barrier), check that they agree on transport, streams, CRC and protocol
// version, and connect the way the chosen transport does. Each transport
// is one driver, registered by kind from its own files: tcp.go and
// tcp_*.go (Streams+1 connections per pair, each opened with a mutually
// authenticated handshake), shm.go and shm_setup.go (one ring per directed
// stream in preallocated /dev/shm files). A failing member records its
// error in the store, so every member fails with a message naming the
// cause within the setup timeout.
package transport

import (
	"context"
	"errors"
	"fmt"

	"github.com/gpubridge/gpubridge/lib/wire"
)

// Stream is one ordered, reliable, framed link to one peer. A stream is used
// by one sender goroutine and one receiver goroutine at a time.
type Stream interface {
	// Send writes one frame. It sets hdr's Len (and CRC when the mesh checks
	// integrity) from payload, and returns once payload may be reused. It
	// honours ctx's deadline and cancellation.
	Send(ctx context.Context, hdr wire.Header, payload []byte) error
	// Recv reads the next frame and calls fn with its header and payload.
	// The payload is valid only during fn (it may be a view of a receive
	// buffer or of shared memory). A CRC mismatch is an error wrapping
	// wire.ErrCorrupt, and fn is not called. A KindAbort frame from the peer
	// is returned as a *PeerError carrying the peer's message.
	Recv(ctx context.Context, fn func(hdr wire.Header, payload []byte) error) error
}

// MaxHeld is how many frames a Holder stream lets its receiver hold at once.
const MaxHeld = 2

// Holder is implemented by streams whose receiver may keep a payload past
// the call that received it, so that the next frame can be read while the
// previous one is still being consumed, without copying it (the TCP, shared
// memory and in-memory streams implement it). Recv and RecvHold may be
// mixed on a stream, by its one receiver goroutine.
type Holder interface {
	// RecvHold reads the next frame like Recv (CRC verified; a KindAbort
	// frame is a *PeerError carrying the peer's message; ctx's deadline and
	// cancellation are honoured) and returns its header and payload. The
	// payload stays valid until release is called, which must happen
	// exactly once per frame (further calls do nothing). It may be called
	// from any goroutine, in any order, and after the mesh was closed; a
	// frame that is never released may keep the stream's buffers (and a
	// shared-memory mapping) alive. At most MaxHeld frames of a stream are
	// held at once: a further RecvHold waits until one is released (or ctx
	// ends, or the mesh is closed). On error, release is nil.
	RecvHold(ctx context.Context) (hdr wire.Header, payload []byte, release func(), err error)
}

// PieceReceiver is implemented by streams that can hand a frame's payload
// to the receiver in pieces as they arrive, through a small buffer that
// stays in cache, instead of reading the whole frame into memory first
// (the TCP stream). A receiver that consumes each piece at once (reduces
// it into its destination) then passes over the payload once, in cache.
type PieceReceiver interface {
	// PieceSize is the size of every piece but a frame's last; 0 when the
	// stream does not hand out pieces now (frames carry a CRC, which can
	// only be checked once the whole frame is in): use Recv or RecvHold.
	// It is a multiple of 64 bytes.
	PieceSize() int
	// RecvPieces reads the next frame: check sees its header first (its
	// error ends the call before any payload byte is read); then fn gets
	// the payload in order, as pieces of PieceSize bytes (the last may be
	// shorter; none for an empty payload), off being a piece's offset in
	// the payload and p valid only during the call. A KindAbort frame is a
	// *PeerError carrying the peer's message, and neither check nor fn is
	// called. An error of fn ends the call with it, and the stream is out
	// of step afterwards (every later call fails).
	RecvPieces(ctx context.Context, check func(wire.Header) error, fn func(off int, p []byte) error) error
}

// MaxHeldPieces is how many pieces a PieceHolder stream lets its receiver
// hold at once: one being read off the wire, one being consumed and two
// queued between them (the collectives' reader and consumer, pipe.go).
const MaxHeldPieces = 4

// PieceHolder is implemented by PieceReceiver streams whose receiver may
// keep a piece past the call that handed it over (the TCP stream), so that
// one goroutine reads the next pieces off the wire while another consumes
// the earlier ones: the kernel's copy out of the socket and the consumer's
// pass over the piece (a reduction) then run at the same time, on two
// cores, instead of one after the other. Each held piece has a buffer of
// its own, of PieceSize bytes, at most MaxHeldPieces per stream (made on
// first need and kept by the stream: MaxHeldPieces x PieceSize bytes per
// stream at most, 2 MiB over TCP); the one released last is reused first,
// so that a receiver that keeps up cycles through two buffers that stay in
// cache. RecvPieces and RecvPiecesHold may be mixed on a stream, by its one
// receiver goroutine.
type PieceHolder interface {
	PieceReceiver
	// RecvPiecesHold is RecvPieces (check first; the pieces in order, of
	// PieceSize bytes but the last; a KindAbort frame a *PeerError; an error
	// of check or fn ends the call with it, and then the stream is out of
	// step), except that a piece stays valid after fn returns, until its
	// release is called. Once fn is called the piece is the receiver's,
	// whatever fn returns: release must be called exactly once per piece
	// (further calls do nothing), from any goroutine, in any order, also
	// after the mesh was closed. Reading a piece while MaxHeldPieces are
	// held waits for a release, or until ctx ends or the mesh is closed;
	// such a wait that ends inside a frame leaves the stream out of step.
	RecvPiecesHold(ctx context.Context, check func(wire.Header) error, fn func(off int, p []byte, release func()) error) error
}

// IntoReceiver is implemented by PieceReceiver streams that can read a
// frame's payload straight into the receiver's memory (the TCP stream:
// the kernel copies from the socket into dst, through no buffer of ours),
// for payloads that need no pass of the receiver's own (final bytes that
// only land).
type IntoReceiver interface {
	PieceReceiver
	// RecvInto reads the next frame, whose payload must be len(dst)
	// bytes, into dst: check sees its header first, and its error ends
	// the call before any payload byte is read (check may wait: until it
	// returns, the payload stays in the socket); a payload of another
	// length is an error. A KindAbort frame is a *PeerError carrying the
	// peer's message, and check is not called. On an error dst's bytes
	// are undefined, and an error after the header leaves the stream out
	// of step. Frames that carry a CRC are read and checked whole, then
	// copied into dst.
	RecvInto(ctx context.Context, check func(wire.Header) error, dst []byte) error
}

// ProgressSender is implemented by streams that can say how much of a
// frame's payload is out while they send it (the TCP stream, which then
// writes a large payload in pieces), so that a receiver whose data depends
// on the payload having been read may proceed piece by piece.
type ProgressSender interface {
	// SendProgress is Send, calling progress(n) (from the sending
	// goroutine) each time the first n payload bytes are out, n growing to
	// len(payload) when the frame is sent; progress may be nil.
	SendProgress(ctx context.Context, hdr wire.Header, payload []byte, progress func(n int)) error
}

// Mesh is one member's links to every other member of a bridge.
type Mesh interface {
	// Self is this member's index, Size the number of members.
	Self() int
	Size() int
	// Streams is the number of data streams per pair of members.
	Streams() int
	// Stream returns data stream i (0 <= i < Streams()) to peer.
	Stream(peer, i int) Stream
	// Control returns the stream to peer reserved for point-to-point
	// messages and barriers, apart from the data streams.
	Control(peer int) Stream
	// P2PStreams is the number of streams per peer reserved for the
	// frames of large point-to-point messages (Config.P2PStreams), apart
	// from the data and control streams; P2PStream returns stream i
	// (0 <= i < P2PStreams()) to peer.
	P2PStreams() int
	P2PStream(peer, i int) Stream
	// Peer describes a member for error messages: "member 1 (rank 2 on host-b)".
	Peer(member int) string
	// Describe names the transport and its settings: "tcp, 4 streams per peer, crc32c".
	Describe() string
	// Abort tells every peer that this member failed with err (best effort,
	// bounded in time) and closes the mesh.
	Abort(err error)
	// Close closes every stream; blocked Send and Recv calls return errors.
	Close() error
}

// ErrClosed is returned by streams of a closed mesh.
var ErrClosed = errors.New("bridge closed")

// Errors a stream returns, wrapped in a *PeerError.
var (
	// ErrConnClosed: the peer's end of a connection went away without an
	// orderly close (EOF or reset). The error names the peer's process
	// and asks whether it died.
	ErrConnClosed = errors.New("connection closed")
	// ErrPeerClosed: the peer closed its mesh.
	ErrPeerClosed = errors.New("closed its end of the bridge")
	// ErrPeerDied: the peer's process is gone (shm); the error is a
	// *ProcessDiedError.
	ErrPeerDied = errors.New("process died")
	// ErrRingRefused: a device refused an RDMA write into a receive ring
	// (verbs): the ring address or key in the receiving member's endpoint
	// record is not valid. The writer's error and the receiver's both
	// carry these words, whichever reaches a member first.
	ErrRingRefused = errors.New("refused a write into its receive ring")
)

// ProcessDiedError is a peer member's process found dead (shm: through its
// pidfd). The process is the bridge member's (gbbridge serve), not the
// rank's: the pid is the one the member published in its endpoint record.
type ProcessDiedError struct {
	Program string // Config.Process of the members: "gbbridge serve"
	Rank    int    // the global rank the process served
	PID     int
}

func (e *ProcessDiedError) Error() string {
	return fmt.Sprintf("%s of rank %d (pid %d) died", e.Program, e.Rank, e.PID)
}

// Is makes errors.Is(err, ErrPeerDied) true.
func (e *ProcessDiedError) Is(target error) bool { return target == ErrPeerDied }

// PeerError is a failure of, or reported by, a peer member.
type PeerError struct {
	Peer string // as Mesh.Peer describes it
	Err  error
}

func (e *PeerError) Error() string { return fmt.Sprintf("%s: %v", e.Peer, e.Err) }
func (e *PeerError) Unwrap() error { return e.Err }
