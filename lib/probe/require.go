package probe

import (
	"fmt"
	"strconv"
	"strings"
)

// Requirement kinds: the vocabulary of --require.
const (
	ReqGPU        = "gpu"         // at least one usable GPU (real, not simulated)
	ReqGPUs       = "gpus"        // gpus=N or gpus>=N: at least N usable GPUs
	ReqNVIDIA     = "nvidia"      // the node is an NVIDIA node (a usable NVIDIA GPU; simulated nvidia only with AllowSimulated)
	ReqAMD        = "amd"         // the node is an AMD node (a usable AMD GPU; simulated amd only with AllowSimulated)
	ReqNVML       = "nvml"        // NVML initialised and answered
	ReqRDMA       = "rdma"        // an ACTIVE RDMA port, any link layer
	ReqIB         = "ib"          // an ACTIVE InfiniBand port
	ReqRoCE       = "roce"        // an ACTIVE Ethernet (RoCE) port
	ReqNIC        = "nic"         // nic=NAME: the interface exists and is up
	ReqRoute      = "route"       // the --route-to host has a route
	ReqNoProblems = "no-problems" // the report lists no problems
)

// Vocabulary lists the requirement words, as help text shows them.
var Vocabulary = []string{ReqGPU, ReqGPUs + "=N", ReqGPUs + ">=N", ReqNVIDIA, ReqAMD, ReqNVML,
	ReqRDMA, ReqIB, ReqRoCE, ReqNIC + "=NAME", ReqRoute, ReqNoProblems}

// Requirement is one parsed --require word.
type Requirement struct {
	// Text is the word as written: "gpus>=4".
	Text string
	// Kind is one of the Req* constants.
	Kind string
	// Name is the interface of nic=NAME.
	Name string
	// N is the count of gpus=N.
	N int
}

// ParseRequirements parses --require values. Each value may hold several
// words separated by commas; blank words are skipped. An unknown word is an
// error (the caller's exit 2), so a typo never passes a prolog silently.
func ParseRequirements(values []string) ([]Requirement, error) {
	var out []Requirement
	for _, v := range values {
		for _, w := range strings.Split(v, ",") {
			w = strings.TrimSpace(w)
			if w == "" {
				continue
			}
			r, err := parseRequirement(w)
			if err != nil {
				return nil, err
			}
			out = append(out, r)
		}
	}
	return out, nil
}

func parseRequirement(w string) (Requirement, error) {
	r := Requirement{Text: w}
	lw := strings.ToLower(w)
	switch lw {
	case ReqGPU, ReqNVIDIA, ReqAMD, ReqNVML, ReqRDMA, ReqIB, ReqRoCE, ReqRoute, ReqNoProblems:
		r.Kind = lw
		return r, nil
	}
	if n, ok := strings.CutPrefix(lw, ReqGPUs+">="); ok {
		return parseCount(r, n)
	}
	if n, ok := strings.CutPrefix(lw, ReqGPUs+"="); ok {
		return parseCount(r, n)
	}
	if name, ok := strings.CutPrefix(w, ReqNIC+"="); ok || strings.HasPrefix(lw, ReqNIC+"=") {
		if !ok {
			name = w[len(ReqNIC)+1:]
		}
		if name == "" || strings.ContainsAny(name, "/ \t") {
			return r, fmt.Errorf("requirement %q: want nic=NAME with an interface name", w)
		}
		r.Kind, r.Name = ReqNIC, name
		return r, nil
	}
	return r, fmt.Errorf("unknown requirement %q (known: %s)", w, strings.Join(Vocabulary, ", "))
}

func parseCount(r Requirement, n string) (Requirement, error) {
	v, err := strconv.Atoi(strings.TrimSpace(n))
	if err != nil || v < 0 {
		return r, fmt.Errorf("requirement %q: want a GPU count >= 0", r.Text)
	}
	r.Kind, r.N = ReqGPUs, v
	return r, nil
}

// Check evaluates requirements against the report. Every result carries a
// reason, whether it holds or not.
func (r *Report) Check(reqs []Requirement) []RequirementResult {
	out := make([]RequirementResult, 0, len(reqs))
	for _, q := range reqs {
		ok, reason := r.check(q)
		out = append(out, RequirementResult{Require: q.Text, OK: ok, Reason: reason})
	}
	return out
}

