// Package netif answers, through netlink, what the network interfaces of
// the caller's network namespace are and which one the kernel routes a
// destination by: what gbprobe reports, and where the TCP bridge listens.
package netif

import (
	"context"
	"errors"
	"fmt"
	"net"
	"sort"
	"strings"
	"time"

	"github.com/vishvananda/netlink"
	"golang.org/x/sys/unix"
)

// Timeout bounds every netlink request; the kernel answers in
// microseconds, so hitting it means something is badly wrong.
const Timeout = 2 * time.Second

// ErrNoRoute is a route request the kernel answered with no route.
var ErrNoRoute = errors.New("kernel returned no route")

// Handle is a netlink socket in the caller's network namespace.
type Handle struct{ h *netlink.Handle }

// Open opens a handle whose requests time out after Timeout.
func Open() (*Handle, error) {
	h, err := netlink.NewHandle(unix.NETLINK_ROUTE)
	if err != nil {
		return nil, fmt.Errorf("netlink: open: %w", err)
	}
	if err := h.SetSocketTimeout(Timeout); err != nil {
		h.Close()
		return nil, fmt.Errorf("netlink: set socket timeout: %w", err)
	}
	return &Handle{h: h}, nil
}

// Close closes the socket.
func (h *Handle) Close() { h.h.Close() }

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

// Links lists the interfaces.
func (h *Handle) Links() ([]netlink.Link, error) { return retryDump(h.h.LinkList) }

// Addrs lists l's addresses of a family (netlink.FAMILY_*); l nil: every
// interface's.
func (h *Handle) Addrs(l netlink.Link, family int) ([]netlink.Addr, error) {
	return retryDump(func() ([]netlink.Addr, error) { return h.h.AddrList(l, family) })
}

// Link returns the interface called name.
func (h *Handle) Link(name string) (netlink.Link, error) { return h.h.LinkByName(name) }

// Route is the kernel's route to a destination.
type Route struct {
	Src       net.IP // the source address it would use; nil: none chosen
	Gateway   net.IP // nil: directly connected
	LinkIndex int
	Interface string // the link's name; "" when it could not be read
}

// RouteTo asks the kernel how it would send to dst.
func (h *Handle) RouteTo(dst net.IP) (Route, error) {
	routes, err := h.h.RouteGet(dst)
	if err != nil {
		return Route{}, err
	}
	if len(routes) == 0 {
		return Route{}, ErrNoRoute
	}
	rt := routes[0]
	r := Route{Src: rt.Src, Gateway: rt.Gw, LinkIndex: rt.LinkIndex}
	if l, err := h.h.LinkByIndex(rt.LinkIndex); err == nil {
		r.Interface = l.Attrs().Name
	}
	return r, nil
}

// LinkIP returns an interface's first IPv4 address, else its first IPv6
// address that is not link-local.
func (h *Handle) LinkIP(l netlink.Link) (net.IP, error) {
	for _, fam := range []int{netlink.FAMILY_V4, netlink.FAMILY_V6} {
		addrs, err := h.Addrs(l, fam)
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

// InterfaceOf names the interface holding ip ("lo" for a loopback address
// no interface lists), or "" when none does.
func (h *Handle) InterfaceOf(ip net.IP) string {
	if ip.IsUnspecified() {
		return ""
	}
	addrs, err := h.Addrs(nil, netlink.FAMILY_ALL)
	if err != nil {
		return ""
	}
	for _, a := range addrs {
		if a.IPNet != nil && a.IP.Equal(ip) {
			if l, err := h.h.LinkByIndex(a.LinkIndex); err == nil {
				return l.Attrs().Name
			}
		}
	}
	if ip.IsLoopback() {
		return "lo"
	}
	return ""
}

// LinkNames lists the interfaces' names, sorted, for messages.
func (h *Handle) LinkNames() string {
	ls, err := h.Links()
	if err != nil {
		return "unknown"
	}
	names := make([]string, len(ls))
	for i, l := range ls {
		names[i] = l.Attrs().Name
	}
	sort.Strings(names)
	return strings.Join(names, ", ")
}

// Resolve returns host's address: host itself when it is one, else the
// first IPv4 address a lookup gives, else the first address. ctx bounds
// the lookup.
func Resolve(ctx context.Context, host string) (net.IP, error) {
	if ip := net.ParseIP(host); ip != nil {
		return ip, nil
	}
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
