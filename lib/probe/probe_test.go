package probe

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"flag"
	"fmt"
	"os"
	"os/exec"
	"os/user"
	"path/filepath"
	"strconv"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/gpubridge/gpubridge/lib/ibverbs"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

var update = flag.Bool("update", false, "rewrite the golden files under testdata/golden")

// tree is the path of a fake sysfs tree (see testdata/sysfs/make-trees.sh).
func tree(name string) string { return filepath.Join("testdata", "sysfs", name) }

// allWords asks every requirement of the vocabulary, so goldens show every
// reason.
var allWords = []string{"gpu,gpus>=4,nvidia,amd,nvml", "rdma,ib,roce,nic=lo,route,no-problems"}

func h100(index int, bus string, uuid string) GPU {
	return GPU{Vendor: VendorNVIDIA, Index: index, Name: "NVIDIA H100 80GB HBM3", UUID: uuid,
		PCIBusID: bus, DeviceID: "0x2330", MemoryBytes: 85520809984, DriverVersion: "550.54.15",
		CUDADriverVersion: "12.4", ComputeCapability: "9.0", Source: "nvml"}
}

func nvmlWith(gpus ...GPU) NVML {
	return NVMLFunc(func() (*NVMLInfo, error) {
		return &NVMLInfo{DriverVersion: "550.54.15", CUDADriverVersion: "12.4", GPUs: gpus}, nil
	})
}

var nvmlMissing = NVMLFunc(func() (*NVMLInfo, error) {
	return nil, fmt.Errorf("%w: libnvidia-ml.so.1: cannot open shared object file: No such file or directory", ErrNVMLUnavailable)
})

// nvmlHangs blocks until the test ends, like nvmlInit on a wedged driver.
func nvmlHangs(t *testing.T) NVML {
	block := make(chan struct{})
	t.Cleanup(func() { close(block) })
	return NVMLFunc(func() (*NVMLInfo, error) { <-block; return nil, errors.New("unblocked") })
}

// verbsWith is a libibverbs that lists devs.
func verbsWith(devs ...VerbsDevice) Verbs {
	return VerbsFunc(func() ([]VerbsDevice, error) { return devs, nil })
}

var verbsMissing = VerbsFunc(func() ([]VerbsDevice, error) {
	return nil, fmt.Errorf("%w: libibverbs.so.1: cannot open shared object file: No such file or directory", ibverbs.ErrUnavailable)
})

// stable masks what differs between machines and runs.
func stable(t *testing.T, rep *Report) []byte {
	t.Helper()
	r := *rep
	r.Hostname = "HOST"
	r.ProbeMS = 0
	r.NICs = []NIC{}
	var b bytes.Buffer
	require.NoError(t, r.WriteJSON(&b))
	return b.Bytes()
}

