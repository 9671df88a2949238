package harness

import (
	"context"
	"encoding/json"
	"fmt"
	"log/slog"
	"os"
	"strconv"
	"time"

	"github.com/gpubridge/gpubridge/lib/collective"
	"github.com/gpubridge/gpubridge/lib/store"
	"github.com/gpubridge/gpubridge/lib/transport"
)

// JoinOptions say how a member joins a selftest or bench.
type JoinOptions struct {
	Store     string // HOST:PORT of the c10d store
	Namespace string
	Rank      int
	Size      int
	Transport string // auto, tcp or shm
	Streams   int
	ChunkB    int
	CRC       bool
	Workers   int
	Timeout   time.Duration // setup, and each collective
	Log       *slog.Logger
}

// Member is one joined member: its store, mesh and communicator.
type Member struct {
	Rank, Size int
	Hosts      []string
	Transport  string
	store      *store.Client
	Mesh       transport.Mesh
	Comm       *collective.Comm
}

// Join connects to the store, learns every member's host, chooses the
// transport (auto: shm when all members share a host, else tcp) and sets up
// the bridge.
func Join(ctx context.Context, o JoinOptions) (*Member, error) {
	if o.Log == nil {
		o.Log = slog.New(slog.DiscardHandler)
	}
	ctx, cancel := context.WithTimeout(ctx, o.Timeout)
	defer cancel()
	c, err := store.Dial(ctx, o.Store, store.WithLogger(o.Log))
	if err != nil {
		return nil, fmt.Errorf("member %d: connect to the store at %s: %w", o.Rank, o.Store, err)
	}
	kv := c.Prefix("gpubridge").Prefix(o.Namespace)
	host, _ := os.Hostname()
	if h := os.Getenv("GPUBRIDGE_SIM_HOSTNAME"); h != "" {
		host = h
	}
	if err := kv.Set(ctx, "host/"+strconv.Itoa(o.Rank), []byte(host)); err != nil {
		c.Close()
		return nil, fmt.Errorf("member %d: publish host: %w", o.Rank, err)
	}
	m := &Member{Rank: o.Rank, Size: o.Size, store: c}
	infos := make([]transport.MemberInfo, o.Size)
	sameHost := true
	for r := 0; r < o.Size; r++ {
		b, err := kv.Get(ctx, "host/"+strconv.Itoa(r))
		if err != nil {
			c.Close()
			return nil, fmt.Errorf("member %d: waiting for member %d to join: %w", o.Rank, r, err)
		}
		infos[r] = transport.MemberInfo{Rank: r, Host: string(b)}
		m.Hosts = append(m.Hosts, string(b))
		sameHost = sameHost && string(b) == host
	}
	m.Transport = o.Transport
	if m.Transport == "auto" || m.Transport == "" {
		m.Transport = "tcp"
		if sameHost {
			m.Transport = "shm"
		}
	}
	mesh, err := transport.Establish(ctx, transport.Config{
		Store: kv, Self: o.Rank, Members: infos, Transport: m.Transport,
		Streams: o.Streams, CRC: o.CRC, Timeout: o.Timeout, Log: o.Log,
		RingBytes: 2 * o.ChunkB, Process: "gbbridge member",
	})
	if err != nil {
		c.Close()
		return nil, fmt.Errorf("member %d: set up the %s bridge: %w", o.Rank, m.Transport, err)
	}
	m.Mesh = mesh
	m.Comm = collective.New(mesh, collective.Options{ChunkBytes: o.ChunkB, Workers: o.Workers, Timeout: o.Timeout, Log: o.Log})
	return m, nil
}

// Close ends the member's communicator, mesh and store connection, after a
// barrier (5 s at most) so that no member closes while another still works.
func (m *Member) Close() error {
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	_ = m.Comm.Barrier(ctx)
	cancel()
	err := m.Comm.Close()
	if cerr := m.Mesh.Close(); err == nil {
		err = cerr
	}
	m.store.Close()
	return err
}

// WriteJSON writes v as one JSON line.
func writeJSON(w interface{ Write([]byte) (int, error) }, v any) error {
	b, err := json.Marshal(v)
	if err != nil {
		return err
	}
	_, err = w.Write(append(b, '\n'))
	return err
}
