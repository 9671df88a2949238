package store

import (
	"fmt"
	"net"
	"strconv"
	"strings"
)

// AddrError is the error of a store address that cannot reach a server: a
// missing host or port, or port 0 (what "$MASTER_ADDR:$MASTER_PORT" becomes
// when MASTER_PORT is not set). Dial returns it at once instead of retrying.
type AddrError struct {
	Addr   string
	Reason string
}

func (e *AddrError) Error() string {
	if e.Addr == "" {
		return e.Reason
	}
	return fmt.Sprintf("store address %q: %s", e.Addr, e.Reason)
}

// CheckAddr checks that addr is HOST:PORT with a host and a port from 1 to
// 65535; it returns an *AddrError otherwise.
func CheckAddr(addr string) error {
	host, port, err := net.SplitHostPort(addr)
	if err != nil {
		return &AddrError{Addr: addr, Reason: "want HOST:PORT: " + err.Error()}
	}
	if host == "" {
		return &AddrError{Addr: addr, Reason: "the host is missing (want HOST:PORT; is MASTER_ADDR set?)"}
	}
	if port == "" {
		return &AddrError{Addr: addr, Reason: "the port is missing (want HOST:PORT; is MASTER_PORT set?)"}
	}
	n, err := strconv.ParseUint(port, 10, 16)
	switch {
	case err != nil:
		return &AddrError{Addr: addr, Reason: fmt.Sprintf("port %q is not a number from 1 to 65535", port)}
	case n == 0:
		return &AddrError{Addr: addr, Reason: "port 0 is no server's port (is MASTER_PORT set?)"}
	}
	return nil
}

// ResolveAddr returns the store address a tool uses: flag when set, else
// MASTER_ADDR:MASTER_PORT from getenv, checked with CheckAddr.
func ResolveAddr(flag string, getenv func(string) string) (string, error) {
	addr := flag
	if addr == "" {
		host, port := getenv("MASTER_ADDR"), getenv("MASTER_PORT")
		var unset []string
		if host == "" {
			unset = append(unset, "MASTER_ADDR")
		}
		if port == "" {
			unset = append(unset, "MASTER_PORT")
		}
		if len(unset) > 0 {
			return "", &AddrError{Reason: fmt.Sprintf("--store is required (or GPUBRIDGE_STORE, or MASTER_ADDR and MASTER_PORT; %s not set)",
				strings.Join(unset, " and "))}
		}
		addr = net.JoinHostPort(host, port)
	}
	if err := CheckAddr(addr); err != nil {
		return "", fmt.Errorf("--store: %w", err)
	}
	return addr, nil
}
