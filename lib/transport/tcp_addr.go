package transport

import (
	"context"
	"fmt"
	"net"
	"time"

	"github.com/gpubridge/gpubridge/lib/netif"
)

// resolveTimeout bounds the name lookups of listenAddr.
const resolveTimeout = 5 * time.Second

// listenAddr picks the address a TCP member listens on and advertises, and
// the interface it belongs to:
//   - ListenHost, when set (an IP, or a name resolved to one);
//   - else the first address of Interface (GPUBRIDGE_IFNAME), IPv4 first;
//   - else the source address the kernel uses to reach the store's host:
//     the interface that routes to the store, or loopback when the store
//     is on this host at a loopback address.
func listenAddr(ctx context.Context, cfg *Config) (net.IP, string, error) {
	h, err := netif.Open()
	if err != nil {
		return nil, "", err
	}
	defer h.Close()
	ctx, cancel := context.WithTimeout(ctx, resolveTimeout)
	defer cancel()
	switch {
	case cfg.ListenHost != "":
		ip, err := netif.Resolve(ctx, cfg.ListenHost)
		if err != nil {
			return nil, "", fmt.Errorf("listen host: %w", err)
		}
		if ip.IsUnspecified() {
			return nil, "", fmt.Errorf("listen host %s: need an address the other members can reach", cfg.ListenHost)
		}
		return ip, h.InterfaceOf(ip), nil
	case cfg.Interface != "":
		l, err := h.Link(cfg.Interface)
		if err != nil {
			return nil, "", fmt.Errorf("interface %q (GPUBRIDGE_IFNAME): %w (interfaces here: %s)", cfg.Interface, err, h.LinkNames())
		}
		ip, err := h.LinkIP(l)
		if err != nil {
			return nil, "", fmt.Errorf("interface %q (GPUBRIDGE_IFNAME): %w", cfg.Interface, err)
		}
		return ip, cfg.Interface, nil
	}
	host, _, err := net.SplitHostPort(cfg.Store.Addr())
	if err != nil {
		return nil, "", fmt.Errorf("store address %q: %w", cfg.Store.Addr(), err)
	}
	dst, err := netif.Resolve(ctx, host)
	if err != nil {
		return nil, "", fmt.Errorf("store host: %w", err)
	}
	rt, err := h.RouteTo(dst)
	if err != nil {
		return nil, "", fmt.Errorf("no route to the store's host %s (%v); set GPUBRIDGE_IFNAME", dst, err)
	}
	src := rt.Src
	if src == nil {
		l, err := h.Link(rt.Interface)
		if err != nil {
			return nil, "", fmt.Errorf("route to the store's host %s: interface %d: %w", dst, rt.LinkIndex, err)
		}
		if src, err = h.LinkIP(l); err != nil {
			return nil, "", fmt.Errorf("route to the store's host %s: %w", dst, err)
		}
	}
	// A local address routes through lo; name the interface that owns it.
	return src, h.InterfaceOf(src), nil
}
