package tools_test

import (
	"bufio"
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"io"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/gpubridge/gpubridge/lib/testenv"
)

// netHosts is a set of "hosts": network namespaces joined by veth pairs to a
// Linux bridge in a switch namespace, each host's uplink rate-limited with
// tc htb. Only these namespaces carry traffic.
type netHosts struct {
	t      *testing.T
	prefix string
	subnet string // "10.231.N"
	n      int
}

func run(t *testing.T, args ...string) {
	t.Helper()
	out, err := exec.Command(args[0], args[1:]...).CombinedOutput()
	require.NoError(t, err, "%s: %s", strings.Join(args, " "), out)
}

// newNetHosts makes n hosts with rate-limited uplinks. It skips the test
// only when not root; as root (CI) anything that stops it is a failure.
func newNetHosts(t *testing.T, n int, rate string) *netHosts {
	t.Helper()
	if os.Geteuid() != 0 {
		t.Skip("needs root: multi-host tests create network namespaces (make test as root runs them)")
	}
	for _, tool := range []string{"ip", "tc"} {
		_, err := exec.LookPath(tool)
		require.NoError(t, err, "multi-host tests need iproute2's ip and tc (ci/deps.sh installs them)")
	}
	id := os.Getpid() % 200
	h := &netHosts{t: t, prefix: fmt.Sprintf("gbt%d", id), subnet: fmt.Sprintf("10.231.%d", id), n: n}
	sw := h.prefix + "-sw"
	out, err := exec.Command("ip", "netns", "add", sw).CombinedOutput()
	require.NoError(t, err, "cannot create a network namespace as root: %s", out)
	t.Cleanup(h.destroy)
	run(t, "ip", "-n", sw, "link", "add", "br0", "type", "bridge")
	run(t, "ip", "-n", sw, "link", "set", "br0", "up")
	for i := 0; i < n; i++ {
		ns := h.ns(i)
		run(t, "ip", "netns", "add", ns)
		run(t, "ip", "link", "add", "eth0", "netns", ns, "type", "veth", "peer", "name", fmt.Sprintf("p%d", i), "netns", sw)
		run(t, "ip", "-n", sw, "link", "set", fmt.Sprintf("p%d", i), "master", "br0", "up")
		run(t, "ip", "-n", ns, "addr", "add", h.ip(i)+"/24", "dev", "eth0")
		run(t, "ip", "-n", ns, "link", "set", "eth0", "up")
		run(t, "ip", "-n", ns, "link", "set", "lo", "up")
		run(t, "ip", "netns", "exec", ns, "tc", "qdisc", "add", "dev", "eth0", "root", "handle", "1:", "htb", "default", "10")
		run(t, "ip", "netns", "exec", ns, "tc", "class", "add", "dev", "eth0", "parent", "1:", "classid", "1:10", "htb", "rate", rate)
	}
	return h
}

func (h *netHosts) ns(i int) string { return fmt.Sprintf("%s-h%d", h.prefix, i) }
func (h *netHosts) ip(i int) string { return fmt.Sprintf("%s.%d", h.subnet, i+1) }

func (h *netHosts) destroy() {
	for i := 0; i < h.n; i++ {
		_ = exec.Command("ip", "netns", "del", h.ns(i)).Run()
	}
	_ = exec.Command("ip", "netns", "del", h.prefix+"-sw").Run()
}

// command runs a tool inside host i as "host-i".
func (h *netHosts) command(ctx context.Context, i int, tool string, args ...string) *exec.Cmd {
	cmd := exec.CommandContext(ctx, "ip", append([]string{"netns", "exec", h.ns(i), filepath.Join(binDir, tool)}, args...)...)
	cmd.Env = append(os.Environ(), fmt.Sprintf("GPUBRIDGE_SIM_HOSTNAME=host-%d", i))
	cmd.SysProcAttr = &syscall.SysProcAttr{Pdeathsig: syscall.SIGKILL}
	return cmd
}

// startStore runs gbdiscover serve in host 0 and returns its address.
func (h *netHosts) startStore(ctx context.Context) string {
	t := h.t
	cmd := h.command(ctx, 0, "gbdiscover", "serve", "--listen", h.ip(0)+":0")
	out, err := cmd.StdoutPipe()
	require.NoError(t, err)
	require.NoError(t, cmd.Start())
	t.Cleanup(func() { _ = cmd.Process.Signal(syscall.SIGTERM); _ = cmd.Wait() })
	line, err := bufio.NewReader(out).ReadString('\n')
	require.NoError(t, err)
	var serve struct{ Listen string }
	require.NoError(t, json.Unmarshal([]byte(line), &serve))
	return serve.Listen
}

type memberResult struct {
	stdout, stderr string
	err            error
	took           time.Duration
}

