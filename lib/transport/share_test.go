package transport

import (
	"bytes"
	"context"
	"encoding/binary"
	"fmt"
	"io"
	"log/slog"
	"net"
	"os"
	"slices"
	"strings"
	"syscall"
	"testing"
	"time"
	"unsafe"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	"golang.org/x/sys/unix"

	"github.com/gpubridge/gpubridge/lib/store/storetest"
	"github.com/gpubridge/gpubridge/lib/testenv"
	"github.com/gpubridge/gpubridge/lib/wire"
)

// sharedPattern fills b with member m's bytes.
func sharedPattern(b []byte, m int) {
	for i := range b {
		b[i] = byte(i*7 + m*13 + i>>12)
	}
}

// mapsWith counts this process's mappings whose line names name.
func mapsWith(t testing.TB, name string) int {
	t.Helper()
	b, err := os.ReadFile("/proc/self/maps")
	require.NoError(t, err)
	return strings.Count(string(b), name)
}

// Every member reads what another shared, in place; withdrawn and closed
// regions are unmapped once nobody holds them.
func TestShareSHM(t *testing.T) {
	for _, n := range []int{2, 3} {
		t.Run(fmt.Sprintf("members=%d", n), func(t *testing.T) {
			meshes := newBridge(t, SHM, n, 2, false).mustEstablish(t)
			ctx, cancel := context.WithTimeout(context.Background(), testenv.Scale(30*time.Second))
			defer cancel()
			const size = 1<<20 + 4096
			name := fmt.Sprintf("gpubridge-test-share-%d", n)
			ids := make([]uint64, n)
			fds := make([]int, n)
			mems := make([][]byte, n)
			for i, m := range meshes {
				fd, mem, err := NewMemfd(name, size)
				require.NoError(t, err)
				t.Cleanup(func() { FreeMemfd(fd, mem) })
				sharedPattern(mem, i)
				fds[i], mems[i] = fd, mem
				ids[i], err = m.(Sharer).Share(fd, mem)
				require.NoError(t, err)
				id, off, ok := m.(Sharer).Locate(mem[4096 : 8192+3])
				require.True(t, ok)
				assert.Equal(t, ids[i], id)
				assert.Equal(t, uint64(4096), off)
				_, _, ok = m.(Sharer).Locate(make([]byte, 64))
				assert.False(t, ok, "a buffer outside every shared region")
			}
			for i, m := range meshes {
				for p := range n {
					if p == i {
						continue
					}
					v, release, err := m.(Sharer).PeerMem(ctx, p, ids[p], 4096, size-4096)
					require.NoError(t, err)
					assert.True(t, bytes.Equal(mems[p][4096:], v), "member %d's view of member %d", i, p)
					release()
					release() // more calls do nothing
					_, _, err = m.(Sharer).PeerMem(ctx, p, ids[p], 4096, size)
					assert.ErrorIs(t, err, ErrNotShared)
					short, stop := context.WithTimeout(ctx, 50*time.Millisecond)
					_, _, err = m.(Sharer).PeerMem(short, p, ids[p]+100, 0, 1)
					stop()
					assert.ErrorIs(t, err, context.DeadlineExceeded, "a region never shared")
				}
			}
			share := func(m Mesh) *shareTable { return m.(*shmMesh).share.tab }
			// A region withdrawn while held stays mapped until released.
			held, release, err := meshes[1].(Sharer).PeerMem(ctx, 0, ids[0], 0, size)
			require.NoError(t, err)
			meshes[0].(Sharer).Unshare(ids[0])
			_, _, ok := meshes[0].(Sharer).Locate(mems[0])
			assert.False(t, ok)
			require.Eventually(t, func() bool {
				tab := share(meshes[1])
				tab.mu.Lock()
				defer tab.mu.Unlock()
				return tab.peers[0].regions[ids[0]] == nil
			},
				testenv.Scale(10*time.Second), time.Millisecond)
			assert.Equal(t, byte(0*13), held[0]) // still readable
			assert.Equal(t, n-1, share(meshes[1]).mapped(), "member 1 still holds member 0's region and maps the others'")
			release()
			assert.Equal(t, n-2, share(meshes[1]).mapped())
			// Closing unmaps every peer region.
			for _, m := range meshes {
				require.NoError(t, m.Close())
				assert.Equal(t, 0, share(m).mapped())
			}
			for i := range meshes {
				FreeMemfd(fds[i], mems[i])
				fds[i], mems[i] = -1, nil
			}
			assert.Zero(t, mapsWith(t, name), "nothing of the shared regions is mapped any more")
		})
	}
}

