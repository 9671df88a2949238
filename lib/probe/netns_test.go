package probe

import (
	"context"
	"encoding/json"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

// The NIC and route code runs against real interfaces in two network
// namespaces made for the test (as root): A holds gbt0 (10.213.7.1/24, MTU
// 1400, up) whose veth peer gbt1 (10.213.7.2/24) is in B, and a veth pair
// gbd0/gbd1 left down. The probe runs in A by re-executing this test binary
// under `ip netns exec` (see TestMain), which also mounts a sysfs of A (link
// speeds). The 10.213.7.0/24 addresses exist only inside these namespaces.

const (
	netnsOutEnv    = "GBPROBE_TEST_NETNS_OUT"
	netnsRoutesEnv = "GBPROBE_TEST_NETNS_ROUTES"
)

func TestNetlinkInNamespace(t *testing.T) {
	// Only a non-root run may skip: as root (CI) a namespace that cannot be
	// made is a failure, not a reason to pass without the test.
	if os.Geteuid() != 0 {
		t.Skip("needs root: creates network namespaces (make test as root runs it)")
	}
	ipPath, err := exec.LookPath("ip")
	require.NoError(t, err, "iproute2's ip is needed to create network namespaces (ci/deps.sh installs it)")
	ip := func(args ...string) error {
		out, err := exec.Command(ipPath, args...).CombinedOutput()
		if err != nil {
			return fmt.Errorf("ip %s: %v: %s", strings.Join(args, " "), err, out)
		}
		return nil
	}
	nsA := fmt.Sprintf("gbprobe-test-%d-a", os.Getpid())
	nsB := fmt.Sprintf("gbprobe-test-%d-b", os.Getpid())
	for _, ns := range []string{nsA, nsB} {
		require.NoError(t, ip("netns", "add", ns), "cannot create network namespaces as root")
		t.Cleanup(func() {
			if err := ip("netns", "del", ns); err != nil {
				t.Errorf("cleanup: %v", err)
			}
		})
	}
	for _, args := range [][]string{
		{"-n", nsA, "link", "set", "lo", "up"},
		{"-n", nsA, "link", "add", "gbt0", "type", "veth", "peer", "name", "gbt1", "netns", nsB},
		{"-n", nsA, "addr", "add", "10.213.7.1/24", "dev", "gbt0"},
		{"-n", nsA, "link", "set", "gbt0", "mtu", "1400", "up"},
		{"-n", nsB, "addr", "add", "10.213.7.2/24", "dev", "gbt1"},
		{"-n", nsB, "link", "set", "gbt1", "up"},
		{"-n", nsA, "link", "add", "gbd0", "type", "veth", "peer", "name", "gbd1"},
	} {
		require.NoError(t, ip(args...))
	}

	out := filepath.Join(t.TempDir(), "reports.json")
	cmd := exec.Command(ipPath, "netns", "exec", nsA, os.Args[0])
	cmd.Env = append(os.Environ(), netnsOutEnv+"="+out, netnsRoutesEnv+"=10.213.7.2,10.99.0.5,localhost")
	b, err := cmd.CombinedOutput()
	require.NoError(t, err, "child: %s", b)
	var reps []Report
	data, err := os.ReadFile(out)
	require.NoError(t, err, "child wrote nothing: %s", b)
	require.NoError(t, json.Unmarshal(data, &reps))
	require.Len(t, reps, 3)

	rep := reps[0]
	require.True(t, rep.NICsProbed)
	nics := map[string]NIC{}
	for _, n := range rep.NICs {
		nics[n.Name] = n
	}
	assert.Len(t, nics, 4, "lo, gbt0, gbd0, gbd1: %+v", rep.NICs)
	gbt0 := nics["gbt0"]
	assert.Equal(t, "up", gbt0.State)
	assert.Equal(t, "up", gbt0.OperState)
	assert.Equal(t, "veth", gbt0.Kind)
	assert.Equal(t, 1400, gbt0.MTU)
	assert.Contains(t, gbt0.Addresses, "10.213.7.1/24")
	assert.Regexp(t, `^([0-9a-f]{2}:){5}[0-9a-f]{2}$`, gbt0.MAC)
	assert.Equal(t, 10000, gbt0.SpeedMbps, "veth reports 10000 Mb/s through the namespace's sysfs")
	assert.Equal(t, "down", nics["gbd0"].State)
	assert.Equal(t, "up", nics["lo"].State)
	assert.Contains(t, nics["lo"].Addresses, "127.0.0.1/8")
	assert.Empty(t, nics["lo"].MAC)

	assert.Equal(t, &Route{To: "10.213.7.2", IP: "10.213.7.2", Interface: "gbt0", Source: "10.213.7.1"}, rep.Route)
	assert.Equal(t, []RequirementResult{
		{Require: "nic=gbt0", OK: true, Reason: "gbt0 is up, mtu 1400"},
		{Require: "nic=gbd0", OK: false, Reason: "gbd0 is down (oper state down)"},
		{Require: "nic=eth0", OK: false, Reason: "no interface eth0 (have: lo, gbt0, gbd1, gbd0)"},
		{Require: "route", OK: true, Reason: "10.213.7.2 via gbt0 src 10.213.7.1"},
	}, rep.Requirements)

	unreachable := reps[1]
	require.NotNil(t, unreachable.Route)
	assert.Equal(t, "10.99.0.5", unreachable.Route.IP)
	assert.Contains(t, unreachable.Route.Error, "network is unreachable")
	assert.Contains(t, unreachable.Problems, "route: "+unreachable.Route.Error)
	assert.False(t, unreachable.Requirements[3].OK)

	local := reps[2]
	assert.Equal(t, &Route{To: "localhost", IP: "127.0.0.1", Interface: "lo", Source: "127.0.0.1"}, local.Route)
}

// TestMain runs the probe inside namespace A when TestNetlinkInNamespace
// re-executes the test binary there (a helper, not a test).
func TestMain(m *testing.M) {
	if out := os.Getenv(netnsOutEnv); out != "" {
		if err := netnsChild(out); err != nil {
			fmt.Fprintln(os.Stderr, "netns child:", err)
			os.Exit(1)
		}
		os.Exit(0)
	}
	os.Exit(m.Run())
}

// netnsChild probes routes to every GBPROBE_TEST_NETNS_ROUTES host and
// writes the reports to out.
func netnsChild(out string) error {
	reqs, err := ParseRequirements([]string{"nic=gbt0,nic=gbd0,nic=eth0,route"})
	if err != nil {
		return err
	}
	var reps []*Report
	for _, to := range strings.Split(os.Getenv(netnsRoutesEnv), ",") {
		rep, err := Run(context.Background(), Options{SysfsRoot: tree("bare"), RouteTo: to, Requirements: reqs})
		if err != nil {
			return err
		}
		reps = append(reps, rep)
	}
	b, err := json.Marshal(reps)
	if err != nil {
		return err
	}
	return os.WriteFile(out, b, 0o644)
}

// As root, a namespace that cannot be made must fail TestNetlinkInNamespace,
// never skip it: run it again with an ip that refuses everything.
func TestNetnsFailureFailsAsRoot(t *testing.T) {
	if os.Geteuid() != 0 {
		t.Skip("needs root: checks what TestNetlinkInNamespace does as root")
	}
	out, err := runWithFailingIP(t, "^TestNetlinkInNamespace$")
	require.Error(t, err, "TestNetlinkInNamespace passed with an ip that fails:\n%s", out)
	assert.Contains(t, out, "--- FAIL: TestNetlinkInNamespace")
	assert.Contains(t, out, "cannot create network namespaces as root")
	assert.NotContains(t, out, "--- SKIP")
}

// runWithFailingIP runs the tests matching run in this test binary with an
// ip(8) first on PATH that prints an error and exits 1.
func runWithFailingIP(t *testing.T, run string) (string, error) {
	t.Helper()
	dir := t.TempDir()
	require.NoError(t, os.WriteFile(filepath.Join(dir, "ip"), []byte("#!/bin/sh\necho 'ip: refused by the test' >&2\nexit 1\n"), 0o755))
	cmd := exec.Command(os.Args[0], "-test.run="+run, "-test.count=1", "-test.v")
	cmd.Env = append(os.Environ(), "PATH="+dir+string(os.PathListSeparator)+os.Getenv("PATH"))
	b, err := cmd.CombinedOutput()
	return string(b), err
}