func TestGolden(t *testing.T) {
	tests := []struct {
		name string
		opts func(t *testing.T) Options
	}{
		{"amd4", func(*testing.T) Options { return Options{SysfsRoot: tree("amd4")} }},
		{"amd4-simulated-nvidia", func(*testing.T) Options {
			return Options{SysfsRoot: tree("amd4"), SimulateVendor: VendorNVIDIA}
		}},
		{"nvidia-nodriver", func(*testing.T) Options {
			return Options{SysfsRoot: tree("nvidia-nodriver"), NVML: NVMLModeOn, NVMLLib: nvmlMissing}
		}},
		{"nvidia-nodriver-nvml-auto", func(*testing.T) Options { return Options{SysfsRoot: tree("nvidia-nodriver")} }},
		{"nvidia-nvml", func(*testing.T) Options {
			return Options{SysfsRoot: tree("nvidia-nodriver"), NVML: NVMLModeOn, NVMLLib: nvmlWith(
				h100(0, "0000:3b:00.0", "GPU-5c0c7b6e-6f0c-5e1a-9e0b-3b0000000000"),
				h100(1, "0000:86:00.0", "GPU-5c0c7b6e-6f0c-5e1a-9e0b-860000000000"))}
		}},
		{"nvidia-nvml-partial", func(*testing.T) Options {
			return Options{SysfsRoot: tree("nvidia-nodriver"), NVML: NVMLModeOn, NVMLLib: nvmlWith(
				h100(0, "0000:3b:00.0", "GPU-5c0c7b6e-6f0c-5e1a-9e0b-3b0000000000"))}
		}},
		{"nvidia-nvml-timeout", func(t *testing.T) Options {
			return Options{SysfsRoot: tree("nvidia-nodriver"), NVML: NVMLModeOn, NVMLLib: nvmlHangs(t), NVMLTimeout: 50 * time.Millisecond}
		}},
		{"ib", func(*testing.T) Options { return Options{SysfsRoot: tree("ib")} }},
		{"roce", func(*testing.T) Options { return Options{SysfsRoot: tree("roce")} }},
		{"roce-verbs", func(*testing.T) Options {
			return Options{SysfsRoot: tree("roce"), Verbs: VerbsModeOn, VerbsLib: verbsWith(VerbsDevice{Name: "mlx5_0", MaxQP: 262144, MaxQPWR: 32768,
				Ports: []VerbsPort{{Port: 1, State: "ACTIVE", LinkLayer: "Ethernet", ActiveMTU: 4096, MaxMTU: 4096, Gbps: 100}}})}
		}},
		{"roce-verbs-cannot-open", func(*testing.T) Options {
			return Options{SysfsRoot: tree("roce"), Verbs: VerbsModeOn, VerbsLib: verbsWith(
				VerbsDevice{Name: "mlx5_0", Error: "ibv_open_device mlx5_0: no such device"}, VerbsDevice{Name: "rxe9"})}
		}},
		{"ib-verbs-missing", func(*testing.T) Options {
			return Options{SysfsRoot: tree("ib"), Verbs: VerbsModeOn, VerbsLib: verbsMissing}
		}},
		{"bare", func(*testing.T) Options { return Options{SysfsRoot: tree("bare")} }},
		{"bare-simulated-amd", func(*testing.T) Options { return Options{SysfsRoot: tree("bare"), SimulateVendor: VendorAMD} }},
	}
	reqs, err := ParseRequirements(allWords)
	require.NoError(t, err)
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			o := tc.opts(t)
			o.NoNICs = true
			o.Requirements = reqs
			rep, err := Run(context.Background(), o)
			require.NoError(t, err)
			got := stable(t, rep)
			path := filepath.Join("testdata", "golden", tc.name+".json")
			if *update {
				require.NoError(t, os.MkdirAll(filepath.Dir(path), 0o755))
				require.NoError(t, os.WriteFile(path, got, 0o644))
			}
			want, err := os.ReadFile(path)
			require.NoError(t, err, "run go test ./lib/probe -run TestGolden -update")
			assert.Equal(t, string(want), string(got))

			// The JSON decodes back into the same Report (gbdiscover's path).
			var back Report
			require.NoError(t, json.Unmarshal(got, &back))
			assert.Equal(t, string(got), string(stable(t, &back)))
		})
	}
}

