package probe

import (
	"context"
	"errors"
	"fmt"
	"net"
	"path/filepath"
	"sort"
	"strconv"
	"time"

	"github.com/vishvananda/netlink"
	"golang.org/x/sys/unix"
)

// netlinkTimeout bounds every netlink request; the kernel answers in
// microseconds, so hitting it means something is badly wrong.
const netlinkTimeout = 2 * time.Second

// newNetlink opens a netlink handle in the caller's network namespace with
// bounded socket reads.
func newNetlink() (*netlink.Handle, error) {
	h, err := netlink.NewHandle(unix.NETLINK_ROUTE)
	if err != nil {
		return nil, fmt.Errorf("netlink: open: %w", err)
	}
	if err := h.SetSocketTimeout(netlinkTimeout); err != nil {
		h.Close()
		return nil, fmt.Errorf("netlink: set socket timeout: %w", err)
	}
	return h, nil
}

// retryDump repeats a netlink dump that the kernel interrupted because the
// table changed under it (ErrDumpInterrupted), a few times.
func retryDump[T any](f func() (T, error)) (T, error) {
	var v T
	var err error
	for range 3 {
		v, err = f()
		if !errors.Is(err, netlink.ErrDumpInterrupted) {
			return v, err
		}
	}
	return v, err
}

// probeNICs lists the network interfaces of the current network namespace.
// speedRoot is the directory holding sys/class/net for link speeds: "/" (the
// host's sysfs, which shows the current namespace's interfaces when sysfs
// was mounted in it, as `ip netns exec` does).
func probeNICs(h *netlink.Handle, speedRoot string) ([]NIC, error) {
	links, err := retryDump(h.LinkList)
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
		addrs, err := retryDump(func() ([]netlink.Addr, error) { return h.AddrList(l, netlink.FAMILY_ALL) })
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
func routeTo(ctx context.Context, h *netlink.Handle, host string, nics []NIC) *Route {
	r := &Route{To: host}
	ip := net.ParseIP(host)
	if ip == nil {
		ctx, cancel := context.WithTimeout(ctx, resolveTimeout)
		defer cancel()
		addrs, err := net.DefaultResolver.LookupIPAddr(ctx, host)
		if err != nil {
			r.Error = fmt.Sprintf("resolve %s: %v", host, err)
			return r
		}
		ip = pickIP(addrs)
		if ip == nil {
			r.Error = fmt.Sprintf("resolve %s: no addresses", host)
			return r
		}
	}
	r.IP = ip.String()
	routes, err := h.RouteGet(ip)
	if err != nil {
		r.Error = fmt.Sprintf("route to %s: %v", ip, err)
		return r
	}
	if len(routes) == 0 {
		r.Error = fmt.Sprintf("route to %s: kernel returned no route", ip)
		return r
	}
	rt := routes[0]
	if rt.Src != nil {
		r.Source = rt.Src.String()
	}
	if rt.Gw != nil {
		r.Gateway = rt.Gw.String()
	}
	for _, n := range nics {
		if n.Index == rt.LinkIndex {
			r.Interface = n.Name
		}
	}
	if r.Interface == "" {
		if l, err := h.LinkByIndex(rt.LinkIndex); err == nil {
			r.Interface = l.Attrs().Name
		} else {
			r.Interface = fmt.Sprintf("ifindex %d", rt.LinkIndex)
		}
	}
	return r
}

// pickIP prefers an IPv4 address, as the bridge's TCP transport does.
func pickIP(addrs []net.IPAddr) net.IP {
	for _, a := range addrs {
		if a.IP.To4() != nil {
			return a.IP
		}
	}
	if len(addrs) > 0 {
		return addrs[0].IP
	}
	return nil
}
