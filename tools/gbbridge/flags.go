package main

import (
	"context"
	"fmt"
	"strconv"
	"time"

	"github.com/alecthomas/kong"

	"github.com/gpubridge/gpubridge/lib/bridge"
	"github.com/gpubridge/gpubridge/lib/cli"
	"github.com/gpubridge/gpubridge/lib/collective"
	"github.com/gpubridge/gpubridge/lib/harness"
	"github.com/gpubridge/gpubridge/lib/transport"
)

// byteSize is a flag of bytes with an optional K, M or G suffix (powers of
// 1024).
type byteSize int64

func (b *byteSize) Decode(ctx *kong.DecodeContext) error {
	v, err := popSize(ctx, false)
	*b = byteSize(v)
	return err
}

// popSize reads a size flag's value; with off, "0" and "off" are 0.
func popSize(ctx *kong.DecodeContext, off bool) (int64, error) {
	var s string
	if err := ctx.Scan.PopValueInto("size", &s); err != nil {
		return 0, err
	}
	if off && (s == "0" || s == "off") {
		return 0, nil
	}
	return harness.ParseSize(s)
}

// smallSize is --small or --stream: bytes like byteSize, or 0 (or "off")
// for none.
type smallSize int64

func (b *smallSize) Decode(ctx *kong.DecodeContext) error {
	v, err := popSize(ctx, true)
	*b = smallSize(v)
	return err
}

// overlapFlag is --overlap: auto, on or off (collective.Options.Overlap).
type overlapFlag collective.Overlap

func (o *overlapFlag) Decode(ctx *kong.DecodeContext) error {
	var s string
	if err := ctx.Scan.PopValueInto("mode", &s); err != nil {
		return err
	}
	v, err := collective.ParseOverlap(s)
	*o = overlapFlag(v)
	return err
}

// memberFlags are what selftest and bench share: how members meet and how
// the bridge between them is set up.
type memberFlags struct {
	Store     string        `help:"Join a run across hosts through this c10d store (HOST:PORT); without it the members run as processes on this host over an embedded store." placeholder:"HOST:PORT"`
	Rank      int           `help:"With --store: this member's index." default:"-1"`
	WorldSize int           `help:"With --store: the number of members." default:"-1"`
	Namespace string        `help:"With --store: key namespace of the run (every member the same)." default:"gbbridge"`
	Transport string        `help:"Bridge transport: auto (shm when every member is on this host, else tcp), tcp, shm or verbs (RDMA: InfiniBand or RoCE; GPUBRIDGE_IB_HCA and GPUBRIDGE_IB_GID_INDEX pick the port and GID, docs/VERBS.md)." enum:"${transports}" default:"auto"`
	Streams   int           `help:"TCP connections (shm rings, verbs queue pairs) per pair of members (8: see docs/BENCHMARKS.md)." default:"8"`
	Chunk     byteSize      `help:"Pipelining unit of the collectives (K, M, G: powers of 1024)." default:"4M" placeholder:"BYTES"`
	Small     smallSize     `help:"An all_reduce of 3 or more members up to this size runs recursive doubling (log2 N dependent steps instead of the ring's 2(N-1)); 0 or off turns it off." default:"32K" placeholder:"BYTES"`
	Split     smallSize     `help:"A 2-member all_reduce of this size and more runs as two halves through the transport (each member reduces the half it owns, then sends it: half the exchange's reduction, the same bytes on the wire); 0 or off: never (the exchange)." default:"16M" placeholder:"BYTES"`
	SockBuf   smallSize     `name:"tcp-sockbuf" help:"SO_SNDBUF and SO_RCVBUF of every TCP connection between members (K, M: powers of 1024); 0 or off: the kernel's autotuning." default:"4M" placeholder:"BYTES"`
	CRC       bool          `help:"CRC32C on every frame between members (off by default: it costs 25-45% at 256 MiB on a 2-core host, see docs/BENCHMARKS.md)." negatable:""`
	Workers   int           `help:"Goroutines that reduce at once; 0: one per CPU." default:"0"`
	Stream    smallSize     `help:"Direct collectives over shared memory, and the last step of a ring, copy into destinations of this size and more with non-temporal stores (no read of the destination before it is written; the all_reduce's writes through, into lines just read, never stream); 0 or off: never." default:"128M" placeholder:"BYTES"`
	PeerWrite string        `help:"Over shared memory, the direct all_reduce's owner of each piece writes the result into every member's buffer (on: peers' shared memory is mapped writable, within the buffers each announces) instead of every member copying it from the owner's (off: read-only, as before); every member must say on for it to run (else the copies); results are the same." enum:"on,off" default:"on" name:"peer-writes" placeholder:"on|off"`
	Overlap   overlapFlag   `help:"Over TCP, read the next pieces of a frame off the socket while the earlier ones are reduced, on two goroutines per stream (up to 2 MiB of pieces per stream): on, off, or auto (off: measured slower on the hosts tried, docs/BENCHMARKS.md)." default:"auto" placeholder:"auto|on|off"`
	SpinUS    int           `help:"Microseconds a shm stream's waiter checks its ring before sleeping, as serve's --spin-us (the plugin passes 200 where every process has a core)." default:"5" name:"spin-us" placeholder:"US"`
	Timeout   time.Duration `help:"Deadline of the setup and of each collective." default:"60s"`
}