// mapPerms returns the permissions ("rw-s", "r--s") of this process's
// mapping that holds b.
func mapPerms(t testing.TB, b []byte) string {
	t.Helper()
	maps, err := os.ReadFile("/proc/self/maps")
	require.NoError(t, err)
	at := uint64(uintptr(unsafe.Pointer(unsafe.SliceData(b))))
	for line := range strings.Lines(string(maps)) {
		var lo, hi uint64
		var perms string
		if _, err := fmt.Sscanf(line, "%x-%x %s", &lo, &hi, &perms); err == nil && lo <= at && at < hi {
			return perms
		}
	}
	t.Fatalf("no mapping holds %#x", at)
	return ""
}

// With Config.PeerWrite a member maps its peers' regions writable, and
// what it writes through PeerMem's view lands in the peer's region, within
// the range asked (the view's capacity ends there); without it they stay
// read-only. Members may differ. A region sealed against writes cannot be
// shared by a member whose peers may write, nor mapped writable.
func TestSharePeerWrite(t *testing.T) {
	meshes := newBridge(t, SHM, 2, 1, false).set(func(c *Config) { c.PeerWrite = c.Self == 0 }).mustEstablish(t)
	ctx, cancel := context.WithTimeout(context.Background(), testenv.Scale(30*time.Second))
	defer cancel()
	assert.True(t, meshes[0].(Sharer).PeerWrite())
	assert.False(t, meshes[1].(Sharer).PeerWrite())
	const size = 3 * 4096
	ids, mems := make([]uint64, 2), make([][]byte, 2)
	for i, m := range meshes {
		fd, mem, err := NewMemfd("gpubridge-test-peerwrite", size)
		require.NoError(t, err)
		t.Cleanup(func() { FreeMemfd(fd, mem) })
		sharedPattern(mem, i)
		mems[i] = mem
		ids[i], err = m.(Sharer).Share(fd, mem)
		require.NoError(t, err)
	}
	v, release, err := meshes[0].(Sharer).PeerMem(ctx, 1, ids[1], 4096, 4096)
	require.NoError(t, err)
	defer release()
	assert.Equal(t, "rw-s", mapPerms(t, v))
	assert.Equal(t, 4096, cap(v), "the view ends with the range asked")
	before := slices.Clone(mems[1])
	for i := range v {
		v[i] = ^v[i]
	}
	for i := range mems[1] {
		want := before[i]
		if i >= 4096 && i < 8192 {
			want = ^want
		}
		require.Equal(t, want, mems[1][i], "byte %d of member 1's region", i)
	}
	r, release1, err := meshes[1].(Sharer).PeerMem(ctx, 0, ids[0], 0, size)
	require.NoError(t, err)
	defer release1()
	assert.Equal(t, "r--s", mapPerms(t, r))

	// A region sealed against writes.
	fd, err := unix.MemfdCreate("gpubridge-test-sealed", unix.MFD_CLOEXEC|unix.MFD_ALLOW_SEALING)
	require.NoError(t, err)
	defer unix.Close(fd)
	require.NoError(t, unix.Ftruncate(fd, 8192))
	_, err = unix.FcntlInt(uintptr(fd), unix.F_ADD_SEALS, unix.F_SEAL_SHRINK|unix.F_SEAL_GROW|unix.F_SEAL_WRITE)
	require.NoError(t, err)
	mem, err := unix.Mmap(fd, 0, 8192, unix.PROT_READ, unix.MAP_SHARED)
	require.NoError(t, err)
	defer unix.Munmap(mem)
	_, err = meshes[0].(Sharer).Share(fd, mem)
	assert.ErrorContains(t, err, "region memfd is sealed against writes")
	id, err := meshes[1].(Sharer).Share(fd, mem) // its peers do not write
	require.NoError(t, err)
	_, _, err = meshes[0].(Sharer).PeerMem(ctx, 1, id, 0, 8192)
	assert.ErrorContains(t, err, "its shared region 2 could not be mapped here: region memfd is sealed against writes")
}

