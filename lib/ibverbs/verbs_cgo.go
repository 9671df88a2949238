//go:build cgo && linux

package ibverbs

/*
#cgo CFLAGS: -O2 -Wall
#cgo LDFLAGS: -ldl
#include <stdlib.h>
#include "shim.h"
*/
import "C"

import (
	"errors"
	"fmt"
	"runtime"
	"sync"
	"syscall"
	"unsafe"

	"golang.org/x/sys/unix"
)

var loadMu sync.Mutex

// Load loads libibverbs from path ("": LibraryPath) unless it is loaded
// already; the first library loaded stays for the process. The error wraps
// ErrUnavailable and carries the loader's reason.
func Load(path string) error {
	loadMu.Lock()
	defer loadMu.Unlock()
	path = LibraryPath(path)
	cpath := C.CString(path)
	defer C.free(unsafe.Pointer(cpath))
	var buf [512]C.char
	if C.gbv_load(cpath, &buf[0], C.int(len(buf))) != 0 {
		return fmt.Errorf("%w: %s", ErrUnavailable, C.GoString(&buf[0]))
	}
	return nil
}

// deviceList is ibv_get_device_list with its failures explained.
func deviceList() (unsafe.Pointer, []unsafe.Pointer, error) {
	var n C.int
	list, err := C.gbv_get_device_list(&n)
	if list == nil {
		err = errnoOr(err, syscall.ENODEV)
		if errors.Is(err, syscall.ENOSYS) {
			return nil, nil, fmt.Errorf("ibv_get_device_list: %w", ErrNoKernelSupport)
		}
		return nil, nil, fmt.Errorf("ibv_get_device_list: %w", err)
	}
	return unsafe.Pointer(list), unsafe.Slice((*unsafe.Pointer)(unsafe.Pointer(list)), int(n)), nil
}

// withDevices loads libibverbs and calls f with its device list, freed
// after f.
func withDevices(f func(devs []unsafe.Pointer) error) error {
	if err := Load(""); err != nil {
		return err
	}
	list, devs, err := deviceList()
	if err != nil {
		return err
	}
	defer C.gbv_free_device_list((*unsafe.Pointer)(list))
	return f(devs)
}

func deviceName(d unsafe.Pointer) string { return C.GoString(C.gbv_device_name(d)) }

// Devices lists the RDMA devices libibverbs sees, by name.
func Devices() ([]string, error) {
	var names []string
	err := withDevices(func(devs []unsafe.Pointer) error {
		for _, d := range devs {
			names = append(names, deviceName(d))
		}
		return nil
	})
	return names, err
}

// Context is an open device.
type Context struct {
	Name string
	p    unsafe.Pointer
}

// Open opens the device called name.
func Open(name string) (*Context, error) {
	var c *Context
	err := withDevices(func(devs []unsafe.Pointer) error {
		var have []string
		for _, d := range devs {
			if dn := deviceName(d); dn != name {
				have = append(have, dn)
				continue
			}
			ctx, err := C.gbv_open_device(d)
			if ctx == nil {
				return fmt.Errorf("ibv_open_device %s: %w", name, errnoOr(err, syscall.EIO))
			}
			c = &Context{Name: name, p: ctx}
			return nil
		}
		return fmt.Errorf("no RDMA device %s (libibverbs sees: %v)", name, have)
	})
	return c, err
}

// Close closes the device. Everything made from it must be closed first.
func (c *Context) Close() error {
	if r := C.gbv_close_device(c.p); r != 0 {
		return fmt.Errorf("ibv_close_device %s: %w", c.Name, syscall.Errno(-r))
	}
	return nil
}

// QueryDevice reads the device's attributes.
func (c *Context) QueryDevice() (DeviceAttr, error) {
	var a C.struct_gbv_device_attr
	if r := C.gbv_query_device(c.p, &a); r != 0 {
		return DeviceAttr{}, fmt.Errorf("ibv_query_device %s: %w", c.Name, retErr(r))
	}
	return DeviceAttr{
		FirmwareVersion: C.GoString(&a.fw_ver[0]), NodeGUID: uint64(a.node_guid), MaxMRSize: uint64(a.max_mr_size),
		MaxQP: int(a.max_qp), MaxQPWR: int(a.max_qp_wr), MaxCQE: int(a.max_cqe), MaxSGE: int(a.max_sge),
		Ports: int(a.phys_port_cnt),
	}, nil
}

