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

// sealVerbsQPNs is the set-up message in which member from gives member to
// the numbers of its queue pairs to it, data streams then point-to-point
// streams: 4 bytes each (little-endian), then their MAC.
func sealVerbsQPNs(secret []byte, from, to int, qpns []uint32) []byte {
	b := make([]byte, 4*len(qpns), 4*len(qpns)+sha256.Size)
	for i, q := range qpns {
		binary.LittleEndian.PutUint32(b[4*i:], q)
	}
	return append(b, verbsQPNMAC(secret, from, to, b)...)
}

// openVerbsQPNs checks and decodes member from's sealVerbsQPNs message to
// member to, which must carry streams + p2p numbers (the counts every
// member agreed on) of 24 bits each.
func openVerbsQPNs(secret []byte, from, to, streams, p2p int, b []byte) ([]uint32, error) {
	w := streams + p2p
	if len(b) != 4*w+sha256.Size {
		return nil, fmt.Errorf("sent %d bytes of queue pair numbers, %d expected (%d data and %d point-to-point streams, signed)", len(b), 4*w+sha256.Size, streams, p2p)
	}
	if !hmac.Equal(b[4*w:], verbsQPNMAC(secret, from, to, b[:4*w])) {
		return nil, errors.New("sent queue pair numbers not signed with this job's secret")
	}
	qpns := make([]uint32, w)
	for i := range qpns {
		qpns[i] = binary.LittleEndian.Uint32(b[4*i:])
		if qpns[i] >= 1<<24 {
			return nil, fmt.Errorf("sent queue pair number %#x (24 bits allowed)", qpns[i])
		}
	}
	return qpns, nil
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
	m := &verbsMesh{meshBase: meshBase[*verbsStream]{self: self, size: n, streams: S, p2p: s.cfg.P2PStreams, crc: s.cfg.CRC},
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
			q = m.links[p][m.ctlIndex()].qp.num()
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
	m.desc = fmt.Sprintf("verbs, %d streams per peer%s, %s, %s, MTU %d", S, p2pWords(s.cfg.P2PStreams), crcWords(s.cfg.CRC), sel.Describe(), sel.port.Attr.ActiveMTU.Bytes())
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

// build makes every queue pair, ring and staging area, per peer W =
// streams + p2p streams of data size (the data streams, then the
// point-to-point ones) and the control stream (index W). Rings: one
// registration for every inbound ring (its address and key go in the
// record; peer p's rings begin at peerIndex(self, p) × (W × dataCap +
// ctlCap)); staging: one registration for every stream's staging ring
// (half a data ring and a page: one frame of the largest record size in
// flight, smaller ones beside it; a control ring's size for control) and
// header slots.
//
// Point-to-point streams get data-sized rings: a striped message's frames
// are up to the collective's chunk (4 MiB by default, and gbbridge makes
// RingBytes twice the chunk), so each is one record received in place and
// copied once into the Recv's buffer; a smaller ring would cut every frame
// into segments and reassemble it (a second copy of every byte). Each
// costs what a data stream costs in pinned memory: RingBytes + 4 KiB of
// receive ring, RingBytes/2 + 8 KiB of staging, 8 KiB of header slots
// (about 12 MiB at gbbridge's default 8 MiB rings); the 4 that lib/bridge
// asks for add 48 MiB per peer to the 8 data streams' and the control
// stream's ~98 MiB, and gbbridge serve asks for them only on bridge 0 and
// the pair/ bridges.
func (m *verbsMesh) build(sel verbsPort, ringBytes int) error {
	n, self, W := m.size, m.self, m.streams+m.p2p
	m.dataCap, m.ctlCap = m.ringSizes(ringBytes)
	dataStage := (m.dataCap/2+4095)&^4095 + 4096
	perPeer := uint64(W)*m.dataCap + m.ctlCap
	hdrBytes := uint64(verbsWindow * verbsRecHdr)
	rings := make([]byte, uint64(n-1)*perPeer)
	stage := make([]byte, uint64(n-1)*(uint64(W)*dataStage+m.ctlCap+uint64(W+1)*hdrBytes))
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
		m.links[p] = make([]*verbsStream, W+1)
		for st := range W + 1 {
			cp, sp := m.dataCap, dataStage
			if st == W {
				cp, sp = m.ctlCap, m.ctlCap
			}
			key := len(m.byKey)
			qp, err := m.dev.newQP(key, verbsSendQueue, verbsRecvQueue)
			if err != nil {
				return fmt.Errorf("%s: queue pair %d of %d: %w", sel.dev, key+1, (n-1)*(W+1), err)
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
	// The first failure, not the cancellations it caused: the one that
	// canceled the others (theirs repeat it, as the cause of their
	// cancellation), else the first that is not a cancellation.
	for _, err := range errs {
		if err != nil && err == context.Cause(ctx) {
			return err
		}
	}
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
	self, W := m.self, m.ctlIndex()
	secret := s.rv.Secret()
	e := eps[p]
	remote := vRemote{lid: uint16(e.LID), gid: e.gid(), global: sel.port.Attr.LinkLayer == ibverbs.LinkEthernet || !e.gid().IsZero() && e.LID == 0,
		mtu: min(sel.port.Attr.ActiveMTU, ibverbs.MTU(e.MTU)), gidIndex: sel.gid.Index, port: sel.port.Num}
	// The peer's rings for this member, in its registration (its stream
	// counts are ours: gather checked).
	base := e.RingAddr + uint64(peerIndex(p, self))*(uint64(W)*e.DataCap+e.CtlCap)
	for st, str := range m.links[p] {
		cp := e.DataCap
		if st == W {
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
	ctl := m.links[p][W]
	r := remote
	r.qpn = e.qpn(self)
	if err := m.connectQP(ctx, s, p, W, r); err != nil {
		return fail("connect its control queue pair", err)
	}
	// Our data and point-to-point queue pair numbers for this peer, signed.
	ours := make([]uint32, W)
	for st := range W {
		ours[st] = m.links[p][st].qp.num()
	}
	msg := sealVerbsQPNs(secret, self, p, ours)
	sendErr := make(chan error, 1)
	go func() {
		sendErr <- ctl.Send(ctx, wire.Header{Kind: wire.KindP2P, Step: verbsSetupStep}, msg)
	}()
	var theirs []uint32
	err := ctl.Recv(ctx, func(h wire.Header, b []byte) error {
		if h.Kind != wire.KindP2P || h.Step != verbsSetupStep {
			return fmt.Errorf("sent a %s frame of %d bytes (step %#x) where its queue pair numbers belong", h.Kind, len(b), h.Step)
		}
		var err error
		theirs, err = openVerbsQPNs(secret, p, self, m.streams, m.p2p, b)
		return err
	})
	if err == nil {
		err = <-sendErr
	}
	if err != nil {
		return fail("exchange queue pair numbers", err)
	}
	for st := range W {
		r := remote
		r.qpn = theirs[st]
		if err := m.connectQP(ctx, s, p, st, r); err != nil {
			return fail(fmt.Sprintf("connect %s", m.streamName(st)), err)
		}
	}
	// A hello each way on every data and point-to-point stream: the
	// peer's ring takes our writes and the path works in both directions.
	var wg sync.WaitGroup
	herr := make([]error, 2*W)
	for st := range W {
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
				return fail("say hello on every data and point-to-point stream", e)
			}
		}
	}
	return nil
}

// connectQP moves the queue pair of stream st to peer p to ready-to-receive,
// connected to the peer's queue pair r.qpn, then to ready-to-send.
//
// The peer may be ready to send before this member is, and write into
// this member's ring in between. A write the device refuses (the ring
// address or key in this member's record is not valid) fails the queue
// pair there and then (RC rules: the responder of a refused request moves
// to ERR), and the move to ready-to-send fails as not allowed from ERR;
// the error says what happened, in the words the writer's own error uses
// (ErrRingRefused), so that every member's error names the cause whichever
// report reaches it first.
func (m *verbsMesh) connectQP(ctx context.Context, s *setup, p, st int, r vRemote) error {
	secret, qp := s.rv.Secret(), m.links[p][st].qp
	step := s.cfg.verbsConnectStep
	if err := qp.readyToReceive(r, verbsPSN(secret, p, m.self, st)); err != nil {
		return err
	}
	if step != nil {
		if err := step(ctx, p, st, qp, false); err != nil {
			return err
		}
	}
	if err := qp.readyToSend(verbsPSN(secret, m.self, p, st)); err != nil {
		if errors.Is(err, ibverbs.ErrQPInError) {
			return fmt.Errorf("this member's device %w from that member before the %s was ready to send, which failed the queue pair (%w): the ring address or key in this member's endpoint record is not valid (a forged or stale record?)",
				ErrRingRefused, m.streamName(st), err)
		}
		return err
	}
	if step != nil {
		return step(ctx, p, st, qp, true)
	}
	return nil
}
