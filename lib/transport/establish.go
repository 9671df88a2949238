package transport

import (
	"context"
	"crypto/sha256"
	"errors"
	"fmt"
	"log/slog"
	"os"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
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
	// Transport is what Choose picked: tcp or shm.
	Transport Kind
	// Streams is the number of data streams per pair of members (default 8).
	Streams int
	// CRC turns on a CRC32C of every frame's payload.
	CRC bool
	// Interface is the NIC to listen on and advertise (GPUBRIDGE_IFNAME);
	// "" is the interface that routes to the store's host.
	Interface string
	// ListenHost is an explicit IP (or host name) to bind and advertise; it
	// wins over Interface.
	ListenHost string
	// Timeout bounds the whole setup (default 60s).
	Timeout time.Duration
	// RingBytes is the size of each shm data ring (default 8 MiB, at least
	// 64 KiB, at most 1 GiB; control rings have 1 MiB). A frame of up to
	// half of it is handed to Recv's fn in place; larger frames are split
	// and reassembled (one more copy). 2 x the chunk size double-buffers.
	RingBytes int
	// Log receives setup events and refused connections (default: discard).
	Log *slog.Logger
	// Process names the program that runs Establish on every member (they
	// all run the same: "gbbridge serve"), for the messages that name a
	// peer's process: "gbbridge serve of rank 2 (pid 1234) died". Default:
	// this executable's name.
	Process string

	// proto overrides the protocol version this member speaks (tests).
	proto uint16
}

// MemberInfo is one bridge member as discovery describes it.
type MemberInfo = rendezvous.Member

// Defaults and limits of Config.
const (
	DefaultStreams   = 8
	DefaultTimeout   = 60 * time.Second
	DefaultRingBytes = 8 << 20
	MaxStreams       = 64
	minRingBytes     = 64 << 10
	maxRingBytes     = 1 << 30
)

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

// A driver is one transport as Establish runs it (NCCL's struct
// ncclTransport). Each transport's setup file registers its driver from
// an init function, so a transport plugs in by adding its own files.
type driver struct {
	kind Kind
	// establish publishes this member's endpoint, gathers every member's,
	// connects and returns the mesh, within ctx (which another member's
	// recorded failure cancels).
	establish func(ctx context.Context, s *setup) (Mesh, error)
}

var drivers = map[Kind]*driver{}

func register(d *driver) {
	if drivers[d.kind] != nil {
		panic("transport: " + string(d.kind) + " registered twice")
	}
	drivers[d.kind] = d
}

// built lists the kinds Establish can run, in requestable order (then
// others, such as test transports, by name).
func built() []Kind {
	var ks []Kind
	for k := range drivers {
		ks = append(ks, k)
	}
	slices.SortFunc(ks, func(a, b Kind) int {
		ia, ib := slices.Index(requestable, a), slices.Index(requestable, b)
		switch {
		case ia >= 0 && ib >= 0:
			return ia - ib
		case ia >= 0:
			return -1
		case ib >= 0:
			return 1
		}
		return strings.Compare(string(a), string(b))
	})
	return ks
}

// setup is one member's set-up in progress: its config and its session of
// the rendezvous.
type setup struct {
	cfg   Config
	rv    *rendezvous.Session
	log   *slog.Logger
	proto uint16
	job   [jobTagSize]byte
}

// Establish joins the bridge described by cfg: it shares the job's secret
// through the store, publishes this member's endpoint, checks that every
// member agrees on the settings, and connects to every other member the
// way cfg.Transport does. Any failure is written to the store, so that
// every member returns an error naming the cause within cfg.Timeout.
func Establish(ctx context.Context, cfg Config) (Mesh, error) {
	d, err := cfg.normalize()
	if err != nil {
		return nil, fmt.Errorf("bridge setup: %w", err)
	}
	ctx, cancel := context.WithTimeout(ctx, cfg.Timeout)
	defer cancel()
	rcfg := rendezvous.Config{Store: cfg.Store, Scope: "bridge", Self: cfg.Self, Members: cfg.Members, Timeout: cfg.Timeout, Log: cfg.Log}
	var m Mesh
	err = rendezvous.Run(ctx, rcfg, func(ctx context.Context, rv *rendezvous.Session) error {
		s := &setup{cfg: cfg, rv: rv, log: cfg.Log, proto: cfg.proto, job: jobTag(rv.Secret())}
		var err error
		m, err = d.establish(ctx, s)
		return err
	})
	if err != nil {
		return nil, fmt.Errorf("bridge setup: %w", err)
	}
	cfg.Log.Info("bridge established", "member", cfg.Self, "members", len(cfg.Members), "transport", m.Describe())
	return m, nil
}

