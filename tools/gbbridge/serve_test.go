package main

import (
	"bufio"
	"bytes"
	"context"
	"encoding/binary"
	"encoding/json"
	"fmt"
	"github.com/gpubridge/gpubridge/lib/store/storetest"
	"math"
	"math/rand/v2"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	"go.uber.org/goleak"

	"github.com/gpubridge/gpubridge/lib/codec"
	"github.com/gpubridge/gpubridge/lib/collective"
	"github.com/gpubridge/gpubridge/lib/discover"
	"github.com/gpubridge/gpubridge/lib/feed"
	"github.com/gpubridge/gpubridge/lib/feed/feedtest"
	"github.com/gpubridge/gpubridge/lib/reduce"
	"github.com/gpubridge/gpubridge/lib/testenv"
	"github.com/gpubridge/gpubridge/lib/transport"
)

var bin string

// TestMain uses GPUBRIDGE_BIN/gbbridge when make test built it, else builds
// gbbridge into a temporary folder.
func TestMain(m *testing.M) {
	if os.Getenv("GBBRIDGE_BARE_MEMBER") != "" {
		os.Exit(bareMember())
	}
	if os.Getenv("GBBRIDGE_ECHO") != "" {
		os.Exit(echoPeer())
	}
	if os.Getenv("GBBRIDGE_FEED_CLIENT") != "" {
		os.Exit(feedClient())
	}
	os.Exit(func() int {
		if dir := os.Getenv("GPUBRIDGE_BIN"); dir != "" {
			if _, err := os.Stat(filepath.Join(dir, "gbbridge")); err == nil {
				bin = filepath.Join(dir, "gbbridge")
				return runChecked(m)
			}
		}
		dir, err := os.MkdirTemp("", "gbbridge-bin")
		if err != nil {
			fmt.Fprintln(os.Stderr, err)
			return 2
		}
		defer os.RemoveAll(dir)
		bin = filepath.Join(dir, "gbbridge")
		cmd := exec.Command("go", "build", "-o", bin, ".")
		cmd.Stdout, cmd.Stderr = os.Stderr, os.Stderr
		if err := cmd.Run(); err != nil {
			fmt.Fprintln(os.Stderr, "build gbbridge:", err)
			return 2
		}
		return runChecked(m)
	}())
}

// runChecked runs the tests and then fails if goroutines of this process
// (stores, clients, helpers) are left over.
func runChecked(m *testing.M) int {
	code := m.Run()
	if code == 0 {
		if err := goleak.Find(); err != nil {
			fmt.Fprintln(os.Stderr, "goleak:", err)
			return 1
		}
	}
	return code
}

// topology is what gbdiscover prints for rank self of a 4-rank CPU job with
// two islands (ranks 0,1 nvidia; 2,3 amd): the leaders 0 and 2 are the
// bridge members. The islands are on host-a and host-b, or both on host-a
// for the shm transport (one host).
func topology(ns string, self int, bridgeTransport transport.Kind) []byte {
	hostB := "host-b"
	if bridgeTransport == discover.BridgeSHM {
		hostB = "host-a"
	}
	ranks := []discover.RankInfo{
		{Rank: 0, Hostname: "host-a", Island: "nvidia", Role: discover.RoleLeader},
		{Rank: 1, Hostname: "host-a", Island: "nvidia", Role: discover.RoleMember},
		{Rank: 2, Hostname: hostB, Island: "amd", Role: discover.RoleLeader},
		{Rank: 3, Hostname: hostB, Island: "amd", Role: discover.RoleMember},
	}
	t := discover.Topology{
		Shared: discover.Shared{
			Schema: discover.TopologySchema, Namespace: ns, WorldSize: 4, RunKind: discover.KindCPU,
			Mode: discover.ModeCPU, Simulated: true, Version: "test",
			Islands: []discover.Island{
				{Label: "nvidia", Vendor: "nvidia", Backend: "gloo", Ranks: []int{0, 1}, Leader: 0, Hosts: []string{"host-a"}},
				{Label: "amd", Vendor: "amd", Backend: "gloo", Ranks: []int{2, 3}, Leader: 2, Hosts: []string{hostB}},
			},
			Bridge: discover.Bridge{Members: []int{0, 2}, Hosts: []string{"host-a", hostB}, Requested: "auto", Transport: bridgeTransport, Reason: "test"},
			Ranks:  ranks,
		},
		Digest: "test",
		Self:   ranks[self],
	}
	b, err := json.MarshalIndent(t, "", "  ")
	if err != nil {
		panic(err)
	}
	return b
}

