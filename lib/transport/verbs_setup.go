package transport

import (
	"context"
	"crypto/hmac"
	"crypto/sha256"
	"encoding/binary"
	"encoding/hex"
	"errors"
	"fmt"
	"strconv"
	"strings"
	"sync"
	"time"

	"github.com/gpubridge/gpubridge/lib/ibverbs"
	"github.com/gpubridge/gpubridge/lib/rendezvous"
	"github.com/gpubridge/gpubridge/lib/wire"
)

// Setting up the verbs transport (verbs.go has the protocol): open the
// port (verbs_select.go), make every queue pair and ring, publish the
// endpoint record, connect the control queue pairs, exchange the data
// queue pair numbers over them, say hello on every data stream, barrier.

func init() { register(&driver{kind: Verbs, establish: establishVerbs}) }

const (
	// verbsMaxMembers keeps the endpoint record (6 hex digits of control
	// queue pair number per member) within the rendezvous's 4 KiB.
	verbsMaxMembers = 512
	// Steps of the set-up frames on the control and data streams (never
	// seen by the layer above: set-up consumes them).
	verbsSetupStep = 0xFFFF_FFF0
	verbsHelloStep = 0xFFFF_FFF1
	verbsMACLabel  = "verbs qpns\x00"
	verbsPSNLabel  = "verbs psn\x00"
	verbsHelloText = "gpubridge verbs hello"
	// verbsLostGrace is how long set-up waits for a recorded failure
	// before it reports a peer that stopped answering.
	verbsLostGrace = 2 * time.Second
)

// verbsEndpoint is a verbs member's endpoint record.
type verbsEndpoint struct {
	endpoint
	Device    string `json:"device"`
	Port      int    `json:"port"`
	LinkLayer string `json:"link_layer"`
	MTU       int    `json:"mtu"` // the IB MTU code, 1 (256 bytes) … 5 (4096)
	GID       string `json:"gid"` // 32 hex digits
	GIDIndex  int    `json:"gid_index"`
	LID       int    `json:"lid"`
	RingAddr  uint64 `json:"ring_addr"`
	RingKey   uint32 `json:"ring_key"`
	DataCap   uint64 `json:"data_cap"`
	CtlCap    uint64 `json:"ctl_cap"`
	// QPNs is the control queue pair number for each member, 6 hex digits
	// each, in member order ("000000" for the writer itself).
	QPNs string `json:"qpns"`
}

// check validates a peer's record for n members (what a decoder of
// untrusted input owes: bounded, well-formed values).
func (e *verbsEndpoint) check(n int) error {
	switch {
	case e.Device == "" || len(e.Device) > 64 || strings.ContainsFunc(e.Device, func(r rune) bool { return r <= ' ' || r > '~' }):
		return fmt.Errorf("device name %q", rendezvous.PeerText([]byte(e.Device), 64))
	case e.Port < 1 || e.Port > 255:
		return fmt.Errorf("port %d", e.Port)
	case e.LinkLayer != ibverbs.LinkEthernet.String() && e.LinkLayer != ibverbs.LinkInfiniBand.String():
		return fmt.Errorf("link layer %q", rendezvous.PeerText([]byte(e.LinkLayer), 32))
	case ibverbs.MTU(e.MTU).Bytes() == 0:
		return fmt.Errorf("MTU code %d", e.MTU)
	case len(e.GID) != 32:
		return fmt.Errorf("GID of %d hex digits", len(e.GID))
	case e.GIDIndex < 0 || e.GIDIndex > 65535:
		return fmt.Errorf("GID index %d", e.GIDIndex)
	case e.LID < 0 || e.LID > 0xffff:
		return fmt.Errorf("LID %d", e.LID)
	case e.DataCap < 2*4096 || e.DataCap%4096 != 0 || e.DataCap > maxRingBytes+4096:
		return fmt.Errorf("data ring of %d bytes", e.DataCap)
	case e.CtlCap < 2*4096 || e.CtlCap%4096 != 0 || e.CtlCap > verbsCtlRing+4096:
		return fmt.Errorf("control ring of %d bytes", e.CtlCap)
	case len(e.QPNs) != 6*n:
		return fmt.Errorf("%d hex digits of queue pair numbers for %d members", len(e.QPNs), n)
	}
	if _, err := hex.DecodeString(e.GID); err != nil {
		return fmt.Errorf("GID %q is not hex", e.GID)
	}
	if _, err := hex.DecodeString(e.QPNs); err != nil {
		return errors.New("queue pair numbers are not hex")
	}
	return nil
}

