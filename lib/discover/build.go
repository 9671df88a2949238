package discover

import (
	"encoding/json"
	"fmt"
	"io"
	"os"
	"strings"

	"github.com/gpubridge/gpubridge/lib/probe"
	"github.com/gpubridge/gpubridge/lib/transport"
)

// MaxProbeBytes bounds the probe report gbdiscover reads.
const MaxProbeBytes = 16 << 20

// ReadProbe decodes gbprobe's --json report.
// maxVerbsPorts bounds the ports a record lists.
const maxVerbsPorts = 64

func ReadProbe(in io.Reader) (*probe.Report, error) {
	b, err := io.ReadAll(io.LimitReader(in, MaxProbeBytes+1))
	if err != nil {
		return nil, fmt.Errorf("read probe report: %w", err)
	}
	if len(b) > MaxProbeBytes {
		return nil, fmt.Errorf("probe report is over %d bytes", MaxProbeBytes)
	}
	if len(b) == 0 {
		return nil, fmt.Errorf("probe report is empty (did gbprobe --json run?)")
	}
	var rep probe.Report
	if err := json.Unmarshal(b, &rep); err != nil {
		return nil, fmt.Errorf("%w (want gbprobe --json output, an object with schema %q)", JSONError("probe report", err), probe.Schema)
	}
	if rep.Schema == "" {
		return nil, fmt.Errorf("probe report has no schema field (want gbprobe --json output, an object with schema %q)", probe.Schema)
	}
	if rep.Schema != probe.Schema {
		return nil, fmt.Errorf("probe report has schema %q, want %q", rep.Schema, probe.Schema)
	}
	return &rep, nil
}

// RecordOptions are what a rank says about itself in its record, besides
// its probe report.
type RecordOptions struct {
	Rank        int
	WorldSize   int
	LocalRank   int // -1: unknown
	ToolVersion string
	Bridge      transport.Kind // the transport asked for
	Vendor      string         // auto, nvidia, amd
	CPUOnly     bool
	SplitTest   string
	Settings    map[string]string
	SimHostname string
	// SimIsland, in simulation, puts the rank in island <vendor>-<SimIsland>
	// instead of <vendor>, so one machine can stand in for three or more
	// islands.
	SimIsland string
	// Problems are reasons this rank cannot run that the caller found (a
	// bad LOCAL_RANK, a missing tool); they go into the rank's record.
	Problems []string
	Getenv   func(string) string // default os.Getenv
}

func (o *RecordOptions) getenv(k string) string {
	if o.Getenv != nil {
		return o.Getenv(k)
	}
	return os.Getenv(k)
}

// BuildRecord makes this rank's record from its options and probe report.
// Nothing here fails: whatever is wrong with this rank (the caller's
// o.Problems first) becomes a problem in its record, so that every rank
// reports it.
func BuildRecord(o RecordOptions, probeIn io.Reader) *Record {
	rec := &Record{
		Schema: RecordSchema, Rank: o.Rank, WorldSize: o.WorldSize, LocalRank: o.LocalRank,
		ToolVersion: o.ToolVersion, Bridge: o.Bridge, SplitTest: o.SplitTest, Settings: o.Settings,
	}
	problem := func(format string, args ...any) { rec.Problems = append(rec.Problems, fmt.Sprintf(format, args...)) }
	for _, p := range o.Problems {
		if p = strings.TrimSpace(p); p != "" {
			problem("%s", p)
		}
	}
	rep, err := ReadProbe(probeIn)
	if err != nil {
		rec.Hostname, _ = os.Hostname()
		problem("%v", err)
		rec.Mode = ModeGPU
		if o.CPUOnly {
			rec.Mode = ModeCPU
		}
		return rec
	}
	rec.Hostname = rep.Hostname
	rec.Simulated = rep.Simulated
	rec.Probe = ProbeSummary{Vendor: rep.RealVendor, GPUs: len(rep.GPUs), NICs: len(rep.NICs), Problems: len(rep.Problems)}
	rec.Probe.Verbs, rec.Probe.VerbsError = rep.Verbs.State, truncateText(rep.Verbs.Error, 256)
	for _, d := range rep.RDMA {
		for _, p := range d.Ports {
			if p.Active() {
				rec.Probe.RDMA++
			}
			if rep.Verbs.State == probe.VerbsOK && rep.VerbsUsable(d, p) && len(rec.Probe.VerbsPorts) < maxVerbsPorts {
				rec.Probe.VerbsPorts = append(rec.Probe.VerbsPorts, VerbsPort{Device: truncateText(d.Name, 64), Port: p.Port, LinkLayer: truncateText(p.LinkLayer, 16)})
			}
		}
	}

	switch {
	case rep.Simulated:
		rec.Mode, rec.Vendor = ModeCPU, rep.Vendor
	case o.Vendor == VendorNVIDIA || o.Vendor == VendorAMD:
		rec.Vendor = o.Vendor
	case rep.RealVendor == probe.VendorNVIDIA || rep.RealVendor == probe.VendorAMD:
		rec.Vendor = rep.RealVendor
	case rep.RealVendor == probe.VendorMixed:
		problem("the node has both NVIDIA and AMD GPUs: pass --vendor (the vendor of this rank's torch build)")
	default:
		problem("no detectable vendor: no usable GPU found (NVML %s) and GPUBRIDGE_VENDOR is not set", nvmlWords(rep.NVML))
	}
	if rec.Mode == "" {
		rec.Mode = ModeGPU
		if o.CPUOnly {
			rec.Mode = ModeCPU
		}
	}
	if rec.Mode == ModeCPU && o.SimHostname != "" {
		rec.Hostname = o.SimHostname
	}
	if rec.Mode == ModeCPU && o.SimIsland != "" {
		if validIslandName(o.SimIsland) {
			rec.SimIsland = o.SimIsland
		} else {
			problem("GPUBRIDGE_SIM_ISLAND=%q: an island name is 1 to 32 characters of a-z, 0-9 and -", o.SimIsland)
		}
	}
	if rec.Mode != ModeGPU || rec.Vendor == "" {
		return rec
	}
	for _, p := range rep.Problems {
		problem("probe: %s", p)
	}
	if o.LocalRank < 0 {
		problem("LOCAL_RANK is not set: cannot tell which GPU this rank drives")
		return rec
	}
	g, err := rep.DeviceFor(rec.Vendor, o.LocalRank, o.getenv)
	if err != nil {
		problem("%v", err)
		return rec
	}
	rec.GPU = &GPU{Index: g.Index, Name: g.Name, UUID: g.UUID, PCI: g.PCIBusID}
	return rec
}

func nvmlWords(s probe.NVMLStatus) string {
	if s.Error != "" {
		return s.State + ": " + s.Error
	}
	return s.State
}

// validIslandName accepts the names SimIsland may give (they end up in store
// keys and process-group prefixes).
func validIslandName(s string) bool {
	if len(s) == 0 || len(s) > 32 {
		return false
	}
	for _, c := range s {
		if (c < 'a' || c > 'z') && (c < '0' || c > '9') && c != '-' {
			return false
		}
	}
	return true
}