// serveProc is one running gbbridge serve.
type serveProc struct {
	cmd    *exec.Cmd
	ready  feed.ReadyLine
	stderr *storetest.SyncBuffer
	done   chan struct{}
	err    error
}

// wait returns the exit code, failing the test after 30 s (scaled).
func (p *serveProc) wait(t testing.TB) int {
	t.Helper()
	select {
	case <-p.done:
	case <-time.After(testenv.Scale(30 * time.Second)):
		t.Fatalf("gbbridge serve did not exit; stderr:\n%s", p.stderr.String())
	}
	return p.cmd.ProcessState.ExitCode()
}

// cluster is a store and a topology per member of a 2-member bridge.
type cluster struct {
	dir   string
	store string
	ns    string
	kind  transport.Kind // the topology's bridge transport; "": tcp
}

func newCluster(t testing.TB) *cluster {
	dir, err := os.MkdirTemp("", "gbbr")
	require.NoError(t, err)
	t.Cleanup(func() { os.RemoveAll(dir) })
	require.NoError(t, os.Chmod(dir, 0o700))
	return &cluster{dir: dir, store: storetest.Start(t), ns: "job-" + strings.ReplaceAll(t.Name(), "/", "-")}
}

func (c *cluster) topoFile(t testing.TB, rank int, kind transport.Kind) string {
	path := filepath.Join(c.dir, fmt.Sprintf("topo%d.json", rank))
	require.NoError(t, os.WriteFile(path, topology(c.ns, rank, kind), 0o600))
	return path
}

// args returns serve's arguments for rank.
func (c *cluster) args(t testing.TB, rank int, extra ...string) []string {
	tr := c.kind
	if tr == "" {
		tr = discover.BridgeTCP
	}
	return append([]string{"serve", "--topology", c.topoFile(t, rank, tr), "--store", c.store,
		"--feed", filepath.Join(c.dir, fmt.Sprintf("feed%d.sock", rank)), "--listen-host", "127.0.0.1",
		"--setup-timeout", testenv.Scale(30 * time.Second).String(), "--timeout", testenv.Scale(20 * time.Second).String(), "--streams", "2"}, extra...)
}

// start runs gbbridge with args; with ready it waits for the ready line.
func start(t testing.TB, args []string, ready bool) *serveProc {
	t.Helper()
	return startEnv(t, args, append(os.Environ(), "GPUBRIDGE_LOG_LEVEL=debug"), ready)
}

func startEnv(t testing.TB, args, env []string, ready bool) *serveProc {
	t.Helper()
	cmd := exec.Command(bin, args...)
	cmd.Env = env
	p := &serveProc{cmd: cmd, stderr: &storetest.SyncBuffer{}, done: make(chan struct{})}
	cmd.Stderr = p.stderr
	out, err := cmd.StdoutPipe()
	require.NoError(t, err)
	require.NoError(t, cmd.Start())
	lines := make(chan string, 1)
	go func() {
		sc := bufio.NewScanner(out)
		for sc.Scan() {
			select {
			case lines <- sc.Text():
			default:
				t.Errorf("more than one line on stdout: %s", sc.Text())
			}
		}
		p.err = cmd.Wait()
		close(p.done)
	}()
	t.Cleanup(func() {
		_ = cmd.Process.Kill()
		<-p.done
	})
	if !ready {
		return p
	}
	select {
	case l := <-lines:
		require.NoError(t, json.Unmarshal([]byte(l), &p.ready), "ready line %q", l)
	case <-p.done:
		t.Fatalf("gbbridge serve exited before it was ready (%v); stderr:\n%s", p.err, p.stderr.String())
	case <-time.After(testenv.Scale(60 * time.Second)):
		t.Fatalf("gbbridge serve not ready; stderr:\n%s", p.stderr.String())
	}
	return p
}

