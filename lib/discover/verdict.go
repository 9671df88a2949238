package discover

import (
	"crypto/sha256"
	"encoding/hex"
	"encoding/json"
	"fmt"
	"slices"
	"sort"
	"strings"

	"github.com/gpubridge/gpubridge/lib/probe"
	"github.com/gpubridge/gpubridge/lib/transport"
)

// Island is every rank of one vendor label, joined by the native library.
type Island struct {
	// Label names the island: the vendor, or the split-test label.
	Label string `json:"label"`
	// Vendor is the real (or simulated) vendor whose library the island uses.
	Vendor string `json:"vendor"`
	// Backend is the torch.distributed backend the island's group runs on.
	Backend string   `json:"backend"`
	Ranks   []int    `json:"ranks"`
	Leader  int      `json:"leader"`
	Hosts   []string `json:"hosts"`
}

// Bridge is the link between island leaders.
type Bridge struct {
	Members   []int          `json:"members"`
	Hosts     []string       `json:"hosts"`
	Requested transport.Kind `json:"requested"`
	Transport transport.Kind `json:"transport"`
	Reason    string         `json:"reason"`
}

// RankInfo is one rank as every rank sees it.
type RankInfo struct {
	Rank      int    `json:"rank"`
	LocalRank int    `json:"local_rank"`
	Hostname  string `json:"hostname"`
	Island    string `json:"island"`
	Role      string `json:"role"`
	GPU       *GPU   `json:"gpu,omitempty"`
}

// Shared is the part of the topology that is identical on every rank.
type Shared struct {
	Schema    string            `json:"schema"`
	Namespace string            `json:"namespace"`
	WorldSize int               `json:"world_size"`
	RunKind   string            `json:"run_kind"`
	Mode      string            `json:"mode"`
	Simulated bool              `json:"simulated"`
	SplitTest string            `json:"split_test,omitempty"`
	Version   string            `json:"version"`
	Settings  map[string]string `json:"settings,omitempty"`
	Islands   []Island          `json:"islands"`
	Bridge    Bridge            `json:"bridge"`
	Ranks     []RankInfo        `json:"ranks"`
}

// Topology is gbdiscover's answer on success: the shared part, its digest
// (equal on every rank), and this rank's place.
type Topology struct {
	Shared
	Digest string   `json:"digest"`
	Self   RankInfo `json:"self"`
}

// Roles of a rank.
const (
	RoleLeader = "leader"
	RoleMember = "member"
)

// BackendFor names the torch.distributed backend an island of vendor uses in
// mode: NCCL on NVIDIA, RCCL (which torch calls "nccl") on AMD, Gloo when the
// ranks run on CPU.
func BackendFor(vendor, mode string) string {
	if mode == ModeCPU {
		return "gloo"
	}
	return "nccl"
}

// Decide computes the verdict from every rank's record (index i holds rank
// i). It is a pure function: the same records give the same topology, or the
// same problems in the same order, on every rank.
func Decide(namespace string, recs []*Record) (*Shared, []string) {
	problems := recordProblems(recs)
	n := len(recs)
	if len(problems) > 0 || n == 0 {
		if n == 0 {
			problems = append(problems, "no ranks")
		}
		return nil, problems
	}

	first := recs[0]
	labels, lp := labelRanks(recs, first.SplitTest)
	problems = append(problems, lp...)
	if len(problems) > 0 {
		return nil, problems
	}

	islands := buildIslands(recs, labels, first.Mode)
	problems = append(problems, sameGPUProblems(recs, labels, islands)...)
	bridge, bp := chooseBridge(recs, islands, first.Bridge)
	problems = append(problems, bp...)
	if len(problems) > 0 {
		return nil, problems
	}

	sh := &Shared{
		Schema: TopologySchema, Namespace: namespace, WorldSize: n,
		Mode: first.Mode, Simulated: first.Simulated, SplitTest: first.SplitTest,
		Version: first.ToolVersion, Settings: first.Settings,
		Islands: islands, Bridge: bridge,
	}
	sh.RunKind = runKind(sh)
	leaders := map[int]bool{}
	for _, is := range islands {
		leaders[is.Leader] = true
	}
	for _, r := range recs {
		role := RoleMember
		if leaders[r.Rank] {
			role = RoleLeader
		}
		sh.Ranks = append(sh.Ranks, RankInfo{Rank: r.Rank, LocalRank: r.LocalRank, Hostname: r.Hostname,
			Island: labels[r.Rank], Role: role, GPU: r.GPU})
	}
	return sh, nil
}

