package probe

// Schema is the value of Report.Schema. A change that removes or renames a
// field, or changes the meaning of one, bumps the version; adding fields does
// not.
const Schema = "gpubridge.probe/v1"

// Vendor values of Report.Vendor, Report.RealVendor and GPU.Vendor.
const (
	VendorNVIDIA = "nvidia"
	VendorAMD    = "amd"
	VendorNone   = "none"  // no usable GPU (Report only)
	VendorMixed  = "mixed" // usable GPUs of both vendors (Report only)
)

// NVML states of NVMLStatus.State.
const (
	NVMLOK          = "ok"          // initialised; its devices are in Report.GPUs
	NVMLOff         = "off"         // not consulted (--nvml=off, or auto under a fake sysfs root)
	NVMLUnavailable = "unavailable" // library not found or driver not loaded
	NVMLTimeout     = "timeout"     // init or query did not return in time
	NVMLError       = "error"       // any other failure
)

// Report is what gbprobe prints with --json: everything the probe found on
// one node. Its JSON form is the schema "gpubridge.probe/v1", documented in
// doc.go; other tools (gbdiscover) decode it into this type. Slices are never
// nil in a Report made by Run, so they encode as [] rather than null.
type Report struct {
	Schema string `json:"schema"`
	// Hostname is os.Hostname().
	Hostname string `json:"hostname"`
	// Vendor is the vendor a rank on this node belongs to: nvidia, amd, none
	// or mixed. It is RealVendor unless Simulated.
	Vendor string `json:"vendor"`
	// Simulated is true when GPUBRIDGE_VENDOR (Options.SimulateVendor) set
	// Vendor; GPUs and RealVendor still hold the real findings.
	Simulated bool `json:"simulated"`
	// RealVendor is the vendor of the usable GPUs found (nvidia, amd, none,
	// mixed), simulated or not.
	RealVendor string `json:"real_vendor"`
	// SysfsRoot is the directory sysfs was read under: "/" on a real node.
	SysfsRoot string `json:"sysfs_root"`
	// GPUs are the usable GPUs: NVIDIA ones seen by NVML, AMD ones with the
	// amdgpu driver bound. NVIDIA first, then AMD, each in runtime index
	// order.
	GPUs []GPU `json:"gpus"`
	// PCIGPUs are the NVIDIA and AMD GPU-class PCI functions seen in sysfs,
	// usable or not: the hardware, whatever the drivers say.
	PCIGPUs []PCIDevice `json:"pci_gpus"`
	// NVML says whether NVML was consulted and what it answered.
	NVML NVMLStatus `json:"nvml"`
	// NICsProbed is false when NIC probing was switched off (--no-nics).
	NICsProbed bool `json:"nics_probed"`
	// NICs are the network interfaces of the probe's network namespace.
	NICs []NIC `json:"nics"`
	// RDMA are the RDMA devices under /sys/class/infiniband.
	RDMA []RDMADevice `json:"rdma"`
	// Verbs says whether libibverbs was consulted and what it answered;
	// the devices and ports carry its view.
	Verbs VerbsStatus `json:"verbs"`
	// Route is present when a route was asked for (--route-to).
	Route *Route `json:"route,omitempty"`
	// Problems are findings that will likely break a job on this node, one
	// sentence each. They do not change the exit status unless the
	// no-problems requirement is asked for.
	Problems []string `json:"problems"`
	// Requirements are the verdicts of the requirements asked for, in order.
	Requirements []RequirementResult `json:"requirements"`
	// ProbeMS is how long the probe took, in milliseconds.
	ProbeMS float64 `json:"probe_ms"`

	// allowSimulated is Options.AllowSimulated: whether Check lets the
	// simulated vendor satisfy the nvidia and amd requirements.
	allowSimulated bool
}

