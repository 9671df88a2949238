package probe

import (
	"context"
	"errors"
	"fmt"
	"strings"
	"time"

	"github.com/gpubridge/gpubridge/lib/ibverbs"
)

// libibverbs' view of the RDMA devices: whether it opens each one, and its
// ports' states and MTUs as the verbs bridge would see them. sysfs says a
// device exists; this says the bridge can use it (a missing provider
// library or uverbs module shows here, not there).

// Verbs states of VerbsStatus.State.
const (
	VerbsOK          = "ok"          // loaded; devices in Report.RDMA carry its view
	VerbsOff         = "off"         // not consulted (--verbs=off, or auto under a fake sysfs root)
	VerbsUnavailable = "unavailable" // libibverbs cannot be loaded, or the kernel has no RDMA
	VerbsTimeout     = "timeout"     // the query did not return in time
	VerbsError       = "error"       // any other failure
)

// DefaultVerbsTimeout bounds the libibverbs query.
const DefaultVerbsTimeout = 5 * time.Second

// VerbsStatus says whether libibverbs was consulted and what it answered.
type VerbsStatus struct {
	State string `json:"state"`
	// Library is the library loaded (or tried).
	Library string `json:"library,omitempty"`
	Error   string `json:"error,omitempty"`
}

// RDMAVerbs is libibverbs' view of one device.
type RDMAVerbs struct {
	// Opened says whether ibv_open_device succeeded (and its port queries).
	Opened bool   `json:"opened"`
	Error  string `json:"error,omitempty"`
	// MaxQP and MaxQPWR are the device's queue pair limits.
	MaxQP   int `json:"max_qp,omitempty"`
	MaxQPWR int `json:"max_qp_wr,omitempty"`
}

// Verbs is the part of libibverbs the probe uses; RealVerbs loads it at
// run time, tests inject fakes through Options.VerbsLib.
type Verbs interface {
	// Query lists the devices and their ports. An error wrapping
	// ibverbs.ErrUnavailable or ibverbs.ErrNoKernelSupport means no usable
	// libibverbs here (a fact on a node without RDMA); others are faults.
	Query() ([]VerbsDevice, error)
}

// VerbsDevice is one device as libibverbs sees it.
type VerbsDevice struct {
	Name           string
	Error          string // opening or querying it failed
	MaxQP, MaxQPWR int
	Ports          []VerbsPort
}

// VerbsPort is one port as libibverbs sees it.
type VerbsPort struct {
	Port              int
	State             string // ACTIVE, DOWN, …
	LinkLayer         string // InfiniBand or Ethernet
	ActiveMTU, MaxMTU int    // bytes
	Gbps              float64
}

// VerbsFunc adapts a function to the Verbs interface.
type VerbsFunc func() ([]VerbsDevice, error)

// Query calls f.
func (f VerbsFunc) Query() ([]VerbsDevice, error) { return f() }

// RealVerbs is this node's libibverbs (path "": GPUBRIDGE_IBVERBS_LIB or
// libibverbs.so.1).
func RealVerbs(path string) Verbs {
	return VerbsFunc(func() ([]VerbsDevice, error) {
		if err := ibverbs.Load(path); err != nil {
			return nil, err
		}
		devs, err := ibverbs.Scan()
		if err != nil {
			return nil, err
		}
		out := make([]VerbsDevice, 0, len(devs))
		for _, d := range devs {
			v := VerbsDevice{Name: d.Name, MaxQP: d.Attr.MaxQP, MaxQPWR: d.Attr.MaxQPWR}
			if d.Err != nil {
				v.Error = d.Err.Error()
			}
			for _, p := range d.Ports {
				v.Ports = append(v.Ports, VerbsPort{Port: p.Num, State: p.Attr.State.String(), LinkLayer: p.Attr.LinkLayer.String(),
					ActiveMTU: p.Attr.ActiveMTU.Bytes(), MaxMTU: p.Attr.MaxMTU.Bytes(), Gbps: p.Attr.Gbps()})
			}
			out = append(out, v)
		}
		return out, nil
	})
}

