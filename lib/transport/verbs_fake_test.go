package transport

import (
	"context"
	"errors"
	"fmt"
	"sync"
	"time"
	"unsafe"

	"github.com/gpubridge/gpubridge/lib/ibverbs"
)

// An in-memory fake of the narrow verbs interface (verbs_dev.go): queue
// pairs of one fabric connected in pairs, RDMA WRITEs that copy between
// registrations (checking keys and bounds as a device does), immediate
// values that consume posted receives, completions in order, and faults
// a test injects at a chosen request: what a real device (and the VM)
// cannot be made to do on demand.

// fakeFault is what happens to one posted request.
type fakeFault int

const (
	faultNone      fakeFault = iota
	faultRetryExc            // no acknowledgement: the request fails with RETRY_EXC
	faultRemAccess           // the peer refuses the write: REM_ACCESS_ERR
	faultHold                // the request stays outstanding (a write the peer never acknowledges), until the queue pair fails
)

type fakeFabric struct {
	mu      sync.Mutex
	mrs     map[uint32]*fakeMR
	qps     map[uint32]*fakeQP
	nextKey uint32
	nextQPN uint32
	// fault decides the fate of each write and send (nil: none). It runs
	// with the fabric locked.
	fault func(q *fakeQP, wr uint64, imm uint32, withImm bool, n int) fakeFault
	// rnr counts immediate values that found no posted receive: the
	// credit protocol must keep it at zero.
	rnr int
	// psnMismatch counts connections whose sequence numbers disagree.
	psnMismatch int
	// silent: requests to a vanished peer never complete (as seen on
	// rdma_rxe) instead of failing after the transport retries.
	silent bool
	// stuckPosts: a post to a lost peer's queue pair waits in the
	// posting thread until this closes (rdma_rxe on a link that went
	// down); nil: posts return at once.
	stuckPosts chan struct{}
}

// stuck makes a post to a lost peer wait for stuckPosts (outside the
// fabric's lock, as a device library's own work would).
func (q *fakeQP) stuck() {
	f := q.d.f
	f.mu.Lock()
	gate, lost := f.stuckPosts, q.peer != nil && (q.peer.errored || q.peer.gone)
	f.mu.Unlock()
	if gate != nil && lost {
		<-gate
	}
}

func newFakeFabric() *fakeFabric {
	return &fakeFabric{mrs: map[uint32]*fakeMR{}, qps: map[uint32]*fakeQP{}, nextKey: 0x100, nextQPN: 0x11}
}

// lostPeer is the fate of a request to a peer that is gone.
func (f *fakeFabric) lostPeer() fakeFault {
	if f.silent {
		return faultHold
	}
	return faultRetryExc
}

type fakeMR struct {
	f      *fakeFabric
	b      []byte
	base   uint64
	key    uint32
	remote bool
}

func (m *fakeMR) keys() (uint32, uint32) { return m.key, m.key }
func (m *fakeMR) addr() uint64           { return m.base }
func (m *fakeMR) close() error {
	m.f.mu.Lock()
	defer m.f.mu.Unlock()
	if _, ok := m.f.mrs[m.key]; !ok {
		return errors.New("fake: deregistered twice")
	}
	delete(m.f.mrs, m.key)
	return nil
}

// fakeDev is one member's device on the fabric.
type fakeDev struct {
	f      *fakeFabric
	name   string
	events chan int
	wakeCh chan struct{}
	down   bool
	closed bool
	qps    int
}

func (f *fakeFabric) dev(name string) *fakeDev {
	return &fakeDev{f: f, name: name, events: make(chan int, 1<<16), wakeCh: make(chan struct{}, 1)}
}

func (d *fakeDev) register(b []byte, remote bool) (vMR, error) {
	if len(b) == 0 {
		return nil, errors.New("fake: empty registration")
	}
	d.f.mu.Lock()
	defer d.f.mu.Unlock()
	d.f.nextKey++
	m := &fakeMR{f: d.f, b: b, base: uint64(uintptr(unsafe.Pointer(&b[0]))), key: d.f.nextKey, remote: remote}
	d.f.mrs[m.key] = m
	return m, nil
}

