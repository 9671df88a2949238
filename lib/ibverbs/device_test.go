//go:build cgo && linux

package ibverbs

import (
	"bytes"
	"errors"
	"syscall"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	"golang.org/x/sys/unix"
)

// NoDevice is the reason device tests give when this machine has none.
const NoDevice = "needs an RDMA device with an active port: the soft-RoCE VM lane (ci/vm, make vm-test) runs it"

// activePort finds the first device with an active port, or skips.
func activePort(t *testing.T) (string, int) {
	t.Helper()
	if err := Load(""); err != nil {
		t.Skipf("%s (%v)", NoDevice, err)
	}
	names, err := Devices()
	if err != nil {
		t.Skipf("%s (%v)", NoDevice, err)
	}
	for _, n := range names {
		c, err := Open(n)
		require.NoError(t, err)
		da, err := c.QueryDevice()
		require.NoError(t, err)
		for p := 1; p <= da.Ports; p++ {
			pa, err := c.QueryPort(p)
			require.NoError(t, err)
			if pa.State == PortActive {
				require.NoError(t, c.Close())
				return n, p
			}
		}
		require.NoError(t, c.Close())
	}
	t.Skip(NoDevice)
	return "", 0
}

// Two queue pairs of one port connected to each other: a WRITE with
// immediate data lands in the other's memory, its immediate value in a
// posted receive, and a SEND with immediate data completes a receive;
// events arrive on the channel.
func TestLoopbackWrite(t *testing.T) {
	dev, port := activePort(t)
	c, err := Open(dev)
	require.NoError(t, err)
	defer c.Close()
	pa, err := c.QueryPort(port)
	require.NoError(t, err)
	gids, err := c.GIDs(port)
	require.NoError(t, err)
	require.NotEmpty(t, gids, "port %d of %s has no GID", port, dev)
	gid := gids[0]
	for _, g := range gids {
		if g.Type == GIDTypeRoCEv2 && g.GID.IP().To4() != nil {
			gid = g
		}
	}
	pd, err := c.AllocPD()
	require.NoError(t, err)
	defer pd.Close()
	ch, err := c.NewCompChannel()
	require.NoError(t, err)
	defer ch.Close()

	src := bytes.Repeat([]byte("gpubridge"), 1<<14)
	dst := make([]byte, len(src))
	smr, err := pd.Register(src, AccessLocalWrite)
	require.NoError(t, err)
	defer smr.Close()
	dmr, err := pd.Register(dst, AccessLocalWrite|AccessRemoteWrite)
	require.NoError(t, err)
	defer dmr.Close()

	var cqs [2]*CQ
	var qps [2]*QP
	for i := range qps {
		cqs[i], err = c.NewCQ(64, ch, uint64(i+1))
		require.NoError(t, err)
		require.NoError(t, cqs[i].Notify())
		qps[i], err = pd.NewRCQP(cqs[i], cqs[i], QPCap{SendWR: 16, RecvWR: 16, SendSGE: 2, RecvSGE: 1})
		require.NoError(t, err)
		require.NoError(t, qps[i].Init(port, AccessLocalWrite|AccessRemoteWrite))
	}
	defer func() {
		for i := range qps {
			assert.NoError(t, qps[i].Close())
			assert.NoError(t, cqs[i].Close())
		}
	}()
	for i := range qps {
		other := qps[1-i]
		rtr := RTR{Port: port, MTU: pa.ActiveMTU, DestQPN: other.Num(), RecvPSN: 100, DestLID: pa.LID,
			DestGID: gid.GID, SGIDIndex: gid.Index, Global: pa.LinkLayer == LinkEthernet, MinRNRTimer: 12}
		require.NoError(t, qps[i].ReadyToReceive(rtr))
		require.NoError(t, qps[i].ReadyToSend(RTS{SendPSN: 100, Timeout: 18, Retry: 7, RNRRetry: 7}))
	}
	require.NoError(t, qps[1].PostRecv(7))
	require.NoError(t, qps[1].PostRecv(8))
	half := uint32(len(src) / 2)
	require.NoError(t, qps[0].PostWrite(1, []SGE{{Addr: smr.Addr, Len: half, LKey: smr.LKey}, {Addr: smr.Addr + uint64(half), Len: half, LKey: smr.LKey}},
		dmr.Addr, dmr.RKey, 0xabcd1234, true))
	require.NoError(t, qps[0].PostSendImm(2, 0x55))

	got := map[uint64]WC{}
	deadline := time.Now().Add(60 * time.Second)
	for len(got) < 4 && time.Now().Before(deadline) {
		fds := []unix.PollFd{{Fd: int32(ch.Fd()), Events: unix.POLLIN}}
		_, err := unix.Poll(fds, 100)
		if err != nil && !errors.Is(err, syscall.EINTR) {
			require.NoError(t, err)
		}
		for {
			key, ok, err := ch.Next()
			require.NoError(t, err)
			if !ok {
				break
			}
			require.Contains(t, []uint64{1, 2}, key)
			require.NoError(t, cqs[key-1].Notify())
		}
		for _, cq := range cqs {
			wcs := make([]WC, 8)
			n, err := cq.Poll(wcs)
			require.NoError(t, err)
			for _, w := range wcs[:n] {
				require.Equal(t, StatusSuccess, w.Status, "wr %d: %s", w.WRID, StatusString(w.Status))
				got[w.WRID] = w
			}
		}
	}
	require.Len(t, got, 4, "completions within the deadline")
	assert.Equal(t, src, dst)
	assert.Equal(t, OpcodeRecvWriteImm, got[7].Opcode)
	assert.True(t, got[7].HasImm())
	assert.Equal(t, uint32(0xabcd1234), got[7].Imm)
	assert.Equal(t, OpcodeRecv, got[8].Opcode)
	assert.Equal(t, uint32(0x55), got[8].Imm)
	assert.Equal(t, OpcodeRDMAWrite, got[1].Opcode)
}