// bench runs gbbridge bench on every host at once.
func (h *netHosts) bench(ctx context.Context, storeAddr, ns string, extra ...string) []memberResult {
	res := make([]memberResult, h.n)
	var wg sync.WaitGroup
	for i := 0; i < h.n; i++ {
		args := append([]string{"bench", "--store", storeAddr, "--rank", fmt.Sprint(i), "--world-size", fmt.Sprint(h.n),
			"--namespace", ns, "--json", "--timeout", testenv.Scale(20 * time.Second).String()}, extra...)
		cmd := h.command(ctx, i, "gbbridge", args...)
		var out, errb bytes.Buffer
		cmd.Stdout, cmd.Stderr = &out, &errb
		wg.Add(1)
		go func() {
			defer wg.Done()
			start := time.Now()
			res[i].err = cmd.Run()
			res[i].took = time.Since(start)
			res[i].stdout, res[i].stderr = out.String(), errb.String()
		}()
	}
	wg.Wait()
	return res
}

func rows(t *testing.T, stdout string) []map[string]any {
	var out []map[string]any
	for _, l := range strings.Split(strings.TrimSpace(stdout), "\n") {
		var r map[string]any
		require.NoError(t, json.Unmarshal([]byte(l), &r), "line %q", l)
		out = append(out, r)
	}
	return out
}

// TestMultiHost runs the bridge across 2 and 4 namespaced hosts whose
// uplinks are limited to 1 Gbit/s: the members pick the interface that
// routes to the store (eth0, not lo), several streams share the limit, the
// results are exact, and a member killed or stalled mid-run gives the
// others an error naming it within the timeout.
func TestMultiHost(t *testing.T) {
	if _, err := os.Stat(filepath.Join(binDir, "gbbridge")); err != nil {
		t.Fatalf("gbbridge not built in %s", binDir)
	}
	const rate = "1gbit" // 125 MB/s per direction
	// Deadlines here catch hangs; testenv.Scale stretches them on a loaded
	// machine. The tools' own --timeout values are what the subtests check
	// and stay as they are.
	ctx, cancel := context.WithTimeout(context.Background(), testenv.Scale(3*time.Minute))
	defer cancel()

	t.Run("2 hosts", func(t *testing.T) {
		h := newNetHosts(t, 2, rate)
		addr := h.startStore(ctx)
		for _, streams := range []string{"1", "4"} {
			res := h.bench(ctx, addr, "x2-"+streams, "--collective", "exchange", "--sizes", "32M", "--iters", "2",
				"--warmup", "1", "--streams", streams)
			for i, r := range res {
				require.NoError(t, r.err, "member %d: %s", i, r.stderr)
			}
			row := rows(t, res[0].stdout)[0]
			assert.Contains(t, row["transport"], "tcp, "+streams+" streams")
			assert.Contains(t, row["transport"], "eth0", "the interface that routes to the store")
			gbps := row["algbw_gbps"].(float64)
			t.Logf("%s streams: %.3f GB/s per direction through a %s limit", streams, gbps, rate)
			assert.Less(t, gbps, 0.125*1.1, "the htb limit binds")
			// A loose floor: traffic flows through the limited uplink (a
			// loaded 2-core machine may not fill it).
			assert.Greater(t, gbps, 0.125*0.25, "the limited uplink carries the traffic")
		}
		res := h.bench(ctx, addr, "x2-ar", "--collective", "all_reduce", "--sizes", "1K,4M", "--iters", "2")
		for i, r := range res {
			require.NoError(t, r.err, "member %d: %s", i, r.stderr)
		}
		for _, row := range rows(t, res[0].stdout) {
			assert.Zero(t, row["wrong"])
		}
	})

	t.Run("4 hosts ring", func(t *testing.T) {
		h := newNetHosts(t, 4, rate)
		addr := h.startStore(ctx)
		for _, coll := range []string{"all_reduce", "all_gather", "reduce_scatter", "broadcast"} {
			res := h.bench(ctx, addr, "x4-"+coll, "--collective", coll, "--sizes", "4K,8M", "--iters", "2")
			for i, r := range res {
				require.NoError(t, r.err, "%s member %d: %s", coll, i, r.stderr)
			}
			for _, row := range rows(t, res[0].stdout) {
				assert.Zero(t, row["wrong"], "%s %v", coll, row)
				assert.Equal(t, 4.0, row["members"])
			}
		}
	})

	t.Run("member stalled", func(t *testing.T) {
		h := newNetHosts(t, 2, rate)
		addr := h.startStore(ctx)
		cmds := make([]*exec.Cmd, 2)
		errs := make([]syncBuffer, 2)
		for i := range cmds {
			// The 4K row tells that the bridge is up and running; the 16M
			// calls are what member 1 stalls in.
			cmds[i] = h.command(ctx, i, "gbbridge", "bench", "--store", addr, "--rank", fmt.Sprint(i), "--world-size", "2",
				"--namespace", "stall", "--json", "--timeout", "4s", "--collective", "all_reduce", "--sizes", "4K,16M", "--iters", "200")
			cmds[i].Stderr = &errs[i]
		}
		running := firstLine(t, cmds[0])
		require.NoError(t, cmds[1].Start())
		waitRunning(t, running, &errs[0])
		require.NoError(t, cmds[1].Process.Signal(syscall.SIGSTOP))
		start := time.Now()
		err := cmds[0].Wait()
		took := time.Since(start)
		_ = cmds[1].Process.Kill()
		_ = cmds[1].Wait()
		require.Error(t, err, "member 0 must give up on a stalled member 1")
		assert.Contains(t, errs[0].String(), "timed out after 4s waiting for member 1")
		assert.Less(t, took, 4*time.Second+testenv.Scale(6*time.Second), "within the collective's timeout")
		t.Logf("member 0 after member 1 stalled (%.1fs): %s", took.Seconds(), strings.TrimSpace(errs[0].String()))
	})

	t.Run("member killed", func(t *testing.T) {
		h := newNetHosts(t, 2, rate)
		addr := h.startStore(ctx)
		kctx, kill := context.WithCancel(ctx)
		cmds := make([]*exec.Cmd, 2)
		errs := make([]syncBuffer, 2)
		for i := range cmds {
			c := ctx
			if i == 1 {
				c = kctx
			}
			cmds[i] = h.command(c, i, "gbbridge", "bench", "--store", addr, "--rank", fmt.Sprint(i), "--world-size", "2",
				"--namespace", "kill", "--json", "--timeout", "10s", "--collective", "all_reduce", "--sizes", "4K,64M", "--iters", "50")
			cmds[i].Stderr = &errs[i]
		}
		running := firstLine(t, cmds[0])
		require.NoError(t, cmds[1].Start())
		waitRunning(t, running, &errs[0])
		kill() // SIGKILL to member 1 (ip netns exec execs the tool)
		start := time.Now()
		err := cmds[0].Wait()
		took := time.Since(start)
		_ = cmds[1].Wait()
		require.Error(t, err, "member 0 must fail when member 1 dies")
		assert.Contains(t, errs[0].String(), "member 1", "the error names the dead peer")
		assert.Less(t, took, 10*time.Second+testenv.Scale(15*time.Second), "within the timeout")
		t.Logf("member 0 after member 1 was killed: %s", strings.TrimSpace(errs[0].String()))
	})
}

