package transport

import (
	"bytes"
	"context"
	"encoding/binary"
	"encoding/json"
	"fmt"
	"github.com/gpubridge/gpubridge/lib/store/storetest"
	"log/slog"
	"math/rand/v2"
	"os"
	"os/exec"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/gpubridge/gpubridge/lib/store"
	"github.com/gpubridge/gpubridge/lib/testenv"
	"github.com/gpubridge/gpubridge/lib/wire"
	"github.com/stretchr/testify/require"
	"go.uber.org/goleak"
)

const childEnv = "GPUBRIDGE_TRANSPORT_TEST_CHILD"

func TestMain(m *testing.M) {
	if spec := os.Getenv(childEnv); spec != "" {
		os.Exit(childMain(spec))
	}
	goleak.VerifyTestMain(m)
}

// dialStore returns a client of the store at addr, prefixed to ns.
func dialStore(t testing.TB, addr, ns string) *store.Client {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), testenv.Scale(20*time.Second))
	defer cancel()
	c, err := store.Dial(ctx, addr, store.WithConnectTimeout(testenv.Scale(20*time.Second)))
	require.NoError(t, err)
	t.Cleanup(func() { _ = c.Close() })
	return c.Prefix(ns)
}

func hostname(t testing.TB) string {
	h, err := os.Hostname()
	require.NoError(t, err)
	return h
}

// members describes n members for a transport: all on this host for shm,
// on made-up hosts for tcp (the host names only appear in messages).
func members(t testing.TB, transport Kind, n int) []MemberInfo {
	out := make([]MemberInfo, n)
	for i := range out {
		out[i] = MemberInfo{Rank: 2 * i, Host: fmt.Sprintf("host-%c", 'a'+i)}
		if transport == "shm" {
			out[i].Host = hostname(t)
		}
	}
	return out
}

// bridge is a set of members' configs over one store namespace.
type bridge struct {
	addr, ns string
	cfgs     []Config
}

// newBridge makes configs for n members; mod adjusts member i's.
func newBridge(t testing.TB, transport Kind, n, streams int, crc bool) *bridge {
	addr := storetest.Start(t)
	b := &bridge{addr: addr, ns: "job-" + strings.ReplaceAll(t.Name(), "/", "-"), cfgs: make([]Config, n)}
	ms := members(t, transport, n)
	for i := range b.cfgs {
		b.cfgs[i] = Config{
			Store: dialStore(t, addr, b.ns), Self: i, Members: ms, Transport: transport,
			Streams: streams, CRC: crc, ListenHost: "127.0.0.1", Timeout: testenv.Scale(30 * time.Second),
		}
	}
	return b
}

// establish runs Establish for the given members at once and returns the
// meshes (closed when the test ends) and errors, by member.
func (b *bridge) establish(t testing.TB, which ...int) ([]Mesh, []error) {
	t.Helper()
	if len(which) == 0 {
		for i := range b.cfgs {
			which = append(which, i)
		}
	}
	meshes := make([]Mesh, len(b.cfgs))
	errs := make([]error, len(b.cfgs))
	var wg sync.WaitGroup
	for _, i := range which {
		wg.Go(func() { meshes[i], errs[i] = Establish(context.Background(), b.cfgs[i]) })
	}
	wg.Wait()
	t.Cleanup(func() {
		for _, m := range meshes {
			if m != nil {
				_ = m.Close()
			}
		}
	})
	return meshes, errs
}

// set applies f to every member's config.
func (b *bridge) set(f func(c *Config)) *bridge {
	for i := range b.cfgs {
		f(&b.cfgs[i])
	}
	return b
}