// Share refuses memory that a peer could not map safely; a peer that sends
// such a descriptor anyway gets it refused on the other side.
func TestShareRefusesUnsafeMemory(t *testing.T) {
	meshes := newBridge(t, SHM, 2, 1, false).mustEstablish(t)
	ctx, cancel := context.WithTimeout(context.Background(), testenv.Scale(30*time.Second))
	defer cancel()
	fd, err := unix.MemfdCreate("gpubridge-test-unsealed", unix.MFD_CLOEXEC|unix.MFD_ALLOW_SEALING)
	require.NoError(t, err)
	defer unix.Close(fd)
	require.NoError(t, unix.Ftruncate(fd, 8192))
	mem, err := unix.Mmap(fd, 0, 8192, unix.PROT_READ|unix.PROT_WRITE, unix.MAP_SHARED)
	require.NoError(t, err)
	defer unix.Munmap(mem)
	_, err = meshes[0].(Sharer).Share(fd, mem)
	assert.ErrorContains(t, err, "F_SEAL_SHRINK")
	f, err := os.CreateTemp(t.TempDir(), "plain")
	require.NoError(t, err)
	defer f.Close()
	_, err = meshes[0].(Sharer).Share(int(f.Fd()), mem)
	assert.ErrorContains(t, err, "not a sealable memfd")

	// Bypassing the check: the receiver refuses to map it.
	sh := meshes[0].(*shmMesh).share
	require.NoError(t, sh.send(1, shareMsg{typ: shareMsgShare, id: 77, size: 8192}, fd))
	_, _, err = meshes[1].(Sharer).PeerMem(ctx, 0, 77, 0, 8192)
	assert.ErrorContains(t, err, "member 0 (rank 0 on")
	assert.ErrorContains(t, err, "its shared region 77 could not be mapped here: region memfd is not sealed with F_SEAL_SHRINK")
	// A region larger than its file.
	fd2, mem2, err := NewMemfd("gpubridge-test-short", 4096)
	require.NoError(t, err)
	defer FreeMemfd(fd2, mem2)
	require.NoError(t, sh.send(1, shareMsg{typ: shareMsgShare, id: 78, size: 1 << 20}, fd2))
	_, _, err = meshes[1].(Sharer).PeerMem(ctx, 0, 78, 0, 1)
	assert.ErrorContains(t, err, "region memfd holds 4096 bytes, the message says 1048576")
	// A share message without a descriptor is a protocol error: the
	// channel is dropped and no later region arrives.
	require.NoError(t, sh.send(1, shareMsg{typ: shareMsgShare, id: 79, size: 4096}, -1))
	_, _, err = meshes[1].(Sharer).PeerMem(ctx, 0, 80, 0, 1)
	assert.ErrorContains(t, err, "its shared region 80 never arrived: protocol error: region 79 came with 0 file descriptors, not 1")
}

// A stranger cannot connect to a member's share socket: it cannot prove
// the secret, and the socket is gone after the set-up.
func TestShareStrangerRefused(t *testing.T) {
	b := newBridge(t, SHM, 2, 1, false)
	logs := &storetest.SyncBuffer{}
	b.cfgs[0].Log = slog.New(slog.NewTextHandler(logs, nil))
	join := b.twoStep(t)
	job := jobTag(secretOf(t, b))
	path := sharePath(job, 0)
	require.Eventually(t, func() bool { _, err := os.Stat(path); return err == nil }, testenv.Scale(20*time.Second), time.Millisecond)
	fi, err := os.Stat(path)
	require.NoError(t, err)
	assert.Equal(t, os.FileMode(0o600), fi.Mode().Perm())

	dial := func(t *testing.T) *net.UnixConn {
		c, err := net.DialUnix("unix", nil, &net.UnixAddr{Name: path, Net: "unix"})
		require.NoError(t, err)
		require.NoError(t, c.SetDeadline(time.Now().Add(testenv.Scale(10*time.Second))))
		return c
	}
	refused := func(t *testing.T, c *net.UnixConn) {
		_, err := io.ReadAll(c)
		assert.NoError(t, err, "the member closes the connection without a confirmation")
	}
	t.Run("garbage", func(t *testing.T) {
		c := dial(t)
		defer c.Close()
		_, _ = c.Write(bytes.Repeat([]byte("x"), shareHelloLen))
		refused(t, c)
	})
	t.Run("wrong secret", func(t *testing.T) {
		c := dial(t)
		defer c.Close()
		h := shareHello{from: 1, to: 0, job: job}
		var hb [shareHelloLen]byte
		h.put(hb[:])
		_, err := c.Write(hb[:])
		require.NoError(t, err)
		var reply [shareReplyLen]byte
		_, err = io.ReadFull(c, reply[:])
		require.NoError(t, err)
		_, err = c.Write(shareMAC([]byte("not the secret"), "gbshare-c\x00", &h, reply[:32]))
		require.NoError(t, err)
		refused(t, c)
	})
	t.Run("another job", func(t *testing.T) {
		c := dial(t)
		defer c.Close()
		h := shareHello{from: 1, to: 0, job: jobTag([]byte("another job"))}
		var hb [shareHelloLen]byte
		h.put(hb[:])
		_, err := c.Write(hb[:])
		require.NoError(t, err)
		refused(t, c)
	})
	meshes := join()
	exchange(t, meshes, []int{5})
	_, err = os.Stat(path)
	assert.ErrorIs(t, err, os.ErrNotExist, "the share socket is unlinked after the set-up")
	assert.Contains(t, logs.String(), "refused a connection to the shared-memory socket")
	assert.Contains(t, logs.String(), "without the job's secret")
	assert.Contains(t, logs.String(), "a hello of another job")
}

