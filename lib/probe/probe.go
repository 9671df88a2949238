package probe

import (
	"context"
	"errors"
	"fmt"
	"io/fs"
	"math"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"time"

	"github.com/gpubridge/gpubridge/lib/ibverbs"
	"github.com/gpubridge/gpubridge/lib/netif"
)

// NVML modes of Options.NVML.
const (
	// NVMLModeAuto consults NVML when sysfs is the real one (SysfsRoot "" or
	// "/") and not under a fake root, whose GPUs NVML could not know about.
	NVMLModeAuto = "auto"
	NVMLModeOn   = "on"  // always consult NVML
	NVMLModeOff  = "off" // never consult NVML
)

// DefaultNVMLTimeout bounds NVML init and query.
const DefaultNVMLTimeout = 5 * time.Second

// Options say what to probe and how.
type Options struct {
	// SysfsRoot is the directory under which sys/ is read: "" or "/" for the
	// node's own sysfs, a fake tree in tests. It must exist and hold sys/.
	// It covers GPUs (PCI, DRM, KFD) and RDMA devices; NICs always come from
	// netlink in the probe's own network namespace (see NoNICs).
	SysfsRoot string
	// NVML is auto (""), on or off; see NVMLModeAuto.
	NVML string
	// NVMLLib is the NVML to consult; nil means RealNVML(NVMLLibrary).
	NVMLLib NVML
	// NVMLLibrary is the library path for RealNVML; "" is libnvidia-ml.so.1.
	NVMLLibrary string
	// NVMLTimeout bounds NVML; 0 means DefaultNVMLTimeout.
	NVMLTimeout time.Duration
	// Verbs is auto (""), on or off: whether libibverbs is consulted
	// about the RDMA devices (auto: only on the real sysfs, as NVML).
	Verbs string
	// VerbsLib is the libibverbs to consult; nil means RealVerbs(VerbsLibrary).
	VerbsLib Verbs
	// VerbsLibrary is the library path for RealVerbs; "" is
	// GPUBRIDGE_IBVERBS_LIB or libibverbs.so.1.
	VerbsLibrary string
	// VerbsTimeout bounds the query; 0 means DefaultVerbsTimeout.
	VerbsTimeout time.Duration
	// NoNICs skips netlink: no NICs, no route.
	NoNICs bool
	// RouteTo, when set, asks which interface and source address the kernel
	// would use to reach this host (name or address).
	RouteTo string
	// SimulateVendor ("nvidia" or "amd", from GPUBRIDGE_VENDOR) makes the
	// report claim that vendor, with Simulated set; "" for none.
	SimulateVendor string
	// AllowSimulated lets a simulated vendor satisfy the nvidia and amd
	// requirements. Without it they count real GPUs only, so a Slurm prolog
	// that inherits GPUBRIDGE_VENDOR cannot pass a node without GPUs.
	AllowSimulated bool
	// Requirements are checked into Report.Requirements.
	Requirements []Requirement
}

// ErrSetup is wrapped by Run's errors: the probe could not run at all (bad
// options, unreadable sysfs root). Everything else the probe meets is a
// finding, reported in Report.Problems.
var ErrSetup = errors.New("probe cannot run")

