// Package discover is gpubridge's start-up agreement: every rank writes a
// record of itself into the job's c10d store, reads every other rank's
// record, and computes from them, as a pure function, either the same
// topology (islands, leaders, bridge) or the same list of problems on every
// rank.
package discover

import (
	"encoding/json"
	"fmt"
	"sort"
	"strings"

	"github.com/gpubridge/gpubridge/lib/transport"
)

// Schemas of what this package writes.
const (
	RecordSchema   = "gpubridge.record/v1"
	TopologySchema = "gpubridge.topology/v1"
)

// Vendors and modes.
const (
	VendorNVIDIA = "nvidia"
	VendorAMD    = "amd"

	ModeGPU = "gpu"
	ModeCPU = "cpu"
)

// Bridge transports: what a rank may ask for (transport.Choose decides,
// these are its kinds), and none: one island, no bridge.
const (
	BridgeAuto  = transport.Auto
	BridgeTCP   = transport.TCP
	BridgeSHM   = transport.SHM
	BridgeVerbs = transport.Verbs
	BridgeNone  = transport.Kind("none")
)

// Split-test modes: a single-vendor job labeled as two vendors.
const (
	SplitHalf      = "half"
	SplitAlternate = "alternate"
	SplitNode      = "node"
)

// Run kinds of a topology.
const (
	KindGPUMixed        = "gpu-mixed"
	KindGPUSingleVendor = "gpu-single-vendor"
	KindSplitTest       = "split-test"
	KindCPU             = "cpu"
)

// GPU identifies the device a rank will drive.
type GPU struct {
	Index int    `json:"index"`
	Name  string `json:"name,omitempty"`
	UUID  string `json:"uuid,omitempty"`
	PCI   string `json:"pci_bus_id,omitempty"`
}

// Record is what one rank writes into the store about itself.
type Record struct {
	Schema      string `json:"schema"`
	Rank        int    `json:"rank"`
	WorldSize   int    `json:"world_size"`
	LocalRank   int    `json:"local_rank"`
	Hostname    string `json:"hostname"`
	ToolVersion string `json:"tool_version"`
	// Vendor is the rank's vendor: real, or simulated (Simulated true).
	Vendor    string `json:"vendor"`
	Simulated bool   `json:"simulated"`
	// Mode is gpu or cpu (simulation and CPU-only runs).
	Mode string `json:"mode"`
	GPU  *GPU   `json:"gpu,omitempty"`
	// Bridge is the transport this rank asked for.
	Bridge transport.Kind `json:"bridge"`
	// SimIsland is the simulated island name this rank asked for (CPU mode
	// only): its island is <vendor>-<SimIsland>.
	SimIsland string `json:"sim_island,omitempty"`
	// SplitTest is the split-test mode this rank runs under, if any.
	SplitTest string `json:"split_test,omitempty"`
	// Settings are policy settings that must be equal on every rank.
	Settings map[string]string `json:"settings,omitempty"`
	// Probe summarises what gbprobe found on the rank's node.
	Probe ProbeSummary `json:"probe"`
	// Problems are this rank's own reasons the job cannot run.
	Problems []string `json:"problems,omitempty"`
	// Claim names the process that wrote the record; it must hold the
	// rank's claim in the store (see Claim).
	Claim *Claim `json:"claim,omitempty"`
}

// ProbeSummary is the part of gbprobe's report a record carries.
type ProbeSummary struct {
	Vendor   string `json:"vendor"`
	GPUs     int    `json:"gpus"`
	NICs     int    `json:"nics"`
	RDMA     int    `json:"rdma_ports_active"`
	Problems int    `json:"problems"`
	// Verbs is libibverbs' state in the probe (ok, off, unavailable, …;
	// "" from a gbprobe that did not consult it), VerbsError its reason,
	// and VerbsPorts the active ports it opens: what the verbs bridge
	// could use on the rank's node.
	Verbs      string      `json:"verbs,omitempty"`
	VerbsError string      `json:"verbs_error,omitempty"`
	VerbsPorts []VerbsPort `json:"verbs_ports,omitempty"`
}

// VerbsPort is an active RDMA port that libibverbs opens.
type VerbsPort struct {
	Device    string `json:"device"`
	Port      int    `json:"port"`
	LinkLayer string `json:"link_layer"`
}

// Encode returns the record's JSON.
func (r *Record) Encode() ([]byte, error) {
	return json.Marshal(r)
}

// MaxRecordBytes bounds a record read from the store.
const MaxRecordBytes = 1 << 20

// encodeFit returns the record's JSON in at most max bytes. A record that is
// larger (a probe report with huge fields or problem lists) is replaced by a
// small one that keeps the rank's identity, its first problems and one
// naming the cause, so that every rank fails naming it rather than on a
// store limit.
func (r *Record) encodeFit(max int) ([]byte, error) {
	b, err := r.Encode()
	if err != nil || len(b) <= max {
		return b, err
	}
	const keep, textMax = 16, 512
	small := &Record{
		Schema: r.Schema, Rank: r.Rank, WorldSize: r.WorldSize, LocalRank: r.LocalRank,
		Hostname: truncateText(r.Hostname, 255), ToolVersion: truncateText(r.ToolVersion, 64),
		Vendor: truncateText(r.Vendor, 64), Simulated: r.Simulated, Mode: truncateText(r.Mode, 16),
		Bridge: transport.Kind(truncateText(string(r.Bridge), 16)), Claim: r.Claim,
	}
	for _, p := range r.Problems[:min(keep, len(r.Problems))] {
		small.Problems = append(small.Problems, truncateText(p, textMax))
	}
	small.Problems = append(small.Problems, fmt.Sprintf(
		"this rank's record is %d bytes, over the %d-byte limit of a record (a probe report with very large fields?); it was cut down to its first %d problems (of %d)",
		len(b), max, len(small.Problems), len(r.Problems)))
	return small.Encode()
}

// DecodeRecord parses a record read from the store for rank, checking that it
// is of this schema and names that rank.
func DecodeRecord(rank int, b []byte) (*Record, error) {
	if len(b) > MaxRecordBytes {
		return nil, fmt.Errorf("record of rank %d is %d bytes, over the %d-byte limit", rank, len(b), MaxRecordBytes)
	}
	var r Record
	if err := json.Unmarshal(b, &r); err != nil {
		return nil, JSONError(fmt.Sprintf("record of rank %d", rank), err)
	}
	if r.Schema != RecordSchema {
		return nil, fmt.Errorf("record of rank %d has schema %q, want %q (different gpubridge versions?)", rank, r.Schema, RecordSchema)
	}
	if r.Rank != rank {
		return nil, fmt.Errorf("record stored for rank %d names rank %d", rank, r.Rank)
	}
	return &r, nil
}

// who names a rank in messages: "rank 3 (host-b)".
func who(r *Record) string {
	return fmt.Sprintf("rank %d (%s)", r.Rank, r.Hostname)
}

func rankList(ranks []int) string {
	s := make([]string, len(ranks))
	for i, r := range ranks {
		s[i] = fmt.Sprint(r)
	}
	return strings.Join(s, ",")
}

func sortedKeys[V any](m map[string]V) []string {
	keys := make([]string, 0, len(m))
	for k := range m {
		keys = append(keys, k)
	}
	sort.Strings(keys)
	return keys
}
