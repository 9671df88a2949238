// Command gbprobe says what is on this node: GPUs (NVML, amdgpu sysfs and
// KFD), NICs (netlink), RDMA devices (sysfs, and libibverbs), as a human summary or JSON,
// and gives a verdict on --require words for Slurm prologs.
package main

import (
	"fmt"
	"strings"
	"time"

	"github.com/gpubridge/gpubridge/lib/cli"
	"github.com/gpubridge/gpubridge/lib/probe"
)

type grammar struct {
	JSON           bool          `name:"json" help:"Print the report as one JSON object (schema gpubridge.probe/v1) instead of the human summary."`
	Require        []string      `name:"require" help:"A requirement that must hold, else exit 1 (repeatable, or comma-separated): gpu, gpus=N, gpus>=N, nvidia, amd, nvml, rdma, ib, roce, nic=NAME, route, no-problems." env:"GPUBRIDGE_REQUIRE" placeholder:"WORD"`
	SysfsRoot      string        `name:"sysfs-root" help:"Read sysfs (PCI, DRM, KFD, InfiniBand) under this directory instead of /; it must hold sys/. NICs still come from this host's netlink." env:"GPUBRIDGE_SYSFS_ROOT" placeholder:"DIR"`
	NVML           string        `name:"nvml" help:"Consult NVML: auto (only when --sysfs-root is the real /), on or off." enum:"auto,on,off" default:"auto" env:"GPUBRIDGE_NVML"`
	NVMLLibrary    string        `name:"nvml-library" help:"NVML library to load. Default: libnvidia-ml.so.1 on the loader's path." env:"GPUBRIDGE_NVML_LIBRARY" placeholder:"PATH"`
	NVMLTimeout    time.Duration `name:"nvml-timeout" help:"Give up on NVML after this long (a broken driver can hang its init)." default:"5s" env:"GPUBRIDGE_NVML_TIMEOUT"`
	Verbs          string        `name:"verbs" help:"Consult libibverbs about the RDMA devices (does it open each, port states, MTUs): auto (only when --sysfs-root is the real /), on or off." enum:"auto,on,off" default:"auto" env:"GPUBRIDGE_VERBS"`
	VerbsLibrary   string        `name:"verbs-library" help:"libibverbs to load. Default: GPUBRIDGE_IBVERBS_LIB, else libibverbs.so.1 on the loader's path." placeholder:"PATH"`
	NoNICs         bool          `name:"no-nics" help:"Do not probe network interfaces (no netlink): nics is empty and nics_probed false." env:"GPUBRIDGE_NO_NICS"`
	RouteTo        string        `name:"route-to" help:"Report the interface and source address the kernel would use to reach this host (name or address)." placeholder:"HOST"`
	SimulateVendor string        `name:"simulate-vendor" help:"Claim this vendor (nvidia or amd) in the report, marked simulated; the real findings stay in gpus and real_vendor." env:"GPUBRIDGE_VENDOR" placeholder:"VENDOR"`
	AllowSimulated bool          `name:"allow-simulated" help:"Let the simulated vendor satisfy --require nvidia or amd (tests). Without it they judge the real GPUs only."`
}

