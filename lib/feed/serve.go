package feed

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"os"
	"strings"
	"time"

	"github.com/gpubridge/gpubridge/lib/cli"
	"github.com/gpubridge/gpubridge/lib/collective"
	"github.com/gpubridge/gpubridge/lib/discover"
	"github.com/gpubridge/gpubridge/lib/store"
	"github.com/gpubridge/gpubridge/lib/transport"
)

// ServeSchema is the schema of the line `gbbridge serve` prints when ready.
const ServeSchema = "gpubridge.bridge-serve/v1"

// ReadyLine is what `gbbridge serve` prints on stdout, as one JSON line,
// once the bridge is up and the feed socket listens.
type ReadyLine struct {
	Schema    string `json:"schema"`
	Feed      string `json:"feed"`
	Member    int    `json:"member"`
	Members   int    `json:"members"`
	Rank      int    `json:"rank"`
	PID       int    `json:"pid"`
	Transport string `json:"transport"`
	Version   int    `json:"feed_version"`
}

// ServeOptions configure RunServe (`gbbridge serve`).
type ServeOptions struct {
	Store         string // HOST:PORT; "": MASTER_ADDR:MASTER_PORT
	Namespace     string // "": the topology's
	Feed          string // the feed socket's path
	Streams       int
	ChunkBytes    int
	CRC           bool
	Workers       int
	Timeout       time.Duration // one collective
	SetupTimeout  time.Duration // store, bridge setup, and the wait for the feed connection
	Interface     string
	ListenHost    string
	RingBytes     int
	DieWithParent bool
	Server        ServerOptions // limits of the feed; Member, Members and Transport are set here
	Log           *slog.Logger
	Getenv        func(string) string
}

// MaxTopologyBytes bounds the topology JSON RunServe reads.
const MaxTopologyBytes = 16 << 20

// ReadTopology decodes gbdiscover's topology JSON.
func ReadTopology(r io.Reader) (*discover.Topology, error) {
	b, err := io.ReadAll(io.LimitReader(r, MaxTopologyBytes+1))
	if err != nil {
		return nil, fmt.Errorf("read topology: %w", err)
	}
	if len(b) > MaxTopologyBytes {
		return nil, fmt.Errorf("topology is over %d bytes", MaxTopologyBytes)
	}
	if len(b) == 0 {
		return nil, errors.New("topology is empty (did gbdiscover succeed?)")
	}
	var t discover.Topology
	if err := json.Unmarshal(b, &t); err != nil {
		if !json.Valid(b) {
			return nil, fmt.Errorf("topology is not JSON: %w", err)
		}
		return nil, fmt.Errorf("topology is JSON, but not gbdiscover's topology: %w", err)
	}
	if t.Schema != discover.TopologySchema {
		return nil, fmt.Errorf("topology has schema %q, want %q (gbdiscover's output on success)", t.Schema, discover.TopologySchema)
	}
	return &t, nil
}

// Membership is this rank's place in the bridge.
type Membership struct {
	Member    int
	Members   []transport.MemberInfo
	Transport string
}

// BridgeMembership finds this rank's member index in the topology's bridge.
func BridgeMembership(t *discover.Topology) (Membership, error) {
	b := t.Bridge
	if b.Transport == discover.BridgeNone || b.Transport == "" || len(b.Members) < 2 {
		return Membership{}, fmt.Errorf("the job has no bridge (transport %q, %d member(s)): a single island needs no gbbridge", b.Transport, len(b.Members))
	}
	if b.Transport != discover.BridgeTCP && b.Transport != discover.BridgeSHM {
		return Membership{}, fmt.Errorf("bridge transport %q is not supported by this gbbridge (tcp, shm)", b.Transport)
	}
	m := Membership{Member: -1, Transport: b.Transport}
	for i, rank := range b.Members {
		host := ""
		if i < len(b.Hosts) {
			host = b.Hosts[i]
		} else if rank >= 0 && rank < len(t.Ranks) {
			host = t.Ranks[rank].Hostname
		}
		m.Members = append(m.Members, transport.MemberInfo{Rank: rank, Host: host})
		if rank == t.Self.Rank {
			m.Member = i
		}
	}
	if m.Member < 0 {
		return Membership{}, fmt.Errorf("rank %d is not a bridge member (the island leaders are ranks %v): only leaders run gbbridge serve", t.Self.Rank, b.Members)
	}
	return m, nil
}

// storeAddr resolves the store's address as gbdiscover does.
func (o *ServeOptions) storeAddr() (string, error) {
	getenv := o.Getenv
	if getenv == nil {
		getenv = os.Getenv
	}
	return store.ResolveAddr(o.Store, getenv)
}

