package transport

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"os"
	"path/filepath"
	"time"

	"github.com/gpubridge/gpubridge/lib/rendezvous"
	"github.com/gpubridge/gpubridge/lib/wire"
)

// Store is the job's store as Establish uses it: the rendezvous's
// operations, and its address, whose route picks the TCP interface.
// lib/store's Client satisfies it.
type Store interface {
	rendezvous.Store
	Addr() string
}

// Config is what Establish needs to join a bridge.
type Config struct {
	// Store is the job's store, already prefixed to the job namespace;
	// the bridge uses the keys under "bridge/" in it.
	Store Store
	// Self is this member's index in Members.
	Self int
	// Members are every bridge member (island leader), in member order.
	Members []MemberInfo
	// Transport is what Choose picked: tcp, shm or verbs.
	Transport Kind
	// Streams is the number of data streams per pair of members (default 8).
	Streams int
	// P2PStreams is the number of streams per pair of members reserved for
	// point-to-point messages (Mesh.P2PStream), apart from the data and
	// control streams: 0 (the zero value) none; lib/bridge asks for
	// DefaultP2PStreams. Every transport opens them (on shm and verbs each
	// is a data-sized ring per peer: see their set-up).
	P2PStreams int
	// CRC turns on a CRC32C of every frame's payload.
	CRC bool
	// PeerWrite maps the regions the peers share (Sharer, shm) writable,
	// so that a collective may write its results straight into a peer's
	// buffer (lib/collective's direct all_reduce: the owner of a piece
	// writes it into every member's buffer instead of each copying it),
	// and tells the peers that they may write this member's shared
	// buffers. Off (the zero value): peers' regions are mapped read-only.
	// Members may differ: a collective writes into peers only when every
	// member has it on.
	PeerWrite bool
	// Interface is the NIC to listen on and advertise (GPUBRIDGE_IFNAME);
	// "" is the interface that routes to the store's host.
	Interface string
	// ListenHost is an explicit IP (or host name) to bind and advertise; it
	// wins over Interface.
	ListenHost string
	// SockBuf is SO_SNDBUF and SO_RCVBUF of every TCP connection (0: 4
	// MiB; negative: the kernel's autotuning). A link with a larger
	// bandwidth-delay product may want more; on one host 256 KiB to 4 MiB
	// made no difference to the 2-member all_reduce (docs/BENCHMARKS.md).
	SockBuf int
	// Timeout bounds the whole setup (default 60s).
	Timeout time.Duration
	// RingBytes is the size of each shm data ring (default 8 MiB, at least
	// 64 KiB, at most 1 GiB; control rings have 1 MiB). A frame of up to
	// half of it is handed to Recv's fn in place; larger frames are split
	// and reassembled (one more copy). 2 x the chunk size double-buffers.
	RingBytes int
	// Spin is how long a shm waiter checks its ring before it sleeps on
	// the futex (default DefaultSpin, at most MaxSpin). Waking a sleeper
	// costs tens of microseconds on virtual machines, several times a
	// small call's whole work; spinning longer pays for itself when every
	// process has a core of its own, and steals the peer's core when not.
	Spin time.Duration
	// Log receives setup events and refused connections (default: discard).
	Log *slog.Logger
	// Process names the program that runs Establish on every member (they
	// all run the same: "gbbridge serve"), for the messages that name a
	// peer's process: "gbbridge serve of rank 2 (pid 1234) died". Default:
	// this executable's name.
	Process string

	// proto overrides the protocol version this member speaks (tests).
	proto uint16
	// verbsOpen replaces the device the verbs transport opens (tests: an
	// in-memory fake); verbsForge alters this member's verbs endpoint
	// record before it is published (tests: a forged peer).
	verbsOpen  func(ctx context.Context, c *Config) (verbsPort, vDev, error)
	verbsForge func(*verbsEndpoint)
	// verbsConnectStep is called as each of this member's queue pairs
	// connects, to peer on stream st (the control stream's index is
	// Streams + P2PStreams): between its moves to ready-to-receive and to
	// ready-to-send (sending false), and after (sending true); an error
	// fails the connect. Tests: hold a member in either state, so that
	// the members' moves and writes come in a chosen order.
	verbsConnectStep func(ctx context.Context, peer, st int, qp vQP, sending bool) error
}

