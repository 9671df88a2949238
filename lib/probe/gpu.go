package probe

import (
	"fmt"
	"path/filepath"
	"regexp"
	"sort"
	"strconv"
	"strings"
)

const (
	pciVendorNVIDIA = "0x10de"
	pciVendorAMD    = "0x1002"
)

// gpuClass reports whether a PCI class ("0x030200") is a display/3D
// controller (0x03) or a processing accelerator (0x12, some Instinct parts).
func gpuClass(class string) bool {
	return strings.HasPrefix(class, "0x03") || strings.HasPrefix(class, "0x12")
}

// pciGPUs lists the NVIDIA and AMD GPU-class functions under
// sys/bus/pci/devices, in address order.
func (s sysfs) pciGPUs() ([]PCIDevice, error) {
	dir := s.path("sys/bus/pci/devices")
	names, err := list(dir)
	if err != nil {
		return nil, err
	}
	out := []PCIDevice{}
	for _, name := range names {
		d := filepath.Join(dir, name)
		vendor := strings.ToLower(read(filepath.Join(d, "vendor")))
		var v string
		switch vendor {
		case pciVendorNVIDIA:
			v = VendorNVIDIA
		case pciVendorAMD:
			v = VendorAMD
		default:
			continue
		}
		class := strings.ToLower(read(filepath.Join(d, "class")))
		if !gpuClass(class) {
			continue
		}
		out = append(out, PCIDevice{
			PCIBusID: normalizePCI(name),
			Vendor:   v,
			VendorID: vendor,
			DeviceID: strings.ToLower(read(filepath.Join(d, "device"))),
			Class:    class,
			Driver:   linkBase(filepath.Join(d, "driver")),
		})
	}
	return out, nil
}

var cardName = regexp.MustCompile(`^card[0-9]+$`)

// amdCard is an amdgpu DRM card.
type amdCard struct {
	name, pci, product, deviceID, uniqueHex string
	vram                                    uint64
}

// amdCards lists the DRM cards (card0, not connectors like card0-DP-1) whose
// device is an AMD one.
func (s sysfs) amdCards() ([]amdCard, error) {
	dir := s.path("sys/class/drm")
	names, err := list(dir)
	if err != nil {
		return nil, err
	}
	var out []amdCard
	for _, name := range names {
		if !cardName.MatchString(name) {
			continue
		}
		dev := filepath.Join(dir, name, "device")
		if strings.ToLower(read(filepath.Join(dev, "vendor"))) != pciVendorAMD {
			continue
		}
		c := amdCard{
			name:      name,
			pci:       pciAddress(dev),
			product:   read(filepath.Join(dev, "product_name")),
			deviceID:  strings.ToLower(read(filepath.Join(dev, "device"))),
			uniqueHex: strings.ToLower(read(filepath.Join(dev, "unique_id"))),
		}
		c.vram, _ = readUint(filepath.Join(dev, "mem_info_vram_total"))
		out = append(out, c)
	}
	return out, nil
}

// kfdNode is one GPU node of the KFD topology.
type kfdNode struct {
	id                           int
	pci, gfx, uniqueID, deviceID string
}

// kfdGPUs lists the GPU nodes (simd_count > 0) of the KFD topology, in node
// order, which is the order ROCm numbers devices in.
func (s sysfs) kfdGPUs() ([]kfdNode, []string, error) {
	dir := s.path("sys/class/kfd/kfd/topology/nodes")
	names, err := list(dir)
	if err != nil {
		return nil, nil, err
	}
	var out []kfdNode
	var problems []string
	for _, name := range names {
		id, err := strconv.Atoi(name)
		if err != nil {
			continue
		}
		props, err := keyValues(filepath.Join(dir, name, "properties"))
		if err != nil {
			problems = append(problems, fmt.Sprintf("KFD node %d: %v", id, err))
			continue
		}
		if simd, _ := strconv.Atoi(props["simd_count"]); simd == 0 {
			continue // a CPU node
		}
		n := kfdNode{id: id}
		if v, err := strconv.ParseUint(props["gfx_target_version"], 10, 64); err == nil {
			n.gfx = gfxTarget(v)
		}
		if v, err := strconv.ParseUint(props["unique_id"], 10, 64); err == nil && v != 0 {
			n.uniqueID = props["unique_id"]
		}
		if v, err := strconv.ParseUint(props["device_id"], 10, 32); err == nil && v != 0 {
			n.deviceID = fmt.Sprintf("0x%04x", v)
		}
		dom, err1 := strconv.ParseUint(props["domain"], 10, 32)
		loc, err2 := strconv.ParseUint(props["location_id"], 10, 32)
		if err1 == nil && err2 == nil {
			// location_id is the PCI bus/device/function: bus<<8 | dev<<3 | fn.
			n.pci = fmt.Sprintf("%04x:%02x:%02x.%x", dom, loc>>8, (loc>>3)&0x1f, loc&7)
		}
		out = append(out, n)
	}
	sort.Slice(out, func(a, b int) bool { return out[a].id < out[b].id })
	return out, problems, nil
}

// gfxTarget turns KFD's gfx_target_version (major*10000 + minor*100 +
// stepping) into the LLVM target name: 90010 -> gfx90a, 90402 -> gfx942,
// 110000 -> gfx1100.
func gfxTarget(v uint64) string {
	if v == 0 {
		return ""
	}
	return fmt.Sprintf("gfx%d%d%x", v/10000, v/100%100, v%100)
}

