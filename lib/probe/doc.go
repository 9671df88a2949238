// Package probe says what is on a node: GPUs, NICs and RDMA devices, and
// whether requirements on them hold. gbprobe is its command line; gbdiscover
// reads gbprobe's JSON back into Report.
//
// # Use
//
//	reqs, err := probe.ParseRequirements([]string{"nvidia,gpus>=8", "ib"})
//	rep, err := probe.Run(ctx, probe.Options{Requirements: reqs})
//	for _, f := range rep.Failed() { ... f.Require, f.Reason ... }
//	uuid, pci := rep.GPUIdentity(localRank)
//
// Run returns an error (wrapping ErrSetup) only when it cannot probe at all:
// bad options or an unreadable sysfs root. Everything it meets on the node —
// a missing driver, an NVML that hangs, a netlink failure — is a finding in
// Report.Problems or Report.NVML, never an error and never a crash.
//
// # Sources
//
//   - NVIDIA GPUs: NVML, loaded at run time with dlopen through go-nvml
//     (RealNVML). A node without libnvidia-ml.so.1 gives NVML state
//     "unavailable". Init and query run in a goroutine bounded by
//     Options.NVMLTimeout (state "timeout", a problem). Tests inject an NVML
//     through Options.NVMLLib.
//   - AMD GPUs: sysfs. sys/class/drm/cardN/device with vendor 0x1002 gives
//     name (product_name), PCI address, device id and VRAM
//     (mem_info_vram_total); the KFD topology
//     (sys/class/kfd/kfd/topology/nodes/N/properties, GPU nodes have
//     simd_count > 0) gives gfx target, unique_id and ROCm's device order,
//     joined to cards by PCI address (domain, location_id).
//   - Every NVIDIA or AMD GPU-class PCI function (class 0x03xxxx or
//     0x12xxxx) under sys/bus/pci/devices is listed in pci_gpus; one that is
//     not usable (NVML does not see it, or no amdgpu card or KFD node) is
//     also a problem, e.g. "NVIDIA GPU at 0000:3b:00.0 but NVML unavailable:
//     driver missing? (...)".
//   - NICs: netlink (rtnetlink, socket timeout 2 s) in the caller's network
//     namespace: name, state, MTU, MAC, addresses; speed from
//     /sys/class/net/NAME/speed of the real sysfs.
//   - Route: --route-to resolves the host (2 s bound, IPv4 preferred) and
//     asks the kernel (RTM_GETROUTE) for the interface and source address.
//   - RDMA: sys/class/infiniband/DEV: node_guid, node_type, fw_ver, and per
//     port state, phys_state, link_layer, rate, lid, non-zero GIDs with
//     gid_attrs/types and gid_attrs/ndevs, and netdevs (GID netdevs, else the
//     PCI function's net/ entries matched by dev_port).
//
// # Fake sysfs roots
//
// Options.SysfsRoot (gbprobe --sysfs-root, GPUBRIDGE_SYSFS_ROOT) moves every
// sysfs read of GPUs and RDMA devices under a directory that must hold sys/.
// Under a fake root:
//
//   - NVML is not consulted by default (mode "auto" means off there: the
//     real NVML knows nothing of the fake tree); mode "on" forces it.
//   - NICs and the route still come from the real netlink of the probe's
//     network namespace, with speeds from the real /sys, unless NoNICs.
//     There is no fake netlink; tests of NICs use real network namespaces.
//
// # Simulation
//
// Options.SimulateVendor (GPUBRIDGE_VENDOR=nvidia|amd) sets Vendor to the
// simulated vendor and Simulated to true. GPUs, PCIGPUs and RealVendor keep
// the real findings. The nvidia and amd requirements follow the simulated
// vendor only with Options.AllowSimulated (gbprobe --allow-simulated);
// without it they judge the real GPUs and their reason says the simulated
// vendor did not count. gpu and gpus=N count real GPUs only.
//
// # Requirements
//
// ParseRequirements takes --require values, each a comma-separated list of
// words: gpu, gpus=N (also gpus>=N; at least N), nvidia, amd, nvml, rdma
// (an ACTIVE port), ib (ACTIVE, link layer InfiniBand), roce (ACTIVE, link
// layer Ethernet), nic=NAME (exists and up), route (the --route-to host has
// a route), no-problems. An unknown word is an error. Report.Check gives
// every requirement a verdict and a reason, held or not.
//
// # Which GPU a rank uses
//
// Report.VisibleGPUs applies CUDA_VISIBLE_DEVICES (NVIDIA), or
// ROCR_VISIBLE_DEVICES then HIP_VISIBLE_DEVICES (or CUDA_VISIBLE_DEVICES) for
// AMD, to the GPUs in runtime order; DeviceFor and GPUIdentity pick entry
// LOCAL_RANK of that list, as torch.cuda.set_device(local_rank) does. The
// NVIDIA base order is NVML's (PCI bus order): it matches CUDA's only with
// CUDA_DEVICE_ORDER=PCI_BUS_ID, which gpubridge jobs should set. The AMD base
// order is the KFD node order, which is ROCm's.
//
// # JSON schema "gpubridge.probe/v1"
//
// One object. Fields may be added within v1; none is removed or changes its
// meaning. Lists are [] when empty, never null. Absent optional fields are
// omitted.
//
//	{
//	  "schema": "gpubridge.probe/v1",
//	  "hostname": "node17",
//	  "vendor": "nvidia",          // nvidia | amd | none | mixed; simulated one if simulated
//	  "simulated": false,
//	  "real_vendor": "nvidia",     // from the usable GPUs, whatever the simulation
//	  "sysfs_root": "/",
//	  "gpus": [{
//	    "vendor": "nvidia",        // nvidia | amd
//	    "index": 0,                // NVML index (PCI order) / KFD order
//	    "name": "NVIDIA H100 80GB HBM3",
//	    "uuid": "GPU-5c0c…",       // AMD: "GPU-" + unique_id as 16 hex digits
//	    "pci_bus_id": "0000:3b:00.0",
//	    "device_id": "0x2330",
//	    "memory_bytes": 85520809984,
//	    "driver_version": "550.54.15",   // NVIDIA
//	    "cuda_driver_version": "12.4",   // NVIDIA
//	    "compute_capability": "9.0",     // NVIDIA
//	    "gfx_target": "gfx90a",          // AMD
//	    "unique_id": "7973255271510548481", // AMD, KFD decimal
//	    "drm_card": "card0",             // AMD
//	    "kfd_node": 2,                   // AMD
//	    "source": "nvml"                 // nvml | sysfs
//	  }],
//	  "pci_gpus": [{"pci_bus_id": "0000:3b:00.0", "vendor": "nvidia", "vendor_id": "0x10de",
//	                "device_id": "0x2330", "class": "0x030200", "driver": "nvidia", "usable": true}],
//	  "nvml": {"state": "ok", "error": "", "driver_version": "550.54.15", "cuda_driver_version": "12.4"},
//	                               // state: ok | off | unavailable | timeout | error
//	  "nics_probed": true,
//	  "nics": [{"name": "eth0", "index": 2, "state": "up", "oper_state": "up", "kind": "device",
//	            "mtu": 9000, "mac": "02:…", "addresses": ["10.0.0.5/24"], "speed_mbps": 100000}],
//	  "rdma": [{"name": "mlx5_0", "node_guid": "0c42:a103:0065:1234", "node_type": "1: CA",
//	            "fw_version": "20.39.1002", "pci_bus_id": "0000:17:00.0",
//	            "ports": [{"port": 1, "state": "ACTIVE", "phys_state": "LinkUp",
//	                       "link_layer": "InfiniBand", "rate": "200 Gb/sec (4X HDR)", "rate_gbps": 200,
//	                       "lid": "0x12",
//	                       "gids": [{"index": 0, "gid": "fe80:…", "type": "IB/RoCE v1", "netdev": ""}],
//	                       "netdevs": ["ib0"]}]}],
//	  "route": {"to": "master", "ip": "10.0.0.1", "interface": "eth0", "source": "10.0.0.5",
//	            "gateway": "", "error": ""},   // only when asked for
//	  "problems": ["NVIDIA GPU at 0000:86:00.0 is not visible to NVML (…): fallen off the bus?"],
//	  "requirements": [{"require": "gpus>=8", "ok": false, "reason": "found 7 GPUs (nvidia), need 8"}],
//	  "probe_ms": 41.27
//	}
package probe