// A peer that dies while this member maps its region: the mapping stays
// valid (the memfd lives on), the channel's end is noticed, and closing
// leaves nothing mapped.
func TestSharePeerKilled(t *testing.T) {
	b := newBridge(t, SHM, 2, 1, false)
	b.cfgs[0].Process = "gbbridge serve"
	child := startChildWith(t, b, 1, childShare)
	ms, errs := b.establish(t, 0)
	require.NoError(t, errs[0])
	m := ms[0]
	ctx, cancel := context.WithTimeout(context.Background(), testenv.Scale(30*time.Second))
	defer cancel()
	var id uint64
	require.NoError(t, m.Stream(1, 0).Recv(ctx, func(_ wire.Header, p []byte) error {
		id = binary.LittleEndian.Uint64(p)
		return nil
	}))
	v, release, err := m.(Sharer).PeerMem(ctx, 1, id, 0, childShareBytes)
	require.NoError(t, err)
	want := make([]byte, childShareBytes)
	sharedPattern(want, 1)
	assert.True(t, bytes.Equal(want, v))
	require.Equal(t, 1, mapsWith(t, childShareName))
	require.NoError(t, child.Process.Signal(syscall.SIGKILL))
	_, _ = child.Process.Wait()
	tab := m.(*shmMesh).share.tab
	require.Eventually(t, func() bool {
		tab.mu.Lock()
		defer tab.mu.Unlock()
		return tab.peers[1].gone != nil
	}, testenv.Scale(10*time.Second), time.Millisecond, "member 0 notices that member 1's channel ended")
	assert.True(t, bytes.Equal(want, v), "the view of a dead peer's region stays readable")
	_, _, err = m.(Sharer).PeerMem(ctx, 1, id+1, 0, 1)
	assert.ErrorContains(t, err, "its shared region 2 never arrived: its shared-memory channel closed")
	release()
	require.NoError(t, m.Close())
	assert.Zero(t, mapsWith(t, childShareName), "nothing of the dead peer's region is mapped")
}

// The in-memory mesh shares too (the collectives' tests use it).
func TestShareMem(t *testing.T) {
	meshes := NewMem(2, 1, false)
	ctx, cancel := context.WithTimeout(context.Background(), testenv.Scale(10*time.Second))
	defer cancel()
	buf := make([]byte, 100)
	sharedPattern(buf, 0)
	id, err := meshes[0].(Sharer).Share(-1, buf)
	require.NoError(t, err)
	v, release, err := meshes[1].(Sharer).PeerMem(ctx, 0, id, 10, 90)
	require.NoError(t, err)
	assert.Equal(t, buf[10:], v)
	release()
	meshes[0].(Sharer).Unshare(id)
	short, stop := context.WithTimeout(ctx, 20*time.Millisecond)
	defer stop()
	_, _, err = meshes[1].(Sharer).PeerMem(short, 0, id, 0, 1)
	assert.Error(t, err)
	require.NoError(t, meshes[0].Close())
	_, _, err = meshes[1].(Sharer).PeerMem(ctx, 0, id+1, 0, 1)
	assert.ErrorIs(t, err, ErrPeerClosed)
	require.NoError(t, meshes[1].Close())
}

// With CRCs on the shm mesh still passes regions but locates none: every
// byte of a collective then travels in checked frames.
func TestShareCRCLocatesNothing(t *testing.T) {
	meshes := newBridge(t, SHM, 2, 1, true).mustEstablish(t)
	fd, mem, err := NewMemfd("gpubridge-test-crc", 8192)
	require.NoError(t, err)
	defer FreeMemfd(fd, mem)
	_, err = meshes[0].(Sharer).Share(fd, mem)
	require.NoError(t, err)
	_, _, ok := meshes[0].(Sharer).Locate(mem)
	assert.False(t, ok)
}