// QueryPort reads a port's attributes.
func (c *Context) QueryPort(port int) (PortAttr, error) {
	var a C.struct_gbv_port_attr
	if r := C.gbv_query_port(c.p, C.int(port), &a); r != 0 {
		return PortAttr{}, fmt.Errorf("ibv_query_port %s port %d: %w", c.Name, port, retErr(r))
	}
	return PortAttr{
		State: PortState(a.state), MaxMTU: MTU(a.max_mtu), ActiveMTU: MTU(a.active_mtu), GIDTableLen: int(a.gid_tbl_len),
		LID: uint16(a.lid), LinkLayer: LinkLayer(a.link_layer), ActiveWidth: uint8(a.active_width),
		ActiveSpeed: uint8(a.active_speed), PhysState: uint8(a.phys_state), MaxMessageSz: uint32(a.max_msg_sz),
	}, nil
}

// GIDs lists the used entries of a port's GID table, with their types and
// interfaces when libibverbs can tell (rdma-core 32 and later).
func (c *Context) GIDs(port int) ([]GIDEntry, error) {
	if C.gbv_has_gid_table() != 0 {
		entries := make([]C.struct_gbv_gid_entry, 1024)
		n, err := C.gbv_query_gid_table(c.p, &entries[0], C.long(len(entries)))
		if n < 0 {
			return nil, fmt.Errorf("ibv_query_gid_table %s: %w", c.Name, errnoOr(err, syscall.EIO))
		}
		var out []GIDEntry
		for _, e := range entries[:n] {
			if int(e.port_num) != port {
				continue
			}
			var g GID
			copy(g[:], C.GoBytes(unsafe.Pointer(&e.gid.raw[0]), 16))
			out = append(out, GIDEntry{Index: int(e.gid_index), GID: g, Type: GIDType(e.gid_type), Ifindex: int(e.ndev_ifindex)})
		}
		return out, nil
	}
	pa, err := c.QueryPort(port)
	if err != nil {
		return nil, err
	}
	var out []GIDEntry
	for i := range pa.GIDTableLen {
		var cg C.struct_gbv_gid
		if C.gbv_query_gid(c.p, C.int(port), C.int(i), &cg) != 0 {
			continue
		}
		var g GID
		copy(g[:], C.GoBytes(unsafe.Pointer(&cg.raw[0]), 16))
		if !g.IsZero() {
			out = append(out, GIDEntry{Index: i, GID: g, Type: GIDTypeUnknown})
		}
	}
	return out, nil
}

// PD is a protection domain.
type PD struct {
	ctx *Context
	p   unsafe.Pointer
}

// AllocPD allocates a protection domain.
func (c *Context) AllocPD() (*PD, error) {
	pd, err := C.gbv_alloc_pd(c.p)
	if pd == nil {
		return nil, fmt.Errorf("ibv_alloc_pd %s: %w", c.Name, errnoOr(err, syscall.ENOMEM))
	}
	return &PD{ctx: c, p: pd}, nil
}

// Close frees the protection domain.
func (pd *PD) Close() error {
	if r := C.gbv_dealloc_pd(pd.p); r != 0 {
		return fmt.Errorf("ibv_dealloc_pd: %w", retErr(r))
	}
	return nil
}

// MR is a memory registration.
type MR struct {
	LKey, RKey uint32
	Addr       uint64
	Len        int
	p          unsafe.Pointer
	pin        runtime.Pinner
}

// Register registers b (not empty) with the device. Go memory is pinned
// until Close, so that the device may keep its address; memory mapped
// outside Go's heap must stay mapped until Close.
func (pd *PD) Register(b []byte, access Access) (*MR, error) {
	if len(b) == 0 {
		return nil, errors.New("ibv_reg_mr: empty buffer")
	}
	mr := &MR{Addr: uint64(uintptr(unsafe.Pointer(&b[0]))), Len: len(b)}
	mr.pin.Pin(&b[0])
	p, err := C.gbv_reg_mr(pd.p, C.uint64_t(mr.Addr), C.uint64_t(len(b)), C.int(access))
	if p == nil {
		mr.pin.Unpin()
		return nil, fmt.Errorf("ibv_reg_mr of %d bytes: %w", len(b), errnoOr(err, syscall.ENOMEM))
	}
	m := (*C.struct_gbv_mr)(p)
	mr.p, mr.LKey, mr.RKey = p, uint32(m.lkey), uint32(m.rkey)
	return mr, nil
}

// Close deregisters the memory.
func (mr *MR) Close() error {
	r := C.gbv_dereg_mr(mr.p)
	mr.pin.Unpin()
	if r != 0 {
		return fmt.Errorf("ibv_dereg_mr: %w", retErr(r))
	}
	return nil
}