// twoStep starts member 0's Establish of a two-member bridge; join then
// establishes member 1 and returns both meshes (closed when the test ends)
// once member 0 is done too, failing the test on an error.
func (b *bridge) twoStep(t *testing.T) (join func() []Mesh) {
	t.Helper()
	var m0 Mesh
	var err0 error
	done := make(chan struct{})
	go func() {
		defer close(done)
		ms, errs := b.establish(t, 0)
		m0, err0 = ms[0], errs[0]
	}()
	return func() []Mesh {
		t.Helper()
		m1, err := Establish(context.Background(), b.cfgs[1])
		require.NoError(t, err, "member 1 could not join")
		t.Cleanup(func() { _ = m1.Close() })
		<-done
		require.NoError(t, err0)
		return []Mesh{m0, m1}
	}
}

// mustEstablish establishes every member and fails the test on an error.
func (b *bridge) mustEstablish(t testing.TB) []Mesh {
	t.Helper()
	ms, errs := b.establish(t)
	for i, err := range errs {
		require.NoError(t, err, "member %d", i)
	}
	return ms
}

// pattern fills p with bytes determined by the frame's identity: a random
// 4 KiB block from that seed, repeated, each copy stamped with its offset
// (cheap under the race detector, and still catches misplaced data).
func pattern(p []byte, from, to, stream int, seq uint64) {
	r := rand.New(rand.NewPCG(uint64(from)<<48|uint64(to)<<32|uint64(stream), seq))
	var block [4096]byte
	for i := 0; i < len(block); i += 8 {
		binary.LittleEndian.PutUint64(block[i:], r.Uint64())
	}
	for off := 0; off < len(p); off += len(block) {
		n := copy(p[off:], block[:])
		if n >= 8 {
			binary.LittleEndian.PutUint64(p[off:], uint64(off)^seq)
		}
	}
}

// patterned returns the pattern of frame k of size bytes from member from
// to member to on stream s, in *buf (grown when too small).
func patterned(buf *[]byte, size, from, to, s, k int) []byte {
	if cap(*buf) < size {
		*buf = make([]byte, size)
	}
	p := (*buf)[:size]
	pattern(p, from, to, s, uint64(k))
	return p
}

// streamOf returns data stream i, then the point-to-point streams, then
// the control stream (i == Streams+P2PStreams).
func streamOf(m Mesh, peer, i int) Stream {
	switch {
	case i < m.Streams():
		return m.Stream(peer, i)
	case i < m.Streams()+m.P2PStreams():
		return m.P2PStream(peer, i-m.Streams())
	}
	return m.Control(peer)
}

// exchange sends frames of the given sizes on every stream (point-to-point
// and control included) from every member to every other, all at once, and checks
// their content, headers and order.
func exchange(t *testing.T, meshes []Mesh, sizes []int) {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), testenv.Scale(60*time.Second))
	defer cancel()
	n := len(meshes)
	var wg sync.WaitGroup
	errc := make(chan error, 2*n*n*(meshes[0].Streams()+meshes[0].P2PStreams()+1))
	for a := range n {
		for b := range n {
			if a == b {
				continue
			}
			for s := 0; s <= meshes[a].Streams()+meshes[a].P2PStreams(); s++ {
				wg.Go(func() {
					out := streamOf(meshes[a], b, s)
					buf := make([]byte, 0, 1<<20)
					for k, size := range sizes {
						p := patterned(&buf, size, a, b, s, k)
						h := wire.Header{Kind: wire.KindData, Seq: uint64(k), Step: uint32(s), Chunk: uint32(a)}
						if err := out.Send(ctx, h, p); err != nil {
							errc <- fmt.Errorf("send %d->%d stream %d frame %d: %w", a, b, s, k, err)
							return
						}
					}
				})
				wg.Go(func() {
					in := streamOf(meshes[a], b, s)
					want := make([]byte, 0, 1<<20)
					for k, size := range sizes {
						w := patterned(&want, size, b, a, s, k)
						err := in.Recv(ctx, func(h wire.Header, p []byte) error {
							if h.Seq != uint64(k) || h.Step != uint32(s) || h.Chunk != uint32(b) || h.Kind != wire.KindData {
								return fmt.Errorf("header %+v, want seq %d step %d chunk %d", h, k, s, b)
							}
							if !bytes.Equal(p, w) {
								return fmt.Errorf("payload of %d bytes differs (want %d)", len(p), len(w))
							}
							return nil
						})
						if err != nil {
							errc <- fmt.Errorf("recv %d<-%d stream %d frame %d: %w", a, b, s, k, err)
							return
						}
					}
				})
			}
		}
	}
	wg.Wait()
	close(errc)
	for err := range errc {
		t.Error(err)
	}
}

