//go:build cgo && linux

package transport

import (
	"errors"
	"fmt"
	"sync"
	"sync/atomic"
	"syscall"
	"time"

	"golang.org/x/sys/unix"

	"github.com/gpubridge/gpubridge/lib/ibverbs"
)

// hwDev is an open device (lib/ibverbs): a protection domain, one
// completion channel for every completion queue, and an eventfd that
// wakes the progress engine.
type hwDev struct {
	ctx      *ibverbs.Context
	pd       *ibverbs.PD
	ch       *ibverbs.CompChannel
	portNum  int
	asyncFd  int
	wakeFd   int
	down     atomic.Bool
	mu       sync.Mutex
	cqs      map[int]*ibverbs.CQ
	keyBuf   []int
	eventBuf [8]byte
}

// openVerbsHW opens the device for the transport.
func openVerbsHW(dev string, port int) (vDev, error) { return openHW(dev, port) }

func openHW(dev string, port int) (_ *hwDev, err error) {
	c, err := ibverbs.Open(dev)
	if err != nil {
		return nil, err
	}
	d := &hwDev{ctx: c, portNum: port, asyncFd: -1, wakeFd: -1, cqs: map[int]*ibverbs.CQ{}}
	defer func() {
		if err != nil {
			_ = d.close()
		}
	}()
	if d.pd, err = c.AllocPD(); err != nil {
		return nil, err
	}
	if d.ch, err = c.NewCompChannel(); err != nil {
		return nil, err
	}
	if d.asyncFd, err = c.AsyncFd(); err != nil {
		return nil, err
	}
	if d.wakeFd, err = unix.Eventfd(0, unix.EFD_NONBLOCK|unix.EFD_CLOEXEC); err != nil {
		return nil, fmt.Errorf("eventfd: %w", err)
	}
	return d, nil
}

func (d *hwDev) port() string {
	s := "port state unknown"
	if pa, err := d.ctx.QueryPort(d.portNum); err == nil {
		s = pa.State.String()
	}
	return fmt.Sprintf("%s port %d (%s)", d.ctx.Name, d.portNum, s)
}

func (d *hwDev) portDown() bool { return d.down.Load() }

type hwMR struct{ mr *ibverbs.MR }

func (m hwMR) keys() (uint32, uint32) { return m.mr.LKey, m.mr.RKey }
func (m hwMR) addr() uint64           { return m.mr.Addr }
func (m hwMR) close() error           { return m.mr.Close() }

func (d *hwDev) register(b []byte, remote bool) (vMR, error) {
	acc := ibverbs.AccessLocalWrite
	if remote {
		acc |= ibverbs.AccessRemoteWrite
	}
	mr, err := d.pd.Register(b, acc)
	if err != nil {
		return nil, err
	}
	return hwMR{mr}, nil
}

type hwQP struct {
	d   *hwDev
	key int
	cq  *ibverbs.CQ
	qp  *ibverbs.QP
}

func (d *hwDev) newQP(key, sendWR, recvWR int) (vQP, error) {
	cq, err := d.ctx.NewCQ(sendWR+recvWR+8, d.ch, uint64(key))
	if err != nil {
		return nil, err
	}
	qp, err := d.pd.NewRCQP(cq, cq, ibverbs.QPCap{SendWR: sendWR, RecvWR: recvWR, SendSGE: 2, RecvSGE: 1})
	if err == nil {
		err = qp.Init(d.portNum, ibverbs.AccessLocalWrite|ibverbs.AccessRemoteWrite)
		if err != nil {
			_ = qp.Close()
		}
	}
	if err == nil {
		err = cq.Notify()
		if err != nil {
			_ = qp.Close()
		}
	}
	if err != nil {
		_ = cq.Close()
		return nil, err
	}
	d.mu.Lock()
	d.cqs[key] = cq
	d.mu.Unlock()
	return &hwQP{d: d, key: key, cq: cq, qp: qp}, nil
}

func (q *hwQP) num() uint32 { return q.qp.Num() }

