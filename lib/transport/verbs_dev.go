package transport

import (
	"time"

	"github.com/gpubridge/gpubridge/lib/ibverbs"
)

// The narrow interface between the verbs streams and a device: what the
// streams and the progress engine do with queue pairs, completion queues
// and memory. verbs_hw.go implements it over lib/ibverbs; the tests have
// an in-memory fake of it (verbs_fake_test.go) for what a real device
// cannot be made to do on demand (lost acknowledgements at a chosen
// request, a peer that overruns its credit, ring positions near wrap).

// vDev is one member's open device.
type vDev interface {
	// register registers b for local access, and for remote writes when
	// remote is set.
	register(b []byte, remote bool) (vMR, error)
	// newQP makes a connected-mode queue pair whose completions go to
	// their own completion queue, tagged with key for wait.
	newQP(key int, sendWR, recvWR int) (vQP, error)
	// wait blocks until completion queues may hold completions (it
	// returns their keys, each re-armed), d passes, or wake is called.
	// Port events are reported through portDown.
	wait(d time.Duration) ([]int, error)
	wake()
	// port describes the local port for messages: "rxe0 port 1 (ACTIVE)".
	port() string
	// portDown reports whether a port-down event was seen since open.
	portDown() bool
	close() error
}

// vMR is a registration.
type vMR interface {
	keys() (lkey, rkey uint32)
	addr() uint64
	close() error
}

// vQP is one Reliable Connected queue pair and its completion queue.
type vQP interface {
	num() uint32
	// readyToReceive connects it to the peer's queue pair remote, its
	// first packet expected numbered recvPSN: from then on the device
	// takes (or refuses) the peer's writes.
	readyToReceive(remote vRemote, recvPSN uint32) error
	// readyToSend moves it on to ready-to-send, its first request
	// numbered sendPSN. The error wraps ibverbs.ErrQPInError when the
	// queue pair had failed already: its device refused a peer's write
	// while it was ready to receive, say (RC rules: the responder of a
	// refused request fails its queue pair).
	readyToSend(sendPSN uint32) error
	// state is its state as the device has it now.
	state() (ibverbs.QPState, error)
	// write posts a signaled RDMA WRITE of sges to raddr under rkey, with
	// immediate data imm when withImm; no sges is a zero-length write.
	write(wrID uint64, sges []ibverbs.SGE, raddr uint64, rkey uint32, imm uint32, withImm bool) error
	// sendImm posts a signaled zero-length SEND with immediate data.
	sendImm(wrID uint64, imm uint32) error
	// postRecv posts a receive for one immediate value.
	postRecv(wrID uint64) error
	poll(wcs []ibverbs.WC) (int, error)
	// fail moves it to the error state: outstanding requests flush.
	fail() error
	close() error
}

// vRemote is how to reach a peer's queue pair.
type vRemote struct {
	qpn      uint32
	lid      uint16
	gid      ibverbs.GID
	global   bool
	mtu      ibverbs.MTU
	gidIndex int // the local GID index to send from
	port     int
}
