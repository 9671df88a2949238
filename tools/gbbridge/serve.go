package main

import (
	"context"
	"encoding/json"
	"fmt"
	"log/slog"
	"os"
	"strings"
	"time"

	"github.com/gpubridge/gpubridge/lib/bridge"
	"github.com/gpubridge/gpubridge/lib/cli"
	"github.com/gpubridge/gpubridge/lib/collective"
	"github.com/gpubridge/gpubridge/lib/discover"
	"github.com/gpubridge/gpubridge/lib/feed"
	"github.com/gpubridge/gpubridge/lib/feed/feedserver"
	"github.com/gpubridge/gpubridge/lib/store"
	"github.com/gpubridge/gpubridge/lib/transport"
)

type serveCmd struct {
	Topology      string        `help:"gbdiscover's topology JSON for this rank; - is stdin." default:"-" placeholder:"FILE"`
	Store         string        `help:"The job's c10d store as HOST:PORT. Default: MASTER_ADDR:MASTER_PORT." env:"GPUBRIDGE_STORE" placeholder:"HOST:PORT"`
	Namespace     string        `help:"Key namespace of the job and attempt; must be the topology's (the default)." env:"GPUBRIDGE_NAMESPACE"`
	Feed          string        `help:"Path of the Unix socket to listen on for the feed: a fresh path in a directory only this user can enter." required:"" placeholder:"PATH"`
	Streams       int           `help:"TCP connections (shm rings) per pair of members; every member must use the same (8: see docs/BENCHMARKS.md)." default:"8"`
	Chunk         byteSize      `help:"Pipelining unit of the collectives (K, M, G suffixes: powers of 1024); every member must use the same." default:"4M" placeholder:"BYTES"`
	Small         smallSize     `help:"An all_reduce of 3 or more members up to this size runs recursive doubling; 0 or off turns it off; every member must use the same." default:"32K" placeholder:"BYTES"`
	Split         smallSize     `help:"A 2-member all_reduce of this size and more runs as two halves (each member reduces the half it owns, then sends it); 0 or off: never; every member must use the same." default:"16M" placeholder:"BYTES"`
	CRC           bool          `help:"CRC32C on every frame between members (off by default, like selftest and bench: see docs/ARCHITECTURE.md); every member must use the same." negatable:""`
	Workers       int           `help:"Goroutines that reduce at once; 0: one per CPU." default:"0"`
	Stream        smallSize     `help:"Direct collectives over shared memory, and the last step of a ring, copy into destinations of this size and more with non-temporal stores (no read of the destination before it is written; the all_reduce's writes through, into lines just read, never stream); 0 or off: never." default:"128M" placeholder:"BYTES"`
	PeerWrite     string        `help:"Over shared memory, the direct all_reduce's owner of each piece writes the result into every member's buffer (on: peers' shared memory is mapped writable, within the buffers each announces) instead of every member copying it from the owner's (off: read-only, as before); every member must say on for it to run (else the copies); results are the same." enum:"on,off" default:"on" name:"peer-writes" placeholder:"on|off"`
	Overlap       overlapFlag   `help:"Over TCP, read the next pieces of a frame off the socket while the earlier ones are reduced, on two goroutines per stream (up to 2 MiB of pieces per stream): on, off, or auto (off: measured slower on the hosts tried, docs/BENCHMARKS.md)." default:"auto" placeholder:"auto|on|off"`
	Timeout       time.Duration `help:"Deadline of one collective or point-to-point operation." default:"5m"`
	SetupTimeout  time.Duration `help:"Deadline of the store connection and the bridge setup, and then of the wait for the plugin's feed connection." default:"60s"`
	Interface     string        `help:"Network interface to listen on and advertise. Default: the one that routes to the store's host." env:"GPUBRIDGE_IFNAME" placeholder:"NAME"`
	ListenHost    string        `help:"IP address (or host name) to listen on and advertise; wins over --interface." placeholder:"ADDR"`
	ShmRing       byteSize      `help:"Size of each shared-memory ring (shm transport)." default:"8M" placeholder:"BYTES"`
	SpinUS        int           `help:"Microseconds a shm stream's waiter checks its ring before sleeping (waking a sleeper costs tens of microseconds on a VM: spin longer when every process has a core); the plugin's feed client spins as long for its answers." default:"5" env:"GPUBRIDGE_SPIN_US" name:"spin-us" placeholder:"US"`
	TinySpinUS    int           `help:"Microseconds the shm waiters of a collective of at most 64 KiB spin instead (its time is mostly wake-ups; a large call's waiters spinning long hold the cores its reduction needs); -1: --spin-us's. The plugin's feed client spins as long for those calls' answers." default:"-1" env:"GPUBRIDGE_TINY_SPIN_US" name:"tiny-spin-us" placeholder:"US"`
	MaxFeedback   byteSize      `help:"Cap on the error-feedback residuals the feed keeps (4 bytes per value of each keyed buffer a lossy all_reduce compresses); a request that would pass it is refused (docs/FEED.md §3a)." default:"64G" placeholder:"SIZE"`
	DieWithParent bool          `help:"Exit when the parent process (the rank) dies (PR_SET_PDEATHSIG)." default:"true" negatable:""`
	ParentPID     int           `help:"With --die-with-parent: the pid the parent says it has; exit 2 at start if the parent is another (it died between spawning and this check). 0: whichever parent this process has at start." default:"0" name:"parent-pid" placeholder:"PID"`
	NoBridge      bool          `help:"Start no bridge 0 (the leaders' bridge): serve only the feed, whose client joins the bridges it needs (JOIN, docs/FEED.md §3b); for a rank that leads no island. The topology is the same." name:"no-bridge"`
}