// amdGPUs joins DRM cards and KFD nodes by PCI address into the usable AMD
// GPUs: KFD nodes first in node order (ROCm's order), then cards without a
// KFD node in address order.
func amdGPUs(cards []amdCard, nodes []kfdNode) []GPU {
	byPCI := map[string]amdCard{}
	for _, c := range cards {
		byPCI[c.pci] = c
	}
	var out []GPU
	seen := map[string]bool{}
	add := func(c amdCard, n kfdNode, pci string) {
		g := GPU{Vendor: VendorAMD, Index: len(out), PCIBusID: pci, Source: "sysfs",
			Name: c.product, DeviceID: c.deviceID, MemoryBytes: c.vram, DRMCard: c.name,
			GFXTarget: n.gfx, UniqueID: n.uniqueID, KFDNode: n.id}
		if g.DeviceID == "" {
			g.DeviceID = n.deviceID
		}
		if g.UniqueID == "" && c.uniqueHex != "" {
			if v, err := strconv.ParseUint(c.uniqueHex, 16, 64); err == nil && v != 0 {
				g.UniqueID = strconv.FormatUint(v, 10)
			}
		}
		if v, err := strconv.ParseUint(g.UniqueID, 10, 64); err == nil && v != 0 {
			g.UUID = fmt.Sprintf("GPU-%016x", v)
		}
		if g.Name == "" {
			g.Name = "AMD GPU " + g.DeviceID
		}
		out = append(out, g)
		seen[pci] = true
	}
	for _, n := range nodes {
		if n.pci != "" && seen[n.pci] {
			continue
		}
		add(byPCI[n.pci], n, n.pci)
	}
	sort.SliceStable(cards, func(a, b int) bool { return cards[a].pci < cards[b].pci })
	for _, c := range cards {
		if !seen[c.pci] {
			add(c, kfdNode{}, c.pci)
		}
	}
	return out
}

// gpuFindings is the GPU part of a report.
type gpuFindings struct {
	gpus     []GPU
	pci      []PCIDevice
	problems []string
}

// joinGPUs combines the PCI scan, the AMD sysfs view and NVML's answer into
// the usable GPUs, marks the PCI functions that are usable, and explains
// the ones that are not.
func joinGPUs(pci []PCIDevice, amd []GPU, kfdPresent bool, nv *NVMLInfo, st NVMLStatus) gpuFindings {
	f := gpuFindings{pci: pci}
	usable := map[string]bool{}
	if nv != nil {
		for _, g := range nv.GPUs {
			f.gpus = append(f.gpus, g)
			usable[g.PCIBusID] = true
		}
		for _, w := range nv.Warnings {
			f.problems = append(f.problems, "NVML: "+w)
		}
	}
	for _, g := range amd {
		f.gpus = append(f.gpus, g)
		usable[g.PCIBusID] = true
		if g.KFDNode == 0 {
			why := "no KFD node"
			if !kfdPresent {
				why = "no KFD topology (/sys/class/kfd)"
			}
			f.problems = append(f.problems, fmt.Sprintf("AMD GPU at %s has %s: ROCm cannot use it (amdkfd missing?)", g.PCIBusID, why))
		}
	}
	for i := range f.pci {
		d := &f.pci[i]
		d.Usable = usable[d.PCIBusID]
		if d.Usable {
			continue
		}
		driver := "kernel driver " + d.Driver
		if d.Driver == "" {
			driver = "no kernel driver bound"
		}
		switch d.Vendor {
		case VendorAMD:
			f.problems = append(f.problems, fmt.Sprintf("AMD GPU at %s but no amdgpu DRM card or KFD node: driver missing? (%s)", d.PCIBusID, driver))
		case VendorNVIDIA:
			switch st.State {
			case NVMLOK:
				f.problems = append(f.problems, fmt.Sprintf("NVIDIA GPU at %s is not visible to NVML (%s): fallen off the bus?", d.PCIBusID, driver))
			case NVMLOff:
				f.problems = append(f.problems, fmt.Sprintf("NVIDIA GPU at %s not checked: NVML off (%s)", d.PCIBusID, driver))
			case NVMLUnavailable:
				f.problems = append(f.problems, fmt.Sprintf("NVIDIA GPU at %s but NVML unavailable: driver missing? (%s; %s)", d.PCIBusID, driver, st.Error))
			default:
				f.problems = append(f.problems, fmt.Sprintf("NVIDIA GPU at %s unusable: NVML %s (%s; %s)", d.PCIBusID, st.State, st.Error, driver))
			}
		}
	}
	if f.gpus == nil {
		f.gpus = []GPU{}
	}
	return f
}

// vendorOf names the vendor of a set of GPUs.
func vendorOf(gpus []GPU) string {
	var nv, amd bool
	for _, g := range gpus {
		switch g.Vendor {
		case VendorNVIDIA:
			nv = true
		case VendorAMD:
			amd = true
		}
	}
	switch {
	case nv && amd:
		return VendorMixed
	case nv:
		return VendorNVIDIA
	case amd:
		return VendorAMD
	}
	return VendorNone
}
