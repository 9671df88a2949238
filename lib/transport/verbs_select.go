package transport

import (
	"fmt"
	"net"
	"os"
	"slices"
	"strconv"
	"strings"

	"github.com/gpubridge/gpubridge/lib/ibverbs"
)

// Which RDMA port and GID a member uses, like NCCL's NCCL_IB_HCA and
// NCCL_IB_GID_INDEX: GPUBRIDGE_IB_HCA names the device (and port:
// "mlx5_0:1"), GPUBRIDGE_IB_GID_INDEX the GID table entry. Without them
// the member takes the port whose RoCE v2 GID carries the address it would
// use for TCP (the interface that routes to the store's host, or
// GPUBRIDGE_IFNAME); when that address is local to the host (a store on
// this host over lo) or no RoCE port has it, the first active port
// (InfiniBand: its GID 0 and LID).

// Environment variables of the verbs transport, read by each member.
const (
	EnvIBHCA      = "GPUBRIDGE_IB_HCA"
	EnvIBGIDIndex = "GPUBRIDGE_IB_GID_INDEX"
)

// verbsDevInfo and verbsPortInfo are what a scan of libibverbs' devices
// found.
type (
	verbsDevInfo  = ibverbs.DeviceInfo
	verbsPortInfo = ibverbs.PortInfo
)

// verbsPort is the port and GID a member uses, and why.
type verbsPort struct {
	dev  string
	port verbsPortInfo
	gid  ibverbs.GIDEntry
	how  string
	// ifname is the interface of the GID (RoCE), for messages.
	ifname string
	limits ibverbs.DeviceAttr
}

// Describe names the port for Describe and messages: "rxe0 port 1
// (Ethernet, RoCE v2 GID 1 ::ffff:10.0.0.1 on eth0)".
func (p verbsPort) Describe() string {
	var b strings.Builder
	fmt.Fprintf(&b, "%s port %d (%s", p.dev, p.port.Num, p.port.Attr.LinkLayer)
	if p.port.Attr.LinkLayer == ibverbs.LinkEthernet || !p.gid.GID.IsZero() {
		fmt.Fprintf(&b, ", %s GID %d %s", p.gid.Type, p.gid.Index, p.gid.GID)
	}
	if p.port.Attr.LinkLayer == ibverbs.LinkInfiniBand {
		fmt.Fprintf(&b, ", LID %#x", p.port.Attr.LID)
	}
	if p.ifname != "" {
		fmt.Fprintf(&b, " on %s", p.ifname)
	}
	b.WriteString(")")
	return b.String()
}

// scanVerbs lists every device with its ports and GIDs.
func scanVerbs() ([]verbsDevInfo, error) { return ibverbs.Scan() }

// verbsWant is what a member asks of its port: the environment's
// settings and the address it would use for TCP.
type verbsWant struct {
	hca      string // GPUBRIDGE_IB_HCA: "dev" or "dev:port"
	gidIndex int    // GPUBRIDGE_IB_GID_INDEX; -1: choose
	ip       net.IP // the address that routes to the store
	ifname   string // its interface
}

// verbsWantFromEnv reads GPUBRIDGE_IB_HCA and GPUBRIDGE_IB_GID_INDEX.
func verbsWantFromEnv() (verbsWant, error) {
	w := verbsWant{hca: strings.TrimSpace(os.Getenv(EnvIBHCA)), gidIndex: -1}
	if v := strings.TrimSpace(os.Getenv(EnvIBGIDIndex)); v != "" {
		i, err := strconv.Atoi(v)
		if err != nil || i < 0 || i > 65535 {
			return w, fmt.Errorf("%s=%q: want a GID table index (0, 1, 3, …)", EnvIBGIDIndex, v)
		}
		w.gidIndex = i
	}
	return w, nil
}