// gid is the record's GID.
func (e *verbsEndpoint) gid() ibverbs.GID {
	var g ibverbs.GID
	_, _ = hex.Decode(g[:], []byte(e.GID))
	return g
}

// qpn is the control queue pair number the record gives member i.
func (e *verbsEndpoint) qpn(i int) uint32 {
	v, _ := strconv.ParseUint(e.QPNs[6*i:6*i+6], 16, 32)
	return uint32(v)
}

// verbsPSN is the first packet sequence number of the queue pair from
// member from to member to, stream st: derived from the job's secret, so
// both ends know it and a stale packet of another job does not match.
func verbsPSN(secret []byte, from, to, st int) uint32 {
	h := hmac.New(sha256.New, secret)
	h.Write([]byte(verbsPSNLabel))
	var b [12]byte
	binary.LittleEndian.PutUint32(b[0:], uint32(from))
	binary.LittleEndian.PutUint32(b[4:], uint32(to))
	binary.LittleEndian.PutUint32(b[8:], uint32(st))
	h.Write(b[:])
	return binary.LittleEndian.Uint32(h.Sum(nil)) & 0xffffff
}

// verbsQPNMAC signs the data queue pair numbers member from gives to.
func verbsQPNMAC(secret []byte, from, to int, qpns []byte) []byte {
	h := hmac.New(sha256.New, secret)
	h.Write([]byte(verbsMACLabel))
	var b [8]byte
	binary.LittleEndian.PutUint32(b[0:], uint32(from))
	binary.LittleEndian.PutUint32(b[4:], uint32(to))
	h.Write(b[:])
	h.Write(qpns)
	return h.Sum(nil)
}

// openVerbs finds this member's port and opens its device: the real one,
// or the test hook's.
func openVerbs(ctx context.Context, s *setup) (verbsPort, vDev, error) {
	if s.cfg.verbsOpen != nil {
		return s.cfg.verbsOpen(ctx, &s.cfg)
	}
	if err := ibverbs.Load(""); err != nil {
		return verbsPort{}, nil, fmt.Errorf("the verbs transport needs libibverbs: %w (install rdma-core's libibverbs1 and the provider of this HCA, Debian's ibverbs-providers; or ask for --transport tcp)", err)
	}
	w, err := verbsWantFromEnv()
	if err != nil {
		return verbsPort{}, nil, err
	}
	if w.hca == "" {
		ip, ifname, err := listenAddr(ctx, &s.cfg)
		if err != nil {
			return verbsPort{}, nil, err
		}
		w.ip, w.ifname = ip, ifname
	}
	devs, err := scanVerbs()
	if err != nil {
		return verbsPort{}, nil, fmt.Errorf("the verbs transport: %w", err)
	}
	p, err := pickVerbsPort(devs, w)
	if err != nil {
		return verbsPort{}, nil, err
	}
	d, err := openVerbsHW(p.dev, p.port.Num)
	if err != nil {
		return verbsPort{}, nil, fmt.Errorf("open %s: %w", p.dev, err)
	}
	return p, d, nil
}

