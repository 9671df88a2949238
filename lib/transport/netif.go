package transport

import (
	"context"
	"fmt"
	"net"
	"sort"
	"strings"
	"time"

	"github.com/vishvananda/netlink"
	"golang.org/x/sys/unix"
)

const (
	netlinkTimeout = 2 * time.Second
	resolveTimeout = 5 * time.Second
)

// listenAddr picks the address a TCP member listens on and advertises, and
// the interface it belongs to:
//   - ListenHost, when set (an IP, or a name resolved to one);
//   - else the first address of Interface (GPUBRIDGE_IFNAME), IPv4 first;
//   - else the source address the kernel uses to reach the store's host
//     (netlink RouteGet): the interface that routes to the store, or
//     loopback when the store is on this host at a loopback address.
func listenAddr(ctx context.Context, cfg *Config) (net.IP, string, error) {
	h, err := netlink.NewHandle(unix.NETLINK_ROUTE)
	if err != nil {
		return nil, "", fmt.Errorf("netlink: %w", err)
	}
	defer h.Close()
	if err := h.SetSocketTimeout(netlinkTimeout); err != nil {
		return nil, "", fmt.Errorf("netlink: %w", err)
	}
	switch {
	case cfg.ListenHost != "":
		ip, err := resolve(ctx, cfg.ListenHost)
		if err != nil {
			return nil, "", fmt.Errorf("listen host: %w", err)
		}
		if ip.IsUnspecified() {
			return nil, "", fmt.Errorf("listen host %s: need an address the other members can reach", cfg.ListenHost)
		}
		return ip, ifaceOf(h, ip), nil
	case cfg.Interface != "":
		l, err := h.LinkByName(cfg.Interface)
		if err != nil {
			return nil, "", fmt.Errorf("interface %q (GPUBRIDGE_IFNAME): %w (interfaces here: %s)", cfg.Interface, err, linkNames(h))
		}
		ip, err := linkIP(h, l)
		if err != nil {
			return nil, "", fmt.Errorf("interface %q (GPUBRIDGE_IFNAME): %w", cfg.Interface, err)
		}
		return ip, cfg.Interface, nil
	}
	host, _, err := net.SplitHostPort(cfg.Store.Addr())
	if err != nil {
		return nil, "", fmt.Errorf("store address %q: %w", cfg.Store.Addr(), err)
	}
	dst, err := resolve(ctx, host)
	if err != nil {
		return nil, "", fmt.Errorf("store host: %w", err)
	}
	routes, err := h.RouteGet(dst)
	if err != nil || len(routes) == 0 {
		return nil, "", fmt.Errorf("no route to the store's host %s (%v); set GPUBRIDGE_IFNAME", dst, err)
	}
	rt := routes[0]
	src := rt.Src
	if src == nil {
		l, err := h.LinkByIndex(rt.LinkIndex)
		if err != nil {
			return nil, "", fmt.Errorf("route to the store's host %s: interface %d: %w", dst, rt.LinkIndex, err)
		}
		if src, err = linkIP(h, l); err != nil {
			return nil, "", fmt.Errorf("route to the store's host %s: %w", dst, err)
		}
	}
	// A local address routes through lo; name the interface that owns it.
	return src, ifaceOf(h, src), nil
}

func resolve(ctx context.Context, host string) (net.IP, error) {
	if ip := net.ParseIP(host); ip != nil {
		return ip, nil
	}
	ctx, cancel := context.WithTimeout(ctx, resolveTimeout)
	defer cancel()
	addrs, err := net.DefaultResolver.LookupIPAddr(ctx, host)
	if err != nil {
		return nil, err
	}
	for _, a := range addrs {
		if a.IP.To4() != nil {
			return a.IP, nil
		}
	}
	if len(addrs) == 0 {
		return nil, fmt.Errorf("%s: no addresses", host)
	}
	return addrs[0].IP, nil
}

// linkIP returns the interface's first IPv4 address, else its first global
// IPv6 address.
func linkIP(h *netlink.Handle, l netlink.Link) (net.IP, error) {
	for _, fam := range []int{netlink.FAMILY_V4, netlink.FAMILY_V6} {
		addrs, err := h.AddrList(l, fam)
		if err != nil {
			return nil, fmt.Errorf("addresses: %w", err)
		}
		for _, a := range addrs {
			if a.IPNet != nil && !a.IP.IsLinkLocalUnicast() {
				return a.IP, nil
			}
		}
	}
	return nil, fmt.Errorf("%s has no usable IP address", l.Attrs().Name)
}

// ifaceOf names the interface holding ip, or "" when none does.
func ifaceOf(h *netlink.Handle, ip net.IP) string {
	if ip.IsUnspecified() {
		return ""
	}
	addrs, err := h.AddrList(nil, netlink.FAMILY_ALL)
	if err != nil {
		return ""
	}
	for _, a := range addrs {
		if a.IPNet != nil && a.IP.Equal(ip) {
			if l, err := h.LinkByIndex(a.LinkIndex); err == nil {
				return l.Attrs().Name
			}
		}
	}
	if ip.IsLoopback() {
		return "lo"
	}
	return ""
}

func linkNames(h *netlink.Handle) string {
	ls, err := h.LinkList()
	if err != nil {
		return "unknown"
	}
	var names []string
	for _, l := range ls {
		names = append(names, l.Attrs().Name)
	}
	sort.Strings(names)
	return strings.Join(names, ", ")
}