// dialedPair starts both members over TCP and connects a client to each.
func dialedPair(t testing.TB) ([]*serveProc, []*feedtest.Client) {
	ps := startPair(t, newCluster(t))
	return ps, []*feedtest.Client{dial(t, ps[0]), dial(t, ps[1])}
}

// startPair starts both members at once (each waits for the other in setup).
func startPair(t testing.TB, c *cluster, extra ...string) []*serveProc {
	t.Helper()
	ps := make([]*serveProc, 2)
	var wg sync.WaitGroup
	for i, rank := range []int{0, 2} {
		wg.Add(1)
		go func() {
			defer wg.Done()
			ps[i] = start(t, c.args(t, rank, extra...), true)
		}()
	}
	wg.Wait()
	if t.Failed() {
		t.FailNow()
	}
	return ps
}

func dial(t testing.TB, p *serveProc) *feedtest.Client {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), testenv.Scale(20*time.Second))
	defer cancel()
	c, err := feedtest.Dial(ctx, p.ready.Feed)
	require.NoError(t, err)
	t.Cleanup(c.Abort)
	return c
}

func TestServeAllReduce(t *testing.T) {
	c := newCluster(t)
	ps := startPair(t, c)
	for i, p := range ps {
		assert.Equal(t, feed.ServeSchema, p.ready.Schema)
		assert.Equal(t, i, p.ready.Member)
		assert.Equal(t, 2, p.ready.Members)
		assert.Equal(t, 2*i, p.ready.Rank)
		assert.Equal(t, p.cmd.Process.Pid, p.ready.PID)
		assert.Contains(t, p.ready.Transport, "tcp")
		assert.Equal(t, feed.Version, p.ready.Version)
	}
	clients := []*feedtest.Client{dial(t, ps[0]), dial(t, ps[1])}
	ctx, cancel := context.WithTimeout(context.Background(), testenv.Scale(60*time.Second))
	defer cancel()
	const n = 3<<20 + 4 // not a multiple of the chunk
	regs := make([]*feedtest.Region, 2)
	inputs := make([][]byte, 2)
	r := rand.New(rand.NewPCG(3, 4))
	for i, cl := range clients {
		reg, err := cl.Map(ctx, n)
		require.NoError(t, err)
		regs[i] = reg
		for k := 0; k < n; k += 4 {
			binary.LittleEndian.PutUint32(reg.Mem[k:], math.Float32bits(float32(r.NormFloat64())))
		}
		inputs[i] = slices.Clone(reg.Mem)
	}
	want := collective.ReferenceAllReduce(reduce.Sum, reduce.Float32, inputs, 2)
	var wg sync.WaitGroup
	errs := make([]error, 2)
	for i, cl := range clients {
		wg.Add(1)
		go func() {
			defer wg.Done()
			// Streamed: the input is released in 1 MiB steps.
			k, err := cl.Start(feed.Request{Kind: feed.MsgAllReduce, Flags: feed.FlagStreamed, Buf: regs[i].All(), DType: reduce.Float32, Op: reduce.Sum, Peer: -1}, nil)
			if err != nil {
				errs[i] = err
				return
			}
			for end := 0; end < n; {
				end = min(end+1<<20, n)
				if err := k.Ready(end); err != nil {
					errs[i] = err
					return
				}
			}
			d, err := k.Wait(ctx)
			if err == nil && d.Seq != 1 {
				err = fmt.Errorf("seq %d", d.Seq)
			}
			errs[i] = err
		}()
	}
	wg.Wait()
	for i := range clients {
		require.NoError(t, errs[i], "member %d; stderr:\n%s", i, ps[i].stderr.String())
		require.True(t, bytes.Equal(want, regs[i].Mem), "member %d: result differs from the reference", i)
	}
	// The feed closes: both exit 0.
	for i, cl := range clients {
		require.NoError(t, cl.Close(ctx))
		assert.Equal(t, 0, ps[i].wait(t), "stderr:\n%s", ps[i].stderr.String())
	}
}