func (d *fakeDev) newQP(key, sendWR, recvWR int) (vQP, error) {
	d.f.mu.Lock()
	defer d.f.mu.Unlock()
	d.f.nextQPN++
	q := &fakeQP{d: d, key: key, qpn: d.f.nextQPN, st: ibverbs.QPInit, maxRecv: recvWR, maxSend: sendWR}
	d.f.qps[q.qpn] = q
	d.qps++
	return q, nil
}

func (d *fakeDev) wait(timeout time.Duration) ([]int, error) {
	t := time.NewTimer(max(timeout, time.Microsecond))
	defer t.Stop()
	var keys []int
	select {
	case k := <-d.events:
		keys = append(keys, k)
	case <-d.wakeCh:
	case <-t.C:
	}
	for {
		select {
		case k := <-d.events:
			keys = append(keys, k)
		default:
			return keys, nil
		}
	}
}

func (d *fakeDev) wake() {
	select {
	case d.wakeCh <- struct{}{}:
	default:
	}
}

func (d *fakeDev) port() string   { return d.name + " port 1 (ACTIVE)" }
func (d *fakeDev) portDown() bool { return d.down }
func (d *fakeDev) close() error {
	d.f.mu.Lock()
	defer d.f.mu.Unlock()
	if d.closed {
		return errors.New("fake: device closed twice")
	}
	d.closed = true
	if d.qps != 0 {
		return fmt.Errorf("fake: device closed with %d queue pairs", d.qps)
	}
	return nil
}

// fakeQP is a queue pair; f.mu guards every field.
type fakeQP struct {
	d                *fakeDev
	key              int
	qpn              uint32
	peer             *fakeQP
	sendPSN, recvPSN uint32
	st               ibverbs.QPState // the last move's; errored overrides it
	errored, gone    bool
	cq               []ibverbs.WC
	recvs            []uint64 // posted receive ids
	maxRecv, maxSend int
	held             []ibverbs.WC // completions a faultHold keeps back
	hooks            fakeHooks
}

// fakeHooks let a test watch a queue pair.
type fakeHooks struct {
	writes int // successful writes with immediate data
}

func (q *fakeQP) num() uint32 { return q.qpn }

// move checks a move from state from (f.mu held): as on a device, a
// queue pair in the error state moves nowhere.
func (q *fakeQP) move(from, to ibverbs.QPState) error {
	switch {
	case q.gone:
		return errors.New("fake: move of a destroyed queue pair")
	case q.errored:
		return fmt.Errorf("fake: move to %s: invalid argument: %w", to, ibverbs.ErrQPInError)
	case q.st != from:
		return fmt.Errorf("fake: move to %s from %s: invalid argument", to, q.st)
	}
	q.st = to
	return nil
}

func (q *fakeQP) readyToReceive(r vRemote, recvPSN uint32) error {
	f := q.d.f
	f.mu.Lock()
	defer f.mu.Unlock()
	if err := q.move(ibverbs.QPInit, ibverbs.QPReadyToReceive); err != nil {
		return err
	}
	// As on a device, the remote queue pair need not exist (its packets
	// then go unanswered).
	q.peer, q.recvPSN = f.qps[r.qpn], recvPSN
	return nil
}

func (q *fakeQP) readyToSend(sendPSN uint32) error {
	f := q.d.f
	f.mu.Lock()
	defer f.mu.Unlock()
	if err := q.move(ibverbs.QPReadyToReceive, ibverbs.QPReadyToSend); err != nil {
		return err
	}
	q.sendPSN = sendPSN
	if p := q.peer; p != nil && p.peer == q && p.st == ibverbs.QPReadyToSend && (p.sendPSN != q.recvPSN || p.recvPSN != q.sendPSN) {
		f.psnMismatch++
	}
	return nil
}

func (q *fakeQP) state() (ibverbs.QPState, error) {
	f := q.d.f
	f.mu.Lock()
	defer f.mu.Unlock()
	switch {
	case q.gone:
		return 0, errors.New("fake: query of a destroyed queue pair")
	case q.errored:
		return ibverbs.QPError, nil
	}
	return q.st, nil
}