func (r *Report) check(q Requirement) (bool, string) {
	switch q.Kind {
	case ReqGPU:
		if len(r.GPUs) > 0 {
			return true, "found " + r.gpuSummary()
		}
		return false, "no usable GPU found" + r.gpuContext("")
	case ReqGPUs:
		if n := len(r.GPUs); n >= q.N {
			return true, fmt.Sprintf("found %s, need %d", r.gpuSummary(), q.N)
		}
		return false, fmt.Sprintf("found %s, need %d", r.gpuSummary(), q.N) + r.gpuContext("")
	case ReqNVIDIA, ReqAMD:
		return r.checkVendor(q.Kind)
	case ReqNVML:
		if r.NVML.State == NVMLOK {
			return true, fmt.Sprintf("NVML ok: driver %s, CUDA %s, %s", r.NVML.DriverVersion, r.NVML.CUDADriverVersion, plural(len(r.GPUsOf(VendorNVIDIA)), "GPU"))
		}
		return false, fmt.Sprintf("NVML %s: %s", r.NVML.State, r.NVML.Error)
	case ReqRDMA:
		return r.checkRDMA(func(RDMAPort) bool { return true }, "RDMA")
	case ReqIB:
		return r.checkRDMA(func(p RDMAPort) bool { return p.LinkLayer == "InfiniBand" }, "InfiniBand")
	case ReqRoCE:
		return r.checkRDMA(func(p RDMAPort) bool { return p.LinkLayer == "Ethernet" }, "RoCE (Ethernet link layer)")
	case ReqNIC:
		return r.checkNIC(q.Name)
	case ReqRoute:
		switch {
		case r.Route == nil:
			return false, "no --route-to host given"
		case r.Route.Error != "":
			return false, r.Route.Error
		}
		return true, r.Route.String()
	case ReqNoProblems:
		if len(r.Problems) == 0 {
			return true, "no problems"
		}
		return false, fmt.Sprintf("%s: %s", plural(len(r.Problems), "problem"), strings.Join(r.Problems, "; "))
	}
	return false, fmt.Sprintf("unknown requirement kind %q", q.Kind)
}

func (r *Report) checkVendor(vendor string) (bool, string) {
	label := map[string]string{VendorNVIDIA: "NVIDIA", VendorAMD: "AMD"}[vendor]
	if r.Simulated && r.allowSimulated {
		if r.Vendor == vendor {
			return true, fmt.Sprintf("vendor %s simulated (GPUBRIDGE_VENDOR), accepted by --allow-simulated; real GPUs: %s", vendor, r.gpuSummary())
		}
		return false, fmt.Sprintf("vendor simulated as %s (GPUBRIDGE_VENDOR); real GPUs: %s", r.Vendor, r.gpuSummary())
	}
	// Without --allow-simulated only real GPUs count: a prolog that inherits
	// GPUBRIDGE_VENDOR must not wave a node without GPUs through.
	note := ""
	if r.Simulated {
		note = fmt.Sprintf("; the simulated vendor %s (GPUBRIDGE_VENDOR) does not count without --allow-simulated", r.Vendor)
	}
	gpus := r.GPUsOf(vendor)
	if len(gpus) == 0 {
		return false, fmt.Sprintf("no %s GPU found", label) + r.gpuContext(vendor) + note
	}
	return true, fmt.Sprintf("found %s: %s", plural(len(gpus), label+" GPU"), gpus[0].Name) + note
}

// gpuSummary is "0 GPUs" or "4 GPUs (4 amd)".
func (r *Report) gpuSummary() string {
	nv, amd := len(r.GPUsOf(VendorNVIDIA)), len(r.GPUsOf(VendorAMD))
	switch {
	case nv > 0 && amd > 0:
		return fmt.Sprintf("%s (%d nvidia, %d amd)", plural(nv+amd, "GPU"), nv, amd)
	case nv > 0:
		return plural(nv, "GPU") + " (nvidia)"
	case amd > 0:
		return plural(amd, "GPU") + " (amd)"
	}
	return "0 GPUs"
}

// plural is "1 GPU", "4 GPUs".
func plural(n int, noun string) string {
	if n == 1 {
		return "1 " + noun
	}
	return fmt.Sprintf("%d %ss", n, noun)
}