func (g *grammar) Run(env *cli.Env) error {
	reqs, err := probe.ParseRequirements(g.Require)
	if err != nil {
		return cli.CannotRun(fmt.Errorf("--require: %w", err))
	}
	// A route verdict needs a host to route to: without one it is a usage
	// error (exit 2), not a failed requirement (exit 1).
	for _, q := range reqs {
		if q.Kind == probe.ReqRoute && strings.TrimSpace(g.RouteTo) == "" {
			return cli.CannotRun(fmt.Errorf("--require %s needs --route-to HOST", q.Text))
		}
	}
	rep, err := probe.Run(env.Ctx, probe.Options{
		SysfsRoot:      g.SysfsRoot,
		NVML:           g.NVML,
		NVMLLibrary:    g.NVMLLibrary,
		NVMLTimeout:    g.NVMLTimeout,
		Verbs:          g.Verbs,
		VerbsLibrary:   g.VerbsLibrary,
		NoNICs:         g.NoNICs,
		RouteTo:        g.RouteTo,
		SimulateVendor: strings.ToLower(strings.TrimSpace(g.SimulateVendor)),
		AllowSimulated: g.AllowSimulated,
		Requirements:   reqs,
	})
	if err != nil {
		return cli.CannotRun(err)
	}
	if g.JSON {
		if err := rep.WriteJSON(env.Stdout); err != nil {
			return cli.CannotRun(err)
		}
		for _, p := range rep.Problems {
			env.Log.Warn("probe problem", "problem", p)
		}
	} else if err := rep.WriteText(env.Stdout); err != nil {
		return cli.CannotRun(fmt.Errorf("write report: %w", err))
	}
	env.Log.Debug("probe done", "ms", rep.ProbeMS, "vendor", rep.Vendor, "gpus", len(rep.GPUs))
	failed := rep.Failed()
	for _, f := range failed {
		fmt.Fprintf(env.Stderr, "%s: requirement %s failed: %s\n", env.Tool.Name, f.Require, f.Reason)
	}
	if len(failed) > 0 {
		return cli.Silent(cli.ExitFail)
	}
	return nil
}

