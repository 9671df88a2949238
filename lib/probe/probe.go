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
	root := opts.SysfsRoot
	if root == "" {
		root = "/"
	}
	root = filepath.Clean(root)
	fakeRoot := root != "/"
	if err := checkRoot(root); err != nil {
		return nil, err
	}
	sim := opts.SimulateVendor
	if sim != "" && sim != VendorNVIDIA && sim != VendorAMD {
		return nil, fmt.Errorf("%w: simulated vendor %q: want nvidia or amd", ErrSetup, sim)
	}
	mode := opts.NVML
	switch mode {
	case "", NVMLModeAuto:
		mode = NVMLModeOn
		if fakeRoot {
			mode = NVMLModeOff
		}
	case NVMLModeOn, NVMLModeOff:
	default:
		return nil, fmt.Errorf("%w: NVML mode %q: want auto, on or off", ErrSetup, opts.NVML)
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
	var nvStatus NVMLStatus
	if mode == NVMLModeOn {
		lib := opts.NVMLLib
		if lib == nil {
			lib = RealNVML(opts.NVMLLibrary)
		}
		timeout := opts.NVMLTimeout
		if timeout <= 0 {
			timeout = DefaultNVMLTimeout
		}
		wg.Go(func() { nvInfo, nvStatus = queryNVML(ctx, lib, timeout) })
	} else {
		why := "not consulted (--nvml=off)"
		if opts.NVML == "" || opts.NVML == NVMLModeAuto {
			why = "not consulted under a fake sysfs root (--nvml=auto; use --nvml=on to consult it)"
		}
		nvStatus = NVMLStatus{State: NVMLOff, Error: why}
	}
	var nics []NIC
	var route *Route
	var nicErr error
	if !opts.NoNICs {
		wg.Go(func() { nics, route, nicErr = probeNetwork(ctx, opts.RouteTo) })
	}

	s := sysfs{root: root}
	var problems []string
	pci, err := s.pciGPUs()
	if err != nil {
		problems = append(problems, fmt.Sprintf("PCI scan: %v", err))
	}
	cards, err := s.amdCards()
	if err != nil {
		problems = append(problems, fmt.Sprintf("DRM scan: %v", err))
	}
	nodes, kfdProblems, err := s.kfdGPUs()
	if err != nil {
		problems = append(problems, fmt.Sprintf("KFD scan: %v", err))
	}
	problems = append(problems, kfdProblems...)
	_, kfdErr := os.Stat(s.path("sys/class/kfd/kfd/topology/nodes"))
	rdma, err := s.rdmaDevices()
	if err != nil {
		problems = append(problems, fmt.Sprintf("RDMA scan: %v", err))
	} else {
		rep.RDMA = rdma
	}

	wg.Wait()

	f := joinGPUs(pci, amdGPUs(cards, nodes), kfdErr == nil, nvInfo, nvStatus)
	rep.GPUs, rep.PCIGPUs, rep.NVML = f.gpus, f.pci, nvStatus
	switch nvStatus.State {
	case NVMLTimeout:
		rep.Problems = append(rep.Problems, "NVML "+nvStatus.Error+": broken driver?")
	case NVMLError:
		rep.Problems = append(rep.Problems, "NVML failed: "+nvStatus.Error)
	}
	rep.Problems = append(rep.Problems, f.problems...)
	rep.Problems = append(rep.Problems, problems...)

	if !opts.NoNICs {
		if nicErr != nil {
			rep.Problems = append(rep.Problems, fmt.Sprintf("NICs: %v", nicErr))
		} else {
			rep.NICsProbed = true
			rep.NICs = nics
		}
		if opts.RouteTo != "" {
			if route == nil {
				route = &Route{To: opts.RouteTo, Error: "not probed: netlink failed"}
			}
			rep.Route = route
		}
	} else if opts.RouteTo != "" {
		rep.Route = &Route{To: opts.RouteTo, Error: "not probed (--no-nics)"}
	}
	if rep.Route != nil && rep.Route.Error != "" {
		rep.Problems = append(rep.Problems, "route: "+rep.Route.Error)
	}

	rep.RealVendor = vendorOf(rep.GPUs)
	rep.Vendor = rep.RealVendor
	if sim != "" {
		rep.Vendor, rep.Simulated = sim, true
	}
	rep.Requirements = rep.Check(opts.Requirements)
	rep.ProbeMS = math.Round(float64(time.Since(start).Microseconds())/10) / 100
	return rep, nil
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

// probeNetwork lists NICs and, when asked, the route to a host, all in the
// calling goroutine's network namespace. NIC speeds come from the host's
// /sys/class/net, never from a fake sysfs root.
func probeNetwork(ctx context.Context, routeTarget string) ([]NIC, *Route, error) {
	h, err := netif.Open()
	if err != nil {
		return nil, nil, err
	}
	defer h.Close()
	nics, err := probeNICs(h, "/")
	if err != nil {
		return nil, nil, err
	}
	var r *Route
	if strings.TrimSpace(routeTarget) != "" {
		r = routeTo(ctx, h, strings.TrimSpace(routeTarget))
	}
	return nics, r, nil
}