func TestRequirementsPerTree(t *testing.T) {
	type want map[string]bool
	tests := []struct {
		tree string
		opts Options
		want want
	}{
		{"amd4", Options{}, want{
			"gpu": true, "gpus=4": true, "gpus>=5": false, "amd": true, "nvidia": false, "nvml": false,
			"rdma": false, "ib": false, "roce": false, "no-problems": true, "route": false,
		}},
		// A simulated vendor counts only with AllowSimulated; without it
		// the vendor words judge the real GPUs.
		{"amd4", Options{SimulateVendor: VendorNVIDIA}, want{
			"nvidia": false, "amd": true, "gpu": true, "gpus>=4": true,
		}},
		{"amd4", Options{SimulateVendor: VendorNVIDIA, AllowSimulated: true}, want{
			"nvidia": true, "amd": false, "gpu": true, "gpus>=4": true,
		}},
		{"nvidia-nodriver", Options{NVML: NVMLModeOn, NVMLLib: nvmlMissing}, want{
			"gpu": false, "gpus=0": true, "gpus=1": false, "nvidia": false, "amd": false, "nvml": false, "no-problems": false,
		}},
		{"nvidia-nodriver", Options{NVML: NVMLModeOn, NVMLLib: nvmlWith(h100(0, "0000:3b:00.0", "GPU-a"), h100(1, "0000:86:00.0", "GPU-b"))}, want{
			"gpu": true, "gpus>=2": true, "gpus=3": false, "nvidia": true, "amd": false, "nvml": true, "no-problems": true,
		}},
		{"ib", Options{}, want{"rdma": true, "ib": true, "roce": false, "gpu": false, "no-problems": true}},
		{"roce", Options{}, want{"rdma": true, "ib": false, "roce": true}},
		{"bare", Options{}, want{
			"gpu": false, "gpus=0": true, "nvidia": false, "amd": false, "rdma": false, "no-problems": true,
		}},
		{"bare", Options{SimulateVendor: VendorAMD}, want{"amd": false, "nvidia": false, "gpu": false}},
		{"bare", Options{SimulateVendor: VendorAMD, AllowSimulated: true}, want{"amd": true, "nvidia": false, "gpu": false}},
	}
	for _, tc := range tests {
		name := tc.tree
		if tc.opts.SimulateVendor != "" {
			name += "-sim-" + tc.opts.SimulateVendor
		}
		if tc.opts.AllowSimulated {
			name += "-allowed"
		}
		if tc.opts.NVMLLib != nil {
			name += "-nvml"
		}
		t.Run(name, func(t *testing.T) {
			o := tc.opts
			o.SysfsRoot, o.NoNICs = tree(tc.tree), true
			rep, err := Run(context.Background(), o)
			require.NoError(t, err)
			for word, ok := range tc.want {
				reqs, err := ParseRequirements([]string{word})
				require.NoError(t, err)
				res := rep.Check(reqs)
				require.Len(t, res, 1)
				assert.Equal(t, ok, res[0].OK, "%s: %s", word, res[0].Reason)
				assert.NotEmpty(t, res[0].Reason, word)
			}
		})
	}
}

func TestRequirementReasons(t *testing.T) {
	rep, err := Run(context.Background(), Options{SysfsRoot: tree("nvidia-nodriver"), NoNICs: true, NVML: NVMLModeOn, NVMLLib: nvmlMissing})
	require.NoError(t, err)
	res := rep.Check(mustParse(t, "nvidia", "nic=ib0", "gpus>=8"))
	assert.Equal(t, "no NVIDIA GPU found (NVML unavailable: libnvidia-ml.so.1: cannot open shared object file: No such file or directory; unusable PCI GPUs: nvidia 0000:3b:00.0, nvidia 0000:86:00.0)", res[0].Reason)
	assert.Equal(t, "NICs not probed (--no-nics, or netlink failed)", res[1].Reason)
	assert.True(t, strings.HasPrefix(res[2].Reason, "found 0 GPUs, need 8"), res[2].Reason)
	assert.Contains(t, rep.Problems, "NVIDIA GPU at 0000:3b:00.0 but NVML unavailable: driver missing? (no kernel driver bound; libnvidia-ml.so.1: cannot open shared object file: No such file or directory)")

	rep.NICsProbed = true
	rep.NICs = []NIC{{Name: "lo", State: "up", MTU: 65536}, {Name: "ib0", State: "down", OperState: "down"}}
	res = rep.Check(mustParse(t, "nic=lo", "nic=ib0", "nic=eth9"))
	assert.Equal(t, []RequirementResult{
		{Require: "nic=lo", OK: true, Reason: "lo is up, mtu 65536"},
		{Require: "nic=ib0", OK: false, Reason: "ib0 is down (oper state down)"},
		{Require: "nic=eth9", OK: false, Reason: "no interface eth9 (have: lo, ib0)"},
	}, res)
}