func establishVerbs(ctx context.Context, s *setup) (_ Mesh, err error) {
	n, self, S := len(s.cfg.Members), s.cfg.Self, s.cfg.Streams
	if n > verbsMaxMembers {
		return nil, fmt.Errorf("the verbs transport takes at most %d members, this bridge has %d", verbsMaxMembers, n)
	}
	sel, dev, err := openVerbs(ctx, s)
	if err != nil {
		return nil, err
	}
	s.log.Debug("verbs port", "member", self, "port", sel.Describe(), "chosen", sel.how)
	m := &verbsMesh{meshBase: meshBase[*verbsStream]{self: self, size: n, streams: S, crc: s.cfg.CRC},
		dev: dev, log: s.log, regs: &verbsRegs{dev: dev}, peersState: make([]verbsPeer, n), done: make(chan struct{})}
	defer func() {
		if err != nil {
			m.closing.Store(true)
			m.closeMu.Lock()
			m.closed = true
			m.closeMu.Unlock()
			close(m.done)
			m.teardown()
		}
	}()
	if err := m.build(sel, s.cfg.RingBytes); err != nil {
		return nil, err
	}
	m.startProgress()

	ep := verbsEndpoint{endpoint: s.endpoint(), Device: sel.dev, Port: sel.port.Num, LinkLayer: sel.port.Attr.LinkLayer.String(),
		MTU: int(sel.port.Attr.ActiveMTU), GID: hex.EncodeToString(sel.gid.GID[:]), GIDIndex: sel.gid.Index,
		LID: int(sel.port.Attr.LID), RingAddr: m.mrs[0].addr(), DataCap: m.dataCap, CtlCap: m.ctlCap}
	_, ep.RingKey = m.mrs[0].keys()
	var qpns strings.Builder
	for p := range n {
		q := uint32(0)
		if p != self {
			q = m.links[p][S].qp.num()
		}
		fmt.Fprintf(&qpns, "%06x", q&0xffffff)
	}
	ep.QPNs = qpns.String()
	if s.cfg.verbsForge != nil {
		s.cfg.verbsForge(&ep)
	}
	if err := s.rv.Publish(ctx, ep); err != nil {
		return nil, err
	}
	eps, err := gather[verbsEndpoint](ctx, s)
	if err != nil {
		return nil, err
	}
	if err := s.agreeVerbs(eps); err != nil {
		return nil, err
	}
	m.peers = make([]string, n)
	m.procs = make([]string, n)
	for i, e := range eps {
		m.peers[i] = fmt.Sprintf("member %d (rank %d on %s, %s port %d)", i, e.Rank, e.Hostname, e.Device, e.Port)
		m.procs[i] = fmt.Sprintf("%s of rank %d (pid %d on %s)", s.cfg.Process, e.Rank, e.PID, e.Hostname)
	}
	if err := m.connect(ctx, s, sel, eps); err != nil {
		return nil, err
	}
	if err := s.rv.Barrier(ctx); err != nil {
		return nil, err
	}
	m.desc = fmt.Sprintf("verbs, %d streams per peer, %s, %s, MTU %d", S, crcWords(s.cfg.CRC), sel.Describe(), sel.port.Attr.ActiveMTU.Bytes())
	return m, nil
}

// agreeVerbs checks what the records must share beyond the common
// settings: the link layer (the same error on every member).
func (s *setup) agreeVerbs(eps []verbsEndpoint) error {
	for i := range eps {
		if err := eps[i].check(len(eps)); err != nil {
			return &rendezvous.SharedError{Err: fmt.Errorf("%s published a bad verbs endpoint record: %w", s.rv.Who(i), err)}
		}
	}
	for i, e := range eps {
		if e.LinkLayer != eps[0].LinkLayer {
			return &rendezvous.SharedError{Err: fmt.Errorf("the verbs transport needs one link layer: %s uses %s port %d (%s), %s uses %s port %d (%s)",
				s.rv.Who(0), eps[0].Device, eps[0].Port, eps[0].LinkLayer, s.rv.Who(i), e.Device, e.Port, e.LinkLayer)}
		}
	}
	return nil
}

// ringSizes are the receive ring sizes: RingBytes rounded up to pages
// plus a page (a frame of RingBytes/2 fits one record), and the control
// ring's.
func (m *verbsMesh) ringSizes(ringBytes int) (uint64, uint64) {
	data := (uint64(ringBytes)+4095)&^4095 + 4096
	return data, verbsCtlRing + 4096
}