var tool = cli.Tool{
	Name:    "gbprobe",
	Summary: "say what is on this node: GPUs, NICs, RDMA devices; verdicts for Slurm prologs",
	Description: `gbprobe reads what a gpubridge rank needs to know about its node. NVIDIA GPUs come from NVML, loaded at run time (a node without libnvidia-ml.so.1 says so; nothing crashes), bounded by --nvml-timeout. AMD GPUs come from sysfs: /sys/class/drm/card*/device (vendor 0x1002) for name, PCI address and VRAM, and the KFD topology (/sys/class/kfd/kfd/topology/nodes) for the gfx target, unique id and ROCm's device order. /sys/bus/pci/devices is scanned for every NVIDIA and AMD GPU-class function (class 0x03 or 0x12), so a GPU whose driver is missing is reported as a problem rather than dropped. NICs come from netlink (state, MTU, MAC, addresses) and /sys/class/net/NAME/speed; RDMA devices from /sys/class/infiniband (ports, states, link layer, rate, non-zero GIDs with their types, RoCE v1 or v2, and RoCE netdevs), and then from libibverbs, loaded at run time like NVML (--verbs): whether it opens each device (a missing provider library or ib_uverbs module shows here), each port's state, active and largest MTU, and the device's queue pair limits. A node with RDMA devices whose libibverbs is missing or cannot open one has that as a problem: the verbs bridge cannot run there.

Without --json gbprobe prints a short summary for people; with --json one JSON object. Stdout carries only the report; log lines and failed requirements go to stderr.

--sysfs-root points every sysfs read at a fake tree (tests). Under a fake root neither NVML nor libibverbs is consulted (--nvml=auto and --verbs=auto mean off there; on forces them), while NICs and --route-to still come from this host's netlink unless --no-nics.

GPUBRIDGE_VENDOR=nvidia|amd (--simulate-vendor) makes a CPU-only node stand in for a vendor: vendor is the simulated one and simulated is true, while gpus, pci_gpus and real_vendor keep the real findings. The nvidia and amd requirements follow the simulated vendor only with --allow-simulated (their reason says so); without it they judge the real GPUs and their reason says that the simulated vendor did not count, so a Slurm prolog that inherits GPUBRIDGE_VENDOR cannot pass a node without GPUs. gpu and gpus=N count real GPUs only.

--require makes gbprobe a verdict. Words: gpu (a usable GPU), gpus=N or gpus>=N (at least N usable GPUs), nvidia, amd (a usable GPU of that vendor, or that vendor simulated with --allow-simulated), nvml (NVML answered), rdma (an ACTIVE RDMA port that the verbs bridge can use: ACTIVE in sysfs and, when libibverbs is consulted, its device opened and the port ACTIVE there too), ib (the same, link layer InfiniBand), roce (the same, link layer Ethernet), nic=NAME (the interface exists and is up), route (the --route-to host has a route; without --route-to, exit 2), no-problems (the report lists no problem). Each failed requirement prints one line on stderr, "gbprobe: requirement WORD failed: REASON", and its reason is in the JSON.`,
	Output: `With --json, one JSON object, schema "gpubridge.probe/v1": schema; hostname; vendor (nvidia, amd, none or mixed; the simulated one when simulated); simulated (bool); real_vendor (from the usable GPUs); sysfs_root; gpus[] (vendor, index, name, uuid, pci_bus_id, device_id, memory_bytes, driver_version, cuda_driver_version, compute_capability, gfx_target, unique_id, drm_card, kfd_node, source nvml or sysfs); pci_gpus[] (pci_bus_id, vendor, vendor_id, device_id, class, driver, usable); nvml (state ok, off, unavailable, timeout or error; error; driver_version; cuda_driver_version); nics_probed (bool); nics[] (name, index, state up or down, oper_state, kind, mtu, mac, addresses[] in CIDR form, speed_mbps); rdma[] (name, node_guid, node_type, fw_version, pci_bus_id, ports[]: port, state, phys_state, link_layer, rate, rate_gbps, lid, gids[] (index, gid, type "IB/RoCE v1" or "RoCE v2", netdev), netdevs[], verbs_state, active_mtu, max_mtu (bytes, from libibverbs); verbs (when consulted): opened, error, max_qp, max_qp_wr); verbs (state ok, off, unavailable, timeout or error; library; error); route (only with --route-to: to, ip, interface, source, gateway, error); problems[] (sentences); requirements[] (require, ok, reason); probe_ms. Empty lists are [], never null. Fields may be added within v1; none is removed or changes meaning.

Without --json, a summary for people whose format may change.`,
	ExitCodes: []cli.ExitCode{
		{Code: cli.ExitOK, Meaning: "the probe ran and every --require held (problems alone do not fail it; --require no-problems does)"},
		{Code: cli.ExitFail, Meaning: "the probe ran and at least one --require failed; one line per failed requirement on stderr, the reasons also in the JSON"},
		{Code: cli.ExitUsage, Meaning: "the probe could not run: bad flags, an unknown --require word, --require route without --route-to, a bad GPUBRIDGE_VENDOR, an unreadable --sysfs-root"},
	},
	Examples: []cli.Example{
		{Command: "gbprobe", Text: "What is on this node, for people."},
		{Command: "gbprobe --json | gbdiscover --rank $RANK --world-size $WORLD_SIZE", Text: "Start-up of one rank: the report feeds discovery."},
		{Command: "gbprobe --json --require 'nvidia,gpus>=8,ib' --route-to $MASTER_ADDR", Text: "An NVIDIA node with 8 GPUs and an active InfiniBand port; also which interface reaches the master."},
		{Command: `#!/bin/bash
# slurm.conf: Prolog=/etc/slurm/prolog.sh
if ! out=$(/usr/local/bin/gbprobe --json --require gpu,rdma 2>&1 >/dev/null); then
    scontrol update nodename="$SLURMD_NODENAME" state=drain reason="$(echo "$out" | grep -m1 '^gbprobe: ')"
    exit 1
fi`, Text: "A Slurm prolog that drains a node whose GPUs or RDMA port are gone, with gbprobe's reason (see ci/slurm/prolog-test.sh)."},
		{Command: "gbprobe --json --require roce | jq '.rdma[] | {name, verbs, ports: [.ports[] | {port, verbs_state, active_mtu, gids}]}'", Text: "A new RoCE node: does libibverbs open the HCA, which MTU is active, which GIDs are RoCE v2."},
		{Command: "GPUBRIDGE_VENDOR=amd gbprobe --json --no-nics", Text: "A CPU-only node standing in for an AMD node in tests."},
		{Command: "GPUBRIDGE_VENDOR=amd gbprobe --require amd --allow-simulated", Text: "A test that wants the simulated vendor to pass --require amd; without --allow-simulated it fails on a node without AMD GPUs."},
	},
	SeeAlso: []string{"gbdiscover", "gbbridge"},
}

func main() { cli.Main(tool, &grammar{}) }