func mustParse(t *testing.T, words ...string) []Requirement {
	t.Helper()
	r, err := ParseRequirements(words)
	require.NoError(t, err)
	return r
}

func TestParseRequirements(t *testing.T) {
	tests := []struct {
		in   []string
		want []Requirement
		err  string
	}{
		{in: nil, want: nil},
		{in: []string{"gpu"}, want: []Requirement{{Text: "gpu", Kind: ReqGPU}}},
		{in: []string{"gpu, nvidia", "ib"}, want: []Requirement{{Text: "gpu", Kind: ReqGPU}, {Text: "nvidia", Kind: ReqNVIDIA}, {Text: "ib", Kind: ReqIB}}},
		{in: []string{"gpus=4"}, want: []Requirement{{Text: "gpus=4", Kind: ReqGPUs, N: 4}}},
		{in: []string{"gpus>=8"}, want: []Requirement{{Text: "gpus>=8", Kind: ReqGPUs, N: 8}}},
		{in: []string{"NVIDIA"}, want: []Requirement{{Text: "NVIDIA", Kind: ReqNVIDIA}}},
		{in: []string{"nic=ens1f0np0"}, want: []Requirement{{Text: "nic=ens1f0np0", Kind: ReqNIC, Name: "ens1f0np0"}}},
		{in: []string{"roce,rdma,no-problems,route,nvml,amd"}, want: []Requirement{
			{Text: "roce", Kind: ReqRoCE}, {Text: "rdma", Kind: ReqRDMA}, {Text: "no-problems", Kind: ReqNoProblems},
			{Text: "route", Kind: ReqRoute}, {Text: "nvml", Kind: ReqNVML}, {Text: "amd", Kind: ReqAMD}}},
		{in: []string{",, ,"}, want: nil},
		{in: []string{"gpux"}, err: `unknown requirement "gpux" (known: gpu, gpus=N`},
		{in: []string{"gpus"}, err: `unknown requirement "gpus"`},
		{in: []string{"gpus=-1"}, err: `requirement "gpus=-1": want a GPU count >= 0`},
		{in: []string{"gpus>=many"}, err: `want a GPU count`},
		{in: []string{"nic="}, err: `want nic=NAME`},
		{in: []string{"nic=a/b"}, err: `want nic=NAME`},
	}
	for _, tc := range tests {
		t.Run(strings.Join(tc.in, "|"), func(t *testing.T) {
			got, err := ParseRequirements(tc.in)
			if tc.err != "" {
				require.Error(t, err)
				assert.Contains(t, err.Error(), tc.err)
				return
			}
			require.NoError(t, err)
			assert.Equal(t, tc.want, got)
		})
	}
}

func TestRunSetupErrors(t *testing.T) {
	empty := t.TempDir()
	file := filepath.Join(empty, "file")
	require.NoError(t, os.WriteFile(file, nil, 0o644))
	tests := []struct {
		name string
		opts Options
		err  string
	}{
		{"missing root", Options{SysfsRoot: filepath.Join(empty, "nope")}, "no such file or directory"},
		{"root without sys", Options{SysfsRoot: empty}, "has no sys/ directory"},
		{"root is a file", Options{SysfsRoot: file}, "not a directory"},
		{"bad vendor", Options{SysfsRoot: tree("bare"), SimulateVendor: "intel"}, `simulated vendor "intel": want nvidia or amd`},
		{"bad nvml mode", Options{SysfsRoot: tree("bare"), NVML: "maybe"}, `NVML mode "maybe"`},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			_, err := Run(context.Background(), tc.opts)
			require.Error(t, err)
			assert.ErrorIs(t, err, ErrSetup)
			assert.Contains(t, err.Error(), tc.err)
		})
	}
}