// Run is `gbbridge serve`: it joins the bridge described by the topology
// as this rank's member (bridge 0; not with --no-bridge), listens on the
// feed socket, prints the ready line, serves exactly one feed connection,
// joining the bridges its client asks for, and returns. Exit 1: the bridge
// failed, the feed was lost with requests in flight, the client broke the
// protocol, or a signal stopped the server; 2: it could not start.
func (c *serveCmd) Run(env *cli.Env) error {
	topo, err := c.readTopology(env)
	if err != nil {
		return cli.CannotRun(err)
	}
	if _, err := spinOf("--spin-us", c.SpinUS); err != nil {
		return cli.CannotRun(err)
	}
	if _, err := c.tinySpin(); err != nil {
		return cli.CannotRun(err)
	}
	setGCBallast(os.Getenv)
	if c.DieWithParent {
		if err := cli.DieWithParent(c.ParentPID); err != nil {
			return cli.CannotRun(err)
		}
	}
	s, err := c.setUp(env, topo)
	if err != nil {
		return cli.CannotRun(err)
	}
	// GPUBRIDGE_CPUPROFILE and GPUBRIDGE_GOTRACE reach serve through the
	// plugin's environment: where a tiny call's legs to and from serve go.
	stop, err := startProfile(topo.Self.Rank)
	if err != nil {
		s.close(err)
		return cli.CannotRun(err)
	}
	err = s.run(env)
	stop()
	s.close(err)
	return err
}

func (c *serveCmd) readTopology(env *cli.Env) (*discover.Topology, error) {
	in := env.Stdin
	if c.Topology != "-" {
		f, err := os.Open(c.Topology)
		if err != nil {
			return nil, fmt.Errorf("open topology: %w", err)
		}
		defer f.Close()
		in = f
	}
	return bridge.ReadTopology(in)
}

// serving is a serve that is set up: the bridge joined, the feed socket
// listening.
type serving struct {
	who    string // "rank R (bridge member M of N)": how messages name it
	rank   int
	topo   *discover.Topology
	store  string // the store's address
	ms     bridge.Membership
	ln     *feedserver.Listener
	member *bridge.Member // bridge 0; nil with --no-bridge
	log    *slog.Logger
	c      *serveCmd
}