// push adds a completion (f.mu held) and signals the device.
func (q *fakeQP) push(w ibverbs.WC) {
	q.cq = append(q.cq, w)
	select {
	case q.d.events <- q.key:
	default:
	}
}

// failLocked moves q to the error state: receives and held requests
// flush.
func (q *fakeQP) failLocked() {
	if q.errored {
		return
	}
	q.errored = true
	for _, w := range q.held {
		w.Status = ibverbs.StatusFlush
		q.push(w)
	}
	q.held = nil
	for _, r := range q.recvs {
		q.push(ibverbs.WC{WRID: r, Status: ibverbs.StatusFlush, Opcode: ibverbs.OpcodeRecv})
	}
	q.recvs = nil
}

// gather reads the gather list from local registrations (f.mu held).
func (q *fakeQP) gather(sges []ibverbs.SGE) ([]byte, bool) {
	var out []byte
	for _, s := range sges {
		m := q.d.f.mrs[s.LKey]
		if m == nil || s.Addr < m.base || s.Addr+uint64(s.Len) > m.base+uint64(len(m.b)) {
			return nil, false
		}
		out = append(out, m.b[s.Addr-m.base:s.Addr-m.base+uint64(s.Len)]...)
	}
	return out, true
}

// deliver hands an immediate value to the peer's next posted receive.
func (q *fakeQP) deliver(op int, imm uint32, n int) {
	p := q.peer
	if len(p.recvs) == 0 {
		q.d.f.rnr++
		return
	}
	r := p.recvs[0]
	p.recvs = p.recvs[1:]
	p.push(ibverbs.WC{WRID: r, Opcode: op, Imm: imm, Flags: 2, ByteLen: uint32(n), QPNum: p.qpn})
}

// complete finishes a send request as the fault says (f.mu held).
func (q *fakeQP) complete(wr uint64, op int, fault fakeFault) {
	w := ibverbs.WC{WRID: wr, Opcode: op, QPNum: q.qpn}
	switch fault {
	case faultRetryExc:
		w.Status = ibverbs.StatusRetryExc
		q.push(w)
		q.failLocked()
	case faultRemAccess:
		w.Status = ibverbs.StatusRemAccess
		q.push(w)
		q.failLocked()
		// The responder of a refused request fails its queue pair too,
		// ready to send or not; rdma_rxe completes the receive the write
		// took with the same status first.
		if p := q.peer; p != nil && !p.gone && !p.errored && p.st >= ibverbs.QPReadyToReceive {
			if len(p.recvs) > 0 {
				p.push(ibverbs.WC{WRID: p.recvs[0], Status: ibverbs.StatusRemAccess, Opcode: ibverbs.OpcodeRecv, QPNum: p.qpn})
				p.recvs = p.recvs[1:]
			}
			p.failLocked()
		}
	case faultHold:
		q.held = append(q.held, w)
	default:
		q.push(w)
	}
}

// post is what every posted send request goes through (f.mu held): a
// destroyed queue pair refuses it, one in the error state flushes it,
// else the test's fault and a vanished peer decide its fate. ok is false
// when the request is done already.
func (q *fakeQP) post(wr uint64, imm uint32, withImm bool, n int) (fakeFault, bool, error) {
	f := q.d.f
	if q.gone {
		return 0, false, errors.New("fake: post on a destroyed queue pair")
	}
	if q.errored {
		q.push(ibverbs.WC{WRID: wr, Status: ibverbs.StatusFlush, QPNum: q.qpn})
		return 0, false, nil
	}
	fault := faultNone
	if f.fault != nil {
		fault = f.fault(q, wr, imm, withImm, n)
	}
	if p := q.peer; p == nil || p.gone || p.errored {
		fault = f.lostPeer()
	}
	return fault, true, nil
}