// pickVerbsPort chooses the port and GID from a scan (a pure function).
func pickVerbsPort(devs []verbsDevInfo, w verbsWant) (verbsPort, error) {
	if len(devs) == 0 {
		return verbsPort{}, fmt.Errorf("no RDMA device: libibverbs finds none (gbprobe lists what the node has)")
	}
	var have []string
	for _, d := range devs {
		if d.Err != nil {
			have = append(have, fmt.Sprintf("%s (cannot open: %v)", d.Name, d.Err))
			continue
		}
		for _, p := range d.Ports {
			have = append(have, fmt.Sprintf("%s port %d %s %s", d.Name, p.Num, p.Attr.LinkLayer, p.Attr.State))
		}
	}
	haveText := strings.Join(have, ", ")

	if w.hca != "" {
		name, portText, hasPort := strings.Cut(w.hca, ":")
		i := slices.IndexFunc(devs, func(d verbsDevInfo) bool { return d.Name == name })
		if i < 0 {
			return verbsPort{}, fmt.Errorf("%s=%s: no such RDMA device (have: %s)", EnvIBHCA, w.hca, haveText)
		}
		d := devs[i]
		if d.Err != nil {
			return verbsPort{}, fmt.Errorf("%s=%s: %v", EnvIBHCA, w.hca, d.Err)
		}
		var port *verbsPortInfo
		if hasPort {
			n, err := strconv.Atoi(portText)
			if err != nil {
				return verbsPort{}, fmt.Errorf("%s=%s: port %q is not a number", EnvIBHCA, w.hca, portText)
			}
			for k := range d.Ports {
				if d.Ports[k].Num == n {
					port = &d.Ports[k]
				}
			}
			if port == nil {
				return verbsPort{}, fmt.Errorf("%s=%s: %s has no port %d (have: %s)", EnvIBHCA, w.hca, name, n, haveText)
			}
		} else {
			for k := range d.Ports {
				if d.Ports[k].Attr.State == ibverbs.PortActive {
					port = &d.Ports[k]
					break
				}
			}
			if port == nil {
				return verbsPort{}, fmt.Errorf("%s=%s: no active port (have: %s)", EnvIBHCA, w.hca, haveText)
			}
		}
		return finishPort(d, *port, w, EnvIBHCA+"="+w.hca)
	}

	// The port whose RoCE v2 GID has the address that routes to the store.
	if w.ip != nil && !w.ip.IsLoopback() {
		for _, d := range devs {
			for _, p := range d.Ports {
				if d.Err != nil || p.Attr.State != ibverbs.PortActive {
					continue
				}
				for _, g := range p.GIDs {
					if g.Type != ibverbs.GIDTypeIB && g.GID.IP().Equal(w.ip) {
						how := fmt.Sprintf("its GID has %s, the address that routes to the store", w.ip)
						if w.ifname != "" {
							how = fmt.Sprintf("its GID has %s of %s, the interface that routes to the store", w.ip, w.ifname)
						}
						return finishPort(d, p, w, how)
					}
				}
			}
		}
	}
	// Otherwise the first active port: RoCE ports only when no address
	// says otherwise (the store on this host).
	local := w.ip == nil || w.ip.IsLoopback()
	for _, d := range devs {
		for _, p := range d.Ports {
			if d.Err != nil || p.Attr.State != ibverbs.PortActive {
				continue
			}
			if p.Attr.LinkLayer == ibverbs.LinkEthernet && !local {
				continue
			}
			how := "the first active InfiniBand port"
			if local {
				how = "the first active port (the store is on this host)"
			}
			return finishPort(d, p, w, how)
		}
	}
	if !local {
		return verbsPort{}, fmt.Errorf("no active RDMA port has a GID with %s (of %s, the interface that routes to the store) and no InfiniBand port is active (have: %s): set %s (and %s), or GPUBRIDGE_IFNAME",
			w.ip, w.ifname, haveText, EnvIBHCA, EnvIBGIDIndex)
	}
	return verbsPort{}, fmt.Errorf("no active RDMA port (have: %s)", haveText)
}

// finishPort picks the GID of the chosen port and checks it is usable.
func finishPort(d verbsDevInfo, p verbsPortInfo, w verbsWant, how string) (verbsPort, error) {
	out := verbsPort{dev: d.Name, port: p, how: how, ifname: w.ifname, limits: d.Attr}
	if p.Attr.State != ibverbs.PortActive {
		return out, fmt.Errorf("%s port %d is %s, not ACTIVE (chosen by %s)", d.Name, p.Num, p.Attr.State, how)
	}
	if p.Attr.ActiveMTU.Bytes() == 0 {
		return out, fmt.Errorf("%s port %d has no active MTU (%d)", d.Name, p.Num, p.Attr.ActiveMTU)
	}
	if w.gidIndex >= 0 {
		i := slices.IndexFunc(p.GIDs, func(g ibverbs.GIDEntry) bool { return g.Index == w.gidIndex })
		if i < 0 {
			return out, fmt.Errorf("%s=%d: %s port %d has no such GID (%s)", EnvIBGIDIndex, w.gidIndex, d.Name, p.Num, gidList(p.GIDs))
		}
		out.gid = p.GIDs[i]
		out.how += fmt.Sprintf(", %s=%d", EnvIBGIDIndex, w.gidIndex)
		out.ifname = ifaceName(out.gid.Ifindex, out.ifname)
		return out, nil
	}
	if p.Attr.LinkLayer == ibverbs.LinkInfiniBand {
		if len(p.GIDs) > 0 && p.GIDs[0].Index == 0 {
			out.gid = p.GIDs[0]
		}
		out.ifname = ""
		return out, nil
	}
	// RoCE: the address's RoCE v2 GID, else another GID with the address,
	// else the first RoCE v2 GID with an IPv4 address, else the first
	// RoCE v2 one, else the first.
	best, rank := -1, 99
	for i, g := range p.GIDs {
		mine := w.ip != nil && g.GID.IP().Equal(w.ip)
		r := 5
		switch {
		case mine && g.Type == ibverbs.GIDTypeRoCEv2:
			r = 0
		case mine && g.Type != ibverbs.GIDTypeIB:
			r = 1
		case g.Type == ibverbs.GIDTypeRoCEv2 && g.GID.IP().To4() != nil:
			r = 2
		case g.Type == ibverbs.GIDTypeRoCEv2:
			r = 3
		case g.Type == ibverbs.GIDTypeUnknown && g.GID.IP().To4() != nil:
			r = 4
		}
		if r < rank {
			best, rank = i, r
		}
	}
	if best < 0 {
		return out, fmt.Errorf("%s port %d (Ethernet) has no GID: is its interface up with an address?", d.Name, p.Num)
	}
	out.gid = p.GIDs[best]
	out.ifname = ifaceName(out.gid.Ifindex, out.ifname)
	return out, nil
}

func gidList(gids []ibverbs.GIDEntry) string {
	if len(gids) == 0 {
		return "no GIDs"
	}
	s := make([]string, len(gids))
	for i, g := range gids {
		s[i] = fmt.Sprintf("%d %s %s", g.Index, g.GID, g.Type)
	}
	return "GIDs " + strings.Join(s, ", ")
}

// ifaceName names interface index i, or returns def.
func ifaceName(i int, def string) string {
	if i <= 0 {
		return def
	}
	if ifc, err := net.InterfaceByIndex(i); err == nil {
		return ifc.Name
	}
	return def
}