// Run probes the node. The error is non-nil only when the probe could not
// run (it wraps ErrSetup); a node with missing drivers or devices gives a
// Report with Problems, not an error.
func Run(ctx context.Context, opts Options) (*Report, error) {
	start := time.Now()
	root, nvmlOn, err := opts.check()
	if err != nil {
		return nil, err
	}
	verbsOn, err := opts.verbsOn(root)
	if err != nil {
		return nil, err
	}
	rep := &Report{
		Schema:         Schema,
		SysfsRoot:      root,
		GPUs:           []GPU{},
		PCIGPUs:        []PCIDevice{},
		NICs:           []NIC{},
		RDMA:           []RDMADevice{},
		Problems:       []string{},
		Requirements:   []RequirementResult{},
		allowSimulated: opts.AllowSimulated,
	}
	if h, err := os.Hostname(); err == nil {
		rep.Hostname = h
	} else {
		rep.Problems = append(rep.Problems, fmt.Sprintf("hostname: %v", err))
	}

	// NVML and netlink run beside the sysfs reads: NVML init can take
	// seconds on a node without persistence mode.
	var wg sync.WaitGroup
	var nvInfo *NVMLInfo
	nvStatus := NVMLStatus{State: NVMLOff, Error: "not consulted (--nvml=off)"}
	switch {
	case nvmlOn:
		wg.Go(func() { nvInfo, nvStatus = opts.queryNVML(ctx) })
	case opts.NVML == "" || opts.NVML == NVMLModeAuto:
		nvStatus.Error = "not consulted under a fake sysfs root (--nvml=auto; use --nvml=on to consult it)"
	}
	var nw network
	if !opts.NoNICs {
		wg.Go(func() { nw = probeNetwork(ctx, opts.RouteTo) })
	}
	var vDevs []VerbsDevice
	vStatus := VerbsStatus{State: VerbsOff, Error: "not consulted (--verbs=off)"}
	switch {
	case verbsOn:
		wg.Go(func() { vDevs, vStatus = opts.queryVerbs(ctx) })
	case opts.Verbs == "" || opts.Verbs == VerbsModeAuto:
		vStatus.Error = "not consulted under a fake sysfs root (--verbs=auto; use --verbs=on to consult it)"
	}
	found := scanSysfs(sysfs{root: root})
	wg.Wait()

	rep.addGPUs(found, nvInfo, nvStatus)
	rep.addVerbs(vDevs, vStatus)
	rep.addNetwork(opts, nw)
	rep.RealVendor = vendorOf(rep.GPUs)
	rep.Vendor = rep.RealVendor
	if opts.SimulateVendor != "" {
		rep.Vendor, rep.Simulated = opts.SimulateVendor, true
	}
	rep.Requirements = rep.Check(opts.Requirements)
	rep.ProbeMS = math.Round(float64(time.Since(start).Microseconds())/10) / 100
	return rep, nil
}

// check refuses options the probe cannot run with, and returns the sysfs
// root and whether NVML is consulted.
func (o *Options) check() (root string, nvmlOn bool, err error) {
	root = o.SysfsRoot
	if root == "" {
		root = "/"
	}
	root = filepath.Clean(root)
	if err := checkRoot(root); err != nil {
		return "", false, err
	}
	if sim := o.SimulateVendor; sim != "" && sim != VendorNVIDIA && sim != VendorAMD {
		return "", false, fmt.Errorf("%w: simulated vendor %q: want nvidia or amd", ErrSetup, sim)
	}
	switch o.NVML {
	case "", NVMLModeAuto:
		// A fake root's GPUs are unknown to NVML.
		return root, root == "/", nil
	case NVMLModeOn:
		return root, true, nil
	case NVMLModeOff:
		return root, false, nil
	}
	return "", false, fmt.Errorf("%w: NVML mode %q: want auto, on or off", ErrSetup, o.NVML)
}

// Verbs modes of Options.Verbs: as the NVML modes.
const (
	VerbsModeAuto = "auto"
	VerbsModeOn   = "on"
	VerbsModeOff  = "off"
)

// verbsOn says whether libibverbs is consulted under root.
func (o *Options) verbsOn(root string) (bool, error) {
	switch o.Verbs {
	case "", VerbsModeAuto:
		return root == "/", nil
	case VerbsModeOn:
		return true, nil
	case VerbsModeOff:
		return false, nil
	}
	return false, fmt.Errorf("%w: verbs mode %q: want auto, on or off", ErrSetup, o.Verbs)
}

// queryVerbs asks the libibverbs of the options, within their timeout.
func (o *Options) queryVerbs(ctx context.Context) ([]VerbsDevice, VerbsStatus) {
	lib := o.VerbsLib
	if lib == nil {
		lib = RealVerbs(o.VerbsLibrary)
	}
	timeout := o.VerbsTimeout
	if timeout <= 0 {
		timeout = DefaultVerbsTimeout
	}
	return queryVerbs(ctx, lib, timeout, ibverbs.LibraryPath(o.VerbsLibrary))
}

// queryNVML asks the NVML of the options, within their timeout.
func (o *Options) queryNVML(ctx context.Context) (*NVMLInfo, NVMLStatus) {
	lib := o.NVMLLib
	if lib == nil {
		lib = RealNVML(o.NVMLLibrary)
	}
	timeout := o.NVMLTimeout
	if timeout <= 0 {
		timeout = DefaultNVMLTimeout
	}
	return queryNVML(ctx, lib, timeout)
}

// sysfsFindings is what the sysfs tree holds: GPUs by PCI, DRM and KFD,
// and RDMA devices.
type sysfsFindings struct {
	pci        []PCIDevice
	cards      []amdCard
	nodes      []kfdNode
	kfdPresent bool
	rdma       []RDMADevice
	problems   []string
}