// An unreadable sysfs root is a setup error. Root reads directories
// whatever their mode, so as root (CI) the test runs itself again as nobody.
func TestUnreadableRootIsSetupError(t *testing.T) {
	if os.Geteuid() == 0 {
		out, err := runAsNobody(t, "^TestUnreadableRootIsSetupError$")
		require.NoError(t, err, "as nobody:\n%s", out)
		require.Contains(t, out, "--- PASS: TestUnreadableRootIsSetupError", "as nobody:\n%s", out)
		return
	}
	dir := t.TempDir()
	require.NoError(t, os.Mkdir(filepath.Join(dir, "sys"), 0o000))
	t.Cleanup(func() { _ = os.Chmod(filepath.Join(dir, "sys"), 0o755) })
	_, err := Run(context.Background(), Options{SysfsRoot: dir})
	assert.ErrorIs(t, err, ErrSetup)
	assert.ErrorContains(t, err, "permission denied")
}

// runAsNobody runs the tests matching run in a copy of this test binary as
// the user nobody and returns their verbose output.
func runAsNobody(t *testing.T, run string) (string, error) {
	t.Helper()
	u, err := user.Lookup("nobody")
	require.NoError(t, err, "the user nobody is needed to run this test without root's rights")
	uid, err := strconv.ParseUint(u.Uid, 10, 32)
	require.NoError(t, err)
	gid, err := strconv.ParseUint(u.Gid, 10, 32)
	require.NoError(t, err)
	// go test's build directory is private to root: nobody runs a copy.
	dir, err := os.MkdirTemp("", "gbprobe-nobody")
	require.NoError(t, err)
	t.Cleanup(func() { _ = os.RemoveAll(dir) })
	require.NoError(t, os.Chmod(dir, 0o755))
	self, err := os.ReadFile(os.Args[0])
	require.NoError(t, err)
	bin := filepath.Join(dir, "probe.test")
	require.NoError(t, os.WriteFile(bin, self, 0o755))
	cmd := exec.Command(bin, "-test.run="+run, "-test.count=1", "-test.v")
	cmd.Dir = dir
	cmd.Env = append(os.Environ(), "TMPDIR="+os.TempDir())
	cmd.SysProcAttr = &syscall.SysProcAttr{Credential: &syscall.Credential{Uid: uint32(uid), Gid: uint32(gid), Groups: []uint32{}}}
	b, err := cmd.CombinedOutput()
	return string(b), err
}

func TestAMDOrderFollowsKFD(t *testing.T) {
	rep, err := Run(context.Background(), Options{SysfsRoot: tree("amd4"), NoNICs: true})
	require.NoError(t, err)
	var order []string
	for _, g := range rep.GPUs {
		order = append(order, g.PCIBusID)
	}
	// KFD nodes 1..4 are the functions at 23, 03, 43, 63 (make-trees.sh).
	assert.Equal(t, []string{"0000:23:00.0", "0000:03:00.0", "0000:43:00.0", "0000:63:00.0"}, order)
	assert.Equal(t, "GPU-6ea6b16ce1e5a002", rep.GPUs[0].UUID)
	assert.Equal(t, "card1", rep.GPUs[0].DRMCard)
	// The audio function of the first GPU is not a GPU.
	for _, d := range rep.PCIGPUs {
		assert.NotEqual(t, "0000:03:00.1", d.PCIBusID)
		assert.True(t, d.Usable)
		assert.Equal(t, "amdgpu", d.Driver)
	}
	assert.Len(t, rep.PCIGPUs, 4)
}

func TestAMDWithoutKFDOrDriver(t *testing.T) {
	cards := []amdCard{{name: "card0", pci: "0000:03:00.0", product: "AMD Instinct MI210", deviceID: "0x740f"}}
	pci := []PCIDevice{
		{PCIBusID: "0000:03:00.0", Vendor: VendorAMD},
		{PCIBusID: "0000:83:00.0", Vendor: VendorAMD},
	}
	f := joinGPUs(pci, amdGPUs(cards, nil), false, nil, NVMLStatus{State: NVMLUnavailable})
	require.Len(t, f.gpus, 1)
	assert.Equal(t, []string{
		"AMD GPU at 0000:03:00.0 has no KFD topology (/sys/class/kfd): ROCm cannot use it (amdkfd missing?)",
		"AMD GPU at 0000:83:00.0 but no amdgpu DRM card or KFD node: driver missing? (no kernel driver bound)",
	}, f.problems)
	assert.Equal(t, []bool{true, false}, []bool{f.pci[0].Usable, f.pci[1].Usable})
}

