package probe

import (
	"fmt"
	"path/filepath"
	"sort"
	"strconv"
	"strings"
)

// rdmaDevices reads sys/class/infiniband: every device, its ports, their
// states and non-zero GIDs.
func (s sysfs) rdmaDevices() ([]RDMADevice, error) {
	dir := s.path("sys/class/infiniband")
	names, err := list(dir)
	if err != nil {
		return nil, err
	}
	out := []RDMADevice{}
	for _, name := range names {
		d := filepath.Join(dir, name)
		dev := RDMADevice{
			Name:            name,
			NodeGUID:        read(filepath.Join(d, "node_guid")),
			NodeType:        read(filepath.Join(d, "node_type")),
			FirmwareVersion: read(filepath.Join(d, "fw_ver")),
			PCIBusID:        pciAddress(filepath.Join(d, "device")),
			Ports:           []RDMAPort{},
		}
		ports, err := list(filepath.Join(d, "ports"))
		if err != nil {
			return nil, err
		}
		devNetdevs := netdevsByPort(filepath.Join(d, "device", "net"))
		for _, p := range ports {
			num, err := strconv.Atoi(p)
			if err != nil {
				continue
			}
			port, err := readPort(filepath.Join(d, "ports", p), num)
			if err != nil {
				return nil, fmt.Errorf("%s port %d: %w", name, num, err)
			}
			if len(port.Netdevs) == 0 {
				// No GID netdevs (InfiniBand, or an older kernel): the PCI
				// function's interfaces whose dev_port is this port, or all
				// of them for a one-port device.
				port.Netdevs = devNetdevs[num-1]
				if port.Netdevs == nil && len(ports) == 1 {
					for _, nds := range devNetdevs {
						port.Netdevs = append(port.Netdevs, nds...)
					}
					sort.Strings(port.Netdevs)
				}
				if port.Netdevs == nil {
					port.Netdevs = []string{}
				}
			}
			dev.Ports = append(dev.Ports, port)
		}
		sort.Slice(dev.Ports, func(a, b int) bool { return dev.Ports[a].Port < dev.Ports[b].Port })
		out = append(out, dev)
	}
	return out, nil
}

func readPort(dir string, num int) (RDMAPort, error) {
	p := RDMAPort{
		Port:      num,
		State:     afterColon(read(filepath.Join(dir, "state"))),
		PhysState: afterColon(read(filepath.Join(dir, "phys_state"))),
		LinkLayer: read(filepath.Join(dir, "link_layer")),
		Rate:      read(filepath.Join(dir, "rate")),
		GIDs:      []GID{},
	}
	if f := strings.Fields(p.Rate); len(f) > 0 {
		p.RateGbps, _ = strconv.ParseFloat(f[0], 64)
	}
	if p.LinkLayer == "InfiniBand" {
		p.LID = read(filepath.Join(dir, "lid"))
	}
	gids, err := list(filepath.Join(dir, "gids"))
	if err != nil {
		return p, err
	}
	seen := map[string]bool{}
	for _, g := range gids {
		idx, err := strconv.Atoi(g)
		if err != nil {
			continue
		}
		val := read(filepath.Join(dir, "gids", g))
		if zeroGID(val) {
			continue
		}
		gid := GID{
			Index:  idx,
			GID:    val,
			Type:   read(filepath.Join(dir, "gid_attrs", "types", g)),
			Netdev: read(filepath.Join(dir, "gid_attrs", "ndevs", g)),
		}
		p.GIDs = append(p.GIDs, gid)
		if gid.Netdev != "" && !seen[gid.Netdev] {
			seen[gid.Netdev] = true
			p.Netdevs = append(p.Netdevs, gid.Netdev)
		}
	}
	sort.Slice(p.GIDs, func(a, b int) bool { return p.GIDs[a].Index < p.GIDs[b].Index })
	sort.Strings(p.Netdevs)
	return p, nil
}

// zeroGID reports whether a GID is empty or all zeros (an unused entry).
func zeroGID(g string) bool {
	return strings.Trim(g, "0:") == ""
}

// netdevsByPort maps a 0-based dev_port to the interface names under a PCI
// device's net/ directory; interfaces without dev_port count as port 0.
func netdevsByPort(dir string) map[int][]string {
	names, err := list(dir)
	if err != nil || len(names) == 0 {
		return nil
	}
	out := map[int][]string{}
	for _, n := range names {
		port := 0
		if v, ok := readUint(filepath.Join(dir, n, "dev_port")); ok {
			port = int(v)
		}
		out[port] = append(out[port], n)
	}
	return out
}