// MemberInfo is one bridge member as discovery describes it.
type MemberInfo = rendezvous.Member

// Defaults and limits of Config.
const (
	DefaultStreams   = 8
	DefaultTimeout   = 60 * time.Second
	DefaultRingBytes = 8 << 20
	DefaultSpin      = 5 * time.Microsecond
	MaxSpin          = 10 * time.Millisecond
	MaxStreams       = 64
	// MinSockBuf and MaxSockBuf bound a Config.SockBuf that is set.
	MinSockBuf = 64 << 10
	MaxSockBuf = 256 << 20
	// DefaultP2PStreams is what lib/bridge asks for (Config.P2PStreams).
	DefaultP2PStreams = 4
	minRingBytes      = 64 << 10
	maxRingBytes      = 1 << 30
)

// wireStreams is the number of streams per pair besides the control
// stream: the data streams, then the point-to-point ones.
func (c *Config) wireStreams() int { return c.Streams + c.P2PStreams }

// p2pWords describes the point-to-point streams for Mesh.Describe.
func p2pWords(n int) string {
	if n == 0 {
		return ""
	}
	return fmt.Sprintf(" and %d for point-to-point", n)
}

// SockBufAllowed says whether n is a Config.SockBuf Establish takes: 0
// or negative, or MinSockBuf..MaxSockBuf.
func SockBufAllowed(n int) bool { return n <= 0 || n >= MinSockBuf && n <= MaxSockBuf }

func (c *Config) normalize() error {
	if c.Store == nil {
		return errors.New("no store")
	}
	if len(c.Members) < 2 {
		return fmt.Errorf("a bridge needs 2 or more members, got %d", len(c.Members))
	}
	if c.Self < 0 || c.Self >= len(c.Members) {
		return fmt.Errorf("member %d of %d", c.Self, len(c.Members))
	}
	if c.Streams == 0 {
		c.Streams = DefaultStreams
	}
	if c.Streams < 1 || c.Streams > MaxStreams {
		return fmt.Errorf("%d streams per peer (1..%d allowed)", c.Streams, MaxStreams)
	}
	if c.P2PStreams < 0 || c.Streams+c.P2PStreams > MaxStreams {
		return fmt.Errorf("%d point-to-point streams per peer besides %d data streams (at most %d in all)", c.P2PStreams, c.Streams, MaxStreams)
	}
	if c.Timeout <= 0 {
		c.Timeout = DefaultTimeout
	}
	if c.RingBytes == 0 {
		c.RingBytes = DefaultRingBytes
	}
	if c.RingBytes < 0 || c.RingBytes > maxRingBytes {
		return fmt.Errorf("ring of %d bytes (at most %d allowed)", c.RingBytes, maxRingBytes)
	}
	c.RingBytes = max(c.RingBytes, minRingBytes)
	if !SockBufAllowed(c.SockBuf) {
		return fmt.Errorf("socket buffers of %d bytes (%d..%d allowed, or negative: the kernel's autotuning)", c.SockBuf, MinSockBuf, MaxSockBuf)
	}
	if c.Spin == 0 {
		c.Spin = DefaultSpin
	}
	if c.Spin < 0 || c.Spin > MaxSpin {
		return fmt.Errorf("spin of %v (0..%v allowed)", c.Spin, MaxSpin)
	}
	if c.Log == nil {
		c.Log = slog.New(slog.DiscardHandler)
	}
	if c.Process == "" {
		c.Process = "the bridge process"
		if exe, err := os.Executable(); err == nil {
			c.Process = filepath.Base(exe)
		}
	}
	if c.proto == 0 {
		c.proto = wire.ProtocolVersion
	}
	return nil
}
