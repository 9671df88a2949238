package probe

import (
	"encoding/json"
	"fmt"
	"io"
	"strings"
)

// WriteJSON writes the report as gbprobe --json does: one indented JSON
// object and a newline, without HTML escaping (so "gpus>=4" stays readable).
func (r *Report) WriteJSON(w io.Writer) error {
	enc := json.NewEncoder(w)
	enc.SetIndent("", "  ")
	enc.SetEscapeHTML(false)
	if err := enc.Encode(r); err != nil {
		return fmt.Errorf("write probe report: %w", err)
	}
	return nil
}

// WriteText writes the short human summary gbprobe prints without --json.
// It is for people; programs read the JSON.
func (r *Report) WriteText(w io.Writer) error {
	var b strings.Builder
	p := func(format string, args ...any) { fmt.Fprintf(&b, format, args...) }
	vendor := r.Vendor
	if r.Simulated {
		vendor += " (simulated by GPUBRIDGE_VENDOR; real: " + r.RealVendor + ")"
	}
	p("host %s: vendor %s, %s\n", r.Hostname, vendor, r.gpuSummary())
	for _, g := range r.GPUs {
		line := fmt.Sprintf("  gpu %s %d: %s, %s, %s", g.Vendor, g.Index, g.Name, g.PCIBusID, formatBytes(g.MemoryBytes))
		for _, extra := range []struct{ label, v string }{
			{"cc ", g.ComputeCapability}, {"", g.GFXTarget}, {"", g.UUID},
		} {
			if extra.v != "" {
				line += ", " + extra.label + extra.v
			}
		}
		p("%s\n", line)
	}
	nv := "nvml: " + r.NVML.State
	switch {
	case r.NVML.State == NVMLOK:
		nv += fmt.Sprintf(", driver %s, CUDA %s", r.NVML.DriverVersion, r.NVML.CUDADriverVersion)
	case r.NVML.Error != "":
		nv += " (" + r.NVML.Error + ")"
	}
	p("%s\n", nv)
	if !r.NICsProbed {
		p("nics: not probed\n")
	}
	for _, n := range r.NICs {
		line := fmt.Sprintf("  nic %s: %s, mtu %d", n.Name, n.State, n.MTU)
		if n.SpeedMbps > 0 {
			line += fmt.Sprintf(", %d Mb/s", n.SpeedMbps)
		}
		if len(n.Addresses) > 0 {
			line += ", " + strings.Join(n.Addresses, " ")
		}
		p("%s\n", line)
	}
	vb := "verbs: " + r.Verbs.State
	if r.Verbs.Error != "" {
		vb += " (" + r.Verbs.Error + ")"
	}
	p("%s\n", vb)
	if len(r.RDMA) == 0 {
		p("rdma: none\n")
	}
	for _, d := range r.RDMA {
		for _, port := range d.Ports {
			line := fmt.Sprintf("  rdma %s port %d: %s %s", d.Name, port.Port, port.LinkLayer, port.State)
			if port.Rate != "" {
				line += ", " + port.Rate
			}
			if len(port.Netdevs) > 0 {
				line += ", netdev " + strings.Join(port.Netdevs, " ")
			}
			if port.VerbsState != "" {
				line += fmt.Sprintf(", libibverbs %s MTU %d", port.VerbsState, port.ActiveMTU)
			} else if d.Verbs != nil && !d.Verbs.Opened {
				line += ", libibverbs cannot open it"
			}
			for _, g := range port.GIDs {
				if g.Type == "RoCE v2" {
					line += fmt.Sprintf(", GID %d %s (RoCE v2)", g.Index, g.GID)
					break
				}
			}
			p("%s\n", line)
		}
	}
	if r.Route != nil {
		p("route: %s\n", r.Route.String())
	}
	for _, pr := range r.Problems {
		p("problem: %s\n", pr)
	}
	for _, q := range r.Requirements {
		verdict := "ok"
		if !q.OK {
			verdict = "FAILED"
		}
		p("require %s: %s: %s\n", q.Require, verdict, q.Reason)
	}
	p("probe took %.1f ms\n", r.ProbeMS)
	_, err := io.WriteString(w, b.String())
	return err
}

func formatBytes(n uint64) string {
	if n == 0 {
		return "memory unknown"
	}
	const gib = 1 << 30
	if n >= gib {
		return fmt.Sprintf("%.0f GiB", float64(n)/gib)
	}
	return fmt.Sprintf("%d MiB", n>>20)
}