// childSpec is what a child member (a re-exec of the test binary) does.
type childSpec struct {
	Store     string       `json:"store"`
	NS        string       `json:"ns"`
	Transport Kind         `json:"transport"`
	Members   []MemberInfo `json:"members"`
	Self      int          `json:"self"`
	Streams   int          `json:"streams"`
	// Mode childShare: share a region of childShareBytes (sharedPattern
	// of the member) and send its id instead of "hello".
	Mode string `json:"mode,omitempty"`
}

const (
	childShare      = "share"
	childShareBytes = 64 << 10
	childShareName  = "gpubridge-test-child-share"
)

// childMain establishes the bridge, sends "hello" on data stream 0 to
// member 0, then waits to be killed.
func childMain(spec string) int {
	var cs childSpec
	if err := json.Unmarshal([]byte(spec), &cs); err != nil {
		fmt.Fprintln(os.Stderr, "child:", err)
		return 2
	}
	ctx, cancel := context.WithTimeout(context.Background(), testenv.Scale(60*time.Second))
	defer cancel()
	c, err := store.Dial(ctx, cs.Store)
	if err != nil {
		fmt.Fprintln(os.Stderr, "child:", err)
		return 2
	}
	m, err := Establish(ctx, Config{Store: c.Prefix(cs.NS), Self: cs.Self, Members: cs.Members, Transport: cs.Transport,
		Streams: cs.Streams, ListenHost: "127.0.0.1", Timeout: testenv.Scale(30 * time.Second),
		Log: slog.New(slog.NewTextHandler(os.Stderr, nil))})
	if err != nil {
		fmt.Fprintln(os.Stderr, "child:", err)
		return 2
	}
	msg := []byte("hello")
	if cs.Mode == childShare {
		fd, mem, err := NewMemfd(childShareName, childShareBytes)
		if err != nil {
			fmt.Fprintln(os.Stderr, "child:", err)
			return 2
		}
		sharedPattern(mem, cs.Self)
		id, err := m.(Sharer).Share(fd, mem)
		if err != nil {
			fmt.Fprintln(os.Stderr, "child:", err)
			return 2
		}
		msg = binary.LittleEndian.AppendUint64(nil, id)
	}
	if err := m.Stream(0, 0).Send(ctx, wire.Header{Kind: wire.KindData}, msg); err != nil {
		fmt.Fprintln(os.Stderr, "child:", err)
		return 2
	}
	time.Sleep(time.Minute)
	return 0
}

// startChild starts a child process as member self of b.
func startChild(t *testing.T, b *bridge, self int) *exec.Cmd {
	t.Helper()
	return startChildWith(t, b, self, "")
}

// startChildWith starts a child process as member self of b that does what
// mode says (childSpec.Mode).
func startChildWith(t *testing.T, b *bridge, self int, mode string) *exec.Cmd {
	t.Helper()
	spec, err := json.Marshal(childSpec{Store: b.addr, NS: b.ns, Transport: b.cfgs[self].Transport,
		Members: b.cfgs[self].Members, Self: self, Streams: b.cfgs[self].Streams, Mode: mode})
	require.NoError(t, err)
	cmd := exec.Command(os.Args[0], "-test.run=^$")
	cmd.Env = append(os.Environ(), childEnv+"="+string(spec))
	cmd.Stderr = os.Stderr
	require.NoError(t, cmd.Start())
	t.Cleanup(func() {
		_ = cmd.Process.Kill()
		_ = cmd.Wait()
	})
	return cmd
}