// GPU is one usable GPU.
type GPU struct {
	// Vendor is nvidia or amd.
	Vendor string `json:"vendor"`
	// Index is the runtime's device index before any *_VISIBLE_DEVICES
	// masking: the NVML index for NVIDIA (PCI bus order, which is CUDA's
	// order under CUDA_DEVICE_ORDER=PCI_BUS_ID), the KFD node order for AMD
	// (ROCm's order).
	Index int `json:"index"`
	// Name is the marketing name (NVML; amdgpu product_name) or, where the
	// driver gives none, "AMD GPU <device id>".
	Name string `json:"name"`
	// UUID is NVML's "GPU-…" UUID, or for AMD "GPU-" and the KFD unique_id
	// as 16 hex digits (the form ROCR_VISIBLE_DEVICES accepts). Empty when
	// unknown.
	UUID string `json:"uuid,omitempty"`
	// PCIBusID is the PCI address, lower case, "dddd:bb:dd.f".
	PCIBusID string `json:"pci_bus_id"`
	// DeviceID is the PCI device id, "0x2330".
	DeviceID string `json:"device_id,omitempty"`
	// MemoryBytes is the total device memory (NVML memory total; amdgpu
	// mem_info_vram_total); 0 when unknown.
	MemoryBytes uint64 `json:"memory_bytes"`
	// DriverVersion is the NVIDIA driver version (NVIDIA only).
	DriverVersion string `json:"driver_version,omitempty"`
	// CUDADriverVersion is the CUDA version the driver supports, "12.4"
	// (NVIDIA only).
	CUDADriverVersion string `json:"cuda_driver_version,omitempty"`
	// ComputeCapability is "9.0" (NVIDIA only).
	ComputeCapability string `json:"compute_capability,omitempty"`
	// GFXTarget is the LLVM target, "gfx90a" (AMD only, from KFD).
	GFXTarget string `json:"gfx_target,omitempty"`
	// UniqueID is KFD's unique_id in decimal, as sysfs gives it (AMD only).
	UniqueID string `json:"unique_id,omitempty"`
	// DRMCard is the DRM card, "card0" (AMD only).
	DRMCard string `json:"drm_card,omitempty"`
	// KFDNode is the KFD topology node id (AMD only; 0 when there is none:
	// node 0 is always a CPU).
	KFDNode int `json:"kfd_node,omitempty"`
	// Source is where the facts came from: "nvml" or "sysfs".
	Source string `json:"source"`
}

// PCIDevice is one NVIDIA or AMD GPU-class PCI function (class 0x03xxxx
// display/3D or 0x12xxxx processing accelerator) seen in sysfs.
type PCIDevice struct {
	PCIBusID string `json:"pci_bus_id"`
	// Vendor is nvidia or amd.
	Vendor string `json:"vendor"`
	// VendorID, DeviceID and Class are as sysfs gives them: "0x10de".
	VendorID string `json:"vendor_id"`
	DeviceID string `json:"device_id"`
	Class    string `json:"class"`
	// Driver is the bound kernel driver ("nvidia", "amdgpu"), empty if none.
	Driver string `json:"driver,omitempty"`
	// Usable is true when the device is in Report.GPUs.
	Usable bool `json:"usable"`
}

// NVMLStatus is the outcome of consulting NVML.
type NVMLStatus struct {
	// State is ok, off, unavailable, timeout or error.
	State string `json:"state"`
	// Error says why State is not ok.
	Error string `json:"error,omitempty"`
	// DriverVersion and CUDADriverVersion are the system's, when State is ok.
	DriverVersion     string `json:"driver_version,omitempty"`
	CUDADriverVersion string `json:"cuda_driver_version,omitempty"`
}

// NIC is one network interface, from netlink.
type NIC struct {
	Name  string `json:"name"`
	Index int    `json:"index"`
	// State is "up" when the interface is administratively up and running
	// (IFF_UP and IFF_RUNNING, as `ip link` shows), else "down".
	State string `json:"state"`
	// OperState is the kernel's operational state: up, down, unknown,
	// lowerlayerdown, dormant, notpresent, testing.
	OperState string `json:"oper_state"`
	// Kind is the link type netlink reports: device, veth, bridge, …
	Kind string `json:"kind"`
	MTU  int    `json:"mtu"`
	// MAC is the hardware address, empty for links without one.
	MAC string `json:"mac,omitempty"`
	// Addresses are the IPv4 and IPv6 addresses in CIDR form.
	Addresses []string `json:"addresses"`
	// SpeedMbps is /sys/class/net/NAME/speed, 0 when unreadable (down links,
	// loopback, virtual links without a speed).
	SpeedMbps int `json:"speed_mbps,omitempty"`
}