// CompChannel is a completion event channel; its descriptor is
// non-blocking, for poll(2).
type CompChannel struct {
	p unsafe.Pointer
}

// NewCompChannel makes a completion event channel.
func (c *Context) NewCompChannel() (*CompChannel, error) {
	ch, err := C.gbv_create_comp_channel(c.p)
	if ch == nil {
		return nil, fmt.Errorf("ibv_create_comp_channel %s: %w", c.Name, errnoOr(err, syscall.ENOMEM))
	}
	cc := &CompChannel{p: ch}
	if err := unix.SetNonblock(cc.Fd(), true); err != nil {
		_ = cc.Close()
		return nil, fmt.Errorf("completion channel: %w", err)
	}
	return cc, nil
}

// Fd is the channel's descriptor: readable when an event is waiting.
func (ch *CompChannel) Fd() int { return int((*C.struct_gbv_comp_channel)(ch.p).fd) }

// Close destroys the channel. Its CQs must be destroyed first.
func (ch *CompChannel) Close() error {
	if r := C.gbv_destroy_comp_channel(ch.p); r != 0 {
		return fmt.Errorf("ibv_destroy_comp_channel: %w", retErr(r))
	}
	return nil
}

// Next takes the next event from the channel without waiting: the key of
// the CQ it is for, acknowledged; ok is false when none is waiting.
func (ch *CompChannel) Next() (key uint64, ok bool, err error) {
	var cq unsafe.Pointer
	var k C.uint64_t
	if r, err := C.gbv_get_cq_event(ch.p, &cq, &k); r != 0 {
		if errors.Is(err, syscall.EAGAIN) || errors.Is(err, syscall.EWOULDBLOCK) {
			return 0, false, nil
		}
		return 0, false, fmt.Errorf("ibv_get_cq_event: %w", errnoOr(err, syscall.EIO))
	}
	C.gbv_ack_cq_events(cq, 1)
	return uint64(k), true, nil
}

// CQ is a completion queue.
type CQ struct {
	p unsafe.Pointer
}

// NewCQ makes a completion queue of at least cqe entries whose events go
// to ch (nil: none), tagged with key.
func (c *Context) NewCQ(cqe int, ch *CompChannel, key uint64) (*CQ, error) {
	var chp unsafe.Pointer
	if ch != nil {
		chp = ch.p
	}
	cq, err := C.gbv_create_cq(c.p, C.int(cqe), C.uint64_t(key), chp)
	if cq == nil {
		return nil, fmt.Errorf("ibv_create_cq of %d entries: %w", cqe, errnoOr(err, syscall.ENOMEM))
	}
	return &CQ{p: cq}, nil
}

// Notify asks for an event on the channel at the next completion.
func (cq *CQ) Notify() error {
	if r := C.gbv_req_notify_cq(cq.p); r != 0 {
		return fmt.Errorf("ibv_req_notify_cq: %w", retErr(r))
	}
	return nil
}

// Poll takes up to len(wcs) completions (at most 32 at once).
func (cq *CQ) Poll(wcs []WC) (int, error) {
	var raw [32]C.struct_gbv_wc
	n := C.gbv_poll_cq(cq.p, C.int(min(len(wcs), len(raw))), &raw[0])
	if n < 0 {
		return 0, fmt.Errorf("ibv_poll_cq: %w", retErr(n))
	}
	for i := range int(n) {
		w := &raw[i]
		wcs[i] = WC{WRID: uint64(w.wr_id), Status: int(w.status), Opcode: int(w.opcode), VendorErr: uint32(w.vendor_err),
			ByteLen: uint32(w.byte_len), Imm: uint32(w.imm_data), QPNum: uint32(w.qp_num), Flags: uint32(w.wc_flags)}
	}
	return int(n), nil
}

// Close destroys the completion queue.
func (cq *CQ) Close() error {
	if r := C.gbv_destroy_cq(cq.p); r != 0 {
		return fmt.Errorf("ibv_destroy_cq: %w", retErr(r))
	}
	return nil
}

// StatusString is libibverbs' text for a completion status.
func StatusString(status int) string {
	if Load("") != nil {
		return fmt.Sprintf("status %d", status)
	}
	return C.GoString(C.gbv_wc_status_str(C.int(status)))
}

// QP is a Reliable Connected queue pair.
type QP struct {
	p unsafe.Pointer
}