// TestServeParentDies kills the shell that spawned serve: serve gets
// SIGTERM (PR_SET_PDEATHSIG), aborts the bridge so that the other member's
// collective fails at once naming it, and exits.
func TestServeParentDies(t *testing.T) {
	c := newCluster(t)
	// Member 1 runs directly; member 0 under a shell that is then killed.
	var member1 *serveProc
	var wg sync.WaitGroup
	wg.Add(1)
	go func() {
		defer wg.Done()
		member1 = start(t, c.args(t, 2), true)
	}()
	args := c.args(t, 0)
	quoted := make([]string, len(args))
	for i, a := range args {
		quoted[i] = "'" + a + "'"
	}
	sh := exec.Command("sh", "-c", "'"+bin+"' "+strings.Join(quoted, " ")+" & echo pid $!; wait")
	sh.Env = os.Environ()
	out, err := sh.StdoutPipe()
	require.NoError(t, err)
	var shErr storetest.SyncBuffer
	sh.Stderr = &shErr
	require.NoError(t, sh.Start())
	shDone := make(chan struct{})
	sc := bufio.NewScanner(out)
	var pid int
	var ready feed.ReadyLine
	for sc.Scan() {
		l := sc.Text()
		if strings.HasPrefix(l, "pid ") {
			pid, _ = strconv.Atoi(strings.TrimPrefix(l, "pid "))
			continue
		}
		require.NoError(t, json.Unmarshal([]byte(l), &ready), "line %q", l)
		break
	}
	go func() {
		_, _ = bufio.NewReader(out).WriteTo(devNull{})
		_ = sh.Wait()
		close(shDone)
	}()
	wg.Wait()
	require.NotZero(t, pid, "stderr: %s", shErr.String())
	require.Equal(t, pid, ready.PID)
	t.Cleanup(func() { _ = syscall.Kill(pid, syscall.SIGKILL) })

	// Member 1's client starts an all_reduce member 0 never joins.
	cl1 := dial(t, member1)
	ctx, cancel := context.WithTimeout(context.Background(), testenv.Scale(60*time.Second))
	defer cancel()
	reg, err := cl1.Map(ctx, 64)
	require.NoError(t, err)
	call, err := cl1.Start(feed.Request{Kind: feed.MsgAllReduce, Buf: reg.Span(0, 64), DType: reduce.Float32, Op: reduce.Sum, Peer: -1}, nil)
	require.NoError(t, err)
	time.Sleep(100 * time.Millisecond)

	killed := time.Now()
	require.NoError(t, sh.Process.Kill())
	<-shDone
	require.Eventually(t, func() bool { return gone(pid) }, testenv.Scale(20*time.Second), 10*time.Millisecond, "gbbridge serve outlived its parent")
	t.Logf("serve exited %s after its parent was killed", time.Since(killed).Round(time.Millisecond))

	_, err = call.Wait(ctx)
	var re *feedtest.RequestError
	require.ErrorAs(t, err, &re)
	assert.Equal(t, feed.StatusBridgeError, re.Status)
	assert.Contains(t, re.Msg, "member 0")
	assert.Less(t, time.Since(killed), testenv.Scale(10*time.Second), "the peer learned late (not at once, at its timeout): %v", err)
	t.Logf("member 1 got: %s", re.Msg)
	require.NoError(t, cl1.Close(ctx))
	assert.Equal(t, 1, member1.wait(t), "a bridge failure during the session is exit 1")
	assert.Contains(t, member1.stderr.String(), "the bridge failed during the session")
}

