package transport

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"time"

	"github.com/gpubridge/gpubridge/lib/ibverbs"
)

// VerbsCheck is the device step of gbbridge selftest --transport verbs: the
// port and GID this member's verbs transport would use (chosen as its
// set-up chooses them), and a loopback: two queue pairs of that port
// connected to each other, an RDMA WRITE with immediate data from one
// into the other's memory, checked byte for byte.
type VerbsCheckReport struct {
	Device    string  `json:"device"`
	Port      int     `json:"port"`
	State     string  `json:"state"`
	LinkLayer string  `json:"link_layer"`
	ActiveMTU int     `json:"active_mtu"`
	Gbps      float64 `json:"gbps,omitempty"`
	LID       int     `json:"lid,omitempty"`
	GIDIndex  int     `json:"gid_index"`
	GID       string  `json:"gid"`
	GIDType   string  `json:"gid_type"`
	Netdev    string  `json:"netdev,omitempty"`
	// Chosen says why this port: GPUBRIDGE_IB_HCA, the store's route, …
	Chosen  string `json:"chosen"`
	MaxQP   int    `json:"max_qp"`
	MaxQPWR int    `json:"max_qp_wr"`
	// Loopback is the write through two connected queue pairs.
	LoopbackBytes  int     `json:"loopback_bytes"`
	LoopbackMicros float64 `json:"loopback_us"`
}

// Describe is the report in a line.
func (r *VerbsCheckReport) Describe() string {
	s := fmt.Sprintf("%s port %d %s, %s, active MTU %d", r.Device, r.Port, r.State, r.LinkLayer, r.ActiveMTU)
	if r.Gbps > 0 {
		s += fmt.Sprintf(", %g Gb/s", r.Gbps)
	}
	if r.LinkLayer == ibverbs.LinkInfiniBand.String() {
		s += fmt.Sprintf(", LID %#x", r.LID)
	}
	s += fmt.Sprintf(", %s GID %d %s", r.GIDType, r.GIDIndex, r.GID)
	if r.Netdev != "" {
		s += " on " + r.Netdev
	}
	return s + " (" + r.Chosen + ")"
}

// VerbsCheckOptions say how the port is found, as the set-up finds it: the
// store's address (its route picks the interface), or an interface or
// listen address.
type VerbsCheckOptions struct {
	StoreAddr  string
	Interface  string
	ListenHost string
	Timeout    time.Duration // the loopback's deadline (default 30 s)
	// open replaces the device (tests).
	open func(ctx context.Context, c *Config) (verbsPort, vDev, error)
}

// addrStore is a Store that only has an address: what listenAddr reads.
type addrStore struct {
	Store
	addr string
}

func (a addrStore) Addr() string { return a.addr }

// VerbsCheck finds this member's port, checks it and runs the loopback.
func VerbsCheck(ctx context.Context, o VerbsCheckOptions) (*VerbsCheckReport, error) {
	if o.StoreAddr == "" {
		o.StoreAddr = "127.0.0.1:0"
	}
	if o.Timeout <= 0 {
		o.Timeout = 30 * time.Second
	}
	ctx, cancel := context.WithTimeout(ctx, o.Timeout)
	defer cancel()
	s := &setup{cfg: Config{Store: addrStore{addr: o.StoreAddr}, Interface: o.Interface, ListenHost: o.ListenHost, verbsOpen: o.open}}
	sel, dev, err := openVerbs(ctx, s)
	if err != nil {
		return nil, err
	}
	rep := &VerbsCheckReport{Device: sel.dev, Port: sel.port.Num, State: sel.port.Attr.State.String(), LinkLayer: sel.port.Attr.LinkLayer.String(),
		ActiveMTU: sel.port.Attr.ActiveMTU.Bytes(), Gbps: sel.port.Attr.Gbps(), LID: int(sel.port.Attr.LID),
		GIDIndex: sel.gid.Index, GID: sel.gid.GID.String(), GIDType: sel.gid.Type.String(), Netdev: sel.ifname, Chosen: sel.how,
		MaxQP: sel.limits.MaxQP, MaxQPWR: sel.limits.MaxQPWR}
	t0 := time.Now()
	n, err := verbsLoopback(ctx, sel, dev)
	if cerr := dev.close(); err == nil && cerr != nil {
		err = cerr
	}
	if err != nil {
		return rep, fmt.Errorf("loopback on %s port %d: %w", sel.dev, sel.port.Num, err)
	}
	rep.LoopbackBytes, rep.LoopbackMicros = n, float64(time.Since(t0).Microseconds())
	return rep, nil
}

// verbsLoopback connects two queue pairs of the port to each other and
// writes a pattern from one into the other's memory with immediate data.
func verbsLoopback(ctx context.Context, sel verbsPort, dev vDev) (int, error) {
	const size = 1 << 20
	src := make([]byte, size)
	for i := range src {
		src[i] = byte(i*7 + i>>11)
	}
	dst := make([]byte, size)
	smr, err := dev.register(src, false)
	if err != nil {
		return 0, err
	}
	defer smr.close()
	dmr, err := dev.register(dst, true)
	if err != nil {
		return 0, err
	}
	defer dmr.close()
	var qps [2]vQP
	for i := range qps {
		if qps[i], err = dev.newQP(i, 4, 4); err != nil {
			return 0, err
		}
		defer qps[i].close()
	}
	if err := qps[1].postRecv(wrRecv); err != nil {
		return 0, err
	}
	for i, q := range qps {
		r := vRemote{qpn: qps[1-i].num(), lid: sel.port.Attr.LID, gid: sel.gid.GID, global: sel.port.Attr.LinkLayer == ibverbs.LinkEthernet,
			mtu: sel.port.Attr.ActiveMTU, gidIndex: sel.gid.Index, port: sel.port.Num}
		if err := q.readyToReceive(r, 0x123456); err != nil {
			return 0, err
		}
		if err := q.readyToSend(0x123456); err != nil {
			return 0, err
		}
	}
	lk, _ := smr.keys()
	_, rk := dmr.keys()
	const imm = 0x0b1d9e
	if err := qps[0].write(1, []ibverbs.SGE{{Addr: smr.addr(), Len: size, LKey: lk}}, dmr.addr(), rk, imm, true); err != nil {
		return 0, err
	}
	var sent, got bool
	wcs := make([]ibverbs.WC, 4)
	for !sent || !got {
		for i, q := range qps {
			n, err := q.poll(wcs)
			if err != nil {
				return 0, err
			}
			for _, w := range wcs[:n] {
				if w.Status != ibverbs.StatusSuccess {
					return 0, fmt.Errorf("queue pair %d: %s", i, ibverbs.StatusString(w.Status))
				}
				if i == 0 {
					sent = true
				} else if w.Imm != imm {
					return 0, fmt.Errorf("immediate data %#x arrived, %#x was sent", w.Imm, imm)
				} else {
					got = true
				}
			}
		}
		if ctx.Err() != nil {
			return 0, fmt.Errorf("no completion (sent %v, received %v): %w", sent, got, ctx.Err())
		}
		if !sent || !got {
			_, _ = dev.wait(time.Millisecond)
		}
	}
	if !bytes.Equal(src, dst) {
		return 0, errors.New("the written bytes differ from the source")
	}
	return size, nil
}