// NewRCQP makes a Reliable Connected queue pair whose completions go to
// send and recv.
func (pd *PD) NewRCQP(send, recv *CQ, cp QPCap) (*QP, error) {
	var a C.struct_gbv_qp_init_attr
	a.send_cq, a.recv_cq = send.p, recv.p
	a.cap.max_send_wr, a.cap.max_recv_wr = C.uint32_t(cp.SendWR), C.uint32_t(cp.RecvWR)
	a.cap.max_send_sge, a.cap.max_recv_sge = C.uint32_t(cp.SendSGE), C.uint32_t(cp.RecvSGE)
	a.qp_type = C.GBV_QPT_RC
	qp, err := C.gbv_create_qp(pd.p, &a)
	if qp == nil {
		return nil, fmt.Errorf("ibv_create_qp (RC, %d send and %d receive requests): %w", cp.SendWR, cp.RecvWR, errnoOr(err, syscall.ENOMEM))
	}
	return &QP{p: qp}, nil
}

// Num is the queue pair's number.
func (qp *QP) Num() uint32 { return uint32((*C.struct_gbv_qp)(qp.p).qp_num) }

// State is the queue pair's state as the device has it now: a device
// moves a queue pair to ERR on its own (a request it refused, a failed
// completion), which libibverbs' cached state does not show.
func (qp *QP) State() (QPState, error) {
	var st C.int
	if r := C.gbv_query_qp_state(qp.p, &st); r != 0 {
		return 0, fmt.Errorf("ibv_query_qp: %w", retErr(r))
	}
	return QPState(st), nil
}

// modify moves the queue pair to another state. When the move fails and
// the queue pair is in the error state, the error wraps ErrQPInError too:
// ERR leads nowhere but RESET, so that is why it failed.
func (qp *QP) modify(a *C.struct_gbv_qp_attr, mask C.int, what string) error {
	if r := C.gbv_modify_qp(qp.p, a, mask); r != 0 {
		err := retErr(r)
		if a.qp_state != C.GBV_QPS_ERR {
			if st, qerr := qp.State(); qerr == nil && st == QPError {
				return fmt.Errorf("ibv_modify_qp to %s: %w: %w", what, err, ErrQPInError)
			}
		}
		return fmt.Errorf("ibv_modify_qp to %s: %w", what, err)
	}
	return nil
}

// Init moves the queue pair from RESET to INIT on port, with the remote
// access it allows.
func (qp *QP) Init(port int, access Access) error {
	var a C.struct_gbv_qp_attr
	a.qp_state = C.GBV_QPS_INIT
	a.port_num = C.uint8_t(port)
	a.qp_access_flags = C.uint(access)
	return qp.modify(&a, C.GBV_QP_STATE|C.GBV_QP_PKEY_INDEX|C.GBV_QP_PORT|C.GBV_QP_ACCESS_FLAGS, "INIT")
}

// ReadyToReceive moves the queue pair to RTR, connected to r.DestQPN.
func (qp *QP) ReadyToReceive(r RTR) error {
	var a C.struct_gbv_qp_attr
	a.qp_state = C.GBV_QPS_RTR
	a.path_mtu = C.int(r.MTU)
	a.dest_qp_num = C.uint32_t(r.DestQPN)
	a.rq_psn = C.uint32_t(r.RecvPSN)
	a.max_dest_rd_atomic = 1
	a.min_rnr_timer = C.uint8_t(r.MinRNRTimer)
	a.ah_attr.dlid = C.uint16_t(r.DestLID)
	a.ah_attr.port_num = C.uint8_t(r.Port)
	if r.Global {
		a.ah_attr.is_global = 1
		for i, b := range r.DestGID {
			a.ah_attr.grh.dgid.raw[i] = C.uint8_t(b)
		}
		a.ah_attr.grh.sgid_index = C.uint8_t(r.SGIDIndex)
		a.ah_attr.grh.hop_limit = C.uint8_t(max(r.HopLimit, 1))
	}
	return qp.modify(&a, C.GBV_QP_STATE|C.GBV_QP_AV|C.GBV_QP_PATH_MTU|C.GBV_QP_DEST_QPN|C.GBV_QP_RQ_PSN|
		C.GBV_QP_MAX_DEST_RD_ATOMIC|C.GBV_QP_MIN_RNR_TIMER, "RTR")
}

// ReadyToSend moves the queue pair to RTS.
func (qp *QP) ReadyToSend(r RTS) error {
	var a C.struct_gbv_qp_attr
	a.qp_state = C.GBV_QPS_RTS
	a.sq_psn = C.uint32_t(r.SendPSN)
	a.timeout = C.uint8_t(r.Timeout)
	a.retry_cnt = C.uint8_t(r.Retry)
	a.rnr_retry = C.uint8_t(r.RNRRetry)
	a.max_rd_atomic = 1
	return qp.modify(&a, C.GBV_QP_STATE|C.GBV_QP_SQ_PSN|C.GBV_QP_TIMEOUT|C.GBV_QP_RETRY_CNT|C.GBV_QP_RNR_RETRY|
		C.GBV_QP_MAX_QP_RD_ATOMIC, "RTS")
}