// Issue 9: when a leader's gbbridge serve was SIGKILLed, the other member's
// error read "member 1 (rank 2, pid N): process died" with N the pid of
// gbbridge, not of the rank. The error names the process that died for
// what it is.
func TestServeKilled(t *testing.T) {
	for _, tr := range []transport.Kind{discover.BridgeTCP, discover.BridgeSHM} {
		t.Run(string(tr), func(t *testing.T) {
			c := newCluster(t)
			c.kind = tr
			ps := startPair(t, c)
			cl1 := dial(t, ps[1])
			ctx, cancel := context.WithTimeout(context.Background(), testenv.Scale(30*time.Second))
			defer cancel()
			reg, err := cl1.Map(ctx, 64)
			require.NoError(t, err)
			// An all_reduce member 0 never joins: member 1 waits in it.
			call, err := cl1.Start(feed.Request{Kind: feed.MsgAllReduce, Buf: reg.Span(0, 64), DType: reduce.Float32, Op: reduce.Sum, Peer: -1}, nil)
			require.NoError(t, err)
			pid := ps[0].cmd.Process.Pid
			require.NoError(t, ps[0].cmd.Process.Kill())
			_, err = call.Wait(ctx)
			var re *feedtest.RequestError
			require.ErrorAs(t, err, &re)
			// The collective fails, or, when member 1 noticed the death
			// before it started, is refused with that cause.
			assert.Contains(t, []feed.Status{feed.StatusBridgeError, feed.StatusBroken}, re.Status)
			t.Logf("member 1 got: %s", re.Msg)
			assert.NotContains(t, re.Msg, fmt.Sprintf("rank 0, pid %d", pid), "the pid is gbbridge's, not the rank's")
			if tr == discover.BridgeSHM {
				assert.Contains(t, re.Msg, fmt.Sprintf("member 0 (rank 0 on host-a): gbbridge serve of rank 0 (pid %d) died", pid))
			} else {
				assert.Contains(t, re.Msg, "member 0 (rank 0 on host-a 127.0.0.1:")
				assert.Contains(t, re.Msg, fmt.Sprintf("did gbbridge serve of rank 0 (pid %d on host-a) die?", pid))
			}
			require.NoError(t, cl1.Close(ctx))
			assert.Equal(t, 1, ps[1].wait(t), "a bridge failure during the session is exit 1")
		})
	}
}

type devNull struct{}

func (devNull) Write(p []byte) (int, error) { return len(p), nil }

// gone reports whether pid has exited (or is a zombie nobody reaped yet).
func gone(pid int) bool {
	b, err := os.ReadFile(fmt.Sprintf("/proc/%d/stat", pid))
	if err != nil {
		return true
	}
	s := string(b)
	i := strings.LastIndexByte(s, ')')
	return i < 0 || i+2 >= len(s) || s[i+2] == 'Z' || s[i+2] == 'X'
}

// TestServeSIGTERM: a signal stops serve in the middle of a session; it
// aborts the bridge (the other member's collective fails naming it) and
// exits 1.
func TestServeSIGTERM(t *testing.T) {
	ps, cls := dialedPair(t)
	ctx, cancel := context.WithTimeout(context.Background(), testenv.Scale(60*time.Second))
	defer cancel()
	call, err := cls[1].Start(feed.Request{Kind: feed.MsgBarrier, Peer: -1}, nil)
	require.NoError(t, err)
	time.Sleep(100 * time.Millisecond)
	require.NoError(t, ps[0].cmd.Process.Signal(syscall.SIGTERM))
	assert.Equal(t, 1, ps[0].wait(t))
	assert.Contains(t, ps[0].stderr.String(), "stopped by a signal")
	_, err = call.Wait(ctx)
	var re *feedtest.RequestError
	require.ErrorAs(t, err, &re)
	assert.Contains(t, re.Msg, "member 0")
	// The client of the stopped member sees the feed close.
	_, err = cls[0].Do(ctx, feed.Request{Kind: feed.MsgBarrier, Peer: -1})
	assert.Error(t, err)
	require.NoError(t, cls[1].Close(ctx))
	assert.Equal(t, 1, ps[1].wait(t))
}

// TestServeFeedLost: the client goes away with a request in flight; serve
// aborts the bridge and exits 1.
func TestServeFeedLost(t *testing.T) {
	ps, cls := dialedPair(t)
	ctx, cancel := context.WithTimeout(context.Background(), testenv.Scale(60*time.Second))
	defer cancel()
	_, err := cls[0].Start(feed.Request{Kind: feed.MsgBarrier, Peer: -1}, nil)
	require.NoError(t, err)
	time.Sleep(50 * time.Millisecond)
	cls[0].Abort()
	assert.Equal(t, 1, ps[0].wait(t))
	assert.Contains(t, ps[0].stderr.String(), "feed lost")
	// Member 0 entered the first barrier before it went, so its token may
	// already be on the way and member 1's first barrier may complete; the
	// next one cannot, and must name member 0.
	err = cls[1].Barrier(ctx)
	if err == nil {
		err = cls[1].Barrier(ctx)
	}
	var re *feedtest.RequestError
	require.ErrorAs(t, err, &re)
	assert.Contains(t, re.Msg, "member 0")
	cls[1].Abort()
	// EOF with nothing in flight closes the feed cleanly, but the bridge
	// failed during the session: exit 1.
	assert.Equal(t, 1, ps[1].wait(t))
}