// gpuContext explains a missing GPU: what NVML said and which PCI GPUs are
// there without a usable driver. vendor narrows it ("" for both).
func (r *Report) gpuContext(vendor string) string {
	var parts []string
	nvidiaHW := false
	for _, d := range r.PCIGPUs {
		nvidiaHW = nvidiaHW || d.Vendor == VendorNVIDIA
	}
	// NVML's state explains a missing NVIDIA GPU; on an AMD node it is noise.
	nvmlMatters := vendor == VendorNVIDIA || (vendor == "" && (nvidiaHW || len(r.GPUs) == 0))
	if nvmlMatters && r.NVML.State != NVMLOK {
		parts = append(parts, fmt.Sprintf("NVML %s: %s", r.NVML.State, r.NVML.Error))
	}
	var unusable []string
	for _, d := range r.PCIGPUs {
		if !d.Usable && (vendor == "" || d.Vendor == vendor) {
			unusable = append(unusable, d.Vendor+" "+d.PCIBusID)
		}
	}
	if len(unusable) > 0 {
		parts = append(parts, "unusable PCI GPUs: "+strings.Join(unusable, ", "))
	}
	if vendor == VendorAMD && len(unusable) == 0 {
		parts = append(parts, "no amdgpu DRM card or KFD node")
	}
	if len(parts) == 0 {
		return ""
	}
	return " (" + strings.Join(parts, "; ") + ")"
}

func (r *Report) checkRDMA(match func(RDMAPort) bool, what string) (bool, string) {
	if len(r.RDMA) == 0 {
		return false, fmt.Sprintf("no active %s port: no RDMA device under %s", what, filepathJoin(r.SysfsRoot, "sys/class/infiniband"))
	}
	var seen []string
	for _, d := range r.RDMA {
		for _, p := range d.Ports {
			desc := fmt.Sprintf("%s port %d %s %s", d.Name, p.Port, p.LinkLayer, p.State)
			if match(p) && r.VerbsUsable(d, p) {
				return true, fmt.Sprintf("%s, %s%s", desc, p.Rate, r.verbsWords(p))
			}
			if match(p) && p.Active() {
				desc += r.verbsWords(p)
			}
			seen = append(seen, desc)
		}
	}
	usable := ""
	if r.Verbs.State != VerbsOff && r.Verbs.State != "" {
		usable = " that libibverbs can use"
	}
	return false, fmt.Sprintf("no active %s port%s (have: %s)", what, usable, strings.Join(seen, ", "))
}

// verbsWords is what libibverbs says of a port, for reasons.
func (r *Report) verbsWords(p RDMAPort) string {
	switch r.Verbs.State {
	case VerbsOff, "":
		return " (libibverbs not consulted)"
	case VerbsOK:
		if p.VerbsState == "" {
			return ", but libibverbs cannot open its device"
		}
		return fmt.Sprintf(", libibverbs: %s, MTU %d", p.VerbsState, p.ActiveMTU)
	}
	return fmt.Sprintf(", but libibverbs is %s (%s)", r.Verbs.State, r.Verbs.Error)
}

func (r *Report) checkNIC(name string) (bool, string) {
	if !r.NICsProbed {
		return false, "NICs not probed (--no-nics, or netlink failed)"
	}
	var names []string
	for _, n := range r.NICs {
		if n.Name == name {
			if n.State == "up" {
				return true, fmt.Sprintf("%s is up, mtu %d", name, n.MTU)
			}
			return false, fmt.Sprintf("%s is down (oper state %s)", name, n.OperState)
		}
		names = append(names, n.Name)
	}
	return false, fmt.Sprintf("no interface %s (have: %s)", name, strings.Join(names, ", "))
}

// String is "10.0.0.2 via eth0 src 10.0.0.1" (or the error).
func (rt *Route) String() string {
	if rt.Error != "" {
		return rt.To + ": " + rt.Error
	}
	s := rt.IP + " via " + rt.Interface
	if rt.Source != "" {
		s += " src " + rt.Source
	}
	if rt.Gateway != "" {
		s += " gw " + rt.Gateway
	}
	if rt.To != rt.IP {
		s = rt.To + " (" + s + ")"
	}
	return s
}

func filepathJoin(root, rel string) string {
	if root == "" || root == "/" {
		return "/" + rel
	}
	return strings.TrimRight(root, "/") + "/" + rel
}
