package bridge

import (
	"context"
	"fmt"
	"log/slog"
	"time"

	"github.com/gpubridge/gpubridge/lib/collective"
	"github.com/gpubridge/gpubridge/lib/discover"
	"github.com/gpubridge/gpubridge/lib/store"
	"github.com/gpubridge/gpubridge/lib/transport"
)

// Config says how a member joins the bridge.
type Config struct {
	// Store is the job's c10d store, HOST:PORT.
	Store string
	// Namespace is the job's key namespace: the members meet under
	// /gpubridge/<Namespace>/, as discovery's ranks do.
	Namespace string
	// Name is how errors name this member (default "member <Self>").
	Name string
	// Size is the number of members when Mesh.Members is nil.
	Size int
	// Mesh are the transport's settings. Join sets its Store. Members nil:
	// every member publishes its host in the store and reads the others'.
	// Transport is the requested kind (transport.Choose). Timeout bounds
	// the whole join; Log also receives the store's events. P2PStreams 0
	// is transport.DefaultP2PStreams (large point-to-point messages are
	// striped over them), negative none.
	Mesh transport.Config
	// Comm are the communicator's settings.
	Comm collective.Options
	// Bridge names a bridge joined after start (docs/FEED.md §3b): its
	// members meet under bridges/<Bridge>/ instead of bridge/, and first
	// agree on Mesh.Members (which must be given): every member must name
	// the same ranks in the same order, or every member fails naming the
	// difference. "": bridge 0, the leaders' bridge.
	Bridge string
}

// Member is this process's place in a joined bridge.
type Member struct {
	// Self is this member's index, Size the number of members.
	Self, Size int
	Mesh       transport.Mesh
	Comm       *collective.Comm
	store      *store.Client
}

// JoinError is a member that could not join the bridge: who, at which
// step, and why.
type JoinError struct {
	Member string // Config.Name
	Step   string // "connect to the store at HOST:PORT", "set up the tcp bridge", …
	Err    error
}

func (e *JoinError) Error() string { return e.Member + ": " + e.Step + ": " + e.Err.Error() }
func (e *JoinError) Unwrap() error { return e.Err }

// Join connects to the store, learns the members and the transport if the
// config does not name them, sets up the mesh and starts the communicator.
// Errors are *JoinError.
func Join(ctx context.Context, c Config) (*Member, error) {
	if c.Mesh.Log == nil {
		c.Mesh.Log = slog.New(slog.DiscardHandler)
	}
	if c.Name == "" {
		c.Name = fmt.Sprintf("member %d", c.Mesh.Self)
	}
	fail := func(step string, err error) error { return &JoinError{Member: c.Name, Step: step, Err: err} }
	if c.Mesh.Timeout > 0 {
		var cancel context.CancelFunc
		ctx, cancel = context.WithTimeout(ctx, c.Mesh.Timeout)
		defer cancel()
	}
	sc, err := store.Dial(ctx, c.Store, store.WithLogger(c.Mesh.Log))
	if err != nil {
		return nil, fail("connect to the store at "+c.Store, err)
	}
	kv := sc.Prefix(discover.KeyPrefix).Prefix(c.Namespace)
	if c.Bridge != "" {
		if len(c.Mesh.Members) < 2 || c.Mesh.Self < 0 || c.Mesh.Self >= len(c.Mesh.Members) {
			sc.Close()
			return nil, fail(fmt.Sprintf("join bridge %q", c.Bridge), fmt.Errorf("member %d of %d members: a named bridge needs its members given", c.Mesh.Self, len(c.Mesh.Members)))
		}
		kv = kv.Prefix(NamedPrefix + "/" + c.Bridge)
		timeout := c.Mesh.Timeout
		if timeout <= 0 {
			timeout = transport.DefaultTimeout
		}
		actx, cancel := context.WithTimeout(ctx, timeout)
		err := agreeMembers(actx, kv, c.Bridge, c.Mesh.Members, c.Mesh.Self, timeout)
		cancel()
		if err != nil {
			sc.Close()
			return nil, fail(fmt.Sprintf("agree on the members of bridge %q", c.Bridge), err)
		}
	}
	c.Mesh.Store = kv
	if c.Mesh.Members == nil {
		var step string
		if c.Mesh.Members, step, err = exchangeHosts(ctx, kv, c.Mesh.Self, c.Size); err != nil {
			sc.Close()
			return nil, fail(step, err)
		}
	}
	if c.Mesh.Transport, _, err = transport.Choose(c.Mesh.Transport, c.Mesh.Members); err != nil {
		sc.Close()
		return nil, fail("choose the transport", err)
	}
	switch {
	case c.Mesh.P2PStreams == 0:
		c.Mesh.P2PStreams = transport.DefaultP2PStreams
	case c.Mesh.P2PStreams < 0:
		c.Mesh.P2PStreams = 0
	}
	mesh, err := transport.Establish(ctx, c.Mesh)
	if err != nil {
		sc.Close()
		return nil, fail(fmt.Sprintf("set up the %s bridge", c.Mesh.Transport), err)
	}
	return &Member{
		Self: c.Mesh.Self, Size: len(c.Mesh.Members), Mesh: mesh,
		Comm: collective.New(mesh, c.Comm), store: sc,
	}, nil
}

// Close ends the communicator (and its mesh) and the store connection.
func (m *Member) Close() error {
	err := m.Comm.Close()
	if m.store != nil {
		m.store.Close()
	}
	return err
}

// Leave closes the member after a barrier (timeout at most), so that no
// member closes while another still works.
func (m *Member) Leave(timeout time.Duration) error {
	ctx, cancel := context.WithTimeout(context.Background(), timeout)
	_ = m.Comm.Barrier(ctx)
	cancel()
	return m.Close()
}
