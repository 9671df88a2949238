package tools_test

import (
	"bufio"
	"bytes"
	"context"
	"encoding/json"
	"fmt"
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

// newNetHosts makes n hosts with rate-limited uplinks, or skips the test
// saying why it cannot.
func newNetHosts(t *testing.T, n int, rate string) *netHosts {
	t.Helper()
	if os.Geteuid() != 0 {
		t.Skip("multi-host tests need root to create network namespaces (make test as root runs them)")
	}
	if _, err := exec.LookPath("ip"); err != nil {
		t.Skip("multi-host tests need iproute2's ip and tc")
	}
	id := os.Getpid() % 200
	h := &netHosts{t: t, prefix: fmt.Sprintf("gbt%d", id), subnet: fmt.Sprintf("10.231.%d", id), n: n}
	sw := h.prefix + "-sw"
	if out, err := exec.Command("ip", "netns", "add", sw).CombinedOutput(); err != nil {
		t.Skipf("cannot create a network namespace here: %s", out)
	}
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
			"--namespace", ns, "--json", "--timeout", "20s"}, extra...)
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
	ctx, cancel := context.WithTimeout(context.Background(), 3*time.Minute)
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
			assert.Greater(t, gbps, 0.125*0.5, "the limit is used")
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
		errs := make([]bytes.Buffer, 2)
		for i := range cmds {
			cmds[i] = h.command(ctx, i, "gbbridge", "bench", "--store", addr, "--rank", fmt.Sprint(i), "--world-size", "2",
				"--namespace", "stall", "--json", "--timeout", "4s", "--collective", "all_reduce", "--sizes", "16M", "--iters", "200")
			cmds[i].Stderr = &errs[i]
			require.NoError(t, cmds[i].Start())
		}
		time.Sleep(2 * time.Second)
		require.NoError(t, cmds[1].Process.Signal(syscall.SIGSTOP))
		start := time.Now()
		err := cmds[0].Wait()
		took := time.Since(start)
		_ = cmds[1].Process.Kill()
		_ = cmds[1].Wait()
		require.Error(t, err, "member 0 must give up on a stalled member 1")
		assert.Contains(t, errs[0].String(), "timed out after 4s waiting for member 1")
		assert.Less(t, took, 10*time.Second, "within the collective's timeout")
		t.Logf("member 0 after member 1 stalled (%.1fs): %s", took.Seconds(), strings.TrimSpace(errs[0].String()))
	})

	t.Run("member killed", func(t *testing.T) {
		h := newNetHosts(t, 2, rate)
		addr := h.startStore(ctx)
		kctx, kill := context.WithCancel(ctx)
		var res [2]memberResult
		var wg sync.WaitGroup
		for i := 0; i < 2; i++ {
			c := ctx
			if i == 1 {
				c = kctx
			}
			cmd := h.command(c, i, "gbbridge", "bench", "--store", addr, "--rank", fmt.Sprint(i), "--world-size", "2",
				"--namespace", "kill", "--json", "--timeout", "10s", "--collective", "all_reduce", "--sizes", "64M", "--iters", "50")
			var errb bytes.Buffer
			cmd.Stderr = &errb
			wg.Add(1)
			go func() {
				defer wg.Done()
				start := time.Now()
				res[i].err = cmd.Run()
				res[i].took, res[i].stderr = time.Since(start), errb.String()
			}()
		}
		time.Sleep(3 * time.Second)
		kill() // SIGKILL to member 1 (ip netns exec execs the tool)
		wg.Wait()
		require.Error(t, res[0].err, "member 0 must fail when member 1 dies")
		assert.Contains(t, res[0].stderr, "member 1", "the error names the dead peer")
		assert.Less(t, res[0].took, 25*time.Second, "within the timeout")
		t.Logf("member 0 after member 1 was killed: %s", strings.TrimSpace(res[0].stderr))
	})
}