// setUp checks the flags against the topology, listens on the feed socket
// (a bad path fails before the peers wait on this member) and joins the
// bridge.
func (c *serveCmd) setUp(env *cli.Env, topo *discover.Topology) (*serving, error) {
	ms := bridge.Membership{Member: -1}
	var err error
	if !c.NoBridge {
		if ms, err = bridge.FromTopology(topo); err != nil {
			return nil, err
		}
	}
	if c.Namespace != "" && c.Namespace != topo.Namespace {
		return nil, fmt.Errorf("--namespace %q differs from the topology's %q: serve must join the bridge of the discovery that made the topology", c.Namespace, topo.Namespace)
	}
	addr, err := store.ResolveAddr(c.Store, os.Getenv)
	if err != nil {
		return nil, err
	}
	if c.SetupTimeout <= 0 {
		return nil, fmt.Errorf("--setup-timeout %s must be positive", c.SetupTimeout)
	}
	if c.Timeout <= 0 {
		return nil, fmt.Errorf("--timeout %s must be positive", c.Timeout)
	}
	s := &serving{c: c, ms: ms, rank: topo.Self.Rank, topo: topo, store: addr,
		who: fmt.Sprintf("rank %d (bridge member %d of %d)", topo.Self.Rank, ms.Member, len(ms.Members)),
		log: env.Log.With("rank", topo.Self.Rank, "member", ms.Member)}
	if c.NoBridge {
		s.who = fmt.Sprintf("rank %d (no bridge 0)", topo.Self.Rank)
	}
	if s.ln, err = feedserver.Listen(c.Feed); err != nil {
		return nil, err
	}
	if c.NoBridge {
		return s, nil
	}
	s.member, err = bridge.Join(env.Ctx, bridge.Config{Store: addr, Namespace: topo.Namespace, Name: s.who,
		Mesh: c.meshConfig(ms.Member, ms.Members, ms.Transport, c.SetupTimeout, s.log),
		Comm: c.commOptions(s.log),
	})
	if err != nil {
		s.ln.Close()
		return nil, setupCause(env.Ctx, err)
	}
	return s, nil
}

// run prints the ready line and serves the one feed connection.
func (s *serving) run(env *cli.Env) error {
	desc := "none"
	var b0 feedserver.Bridge
	if s.member != nil {
		desc, b0 = s.member.Mesh.Describe(), s.member.Comm
	}
	line, _ := json.Marshal(feed.ReadyLine{
		Schema: feed.ServeSchema, Feed: s.ln.Path(), Member: s.ms.Member, Members: len(s.ms.Members),
		Rank: s.rank, PID: os.Getpid(), Transport: desc, Version: feed.Version, Bridge0: s.member != nil,
	})
	if _, err := fmt.Fprintf(env.Stdout, "%s\n", line); err != nil {
		return cli.CannotRun(fmt.Errorf("write the ready line: %w", err))
	}
	s.log.Info("feed ready", "bridge0", desc, "feed", s.ln.Path())

	ctx := env.Ctx
	conn, err := s.ln.Accept(ctx, s.c.SetupTimeout)
	if err != nil {
		if ctx.Err() != nil {
			return cli.Failed(fmt.Errorf("%s: stopped by a signal (or the parent's death) while waiting for the feed: %v", s.who, context.Cause(ctx)))
		}
		return cli.CannotRun(fmt.Errorf("%s: %w", s.who, err))
	}
	tiny, _ := s.c.tinySpin() // checked in Run
	srv := feedserver.NewServer(conn, b0, feedserver.ServerOptions{
		Member: max(s.ms.Member, 0), Members: len(s.ms.Members), Transport: desc, MaxFeedbackBytes: uint64(s.c.MaxFeedback), Log: s.log,
		Rank: s.rank, WorldSize: len(s.topo.Ranks), Joiner: s, TinySpin: tiny})
	err = srv.Serve(ctx)
	switch {
	case err != nil && ctx.Err() != nil:
		return cli.Failed(fmt.Errorf("%s: stopped by a signal (or the parent's death) while serving: %v", s.who, context.Cause(ctx)))
	case err != nil:
		return cli.Failed(fmt.Errorf("%s: %w", s.who, err))
	}
	if b := srv.Broken(); b != nil {
		return cli.Failed(fmt.Errorf("%s: the bridge failed during the session: %w", s.who, b))
	}
	s.log.Info("feed closed")
	return nil
}

// close ends the member and the socket. After a failure it aborts the mesh
// first, so that the peers learn why at once (they name this member
// themselves).
func (s *serving) close(err error) {
	if s.member != nil {
		if err != nil {
			s.member.Mesh.Abort(fmt.Errorf("gbbridge serve stopped: %s", strings.TrimPrefix(err.Error(), s.who+": ")))
		}
		_ = s.member.Close()
	}
	_ = s.ln.Close()
}