func (c *Config) normalize() (*driver, error) {
	if c.Store == nil {
		return nil, errors.New("no store")
	}
	if len(c.Members) < 2 {
		return nil, fmt.Errorf("a bridge needs 2 or more members, got %d", len(c.Members))
	}
	if c.Self < 0 || c.Self >= len(c.Members) {
		return nil, fmt.Errorf("member %d of %d", c.Self, len(c.Members))
	}
	if c.Streams == 0 {
		c.Streams = DefaultStreams
	}
	if c.Streams < 1 || c.Streams > MaxStreams {
		return nil, fmt.Errorf("%d streams per peer (1..%d allowed)", c.Streams, MaxStreams)
	}
	if c.Timeout <= 0 {
		c.Timeout = DefaultTimeout
	}
	if c.RingBytes == 0 {
		c.RingBytes = DefaultRingBytes
	}
	if c.RingBytes < 0 || c.RingBytes > maxRingBytes {
		return nil, fmt.Errorf("ring of %d bytes (at most %d allowed)", c.RingBytes, maxRingBytes)
	}
	c.RingBytes = max(c.RingBytes, minRingBytes)
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
	d := drivers[c.Transport]
	if d == nil {
		return nil, fmt.Errorf("unknown transport %q (%s)", string(c.Transport), orList(built()))
	}
	return d, nil
}

// jobTag identifies the job in handshakes and ring file names: a one-way
// hash of the secret, so it reveals nothing about it. (The namespace
// itself is not visible through the store; the secret is as unique.)
func jobTag(secret []byte) [jobTagSize]byte {
	h := sha256.New()
	h.Write([]byte("gpubridge job tag\x00"))
	h.Write(secret)
	var t [jobTagSize]byte
	copy(t[:], h.Sum(nil))
	return t
}

// endpoint begins every transport's endpoint record: the settings every
// member must agree on, and who wrote it. A transport's record embeds it
// and adds how to reach the member.
type endpoint struct {
	Proto     int  `json:"proto"`
	Transport Kind `json:"transport"`
	Streams   int  `json:"streams"`
	CRC       bool `json:"crc"`
	rendezvous.Identity
}

func (e endpoint) settings() endpoint { return e }

// endpointRecord is a transport's endpoint record.
type endpointRecord interface {
	rendezvous.Record
	settings() endpoint
}

// endpoint fills the fields every transport publishes.
func (s *setup) endpoint() endpoint {
	return endpoint{Proto: int(s.proto), Transport: s.cfg.Transport, Streams: s.cfg.Streams, CRC: s.cfg.CRC,
		Identity: s.rv.Identity()}
}

// gather reads every member's endpoint record, checked to agree on the
// settings: the same error on every member when they do not.
func gather[R endpointRecord](ctx context.Context, s *setup) ([]R, error) {
	return rendezvous.Gather(ctx, s.rv, func(recs []R) error {
		var diffs []string
		diff := func(what string, val func(e endpoint) string) {
			first := val(recs[0].settings())
			same := true
			for _, r := range recs {
				same = same && val(r.settings()) == first
			}
			if !same {
				parts := make([]string, len(recs))
				for i, r := range recs {
					parts[i] = s.rv.Who(i) + " " + val(r.settings())
				}
				diffs = append(diffs, what+": "+strings.Join(parts, ", "))
			}
		}
		diff("bridge protocol", func(e endpoint) string { return "v" + strconv.Itoa(e.Proto) })
		diff("transport", func(e endpoint) string { return string(e.Transport) })
		diff("streams per peer", func(e endpoint) string { return strconv.Itoa(e.Streams) })
		diff("crc", func(e endpoint) string { return onOff(e.CRC) })
		if len(diffs) > 0 {
			return fmt.Errorf("members disagree on the bridge settings: %s", strings.Join(diffs, "; "))
		}
		return nil
	})
}

func onOff(b bool) string {
	if b {
		return "on"
	}
	return "off"
}

// crcWords says whether frames carry a CRC, for Describe.
func crcWords(crc bool) string {
	if crc {
		return "crc32c"
	}
	return "no crc"
}