func scanSysfs(s sysfs) sysfsFindings {
	var f sysfsFindings
	var err error
	if f.pci, err = s.pciGPUs(); err != nil {
		f.problems = append(f.problems, fmt.Sprintf("PCI scan: %v", err))
	}
	if f.cards, err = s.amdCards(); err != nil {
		f.problems = append(f.problems, fmt.Sprintf("DRM scan: %v", err))
	}
	var kfdProblems []string
	if f.nodes, kfdProblems, err = s.kfdGPUs(); err != nil {
		f.problems = append(f.problems, fmt.Sprintf("KFD scan: %v", err))
	}
	f.problems = append(f.problems, kfdProblems...)
	_, err = os.Stat(s.path("sys/class/kfd/kfd/topology/nodes"))
	f.kfdPresent = err == nil
	if f.rdma, err = s.rdmaDevices(); err != nil {
		f.problems = append(f.problems, fmt.Sprintf("RDMA scan: %v", err))
	}
	return f
}

// addGPUs puts the GPUs, their PCI devices, NVML's state and the RDMA
// devices into the report, with their problems.
func (rep *Report) addGPUs(found sysfsFindings, nvInfo *NVMLInfo, nvStatus NVMLStatus) {
	f := joinGPUs(found.pci, amdGPUs(found.cards, found.nodes), found.kfdPresent, nvInfo, nvStatus)
	rep.GPUs, rep.PCIGPUs, rep.NVML = f.gpus, f.pci, nvStatus
	if found.rdma != nil {
		rep.RDMA = found.rdma
	}
	switch nvStatus.State {
	case NVMLTimeout:
		rep.Problems = append(rep.Problems, "NVML "+nvStatus.Error+": broken driver?")
	case NVMLError:
		rep.Problems = append(rep.Problems, "NVML failed: "+nvStatus.Error)
	}
	rep.Problems = append(rep.Problems, f.problems...)
	rep.Problems = append(rep.Problems, found.problems...)
}

// addNetwork puts the NICs and the route into the report, with their
// problems.
func (rep *Report) addNetwork(opts Options, nw network) {
	switch {
	case opts.NoNICs:
		if opts.RouteTo != "" {
			rep.Route = &Route{To: opts.RouteTo, Error: "not probed (--no-nics)"}
		}
	case nw.err != nil:
		rep.Problems = append(rep.Problems, fmt.Sprintf("NICs: %v", nw.err))
	default:
		rep.NICsProbed = true
		rep.NICs = nw.nics
	}
	if !opts.NoNICs && opts.RouteTo != "" {
		rep.Route = nw.route
		if rep.Route == nil {
			rep.Route = &Route{To: opts.RouteTo, Error: "not probed: netlink failed"}
		}
	}
	if rep.Route != nil && rep.Route.Error != "" {
		rep.Problems = append(rep.Problems, "route: "+rep.Route.Error)
	}
}

// checkRoot makes sure the sysfs root can be read at all: a typo in
// --sysfs-root must not look like a node without devices.
func checkRoot(root string) error {
	st, err := os.Stat(filepath.Join(root, "sys"))
	switch {
	case errors.Is(err, fs.ErrNotExist):
		if _, rerr := os.Stat(root); rerr != nil {
			return fmt.Errorf("%w: sysfs root: %w", ErrSetup, rerr)
		}
		return fmt.Errorf("%w: sysfs root %s has no sys/ directory", ErrSetup, root)
	case err != nil:
		return fmt.Errorf("%w: sysfs root: %w", ErrSetup, err)
	case !st.IsDir():
		return fmt.Errorf("%w: sysfs root: %s is not a directory", ErrSetup, filepath.Join(root, "sys"))
	}
	if _, err := os.ReadDir(filepath.Join(root, "sys")); err != nil {
		return fmt.Errorf("%w: sysfs root: %w", ErrSetup, err)
	}
	return nil
}

// network is what netlink says: the NICs and, when asked, the route.
type network struct {
	nics  []NIC
	route *Route
	err   error
}

// probeNetwork lists NICs and, when asked, the route to a host, all in the
// calling goroutine's network namespace. NIC speeds come from the host's
// /sys/class/net, never from a fake sysfs root.
func probeNetwork(ctx context.Context, routeTarget string) network {
	h, err := netif.Open()
	if err != nil {
		return network{err: err}
	}
	defer h.Close()
	nics, err := probeNICs(h, "/")
	if err != nil {
		return network{err: err}
	}
	nw := network{nics: nics}
	if strings.TrimSpace(routeTarget) != "" {
		nw.route = routeTo(ctx, h, strings.TrimSpace(routeTarget))
	}
	return nw
}
