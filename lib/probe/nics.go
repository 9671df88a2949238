package probe

import (
	"context"
	"fmt"
	"net"
	"path/filepath"
	"sort"
	"strconv"
	"time"

	"github.com/vishvananda/netlink"
	"golang.org/x/sys/unix"

	"github.com/gpubridge/gpubridge/lib/netif"
)

// probeNICs lists the network interfaces of the current network namespace.
// speedRoot is the directory holding sys/class/net for link speeds: "/" (the
// host's sysfs, which shows the current namespace's interfaces when sysfs
// was mounted in it, as `ip netns exec` does).
func probeNICs(h *netif.Handle, speedRoot string) ([]NIC, error) {
	links, err := h.Links()
	if err != nil {
		return nil, fmt.Errorf("netlink: list links: %w", err)
	}
	out := make([]NIC, 0, len(links))
	for _, l := range links {
		a := l.Attrs()
		n := NIC{
			Name:      a.Name,
			Index:     a.Index,
			State:     "down",
			OperState: a.OperState.String(),
			Kind:      l.Type(),
			MTU:       a.MTU,
			Addresses: []string{},
		}
		if a.RawFlags&unix.IFF_UP != 0 && a.RawFlags&unix.IFF_RUNNING != 0 {
			n.State = "up"
		}
		if len(a.HardwareAddr) > 0 && a.Flags&net.FlagLoopback == 0 {
			n.MAC = a.HardwareAddr.String()
		}
		addrs, err := h.Addrs(l, netlink.FAMILY_ALL)
		if err != nil {
			return nil, fmt.Errorf("netlink: addresses of %s: %w", a.Name, err)
		}
		for _, ad := range addrs {
			if ad.IPNet != nil {
				n.Addresses = append(n.Addresses, ad.IPNet.String())
			}
		}
		if v, err := strconv.Atoi(read(filepath.Join(speedRoot, "sys/class/net", a.Name, "speed"))); err == nil && v > 0 {
			n.SpeedMbps = v
		}
		out = append(out, n)
	}
	sort.Slice(out, func(i, j int) bool { return out[i].Index < out[j].Index })
	return out, nil
}

// resolveTimeout bounds the name lookup of --route-to.
const resolveTimeout = 2 * time.Second

// routeTo asks the kernel which interface and source address traffic to
// host would use. Failures are reported in Route.Error, not returned.
func routeTo(ctx context.Context, h *netif.Handle, host string) *Route {
	r := &Route{To: host}
	ctx, cancel := context.WithTimeout(ctx, resolveTimeout)
	defer cancel()
	ip, err := netif.Resolve(ctx, host)
	if err != nil {
		r.Error = fmt.Sprintf("resolve %s: %v", host, err)
		return r
	}
	r.IP = ip.String()
	rt, err := h.RouteTo(ip)
	if err != nil {
		r.Error = fmt.Sprintf("route to %s: %v", ip, err)
		return r
	}
	if rt.Src != nil {
		r.Source = rt.Src.String()
	}
	if rt.Gateway != nil {
		r.Gateway = rt.Gateway.String()
	}
	r.Interface = rt.Interface
	if r.Interface == "" {
		r.Interface = fmt.Sprintf("ifindex %d", rt.LinkIndex)
	}
	return r
}