// Validate refuses flags a member would refuse, before members start
// (kong calls it after parsing).
func (f memberFlags) Validate() error {
	if n := int(f.SockBuf); !transport.SockBufAllowed(n) {
		return fmt.Errorf("--tcp-sockbuf %d: want %dK..%dM, or 0 (off) for the kernel's autotuning", n, transport.MinSockBuf>>10, transport.MaxSockBuf>>20)
	}
	_, err := spinOf("--spin-us", f.SpinUS)
	return err
}

// memberArgs are the flags that make a child process member rank of n
// (with an embedded store at storeAddr).
func (f memberFlags) memberArgs(cmd string, rank, n int, storeAddr, ns string) []string {
	return []string{cmd, "--store", storeAddr, "--rank", strconv.Itoa(rank), "--world-size", strconv.Itoa(n),
		"--namespace", ns, "--transport", f.Transport, "--streams", strconv.Itoa(f.Streams),
		"--chunk", strconv.Itoa(int(f.Chunk)), "--small", strconv.Itoa(int(f.Small)), "--split", strconv.Itoa(int(f.Split)), "--tcp-sockbuf", strconv.Itoa(int(f.SockBuf)), "--crc=" + strconv.FormatBool(f.CRC),
		"--workers", strconv.Itoa(f.Workers), "--stream", strconv.Itoa(int(f.Stream)), "--peer-writes", f.PeerWrite, "--overlap", collective.Overlap(f.Overlap).String(), "--spin-us", strconv.Itoa(f.SpinUS),
		"--timeout", f.Timeout.String()}
}

// join makes this process member --rank of a run through --store: the
// members learn each other's hosts through the store, and auto picks the
// transport from them.
func (f memberFlags) join(env *cli.Env) (*bridge.Member, error) {
	if f.WorldSize < 2 || f.Rank < 0 || f.Rank >= f.WorldSize {
		return nil, fmt.Errorf("with --store, --rank (0..N-1) and --world-size N >= 2 are needed; got rank %d of %d", f.Rank, f.WorldSize)
	}
	spin, err := spinOf("--spin-us", f.SpinUS)
	if err != nil {
		return nil, err
	}
	return bridge.Join(env.Ctx, bridge.Config{Store: f.Store, Namespace: f.Namespace, Size: f.WorldSize,
		Mesh: transport.Config{Self: f.Rank, Transport: transport.Kind(f.Transport), Streams: f.Streams, SockBuf: smallBytes(f.SockBuf), CRC: f.CRC, PeerWrite: f.PeerWrite == "on",
			Timeout: f.Timeout, RingBytes: 2 * int(f.Chunk), Spin: spin, Log: env.Log, Process: "gbbridge member"},
		Comm: collective.Options{ChunkBytes: int(f.Chunk), SmallBytes: smallBytes(f.Small), SplitBytes: smallBytes(f.Split), Workers: f.Workers, StreamBytes: smallBytes(f.Stream),
			Overlap: collective.Overlap(f.Overlap), Timeout: f.Timeout, Log: env.Log},
	})
}

// smallBytes is --small (--split, --stream) as collective.Options.SmallBytes
// (SplitBytes, StreamBytes), where 0 means its default: off is negative there.
func smallBytes(b smallSize) int {
	if b == 0 {
		return -1
	}
	return int(b)
}

// leaveTimeout bounds the barrier before a member closes.
const leaveTimeout = 5 * time.Second

// withMember runs fn as a joined member (see join) and leaves the bridge
// after it. A member that cannot join cannot run (exit 2).
func (f memberFlags) withMember(env *cli.Env, fn func(ctx context.Context, m *bridge.Member) error) error {
	m, err := f.join(env)
	if err != nil {
		return cli.CannotRun(err)
	}
	defer m.Leave(leaveTimeout)
	return fn(env.Ctx, m)
}