func TestHelpers(t *testing.T) {
	for in, want := range map[uint64]string{90010: "gfx90a", 90402: "gfx942", 110000: "gfx1100", 100300: "gfx1030", 90008: "gfx908", 0: ""} {
		assert.Equal(t, want, gfxTarget(in), "gfxTarget(%d)", in)
	}
	for in, want := range map[string]string{
		"00000000:3B:00.0": "0000:3b:00.0", "0000:3b:00.0": "0000:3b:00.0", "00000001:3B:00.0": "0001:3b:00.0",
	} {
		assert.Equal(t, want, normalizePCI(in), in)
	}
	assert.True(t, looksPCI("0000:3b:00.0"))
	assert.False(t, looksPCI("card0"))
	assert.Equal(t, "12.4", cudaVersion(12040))
	assert.Equal(t, "11.8", cudaVersion(11080))
	assert.Equal(t, "", cudaVersion(0))
	assert.True(t, zeroGID("0000:0000:0000:0000:0000:0000:0000:0000"))
	assert.True(t, zeroGID(""))
	assert.False(t, zeroGID("fe80:0000:0000:0000:0c42:a103:0065:1234"))
	assert.Equal(t, "ACTIVE", afterColon("4: ACTIVE"))
	assert.Equal(t, "LinkUp", afterColon("LinkUp"))
}

func TestWriteText(t *testing.T) {
	rep, err := Run(context.Background(), Options{SysfsRoot: tree("amd4"), NoNICs: true, SimulateVendor: VendorNVIDIA,
		Requirements: mustParse(t, "nvidia,ib")})
	require.NoError(t, err)
	var b strings.Builder
	require.NoError(t, rep.WriteText(&b))
	out := b.String()
	for _, want := range []string{
		"vendor nvidia (simulated by GPUBRIDGE_VENDOR; real: amd), 4 GPUs (amd)",
		"  gpu amd 0: AMD Instinct MI210, 0000:23:00.0, 64 GiB, gfx90a, GPU-6ea6b16ce1e5a002\n",
		"nvml: off (", "nics: not probed\n", "rdma: none\n",
		"require nvidia: FAILED: no NVIDIA GPU found", "require ib: FAILED: no active InfiniBand port",
	} {
		assert.Contains(t, out, want)
	}
}

// A node without GPUs must not pass --require nvidia because GPUBRIDGE_VENDOR
// says nvidia (a prolog inheriting the variable would wave jobs through):
// the simulated vendor counts only when asked for, and the verdict says why.
func TestSimulatedVendorNeedsAllow(t *testing.T) {
	tests := []struct {
		name   string
		allow  bool
		ok     bool
		reason string
	}{
		{"refused", false, false, "no NVIDIA GPU found (NVML off: not consulted (--nvml=off)); the simulated vendor nvidia (GPUBRIDGE_VENDOR) does not count without --allow-simulated"},
		{"allowed", true, true, "vendor nvidia simulated (GPUBRIDGE_VENDOR), accepted by --allow-simulated; real GPUs: 0 GPUs"},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			rep, err := Run(context.Background(), Options{SysfsRoot: tree("bare"), NoNICs: true, NVML: NVMLModeOff,
				SimulateVendor: VendorNVIDIA, AllowSimulated: tc.allow, Requirements: mustParse(t, "nvidia")})
			require.NoError(t, err)
			require.Len(t, rep.Requirements, 1)
			assert.Equal(t, RequirementResult{Require: "nvidia", OK: tc.ok, Reason: tc.reason}, rep.Requirements[0])
			assert.Equal(t, !tc.ok, len(rep.Failed()) == 1)
		})
	}
}