func TestServeRefuses(t *testing.T) {
	c := newCluster(t)
	run := func(t *testing.T, args ...string) (int, string) {
		p := start(t, args, false)
		code := p.wait(t)
		return code, p.stderr.String()
	}
	feedPath := filepath.Join(c.dir, "x.sock")
	t.Run("not a leader", func(t *testing.T) {
		code, stderr := run(t, "serve", "--topology", c.topoFile(t, 1, "tcp"), "--store", c.store, "--feed", feedPath)
		assert.Equal(t, 2, code)
		assert.Contains(t, stderr, "rank 1 is not a bridge member (the island leaders are ranks [0 2])")
	})
	t.Run("no bridge", func(t *testing.T) {
		code, stderr := run(t, "serve", "--topology", c.topoFile(t, 0, "none"), "--store", c.store, "--feed", feedPath)
		assert.Equal(t, 2, code)
		assert.Contains(t, stderr, "the job has no bridge")
	})
	t.Run("namespace mismatch", func(t *testing.T) {
		code, stderr := run(t, "serve", "--topology", c.topoFile(t, 0, "tcp"), "--store", c.store, "--feed", feedPath, "--namespace", "other")
		assert.Equal(t, 2, code)
		assert.Contains(t, stderr, "differs from the topology's")
	})
	t.Run("no store", func(t *testing.T) {
		p := startEnv(t, []string{"serve", "--topology", c.topoFile(t, 0, "tcp"), "--feed", feedPath}, []string{"PATH=" + os.Getenv("PATH")}, false)
		assert.Equal(t, 2, p.wait(t))
		assert.Contains(t, p.stderr.String(), "--store is required")
	})
	t.Run("spin out of range", func(t *testing.T) {
		code, stderr := run(t, "serve", "--topology", c.topoFile(t, 0, "tcp"), "--store", c.store, "--feed", feedPath, "--spin-us", "20000")
		assert.Equal(t, 2, code)
		assert.Contains(t, stderr, "--spin-us 20000: 0..10000 allowed")
		for _, bad := range []string{"20000", "-2"} {
			code, stderr = run(t, "serve", "--topology", c.topoFile(t, 0, "tcp"), "--store", c.store, "--feed", feedPath, "--tiny-spin-us="+bad)
			assert.Equal(t, 2, code)
			assert.Contains(t, stderr, "--tiny-spin-us "+bad+": 0..10000 allowed")
		}
	})
	t.Run("parent already gone", func(t *testing.T) {
		// The spawner says it is pid 1: this test is the parent, so serve
		// must take the spawner for dead and refuse to start.
		code, stderr := run(t, "serve", "--topology", c.topoFile(t, 0, "tcp"), "--store", c.store, "--feed", feedPath, "--parent-pid", "1")
		assert.Equal(t, 2, code)
		assert.Contains(t, stderr, "parent process 1 already exited")
	})
	t.Run("feed path exists", func(t *testing.T) {
		require.NoError(t, os.WriteFile(feedPath, nil, 0o600))
		defer os.Remove(feedPath)
		code, stderr := run(t, "serve", "--topology", c.topoFile(t, 0, "tcp"), "--store", c.store, "--feed", feedPath)
		assert.Equal(t, 2, code)
		assert.Contains(t, stderr, "already exists")
	})
	t.Run("peer never comes", func(t *testing.T) {
		start := time.Now()
		code, stderr := run(t, "serve", "--topology", c.topoFile(t, 0, "tcp"), "--store", c.store, "--feed", feedPath,
			"--listen-host", "127.0.0.1", "--setup-timeout", "2s")
		assert.Equal(t, 2, code)
		assert.Contains(t, stderr, "bridge setup")
		assert.Contains(t, stderr, "member 1 (rank 2 on host-b) did not publish its endpoint within 2s")
		assert.Less(t, time.Since(start), testenv.Scale(20*time.Second), "bounded by the set-up timeout")
	})
}