// recordProblems lists what the records say is wrong before any topology
// is built: each rank's own problems, a wrong world size or no vendor, and
// settings that differ between ranks.
func recordProblems(recs []*Record) []string {
	var problems []string
	add := func(format string, args ...any) { problems = append(problems, fmt.Sprintf(format, args...)) }
	n := len(recs)

	for _, r := range recs {
		for _, p := range r.Problems {
			add("%s: %s", who(r), p)
		}
		if r.WorldSize != n {
			add("%s was started with world size %d, but %d ranks reported", who(r), r.WorldSize, n)
		}
		if r.Vendor == "" && len(r.Problems) == 0 {
			add("%s: no detectable vendor (no GPU found, GPUBRIDGE_VENDOR not set)", who(r))
		}
	}
	// Settings are compared among the ranks without problems of their own:
	// a rank whose probe failed has an incomplete record, and its problem
	// is the one to report.
	mismatch := func(what string, value func(*Record) string) {
		groups := map[string][]int{}
		for _, r := range recs {
			if len(r.Problems) == 0 {
				groups[value(r)] = append(groups[value(r)], r.Rank)
			}
		}
		if len(groups) < 2 {
			return
		}
		var parts []string
		for _, v := range sortedKeys(groups) {
			shown := v
			if shown == "" {
				shown = "(unset)"
			}
			parts = append(parts, fmt.Sprintf("%s on ranks %s", shown, rankList(groups[v])))
		}
		add("%s differs between ranks: %s", what, strings.Join(parts, "; "))
	}
	mismatch("gpubridge version", func(r *Record) string { return r.ToolVersion })
	mismatch("CPU/GPU mode (a CPU/GPU mix)", func(r *Record) string { return r.Mode })
	mismatch("the requested bridge", func(r *Record) string { return string(r.Bridge) })
	mismatch("GPUBRIDGE_SPLIT_TEST", func(r *Record) string { return r.SplitTest })
	mismatch("simulation (GPUBRIDGE_VENDOR set on some ranks only)", func(r *Record) string { return fmt.Sprint(r.Simulated) })
	keys := map[string]bool{}
	for _, r := range recs {
		for k := range r.Settings {
			keys[k] = true
		}
	}
	for _, k := range sortedKeys(keys) {
		mismatch("setting "+k, func(r *Record) string { return r.Settings[k] })
	}
	return problems
}

// labelRanks gives every rank its island label: its vendor (with a simulated
// island name, <vendor>-<name>), or under a split test a label that
// alternates between two vendors' names.
func labelRanks(recs []*Record, split string) ([]string, []string) {
	labels := make([]string, len(recs))
	if split == "" {
		for i, r := range recs {
			labels[i] = r.Vendor
			if r.SimIsland != "" {
				labels[i] = r.Vendor + "-" + r.SimIsland
			}
		}
		return labels, nil
	}
	vendors := map[string][]int{}
	for _, r := range recs {
		vendors[r.Vendor] = append(vendors[r.Vendor], r.Rank)
	}
	if len(vendors) != 1 {
		var parts []string
		for _, v := range sortedKeys(vendors) {
			parts = append(parts, fmt.Sprintf("%s on ranks %s", v, rankList(vendors[v])))
		}
		return nil, []string{"GPUBRIDGE_SPLIT_TEST needs a single-vendor job, but vendors are " + strings.Join(parts, "; ")}
	}
	n := len(recs)
	if n < 2 {
		return nil, []string{"GPUBRIDGE_SPLIT_TEST needs at least 2 ranks, the job has 1"}
	}
	two := [2]string{VendorNVIDIA, VendorAMD}
	switch split {
	case SplitHalf:
		for i := range recs {
			labels[i] = two[boolIndex(i >= n/2)]
		}
	case SplitAlternate:
		for i := range recs {
			labels[i] = two[i%2]
		}
	case SplitNode:
		hostIndex := map[string]int{}
		for _, r := range recs {
			if _, ok := hostIndex[r.Hostname]; !ok {
				hostIndex[r.Hostname] = len(hostIndex)
			}
		}
		if len(hostIndex) < 2 {
			return nil, []string{fmt.Sprintf("GPUBRIDGE_SPLIT_TEST=node needs ranks on at least 2 hosts, all %d ranks are on %s", n, recs[0].Hostname)}
		}
		for i, r := range recs {
			labels[i] = two[hostIndex[r.Hostname]%2]
		}
	default:
		return nil, []string{fmt.Sprintf("GPUBRIDGE_SPLIT_TEST=%q is not a split mode (half, alternate, node)", split)}
	}
	return labels, nil
}

func boolIndex(b bool) int {
	if b {
		return 1
	}
	return 0
}