func (q *fakeQP) write(wr uint64, sges []ibverbs.SGE, raddr uint64, rkey uint32, imm uint32, withImm bool) error {
	q.stuck()
	f := q.d.f
	f.mu.Lock()
	defer f.mu.Unlock()
	data, ok := q.gather(sges)
	if !ok && !q.gone && !q.errored {
		q.push(ibverbs.WC{WRID: wr, Status: ibverbs.StatusLocProt, QPNum: q.qpn})
		q.failLocked()
		return nil
	}
	fault, ok, err := q.post(wr, imm, withImm, len(data))
	if !ok {
		return err
	}
	if fault == faultNone && len(data) > 0 {
		m := f.mrs[rkey]
		if m == nil || !m.remote || raddr < m.base || raddr+uint64(len(data)) > m.base+uint64(len(m.b)) {
			fault = faultRemAccess
		} else {
			copy(m.b[raddr-m.base:], data)
		}
	}
	if fault == faultNone && withImm {
		q.hooks.writes++
		q.deliver(ibverbs.OpcodeRecvWriteImm, imm, len(data))
	}
	q.complete(wr, ibverbs.OpcodeRDMAWrite, fault)
	return nil
}

func (q *fakeQP) sendImm(wr uint64, imm uint32) error {
	q.stuck()
	f := q.d.f
	f.mu.Lock()
	defer f.mu.Unlock()
	fault, ok, err := q.post(wr, imm, true, 0)
	if !ok {
		return err
	}
	if fault == faultNone {
		q.deliver(ibverbs.OpcodeRecv, imm, 0)
	}
	q.complete(wr, 0, fault)
	return nil
}

func (q *fakeQP) postRecv(wr uint64) error {
	f := q.d.f
	f.mu.Lock()
	defer f.mu.Unlock()
	if q.gone {
		return errors.New("fake: post on a destroyed queue pair")
	}
	if q.errored {
		q.push(ibverbs.WC{WRID: wr, Status: ibverbs.StatusFlush, Opcode: ibverbs.OpcodeRecv})
		return nil
	}
	if len(q.recvs) >= q.maxRecv {
		return errors.New("fake: receive queue full")
	}
	q.recvs = append(q.recvs, wr)
	return nil
}

func (q *fakeQP) poll(wcs []ibverbs.WC) (int, error) {
	f := q.d.f
	f.mu.Lock()
	defer f.mu.Unlock()
	if q.gone {
		return 0, errors.New("fake: poll of a destroyed queue pair")
	}
	n := copy(wcs, q.cq)
	q.cq = q.cq[n:]
	return n, nil
}

func (q *fakeQP) fail() error {
	f := q.d.f
	f.mu.Lock()
	defer f.mu.Unlock()
	q.failLocked()
	return nil
}

func (q *fakeQP) close() error {
	f := q.d.f
	f.mu.Lock()
	defer f.mu.Unlock()
	if q.gone {
		return errors.New("fake: queue pair destroyed twice")
	}
	q.gone = true
	q.failLocked()
	delete(f.qps, q.qpn)
	q.d.qps--
	return nil
}

// opener returns a Config.verbsOpen that gives member i the fake device
// devs[i] with an Ethernet port of MTU 1024.
func (f *fakeFabric) opener(devs []*fakeDev) func(ctx context.Context, c *Config) (verbsPort, vDev, error) {
	return func(_ context.Context, c *Config) (verbsPort, vDev, error) {
		d := devs[c.Self]
		var g ibverbs.GID
		copy(g[10:], []byte{0xff, 0xff, 10, 0, 0, byte(c.Self + 1)})
		p := verbsPort{dev: d.name, port: verbsPortInfo{Num: 1, Attr: ibverbs.PortAttr{State: ibverbs.PortActive, ActiveMTU: 3, MaxMTU: 5, LinkLayer: ibverbs.LinkEthernet}},
			gid: ibverbs.GIDEntry{Index: 1, GID: g, Type: ibverbs.GIDTypeRoCEv2}, how: "the test's fake", ifname: "fake0"}
		return p, d, nil
	}
}

// qpsOf lists the fabric's queue pairs of device d.
func (f *fakeFabric) qpsOf(d *fakeDev) []*fakeQP {
	f.mu.Lock()
	defer f.mu.Unlock()
	var out []*fakeQP
	for _, q := range f.qps {
		if q.d == d {
			out = append(out, q)
		}
	}
	return out
}