// syncBuffer is a bytes.Buffer that a command's stderr may be copied into
// while the test reads it.
type syncBuffer struct {
	mu sync.Mutex
	b  bytes.Buffer
}

func (s *syncBuffer) Write(p []byte) (int, error) {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.b.Write(p)
}

func (s *syncBuffer) String() string {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.b.String()
}

// firstLine starts cmd and returns a channel that gets its first line of
// stdout (closed without one if stdout ends first).
func firstLine(t *testing.T, cmd *exec.Cmd) <-chan string {
	t.Helper()
	out, err := cmd.StdoutPipe()
	require.NoError(t, err)
	require.NoError(t, cmd.Start())
	ch := make(chan string, 1)
	go func() {
		defer close(ch)
		r := bufio.NewReader(out)
		line, err := r.ReadString('\n')
		if err == nil {
			ch <- line
		}
		_, _ = io.Copy(io.Discard, r) // keep the pipe drained until cmd exits
	}()
	return ch
}

// waitRunning waits for member 0's first bench row: the bridge is up and
// the members are inside the sweep.
func waitRunning(t *testing.T, running <-chan string, stderr *syncBuffer) {
	t.Helper()
	select {
	case line, ok := <-running:
		require.True(t, ok, "member 0 ended before its first row: %s", stderr.String())
		require.NotEmpty(t, line)
	case <-time.After(testenv.Scale(60 * time.Second)):
		t.Fatalf("member 0 printed no row within %s: %s", testenv.Scale(60*time.Second), stderr.String())
	}
}

// As root, hosts that cannot be made must fail TestMultiHost, never skip it:
// run its first subtest again with an ip that refuses everything.
func TestNetnsFailureFailsAsRoot(t *testing.T) {
	if os.Geteuid() != 0 {
		t.Skip("needs root: checks what TestMultiHost does as root")
	}
	dir := t.TempDir()
	require.NoError(t, os.WriteFile(filepath.Join(dir, "ip"), []byte("#!/bin/sh\necho 'ip: refused by the test' >&2\nexit 1\n"), 0o755))
	cmd := exec.Command(os.Args[0], "-test.run=^TestMultiHost$/^2_hosts$", "-test.count=1", "-test.v")
	cmd.Env = append(os.Environ(), "PATH="+dir+string(os.PathListSeparator)+os.Getenv("PATH"), "GPUBRIDGE_BIN="+binDir)
	b, err := cmd.CombinedOutput()
	out := string(b)
	require.Error(t, err, "TestMultiHost passed with an ip that fails:\n%s", out)
	assert.Contains(t, out, "--- FAIL: TestMultiHost/2_hosts")
	assert.Contains(t, out, "cannot create a network namespace as root")
	assert.NotContains(t, out, "--- SKIP")
}
