// Package ibverbs is the part of libibverbs (rdma-core) that gpubridge
// uses: device and port queries, protection domains, memory registration,
// completion queues and channels, Reliable Connected queue pairs, RDMA
// WRITE with immediate data, zero-length SENDs with immediate data and
// receives without buffers.
//
// The library is loaded at run time with dlopen (as NCCL does), so the same
// binary runs where libibverbs is absent and says so: Load returns an error
// wrapping ErrUnavailable with the loader's reason. Building needs no
// libibverbs-dev: gbverbs.h declares the binary interface used (the
// context's operation table for the data path, as libibverbs' inline
// functions use it), and abi_test.go checks it against the system's
// <infiniband/verbs.h> when that is installed. Without cgo every call
// fails with ErrUnavailable.
package ibverbs

import (
	"errors"
	"fmt"
	"net"
	"os"
)

// DefaultLibrary is what Load opens when given no path and
// GPUBRIDGE_IBVERBS_LIB is unset.
const DefaultLibrary = "libibverbs.so.1"

// ErrUnavailable is wrapped by Load's error when libibverbs cannot be
// loaded (not installed, too old, or a build without cgo).
var ErrUnavailable = errors.New("libibverbs is not available")

// ErrNoKernelSupport is returned when the kernel offers no RDMA
// (ib_uverbs is not loaded): libibverbs' device list fails with ENOSYS.
var ErrNoKernelSupport = errors.New("the kernel has no RDMA support (no /sys/class/infiniband_verbs: is ib_uverbs loaded?)")

// ErrQPInError is wrapped, beside the library's errno, by a failed move of
// a queue pair to another state when the queue pair turns out to be in the
// error state already: the device failed it on its own (a request it
// refused, a failed completion), so the move was not a bad argument.
var ErrQPInError = errors.New("the queue pair is in the error state already")

// LibraryPath is the library Load opens for path "": GPUBRIDGE_IBVERBS_LIB
// when set, else DefaultLibrary.
func LibraryPath(path string) string {
	if path != "" {
		return path
	}
	if p := os.Getenv("GPUBRIDGE_IBVERBS_LIB"); p != "" {
		return p
	}
	return DefaultLibrary
}

// PortState is a port's logical state (ibv_port_state).
type PortState int

// Port states.
const (
	PortNop    PortState = 0
	PortDown   PortState = 1
	PortInit   PortState = 2
	PortArmed  PortState = 3
	PortActive PortState = 4
)

func (s PortState) String() string {
	switch s {
	case PortDown:
		return "DOWN"
	case PortInit:
		return "INIT"
	case PortArmed:
		return "ARMED"
	case PortActive:
		return "ACTIVE"
	case PortNop:
		return "NOP"
	}
	return fmt.Sprintf("state(%d)", int(s))
}

// MTU is an IB MTU enum value: 1 (256 bytes) to 5 (4096 bytes).
type MTU int

// Bytes is the MTU in bytes, 0 when unknown.
func (m MTU) Bytes() int {
	if m < 1 || m > 5 {
		return 0
	}
	return 128 << m
}

// LinkLayer is a port's link layer.
type LinkLayer int

// Link layers (IBV_LINK_LAYER_*).
const (
	LinkUnspecified LinkLayer = 0
	LinkInfiniBand  LinkLayer = 1
	LinkEthernet    LinkLayer = 2
)

// String is the name sysfs gives the link layer: InfiniBand or Ethernet.
func (l LinkLayer) String() string {
	switch l {
	case LinkEthernet:
		return "Ethernet"
	case LinkInfiniBand, LinkUnspecified:
		// Unspecified is reported by old InfiniBand drivers.
		return "InfiniBand"
	}
	return fmt.Sprintf("link-layer(%d)", int(l))
}

// PortAttr is what ibv_query_port says about a port.
type PortAttr struct {
	State        PortState
	MaxMTU       MTU
	ActiveMTU    MTU
	GIDTableLen  int
	LID          uint16
	LinkLayer    LinkLayer
	ActiveWidth  uint8 // IB width code: 1 1X, 2 4X, 4 8X, 8 12X, 16 2X
	ActiveSpeed  uint8 // IB speed code: 1 SDR … 128 NDR
	PhysState    uint8
	MaxMessageSz uint32
}

// Gbps is the port's data rate from its width and speed codes, 0 when
// they are unknown.
func (p PortAttr) Gbps() float64 {
	lanes := map[uint8]float64{1: 1, 2: 4, 4: 8, 8: 12, 16: 2}[p.ActiveWidth]
	lane := map[uint8]float64{1: 2.5, 2: 5, 4: 10, 8: 10, 16: 14, 32: 25, 64: 50, 128: 100}[p.ActiveSpeed]
	return lanes * lane
}

// DeviceAttr is what ibv_query_device says about a device.
type DeviceAttr struct {
	FirmwareVersion string
	NodeGUID        uint64
	MaxMRSize       uint64
	MaxQP, MaxQPWR  int
	MaxCQE, MaxSGE  int
	Ports           int
}

// GID is a GID table entry's 16 bytes, in network order.
type GID [16]byte