// build makes every queue pair, ring and staging area. Rings: one
// registration for every inbound ring (its address and key go in the
// record; peer p's rings begin at peerIndex(self, p) × (S × dataCap +
// ctlCap)); staging: one registration for every stream's staging ring
// (half a data ring and a page: one frame of the largest record size in
// flight, smaller ones beside it; a control ring's size for control) and
// header slots.
func (m *verbsMesh) build(sel verbsPort, ringBytes int) error {
	n, self, S := m.size, m.self, m.streams
	m.dataCap, m.ctlCap = m.ringSizes(ringBytes)
	dataStage := (m.dataCap/2+4095)&^4095 + 4096
	perPeer := uint64(S)*m.dataCap + m.ctlCap
	hdrBytes := uint64(verbsWindow * verbsRecHdr)
	rings := make([]byte, uint64(n-1)*perPeer)
	stage := make([]byte, uint64(n-1)*(uint64(S)*dataStage+m.ctlCap+uint64(S+1)*hdrBytes))
	rmr, err := m.dev.register(rings, true)
	if err != nil {
		return fmt.Errorf("register %d MiB of receive rings on %s: %w (is the locked-memory limit, ulimit -l, too low?)", len(rings)>>20, sel.dev, err)
	}
	m.mrs = append(m.mrs, rmr)
	smr, err := m.dev.register(stage, false)
	if err != nil {
		return fmt.Errorf("register %d MiB of staging on %s: %w (is the locked-memory limit, ulimit -l, too low?)", len(stage)>>20, sel.dev, err)
	}
	m.mrs = append(m.mrs, smr)
	slk, _ := smr.keys()
	m.links = make([][]*verbsStream, n)
	var roff, soff uint64
	for p := range n {
		if p == self {
			continue
		}
		m.links[p] = make([]*verbsStream, S+1)
		for st := range S + 1 {
			cp, sp := m.dataCap, dataStage
			if st == S {
				cp, sp = m.ctlCap, m.ctlCap
			}
			key := len(m.byKey)
			qp, err := m.dev.newQP(key, verbsSendQueue, verbsRecvQueue)
			if err != nil {
				return fmt.Errorf("%s: queue pair %d of %d: %w", sel.dev, key+1, (n-1)*(S+1), err)
			}
			s := newVerbsStream(m, p, st, qp, rings[roff:roff+cp:roff+cp])
			roff += cp
			s.stage, s.stageKey, s.stageAddr = stage[soff:soff+sp:soff+sp], slk, smr.addr()+soff
			soff += sp
			s.hdrs, s.hdrKey, s.hdrAddr = stage[soff:soff+hdrBytes:soff+hdrBytes], slk, smr.addr()+soff
			soff += hdrBytes
			m.links[p][st] = s
			m.byKey = append(m.byKey, s)
			if err := s.postRecvs(); err != nil {
				return err
			}
		}
	}
	return nil
}

// connect connects every queue pair: the control ones from the records,
// the data ones from the numbers each peer sends over its control stream;
// then a hello on every data stream. Peers in parallel.
func (m *verbsMesh) connect(ctx context.Context, s *setup, sel verbsPort, eps []verbsEndpoint) error {
	n, self := m.size, m.self
	ctx, cancel := context.WithCancelCause(ctx)
	defer cancel(nil)
	var wg sync.WaitGroup
	errs := make([]error, n)
	for p := range n {
		if p == self {
			continue
		}
		wg.Go(func() {
			if err := m.connectPeer(ctx, s, sel, eps, p); err != nil {
				errs[p] = err
				cancel(err)
			}
		})
	}
	wg.Wait()
	// The first failure, not the cancellations it caused.
	for _, err := range errs {
		if err != nil && !errors.Is(err, context.Canceled) {
			return err
		}
	}
	for _, err := range errs {
		if err != nil {
			return err
		}
	}
	return nil
}