// TestServeNoFeedConnection: nobody connects within the setup timeout.
func TestServeNoFeedConnection(t *testing.T) {
	c := newCluster(t)
	// The bridge set-up must finish within the setup timeout too, and
	// then nobody connects within it.
	ps := startPair(t, c, "--setup-timeout", testenv.Scale(5*time.Second).String())
	for _, p := range ps {
		assert.Equal(t, 2, p.wait(t))
		assert.Contains(t, p.stderr.String(), "no client connected")
	}
}

// Over shm the feed regions are shared and the members reduce from each
// other's memory (collective.AlgoDirectWrite, or AlgoDirect with
// --peer-writes off). A member killed in the middle of such an all_reduce
// (both are in it, part of their input ready): the other's call fails
// naming the dead process, and the survivor exits. In both modes.
func TestServeKilledDirect(t *testing.T) {
	for _, peerWrites := range []string{"on", "off"} {
		t.Run("peer-writes="+peerWrites, func(t *testing.T) { testServeKilledDirect(t, peerWrites) })
	}
}

func testServeKilledDirect(t *testing.T, peerWrites string) {
	c := newCluster(t)
	c.kind = discover.BridgeSHM
	ps := startPair(t, c, "--peer-writes", peerWrites)
	cls := []*feedtest.Client{dial(t, ps[0]), dial(t, ps[1])}
	ctx, cancel := context.WithTimeout(context.Background(), testenv.Scale(30*time.Second))
	defer cancel()
	const n = 4 << 20
	calls := make([]*feedtest.Call, 2)
	for i, cl := range cls {
		reg, err := cl.Map(ctx, n)
		require.NoError(t, err)
		calls[i], err = cl.Start(feed.Request{Kind: feed.MsgAllReduce, Flags: feed.FlagStreamed, Buf: reg.All(),
			DType: reduce.Float32, Op: reduce.Sum, Peer: -1}, nil)
		require.NoError(t, err)
		require.NoError(t, calls[i].Ready(n/2))
	}
	time.Sleep(100 * time.Millisecond) // both are in the direct all_reduce, waiting for the second half
	pid := ps[0].cmd.Process.Pid
	require.NoError(t, ps[0].cmd.Process.Kill())
	_, err := calls[1].Wait(ctx)
	var re *feedtest.RequestError
	require.ErrorAs(t, err, &re)
	assert.Equal(t, feed.StatusBridgeError, re.Status)
	t.Logf("member 1 got: %s", re.Msg)
	assert.Contains(t, re.Msg, fmt.Sprintf("member 0 (rank 0 on host-a): gbbridge serve of rank 0 (pid %d) died", pid))
	require.NoError(t, cls[1].Close(ctx))
	assert.Equal(t, 1, ps[1].wait(t), "a bridge failure during the session is exit 1")
	assert.Contains(t, ps[1].stderr.String(), "shared", "member 1 logs its regions as shared")
}

// --max-feedback caps the residuals of a session: a keyed lossy all_reduce
// whose residual would pass it is refused (status 1, naming the cap), and
// the feed goes on.
func TestServeFeedbackCap(t *testing.T) {
	ps := startPair(t, newCluster(t), "--max-feedback", "1K")
	cls := []*feedtest.Client{dial(t, ps[0]), dial(t, ps[1])}
	ctx, cancel := context.WithTimeout(context.Background(), testenv.Scale(60*time.Second))
	defer cancel()
	for i, cl := range cls {
		assert.Equal(t, uint16(feed.Version), cl.Welcome().Version)
		reg, err := cl.Map(ctx, 4096)
		require.NoError(t, err)
		key := uint64(9)
		_, err = cl.AllReduceCodec(ctx, reg.Span(0, 4096), reduce.Float32, reduce.Sum, 2, &key)
		var re *feedtest.RequestError
		require.ErrorAs(t, err, &re, "member %d", i)
		assert.Equal(t, feed.StatusBadRequest, re.Status)
		assert.Contains(t, re.Msg, "feedback key 9: a residual of 1024 float32 values takes 4096 bytes")
		assert.Contains(t, re.Msg, "over the cap of 1024 bytes (gbbridge serve --max-feedback)")
	}
	// The bridge is fine: a barrier meets.
	errs := make([]error, 2)
	var wg sync.WaitGroup
	for i, cl := range cls {
		wg.Add(1)
		go func() {
			defer wg.Done()
			errs[i] = cl.Barrier(ctx)
		}()
	}
	wg.Wait()
	for i, cl := range cls {
		require.NoError(t, errs[i], "member %d", i)
		require.NoError(t, cl.Close(ctx))
		assert.Equal(t, 0, ps[i].wait(t), "stderr:\n%s", ps[i].stderr.String())
	}
}