// RunServe is `gbbridge serve`: it joins the bridge described by the
// topology as this rank's member, listens on the feed socket, prints the
// ready line on stdout, serves exactly one feed connection and returns.
// nil: the feed closed cleanly and the bridge never failed. Exit codes (as
// cli errors): 1 the bridge failed, the feed was lost with requests in
// flight, the client broke the protocol, or a signal stopped the server; 2
// the server could not start (usage, topology, store, bridge setup, no feed
// connection within the setup timeout).
func RunServe(ctx context.Context, o ServeOptions, topo *discover.Topology, stdout io.Writer) (err error) {
	if o.Log == nil {
		o.Log = slog.New(slog.DiscardHandler)
	}
	if o.DieWithParent {
		if err := cli.DieWithParent(); err != nil {
			return cli.CannotRun(err)
		}
	}
	ms, err := BridgeMembership(topo)
	if err != nil {
		return cli.CannotRun(err)
	}
	ns := topo.Namespace
	if o.Namespace != "" && o.Namespace != ns {
		return cli.CannotRun(fmt.Errorf("--namespace %q differs from the topology's %q: serve must join the bridge of the discovery that made the topology", o.Namespace, ns))
	}
	addr, err := o.storeAddr()
	if err != nil {
		return cli.CannotRun(err)
	}
	if o.SetupTimeout <= 0 {
		return cli.CannotRun(fmt.Errorf("--setup-timeout %s must be positive", o.SetupTimeout))
	}
	if o.Timeout <= 0 {
		return cli.CannotRun(fmt.Errorf("--timeout %s must be positive", o.Timeout))
	}
	who := fmt.Sprintf("rank %d (bridge member %d of %d)", topo.Self.Rank, ms.Member, len(ms.Members))
	log := o.Log.With("rank", topo.Self.Rank, "member", ms.Member)

	// The feed socket first: a bad path fails before the peers wait on us.
	ln, err := Listen(o.Feed)
	if err != nil {
		return cli.CannotRun(err)
	}
	defer ln.Close()

	setupCtx, cancel := context.WithTimeout(ctx, o.SetupTimeout)
	defer cancel()
	sc, err := store.Dial(setupCtx, addr, store.WithLogger(log))
	if err != nil {
		return cli.CannotRun(setupCause(ctx, fmt.Errorf("%s: connect to the store at %s: %w", who, addr, err)))
	}
	defer sc.Close()
	mesh, err := transport.Establish(setupCtx, transport.Config{
		Store: sc.Prefix(discover.KeyPrefix).Prefix(ns), Self: ms.Member, Members: ms.Members,
		Transport: ms.Transport, Streams: o.Streams, CRC: o.CRC, Interface: o.Interface,
		ListenHost: o.ListenHost, Timeout: o.SetupTimeout, RingBytes: o.RingBytes, Log: log,
		Process: "gbbridge serve",
	})
	if err != nil {
		return cli.CannotRun(setupCause(ctx, fmt.Errorf("%s: %w", who, err)))
	}
	comm := collective.New(mesh, collective.Options{ChunkBytes: o.ChunkBytes, Workers: o.Workers, Timeout: o.Timeout, Log: log})
	// From here on every exit ends the communicator; a failure aborts the
	// mesh first so that the peers learn why at once.
	defer func() {
		if err != nil {
			// The peers name this member themselves.
			mesh.Abort(fmt.Errorf("gbbridge serve stopped: %s", strings.TrimPrefix(err.Error(), who+": ")))
		}
		_ = comm.Close()
	}()

	line, _ := json.Marshal(ReadyLine{
		Schema: ServeSchema, Feed: ln.Path(), Member: ms.Member, Members: len(ms.Members),
		Rank: topo.Self.Rank, PID: os.Getpid(), Transport: mesh.Describe(), Version: Version,
	})
	if _, err := fmt.Fprintf(stdout, "%s\n", line); err != nil {
		return cli.CannotRun(fmt.Errorf("write the ready line: %w", err))
	}
	log.Info("bridge ready", "transport", mesh.Describe(), "feed", ln.Path())

	conn, err := ln.Accept(ctx, o.SetupTimeout)
	if err != nil {
		if ctx.Err() != nil {
			return cli.Failed(fmt.Errorf("%s: stopped by a signal (or the parent's death) while waiting for the feed: %v", who, context.Cause(ctx)))
		}
		return cli.CannotRun(fmt.Errorf("%s: %w", who, err))
	}
	so := o.Server
	so.Member, so.Members, so.Transport, so.Log = ms.Member, len(ms.Members), mesh.Describe(), log
	srv := NewServer(conn, comm, so)
	err = srv.Serve(ctx)
	switch {
	case err != nil && ctx.Err() != nil:
		return cli.Failed(fmt.Errorf("%s: stopped by a signal (or the parent's death) while serving: %v", who, context.Cause(ctx)))
	case err != nil:
		return cli.Failed(fmt.Errorf("%s: %w", who, err))
	}
	if b := srv.Broken(); b != nil {
		return cli.Failed(fmt.Errorf("%s: the bridge failed during the session: %w", who, b))
	}
	log.Info("feed closed")
	return nil
}

// setupCause prefers a signal's cause to the error it caused.
func setupCause(ctx context.Context, err error) error {
	if ctx.Err() != nil {
		return fmt.Errorf("%w (stopped: %v)", err, context.Cause(ctx))
	}
	return err
}