// queryVerbs runs lib.Query bounded by timeout and ctx (a broken driver
// can hang ibv_open_device; the goroutine is then abandoned).
func queryVerbs(ctx context.Context, lib Verbs, timeout time.Duration, library string) ([]VerbsDevice, VerbsStatus) {
	type result struct {
		devs []VerbsDevice
		err  error
	}
	done := make(chan result, 1)
	go func() {
		devs, err := lib.Query()
		done <- result{devs, err}
	}()
	t := time.NewTimer(timeout)
	defer t.Stop()
	st := VerbsStatus{Library: library}
	select {
	case r := <-done:
		switch {
		case r.err == nil:
			st.State = VerbsOK
			return r.devs, st
		case errors.Is(r.err, ibverbs.ErrUnavailable) || errors.Is(r.err, ibverbs.ErrNoKernelSupport):
			st.State, st.Error = VerbsUnavailable, strings.TrimPrefix(r.err.Error(), ibverbs.ErrUnavailable.Error()+": ")
		default:
			st.State, st.Error = VerbsError, r.err.Error()
		}
	case <-t.C:
		st.State, st.Error = VerbsTimeout, fmt.Sprintf("query timed out after %s", timeout)
	case <-ctx.Done():
		st.State, st.Error = VerbsTimeout, fmt.Sprintf("query abandoned: %v", ctx.Err())
	}
	return nil, st
}

// addVerbs joins libibverbs' view to the sysfs devices, with problems
// where the two disagree or the bridge could not use a device.
func (rep *Report) addVerbs(devs []VerbsDevice, st VerbsStatus) {
	rep.Verbs = st
	switch st.State {
	case VerbsOff:
		return
	case VerbsOK:
	default:
		if len(rep.RDMA) > 0 {
			rep.Problems = append(rep.Problems, fmt.Sprintf("RDMA devices are present but libibverbs is %s (%s): the verbs bridge cannot run here", st.State, st.Error))
		}
		return
	}
	byName := map[string]*RDMADevice{}
	for i := range rep.RDMA {
		byName[rep.RDMA[i].Name] = &rep.RDMA[i]
		rep.RDMA[i].Verbs = &RDMAVerbs{Error: "libibverbs does not list it"}
	}
	for _, v := range devs {
		d := byName[v.Name]
		if d == nil {
			rep.Problems = append(rep.Problems, fmt.Sprintf("libibverbs lists RDMA device %s, which %s does not", v.Name, filepathJoin(rep.SysfsRoot, "sys/class/infiniband")))
			continue
		}
		d.Verbs = &RDMAVerbs{Opened: v.Error == "", Error: v.Error, MaxQP: v.MaxQP, MaxQPWR: v.MaxQPWR}
		for _, vp := range v.Ports {
			for k := range d.Ports {
				if p := &d.Ports[k]; p.Port == vp.Port {
					p.VerbsState, p.ActiveMTU, p.MaxMTU = vp.State, vp.ActiveMTU, vp.MaxMTU
				}
			}
		}
	}
	for _, d := range rep.RDMA {
		if !d.Verbs.Opened {
			rep.Problems = append(rep.Problems, fmt.Sprintf("RDMA device %s: libibverbs cannot use it: %s (its provider, ibverbs-providers, missing?)", d.Name, d.Verbs.Error))
		}
	}
}

// VerbsUsable reports whether the verbs bridge could use port p of d: the
// port is ACTIVE in sysfs and, when libibverbs was consulted, it opens the
// device and sees the port ACTIVE too.
func (r *Report) VerbsUsable(d RDMADevice, p RDMAPort) bool {
	if !p.Active() {
		return false
	}
	switch r.Verbs.State {
	case VerbsOff, "":
		return true
	case VerbsOK:
		return d.Verbs != nil && d.Verbs.Opened && p.VerbsState == "ACTIVE"
	}
	return false
}