func (m *verbsMesh) connectPeer(ctx context.Context, s *setup, sel verbsPort, eps []verbsEndpoint, p int) error {
	self, S := m.self, m.streams
	secret := s.rv.Secret()
	e := eps[p]
	remote := vRemote{lid: uint16(e.LID), gid: e.gid(), global: sel.port.Attr.LinkLayer == ibverbs.LinkEthernet || !e.gid().IsZero() && e.LID == 0,
		mtu: min(sel.port.Attr.ActiveMTU, ibverbs.MTU(e.MTU)), gidIndex: sel.gid.Index, port: sel.port.Num}
	// The peer's rings for this member, in its registration.
	base := e.RingAddr + uint64(peerIndex(p, self))*(uint64(S)*e.DataCap+e.CtlCap)
	for st, str := range m.links[p] {
		cp := e.DataCap
		if st == S {
			cp = e.CtlCap
		}
		str.rAddr, str.rKey, str.rCap, str.rMaxRec = base+uint64(st)*e.DataCap, e.RingKey, cp, cp/2&^63
	}
	// fail words a failure: a timeout names the peer waited for (what is
	// what it did not do), a peer's error names it already.
	fail := func(what string, err error) error {
		var pe *PeerError
		if errors.As(err, &pe) {
			// A peer that failed tears its queue pairs and rings down,
			// which shows here as its fault: give its recorded failure
			// (the cause) the time to reach us.
			t := time.NewTimer(verbsLostGrace)
			select {
			case <-ctx.Done():
			case <-t.C:
			}
			t.Stop()
		}
		if rendezvous.DoneCause(ctx) != nil {
			return s.rv.Explain(ctx, err, what, p)
		}
		if errors.As(err, &pe) {
			return fmt.Errorf("%s: %w", what, err)
		}
		return fmt.Errorf("%s with %s: %w", what, m.Peer(p), err)
	}
	ctl := m.links[p][S]
	r := remote
	r.qpn = e.qpn(self)
	if err := ctl.qp.connect(r, verbsPSN(secret, self, p, S), verbsPSN(secret, p, self, S)); err != nil {
		return fail("connect its control queue pair", err)
	}
	// Our data queue pair numbers for this peer, signed.
	qpns := make([]byte, 4*S)
	for st := range S {
		binary.LittleEndian.PutUint32(qpns[4*st:], m.links[p][st].qp.num())
	}
	msg := append(qpns, verbsQPNMAC(secret, self, p, qpns)...)
	sendErr := make(chan error, 1)
	go func() {
		sendErr <- ctl.Send(ctx, wire.Header{Kind: wire.KindP2P, Step: verbsSetupStep}, msg)
	}()
	var theirs []byte
	err := ctl.Recv(ctx, func(h wire.Header, b []byte) error {
		if h.Kind != wire.KindP2P || h.Step != verbsSetupStep || len(b) != 4*S+sha256.Size {
			return fmt.Errorf("sent a %s frame of %d bytes (step %#x) where its data queue pair numbers belong", h.Kind, len(b), h.Step)
		}
		if !hmac.Equal(b[4*S:], verbsQPNMAC(secret, p, self, b[:4*S])) {
			return errors.New("sent data queue pair numbers not signed with this job's secret")
		}
		theirs = append([]byte(nil), b[:4*S]...)
		return nil
	})
	if err == nil {
		err = <-sendErr
	}
	if err != nil {
		return fail("exchange queue pair numbers", err)
	}
	for st := range S {
		r := remote
		r.qpn = binary.LittleEndian.Uint32(theirs[4*st:])
		if err := m.links[p][st].qp.connect(r, verbsPSN(secret, self, p, st), verbsPSN(secret, p, self, st)); err != nil {
			return fail(fmt.Sprintf("connect data queue pair %d", st), err)
		}
	}
	// A hello each way on every data stream: the peer's ring takes our
	// writes and the path works in both directions.
	var wg sync.WaitGroup
	herr := make([]error, 2*S)
	for st := range S {
		str := m.links[p][st]
		wg.Go(func() {
			herr[2*st] = str.Send(ctx, wire.Header{Kind: wire.KindBarrier, Step: verbsHelloStep}, []byte(verbsHelloText))
		})
		wg.Go(func() {
			herr[2*st+1] = str.Recv(ctx, func(h wire.Header, b []byte) error {
				if h.Kind != wire.KindBarrier || h.Step != verbsHelloStep || string(b) != verbsHelloText {
					return fmt.Errorf("sent a %s frame (step %#x) where its hello belongs", h.Kind, h.Step)
				}
				return nil
			})
		})
	}
	wg.Wait()
	if err := errors.Join(herr...); err != nil {
		for _, e := range herr {
			if e != nil {
				return fail("say hello on every data stream", e)
			}
		}
	}
	return nil
}