// IsZero reports whether the GID is all zeros (an unused entry).
func (g GID) IsZero() bool { return g == GID{} }

// IP is the GID as an IPv6 address (an IPv4 address for IPv4-mapped GIDs,
// as RoCE v2 makes them).
func (g GID) IP() net.IP {
	ip := net.IP(g[:])
	if v4 := ip.To4(); v4 != nil {
		return v4
	}
	return ip
}

// String is the GID as ibv_devinfo writes it: "fe80::1", "::ffff:10.0.0.1".
func (g GID) String() string {
	if v4 := net.IP(g[:]).To4(); v4 != nil {
		return "::ffff:" + v4.String()
	}
	return net.IP(g[:]).String()
}

// GIDType is a GID's type (enum ibv_gid_type).
type GIDType int

// GID types.
const (
	GIDTypeIB      GIDType = 0
	GIDTypeRoCEv1  GIDType = 1
	GIDTypeRoCEv2  GIDType = 2
	GIDTypeUnknown GIDType = -1 // the library cannot say (libibverbs < 1.11)
)

// String is the type as sysfs spells it.
func (t GIDType) String() string {
	switch t {
	case GIDTypeIB:
		return "IB/RoCE v1"
	case GIDTypeRoCEv1:
		return "RoCE v1"
	case GIDTypeRoCEv2:
		return "RoCE v2"
	}
	return "unknown"
}

// GIDEntry is one used GID table entry of a port.
type GIDEntry struct {
	Index   int
	GID     GID
	Type    GIDType
	Ifindex int // the network interface of a RoCE GID, 0 when none or unknown
}

// Access flags of a memory registration.
type Access int

// Access flags.
const (
	AccessLocalWrite  Access = 1
	AccessRemoteWrite Access = 1 << 1
)

// SGE is one gather entry of a posted write: bytes [Addr, Addr+Len) of
// memory registered with LKey.
type SGE struct {
	Addr uint64
	Len  uint32
	LKey uint32
}

// Opcodes of WC.Opcode.
const (
	OpcodeRDMAWrite     = 1
	OpcodeRecv          = 1 << 7
	OpcodeRecvWriteImm  = 1<<7 + 1
	wcFlagWithImmediate = 1 << 1
)

// WC is one work completion.
type WC struct {
	WRID      uint64
	Status    int // 0: success
	Opcode    int
	VendorErr uint32
	ByteLen   uint32
	Imm       uint32
	QPNum     uint32
	Flags     uint32
}

// HasImm reports whether the completion carries immediate data.
func (w WC) HasImm() bool { return w.Flags&wcFlagWithImmediate != 0 }

// Work completion statuses that callers tell apart.
const (
	StatusSuccess   = 0
	StatusLocLen    = 1
	StatusLocQPOp   = 2
	StatusLocProt   = 4
	StatusFlush     = 5
	StatusRemInvReq = 9
	StatusRemAccess = 10
	StatusRemOp     = 11
	StatusRetryExc  = 12
	StatusRNRRetry  = 13
	StatusFatal     = 19
)

// QPState is a queue pair's state (enum ibv_qp_state).
type QPState int

// Queue pair states.
const (
	QPReset          QPState = 0
	QPInit           QPState = 1
	QPReadyToReceive QPState = 2
	QPReadyToSend    QPState = 3
	QPSendDrain      QPState = 4
	QPSendError      QPState = 5
	QPError          QPState = 6
)

// String is the state as the verbs specification abbreviates it: RTR, RTS, ERR.
func (s QPState) String() string {
	switch s {
	case QPReset:
		return "RESET"
	case QPInit:
		return "INIT"
	case QPReadyToReceive:
		return "RTR"
	case QPReadyToSend:
		return "RTS"
	case QPSendDrain:
		return "SQD"
	case QPSendError:
		return "SQE"
	case QPError:
		return "ERR"
	}
	return fmt.Sprintf("qp-state(%d)", int(s))
}

// RTR is what moving a queue pair to Ready To Receive needs: the remote
// queue pair, its path and the first packet sequence number expected.
type RTR struct {
	Port      int
	MTU       MTU
	DestQPN   uint32
	RecvPSN   uint32
	DestLID   uint16
	DestGID   GID
	SGIDIndex int
	Global    bool // route with a GRH (RoCE, or InfiniBand across subnets)
	HopLimit  uint8
	// MinRNRTimer is the IB code of the RNR NAK delay it asks of senders.
	MinRNRTimer uint8
}

// RTS is what moving a queue pair to Ready To Send needs.
type RTS struct {
	SendPSN uint32
	// Timeout is the local ACK timeout exponent: 4.096 µs × 2^Timeout.
	Timeout  uint8
	Retry    uint8 // transport retries, at most 7
	RNRRetry uint8 // RNR retries, 7: without limit
}

// QPCap sizes a queue pair's queues.
type QPCap struct {
	SendWR, RecvWR   int
	SendSGE, RecvSGE int
}

// Async event types that callers tell apart.
const (
	EventPortActive = 9
	EventPortErr    = 10
)

// AsyncEvent is one asynchronous event of a device.
type AsyncEvent struct {
	Type int
	Port int // for port events
}