// TestServeCompressed: two gbbridge serve processes run fp8 all_reduces
// with a feedback key, twice, and a zstd one: the results are bit for bit
// collective.ReferenceAllReduceCodec's (the second call's depends on the
// residual the first left in each serve), and DONE counts packed bytes.
func TestServeCompressed(t *testing.T) {
	ps := startPair(t, newCluster(t))
	cls := []*feedtest.Client{dial(t, ps[0]), dial(t, ps[1])}
	ctx, cancel := context.WithTimeout(context.Background(), testenv.Scale(60*time.Second))
	defer cancel()
	const E = 1<<20 + 3 // values: 4 MiB and 12 bytes, more than one chunk
	n := 4 * E
	regs := make([]*feedtest.Region, 2)
	for i, cl := range cls {
		assert.Equal(t, uint16(feed.Version), cl.Welcome().Version)
		reg, err := cl.Map(ctx, n)
		require.NoError(t, err)
		regs[i] = reg
	}
	r := rand.New(rand.NewPCG(13, 2))
	resid := [][]byte{make([]byte, 4*E), make([]byte, 4*E)}
	run := func(id uint8, op reduce.Op, key *uint64) []feed.DoneMsg {
		dones := make([]feed.DoneMsg, 2)
		errs := make([]error, 2)
		var wg sync.WaitGroup
		for i, cl := range cls {
			wg.Add(1)
			go func() {
				defer wg.Done()
				dones[i], errs[i] = cl.AllReduceCodec(ctx, regs[i].All(), reduce.Float32, op, id, key)
			}()
		}
		wg.Wait()
		for i := range cls {
			require.NoError(t, errs[i], "member %d; stderr:\n%s", i, ps[i].stderr.String())
		}
		return dones
	}
	key := uint64(7)
	for call, op := range []reduce.Op{reduce.Sum, reduce.Avg} {
		inputs := make([][]byte, 2)
		for i, reg := range regs {
			for k := 0; k < n; k += 4 {
				binary.LittleEndian.PutUint32(reg.Mem[k:], math.Float32bits(float32(r.NormFloat64())))
			}
			inputs[i] = slices.Clone(reg.Mem)
		}
		want, res := collective.ReferenceAllReduceCodec(codec.MXFP8, op, reduce.Float32, inputs, resid, 2)
		resid = res
		dones := run(uint8(codec.MXFP8), op, &key)
		for i := range regs {
			require.True(t, bytes.Equal(want, regs[i].Mem), "call %d, member %d: result differs from the reference", call, i)
			require.Len(t, dones[i].Ext, 1)
			var b feed.BridgeStats
			require.NoError(t, feed.DecodeBridgeStats(dones[i].Ext[0].Value, &b))
			assert.Equal(t, uint64(codec.MXFP8Len(E)), b.BytesSent, "member %d sends its packing once", i)
			assert.NotZero(t, b.CodecNS)
		}
	}
	// zstd: raw's bits.
	inputs := make([][]byte, 2)
	for i, reg := range regs {
		for k := 0; k < n; k += 4 {
			binary.LittleEndian.PutUint32(reg.Mem[k:], math.Float32bits(float32(r.IntN(4))))
		}
		inputs[i] = slices.Clone(reg.Mem)
	}
	want := collective.ReferenceAllReduce(reduce.Sum, reduce.Float32, inputs, 2)
	run(uint8(codec.Zstd), reduce.Sum, nil)
	for i := range regs {
		require.True(t, bytes.Equal(want, regs[i].Mem), "zstd, member %d", i)
	}
	for i, cl := range cls {
		require.NoError(t, cl.Close(ctx))
		assert.Equal(t, 0, ps[i].wait(t), "stderr:\n%s", ps[i].stderr.String())
	}
}