// SetError moves the queue pair to ERR: every outstanding request
// completes with a flush status.
func (qp *QP) SetError() error {
	var a C.struct_gbv_qp_attr
	a.qp_state = C.GBV_QPS_ERR
	return qp.modify(&a, C.GBV_QP_STATE, "ERR")
}

// PostWrite posts a signaled RDMA WRITE of sges (at most 2, possibly
// none) to raddr under rkey, with immediate data imm when withImm.
func (qp *QP) PostWrite(wrID uint64, sges []SGE, raddr uint64, rkey uint32, imm uint32, withImm bool) error {
	if len(sges) > 2 {
		return fmt.Errorf("ibv_post_send: %d gather entries, at most 2", len(sges))
	}
	var sg [2]C.struct_gbv_sge
	for i, s := range sges {
		sg[i] = C.struct_gbv_sge{addr: C.uint64_t(s.Addr), length: C.uint32_t(s.Len), lkey: C.uint32_t(s.LKey)}
	}
	wi := C.int(0)
	if withImm {
		wi = 1
	}
	if r := C.gbv_post_write(qp.p, C.uint64_t(wrID), &sg[0], C.int(len(sges)), C.uint64_t(raddr), C.uint32_t(rkey), C.uint32_t(imm), wi); r != 0 {
		return fmt.Errorf("ibv_post_send (RDMA WRITE): %w", retErr(r))
	}
	return nil
}

// PostSendImm posts a signaled zero-length SEND with immediate data.
func (qp *QP) PostSendImm(wrID uint64, imm uint32) error {
	if r := C.gbv_post_send_imm(qp.p, C.uint64_t(wrID), C.uint32_t(imm)); r != 0 {
		return fmt.Errorf("ibv_post_send (SEND): %w", retErr(r))
	}
	return nil
}

// PostRecv posts a receive request without buffers: it takes one
// immediate value (of a WRITE with immediate or a zero-length SEND).
func (qp *QP) PostRecv(wrID uint64) error {
	if r := C.gbv_post_recv(qp.p, C.uint64_t(wrID)); r != 0 {
		return fmt.Errorf("ibv_post_recv: %w", retErr(r))
	}
	return nil
}

// Close destroys the queue pair: the device no longer touches its
// requests' memory once it returns.
func (qp *QP) Close() error {
	if r := C.gbv_destroy_qp(qp.p); r != 0 {
		return fmt.Errorf("ibv_destroy_qp: %w", retErr(r))
	}
	return nil
}

// AsyncFd is the descriptor of the device's asynchronous events, made
// non-blocking for poll(2).
func (c *Context) AsyncFd() (int, error) {
	fd := int((*C.struct_gbv_context)(c.p).async_fd)
	if err := unix.SetNonblock(fd, true); err != nil {
		return -1, fmt.Errorf("async event descriptor of %s: %w", c.Name, err)
	}
	return fd, nil
}

// NextAsync takes the next asynchronous event without waiting (AsyncFd
// must have been called), acknowledged; ok is false when none is waiting.
func (c *Context) NextAsync() (AsyncEvent, bool, error) {
	var ev C.struct_gbv_async_event
	if r, err := C.gbv_get_async_event(c.p, &ev); r != 0 {
		if errors.Is(err, syscall.EAGAIN) || errors.Is(err, syscall.EWOULDBLOCK) {
			return AsyncEvent{}, false, nil
		}
		return AsyncEvent{}, false, fmt.Errorf("ibv_get_async_event %s: %w", c.Name, errnoOr(err, syscall.EIO))
	}
	out := AsyncEvent{Type: int(ev.event_type)}
	if out.Type == EventPortActive || out.Type == EventPortErr {
		out.Port = int(*(*C.int)(unsafe.Pointer(&ev.element)))
	}
	C.gbv_ack_async_event(&ev)
	return out, true, nil
}

// retErr turns a verbs return value (an errno, positive or negative) into
// an error.
func retErr(r C.int) error {
	if r < 0 {
		r = -r
	}
	return syscall.Errno(r)
}

func errnoOr(err error, def syscall.Errno) error {
	var e syscall.Errno
	if errors.As(err, &e) && e != 0 {
		return e
	}
	return def
}