func (q *hwQP) readyToReceive(r vRemote, recvPSN uint32) error {
	return q.qp.ReadyToReceive(ibverbs.RTR{Port: r.port, MTU: r.mtu, DestQPN: r.qpn, RecvPSN: recvPSN, DestLID: r.lid,
		DestGID: r.gid, SGIDIndex: r.gidIndex, Global: r.global, HopLimit: 64, MinRNRTimer: verbsMinRNR})
}

func (q *hwQP) readyToSend(sendPSN uint32) error {
	return q.qp.ReadyToSend(ibverbs.RTS{SendPSN: sendPSN, Timeout: verbsAckTimeout, Retry: verbsRetries, RNRRetry: verbsRNRRetries})
}

func (q *hwQP) state() (ibverbs.QPState, error) { return q.qp.State() }

func (q *hwQP) write(wrID uint64, sges []ibverbs.SGE, raddr uint64, rkey, imm uint32, withImm bool) error {
	return q.qp.PostWrite(wrID, sges, raddr, rkey, imm, withImm)
}

func (q *hwQP) sendImm(wrID uint64, imm uint32) error { return q.qp.PostSendImm(wrID, imm) }
func (q *hwQP) postRecv(wrID uint64) error            { return q.qp.PostRecv(wrID) }
func (q *hwQP) poll(wcs []ibverbs.WC) (int, error)    { return q.cq.Poll(wcs) }
func (q *hwQP) fail() error                           { return q.qp.SetError() }

func (q *hwQP) close() error {
	q.d.mu.Lock()
	delete(q.d.cqs, q.key)
	q.d.mu.Unlock()
	return errors.Join(q.qp.Close(), q.cq.Close())
}

func (d *hwDev) wake() {
	var one = [8]byte{1}
	_, _ = unix.Write(d.wakeFd, one[:])
}

// wait polls the completion channel, the async event descriptor and the
// wake eventfd; it returns the keys of the queues with events, re-armed.
func (d *hwDev) wait(timeout time.Duration) ([]int, error) {
	fds := []unix.PollFd{{Fd: int32(d.ch.Fd()), Events: unix.POLLIN}, {Fd: int32(d.asyncFd), Events: unix.POLLIN}, {Fd: int32(d.wakeFd), Events: unix.POLLIN}}
	ms := int(timeout.Milliseconds())
	if timeout > 0 && ms == 0 {
		ms = 1
	}
	if _, err := unix.Poll(fds, ms); err != nil && !errors.Is(err, syscall.EINTR) {
		return nil, fmt.Errorf("poll the completion channel: %w", err)
	}
	if fds[2].Revents != 0 {
		_, _ = unix.Read(d.wakeFd, d.eventBuf[:])
	}
	if fds[1].Revents != 0 {
		for {
			ev, ok, err := d.ctx.NextAsync()
			if err != nil || !ok {
				break
			}
			if ev.Port == d.portNum {
				switch ev.Type {
				case ibverbs.EventPortErr:
					d.down.Store(true)
				case ibverbs.EventPortActive:
					d.down.Store(false)
				}
			}
		}
	}
	keys := d.keyBuf[:0]
	for {
		k, ok, err := d.ch.Next()
		if err != nil {
			return keys, err
		}
		if !ok {
			break
		}
		keys = append(keys, int(k))
	}
	d.mu.Lock()
	for _, k := range keys {
		if cq := d.cqs[k]; cq != nil {
			_ = cq.Notify()
		}
	}
	d.mu.Unlock()
	d.keyBuf = keys
	return keys, nil
}

func (d *hwDev) close() error {
	var errs []error
	if d.pd != nil {
		errs = append(errs, d.pd.Close())
	}
	if d.ch != nil {
		errs = append(errs, d.ch.Close())
	}
	if d.wakeFd >= 0 {
		_ = unix.Close(d.wakeFd)
	}
	errs = append(errs, d.ctx.Close())
	return errors.Join(errs...)
}