// Route is the answer to "which interface would traffic to Host take".
type Route struct {
	// To is the host asked for; IP the address it resolved to and was routed.
	To string `json:"to"`
	IP string `json:"ip,omitempty"`
	// Interface and Source are the outgoing interface and the source address
	// the kernel picks; Gateway is the next hop, empty when on-link.
	Interface string `json:"interface,omitempty"`
	Source    string `json:"source,omitempty"`
	Gateway   string `json:"gateway,omitempty"`
	// Error says why there is no route (unresolvable, unreachable).
	Error string `json:"error,omitempty"`
}

// RDMADevice is one device under /sys/class/infiniband.
type RDMADevice struct {
	Name string `json:"name"`
	// NodeGUID is node_guid, "0c42:a103:0065:1234".
	NodeGUID string `json:"node_guid,omitempty"`
	// NodeType is node_type, "1: CA".
	NodeType string `json:"node_type,omitempty"`
	// FirmwareVersion is fw_ver.
	FirmwareVersion string `json:"fw_version,omitempty"`
	// PCIBusID is the PCI function behind the device, when discoverable.
	PCIBusID string     `json:"pci_bus_id,omitempty"`
	Ports    []RDMAPort `json:"ports"`
	// Verbs is libibverbs' view of the device, when it was consulted.
	Verbs *RDMAVerbs `json:"verbs,omitempty"`
}

// RDMAPort is one port of an RDMA device.
type RDMAPort struct {
	Port int `json:"port"`
	// State is the logical state without its number: ACTIVE, DOWN, INIT, ARMED.
	State string `json:"state"`
	// PhysState is the physical state without its number: LinkUp, Disabled, Polling, …
	PhysState string `json:"phys_state"`
	// LinkLayer is InfiniBand or Ethernet (RoCE).
	LinkLayer string `json:"link_layer"`
	// Rate is the rate as sysfs gives it, "200 Gb/sec (4X HDR)"; RateGbps its
	// number.
	Rate     string  `json:"rate,omitempty"`
	RateGbps float64 `json:"rate_gbps,omitempty"`
	// LID is the port's LID (InfiniBand), "0x12".
	LID string `json:"lid,omitempty"`
	// GIDs are the non-zero GID table entries.
	GIDs []GID `json:"gids"`
	// Netdevs are the network interfaces of the port: for RoCE from the GID
	// attributes (gid_attrs/ndevs) or else the PCI device's net/ entries; for
	// InfiniBand the IPoIB interfaces.
	Netdevs []string `json:"netdevs"`
	// VerbsState is the port's state as libibverbs queries it, ActiveMTU
	// and MaxMTU its MTUs in bytes (when libibverbs was consulted).
	VerbsState string `json:"verbs_state,omitempty"`
	ActiveMTU  int    `json:"active_mtu,omitempty"`
	MaxMTU     int    `json:"max_mtu,omitempty"`
}

// Active reports whether the port's logical state is ACTIVE.
func (p RDMAPort) Active() bool { return p.State == "ACTIVE" }

// GID is one non-zero GID table entry.
type GID struct {
	Index int    `json:"index"`
	GID   string `json:"gid"`
	// Type is gid_attrs/types/N: "IB/RoCE v1" or "RoCE v2"; empty if absent.
	Type string `json:"type,omitempty"`
	// Netdev is gid_attrs/ndevs/N (RoCE); empty if absent.
	Netdev string `json:"netdev,omitempty"`
}

// RequirementResult is the verdict on one requirement.
type RequirementResult struct {
	// Require is the requirement as written: "nvidia", "gpus>=4", "nic=ib0".
	Require string `json:"require"`
	OK      bool   `json:"ok"`
	// Reason says what was found, whether OK or not.
	Reason string `json:"reason"`
}

// Failed returns the requirements that did not hold.
func (r *Report) Failed() []RequirementResult {
	var out []RequirementResult
	for _, q := range r.Requirements {
		if !q.OK {
			out = append(out, q)
		}
	}
	return out
}

// GPUsOf returns the usable GPUs of one vendor, in index order.
func (r *Report) GPUsOf(vendor string) []GPU {
	var out []GPU
	for _, g := range r.GPUs {
		if g.Vendor == vendor {
			out = append(out, g)
		}
	}
	return out
}