func buildIslands(recs []*Record, labels []string, mode string) []Island {
	byLabel := map[string]*Island{}
	var order []string
	for i, r := range recs {
		is, ok := byLabel[labels[i]]
		if !ok {
			is = &Island{Label: labels[i], Vendor: r.Vendor, Backend: BackendFor(r.Vendor, mode), Leader: r.Rank}
			byLabel[labels[i]] = is
			order = append(order, labels[i])
		}
		is.Ranks = append(is.Ranks, r.Rank)
		if !slices.Contains(is.Hosts, r.Hostname) {
			is.Hosts = append(is.Hosts, r.Hostname)
		}
	}
	// Islands in order of their leaders (the lowest rank of each).
	out := make([]Island, 0, len(order))
	for _, l := range order {
		out = append(out, *byLabel[l])
	}
	sort.Slice(out, func(i, j int) bool { return out[i].Leader < out[j].Leader })
	return out
}

// sameGPUProblems finds two ranks of one island on one GPU, which NCCL and
// RCCL refuse. A GPU is the same when its UUID is, or (no UUID) its PCI bus
// id on the same host.
func sameGPUProblems(recs []*Record, labels []string, islands []Island) []string {
	var problems []string
	for _, is := range islands {
		seen := map[string]int{}
		for _, rank := range is.Ranks {
			r := recs[rank]
			if r.Mode != ModeGPU || r.GPU == nil {
				continue
			}
			var id string
			switch {
			case r.GPU.UUID != "":
				id = "GPU " + r.GPU.UUID
			case r.GPU.PCI != "":
				id = "GPU at PCI " + r.GPU.PCI + " on " + r.Hostname
			default:
				continue
			}
			if other, ok := seen[id]; ok {
				problems = append(problems, fmt.Sprintf("ranks %d and %d of island %s both use %s: NCCL/RCCL need one GPU per rank (check LOCAL_RANK and CUDA_VISIBLE_DEVICES/HIP_VISIBLE_DEVICES)", other, rank, is.Label, id))
				continue
			}
			seen[id] = rank
		}
	}
	return problems
}

func chooseBridge(recs []*Record, islands []Island, requested transport.Kind) (Bridge, []string) {
	b := Bridge{Requested: requested}
	members := make([]transport.MemberInfo, 0, len(islands))
	for _, is := range islands {
		h := recs[is.Leader].Hostname
		b.Members = append(b.Members, is.Leader)
		if !slices.Contains(b.Hosts, h) {
			b.Hosts = append(b.Hosts, h)
		}
		members = append(members, transport.MemberInfo{Rank: is.Leader, Host: h})
	}
	if len(islands) < 2 {
		b.Transport, b.Reason = BridgeNone, "one island: every collective runs on the native library alone"
		return b, nil
	}
	rdma := make([]transport.RDMAOffer, len(islands))
	for i, is := range islands {
		p := recs[is.Leader].Probe
		o := transport.RDMAOffer{Probed: p.Verbs != "" && p.Verbs != probe.VerbsOff}
		if o.Probed && p.Verbs != probe.VerbsOK {
			o.Why = fmt.Sprintf("libibverbs %s: %s", p.Verbs, p.VerbsError)
		}
		for _, vp := range p.VerbsPorts {
			o.Ports = append(o.Ports, transport.RDMAPortOffer{Device: vp.Device, Port: vp.Port, LinkLayer: vp.LinkLayer})
		}
		rdma[i] = o
	}
	k, reason, err := transport.ChooseFor(requested, members, rdma)
	if err != nil {
		return b, []string{err.Error()}
	}
	b.Transport, b.Reason = k, reason
	return b, nil
}

func runKind(sh *Shared) string {
	switch {
	case sh.SplitTest != "":
		return KindSplitTest
	case sh.Mode == ModeCPU:
		return KindCPU
	}
	vendors := map[string]bool{}
	for _, is := range sh.Islands {
		vendors[is.Vendor] = true
	}
	if len(vendors) > 1 {
		return KindGPUMixed
	}
	return KindGPUSingleVendor
}

// Digest returns a hash of the shared topology, equal on every rank.
func (sh *Shared) Digest() string {
	b, err := json.Marshal(sh)
	if err != nil {
		panic(fmt.Sprintf("marshal topology: %v", err)) // plain data: cannot fail
	}
	sum := sha256.Sum256(b)
	return hex.EncodeToString(sum[:8])
}

// ForRank returns the topology as rank sees it.
func (sh *Shared) ForRank(rank int) *Topology {
	return &Topology{Shared: *sh, Digest: sh.Digest(), Self: sh.Ranks[rank]}
}