// Join joins the named bridge a JOIN asks for (feedserver.Joiner): its
// members are placed on the topology's hosts, and meet through the store
// with bridge 0's settings (docs/FEED.md §3b).
func (s *serving) Join(ctx context.Context, j feedserver.JoinRequest) (*feedserver.Joined, error) {
	members, err := bridge.MembersOf(s.topo, j.Ranks)
	if err != nil {
		return nil, err
	}
	c := s.c
	who := fmt.Sprintf("rank %d (member %d of bridge %q)", s.rank, j.Member, j.Name)
	log := s.log.With("bridge", j.ID, "name", j.Name)
	// Members JOIN when each first needs the bridge (a point-to-point
	// peer, a policy's first call), which may be as far apart as a
	// collective may wait for its members: not only --setup-timeout.
	meet := max(c.SetupTimeout, c.Timeout)
	mc := c.meshConfig(j.Member, members, bridge.NamedTransport(members, s.topo.Bridge.Transport), meet, log)
	mc.P2PStreams = p2pStreamsOf(j.Name)
	m, err := bridge.Join(ctx, bridge.Config{Store: s.store, Namespace: s.topo.Namespace, Name: who, Bridge: j.Name,
		Mesh: mc, Comm: c.commOptions(log)})
	if err != nil {
		return nil, err
	}
	return &feedserver.Joined{Bridge: m.Comm, Transport: m.Mesh.Describe(), Close: func(cause error) {
		if cause != nil {
			m.Mesh.Abort(fmt.Errorf("gbbridge serve stopped: %v", cause))
		}
		_ = m.Close()
	}}, nil
}

// setupCause prefers a signal's cause to the error it caused.
func setupCause(ctx context.Context, err error) error {
	if ctx.Err() != nil {
		return fmt.Errorf("%w (stopped: %v)", err, context.Cause(ctx))
	}
	return err
}

// meshConfig is the transport settings of every bridge serve joins (bridge
// 0 and the named ones): the flags, and the member's place in it.
func (c *serveCmd) meshConfig(self int, members []transport.MemberInfo, kind transport.Kind, timeout time.Duration, log *slog.Logger) transport.Config {
	return transport.Config{Self: self, Members: members, Transport: kind,
		Streams: c.Streams, CRC: c.CRC, PeerWrite: c.PeerWrite == "on", Interface: c.Interface, ListenHost: c.ListenHost,
		Timeout: timeout, RingBytes: int(c.ShmRing), Spin: c.spin(), Log: log, Process: "gbbridge serve"}
}

// commOptions is the collectives' settings of every bridge serve joins.
func (c *serveCmd) commOptions(log *slog.Logger) collective.Options {
	return collective.Options{ChunkBytes: int(c.Chunk), SmallBytes: smallBytes(c.Small), SplitBytes: smallBytes(c.Split), Workers: c.Workers,
		StreamBytes: smallBytes(c.Stream), Overlap: collective.Overlap(c.Overlap), Timeout: c.Timeout, Log: log}
}

// spin is the shm waiters' spin (checked in Run).
func (c *serveCmd) spin() time.Duration {
	s, _ := spinOf("--spin-us", c.SpinUS)
	return s
}

// tinySpin is the tiny calls' spin, feedserver.ServerOptions.TinySpin
// (0: --spin-us's).
func (c *serveCmd) tinySpin() (time.Duration, error) {
	if c.TinySpinUS == -1 {
		return 0, nil
	}
	return spinOf("--tiny-spin-us", c.TinySpinUS)
}

// spinOf is a spin flag's microseconds as transport.Config.Spin: 0 means
// none (Config's zero is its default).
func spinOf(flag string, us int) (time.Duration, error) {
	if us < 0 || time.Duration(us)*time.Microsecond > transport.MaxSpin {
		return 0, fmt.Errorf("%s %d: 0..%d allowed", flag, us, transport.MaxSpin.Microseconds())
	}
	return max(time.Duration(us)*time.Microsecond, time.Nanosecond), nil
}

// p2pStreamsOf is the point-to-point streams a named bridge gets (0: the
// default, -1: none): only bridges named "pair/..." carry point-to-point
// messages besides bridge 0 (docs/FEED.md §3b), and on shm every stream is
// a ring of --shm-ring bytes reserved in /dev/shm (fallocate) per peer (on
// verbs as many bytes of ring and half as much staging, pinned), so the
// flat and shard bridges do without them.
func p2pStreamsOf(name string) int {
	if strings.HasPrefix(name, "pair/") {
		return 0
	}
	return -1
}
