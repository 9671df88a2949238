package feedserver

import (
	"context"
	"encoding/binary"
	"errors"
	"fmt"
	"io"
	"math"
	"net"
	"os"
	"path/filepath"
	"sort"
	"sync"
	"testing"
	"time"

	"github.com/gpubridge/gpubridge/lib/feed"
	"github.com/gpubridge/gpubridge/lib/feed/feedtest"
	"github.com/gpubridge/gpubridge/lib/reduce"
	"github.com/gpubridge/gpubridge/lib/testenv"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	"go.uber.org/goleak"
	"golang.org/x/sys/unix"
)

func TestMain(m *testing.M) { goleak.VerifyTestMain(m) }

// sockDir returns a short private directory for sockets (sun_path is 108
// bytes; t.TempDir() paths can be longer).
func sockDir(t testing.TB) string {
	dir, err := os.MkdirTemp("", "gbfeed")
	require.NoError(t, err)
	t.Cleanup(func() { os.RemoveAll(dir) })
	return dir
}

// feedEnv is n feed servers, each driving one bridge member, and a client
// connected to each.
type feedEnv struct {
	t       testing.TB
	clients []*feedtest.Client
	servers []*Server
	errs    []chan error
	cancel  context.CancelFunc
}

func startFeeds(t testing.TB, bs []Bridge, tune func(*ServerOptions)) *feedEnv {
	t.Helper()
	return startFeedsVersion(t, bs, tune, feed.Version)
}

// startFeedsVersion is startFeeds with clients that speak feed protocol
// versions up to max.
func startFeedsVersion(t testing.TB, bs []Bridge, tune func(*ServerOptions), max uint16) *feedEnv {
	t.Helper()
	ctx, cancel := context.WithCancel(context.Background())
	e := &feedEnv{t: t, cancel: cancel, servers: make([]*Server, len(bs))}
	dir := sockDir(t)
	var ready sync.WaitGroup
	for i, b := range bs {
		path := filepath.Join(dir, fmt.Sprintf("m%d.sock", i))
		ln, err := Listen(path)
		require.NoError(t, err)
		errc := make(chan error, 1)
		e.errs = append(e.errs, errc)
		o := ServerOptions{Member: i, Members: len(bs), Transport: "fake"}
		if tune != nil {
			tune(&o)
		}
		ready.Add(1)
		go func() {
			conn, err := ln.Accept(ctx, 5*time.Second)
			if err != nil {
				ready.Done()
				errc <- err
				return
			}
			e.servers[i] = NewServer(conn, b, o)
			ready.Done()
			errc <- e.servers[i].Serve(ctx)
		}()
		c, err := feedtest.DialVersion(ctx, path, max)
		require.NoError(t, err)
		e.clients = append(e.clients, c)
	}
	ready.Wait()
	t.Cleanup(func() {
		cancel()
		for _, c := range e.clients {
			c.Abort()
		}
		for _, ch := range e.errs {
			select {
			case <-ch:
			case <-time.After(testenv.Scale(20 * time.Second)):
				t.Error("a feed server did not stop")
			}
		}
	})
	return e
}

// closeAll says BYE on every client and checks that every server returns nil.
func (e *feedEnv) closeAll() {
	e.t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), testenv.Scale(20*time.Second))
	defer cancel()
	for _, c := range e.clients {
		require.NoError(e.t, c.Close(ctx))
	}
	for i := range e.errs {
		require.NoError(e.t, e.wait(i))
	}
}

// wait returns server i's result, and puts it back for the cleanup.
func (e *feedEnv) wait(i int) error {
	select {
	case err := <-e.errs[i]:
		e.errs[i] <- err
		return err
	case <-time.After(testenv.Scale(20 * time.Second)):
		return errors.New("timeout waiting for the feed server")
	}
}

// parallel runs fn for every member at once and fails on the first error.
func parallel(t testing.TB, n int, fn func(i int) error) {
	t.Helper()
	errs := make([]error, n)
	var wg sync.WaitGroup
	for i := 0; i < n; i++ {
		wg.Add(1)
		go func() {
			defer wg.Done()
			errs[i] = fn(i)
		}()
	}
	wg.Wait()
	for i, err := range errs {
		require.NoError(t, err, "member %d", i)
	}
}

func putF32(b []byte, vals ...float32) {
	for i, v := range vals {
		binary.LittleEndian.PutUint32(b[4*i:], math.Float32bits(v))
	}
}

func getF32(b []byte) []float32 {
	out := make([]float32, len(b)/4)
	for i := range out {
		out[i] = math.Float32frombits(binary.LittleEndian.Uint32(b[4*i:]))
	}
	return out
}

func mapRegions(t testing.TB, cs []*feedtest.Client, size int) []*feedtest.Region {
	t.Helper()
	out := make([]*feedtest.Region, len(cs))
	for i, c := range cs {
		r, err := c.Map(context.Background(), size)
		require.NoError(t, err)
		out[i] = r
	}
	return out
}

func TestEveryRequest(t *testing.T) {
	e := startFeeds(t, bridges(newFakeGroup(2, 8)), nil)
	ctx := context.Background()
	cs := e.clients
	for i, c := range cs {
		w := c.Welcome()
		assert.Equal(t, uint16(feed.Version), w.Version)
		assert.Equal(t, uint32(i), w.Member)
		assert.Equal(t, uint32(2), w.Members)
		assert.Equal(t, "fake", w.Transport)
	}
	regs := mapRegions(t, cs, 4096)

	// all_reduce, sum of float32, in place at an offset.
	for i, r := range regs {
		putF32(r.Mem[64:], float32(i+1), -2, 0.5)
	}
	var seqs [2]uint64
	parallel(t, 2, func(i int) error {
		d, err := cs[i].Do(ctx, feed.Request{Kind: feed.MsgAllReduce, Buf: regs[i].Span(64, 12), DType: reduce.Float32, Op: reduce.Sum, Peer: -1})
		seqs[i] = d.Seq
		if err == nil && d.Bytes != 12 {
			err = fmt.Errorf("done says %d bytes", d.Bytes)
		}
		return err
	})
	for _, r := range regs {
		assert.Equal(t, []float32{3, -4, 1}, getF32(r.Mem[64:76]))
	}
	assert.Equal(t, uint64(1), seqs[0])
	assert.Equal(t, seqs[0], seqs[1])

	// broadcast from member 1.
	copy(regs[0].Mem[:8], "xxxxxxxx")
	copy(regs[1].Mem[:8], "from-one")
	parallel(t, 2, func(i int) error { return cs[i].Broadcast(ctx, regs[i].Span(0, 8), 1) })
	for _, r := range regs {
		assert.Equal(t, "from-one", string(r.Mem[:8]))
	}

	// all_gather into another part of the region.
	copy(regs[0].Mem[100:], "AAA")
	copy(regs[1].Mem[100:], "BBB")
	parallel(t, 2, func(i int) error { return cs[i].AllGather(ctx, regs[i].Span(200, 6), regs[i].Span(100, 3)) })
	for _, r := range regs {
		assert.Equal(t, "AAABBB", string(r.Mem[200:206]))
	}

	// reduce_scatter of int32 max: 4 elements in, 2 out.
	for i, r := range regs {
		for k := 0; k < 4; k++ {
			binary.LittleEndian.PutUint32(r.Mem[300+4*k:], uint32(10*i+k))
		}
	}
	parallel(t, 2, func(i int) error {
		return cs[i].ReduceScatter(ctx, regs[i].Span(400, 8), regs[i].Span(300, 16), reduce.Int32, reduce.Max)
	})
	for i, r := range regs {
		assert.Equal(t, uint32(10+2*i), binary.LittleEndian.Uint32(r.Mem[400:]), "member %d", i)
		assert.Equal(t, uint32(10+2*i+1), binary.LittleEndian.Uint32(r.Mem[404:]), "member %d", i)
	}

	// barrier.
	parallel(t, 2, func(i int) error { return cs[i].Barrier(ctx) })

	// send/recv both ways with tags, concurrently with a collective.
	parallel(t, 2, func(i int) error { return sendRecvAroundBarrier(ctx, cs[i], regs[i], i) })
	// Six collectives ran; the barrier between the recv and its send did
	// not wait for the recv.
	for i := range cs {
		assert.Equal(t, uint64(6), e.servers[i].lane0.bridge.Seq(), "member %d", i)
	}
	for i, c := range cs {
		require.NoError(t, c.Release(ctx, regs[i]))
	}
	e.closeAll()
}

// sendRecvAroundBarrier is member i of 2: it posts a tagged recv, meets
// the other member in a barrier, sends, and checks what it received.
func sendRecvAroundBarrier(ctx context.Context, c *feedtest.Client, reg *feedtest.Region, i int) error {
	copy(reg.Mem[1000:], []string{"zero->one", "one->zero!"}[i])
	peer := 1 - i
	recv, err := c.Start(feed.Request{Kind: feed.MsgRecv, Buf: reg.Span(2000, 64), Peer: int32(peer), Tag: 7}, nil)
	if err != nil {
		return err
	}
	if err := c.Barrier(ctx); err != nil {
		return err
	}
	if err := c.Send(ctx, peer, 7, reg.Span(1000, 9+i)); err != nil {
		return err
	}
	d, err := recv.Wait(ctx)
	if err != nil {
		return err
	}
	if d.Seq != 0 {
		return fmt.Errorf("recv DONE has seq %d", d.Seq)
	}
	want := []string{"one->zero!", "zero->one"}[i]
	if got := string(reg.Mem[2000 : 2000+d.Bytes]); got != want {
		return fmt.Errorf("received %q, want %q", got, want)
	}
	return nil
}

func TestStreamedAllReduce(t *testing.T) {
	const chunk, size = 1024, 64 << 10
	e := startFeeds(t, bridges(newFakeGroup(2, chunk)), nil)
	regs := mapRegions(t, e.clients, size+512)
	ctx := context.Background()
	for i, r := range regs {
		for k := 0; k < size/4; k++ {
			binary.LittleEndian.PutUint32(r.Mem[512+4*k:], math.Float32bits(float32(k*(i+1))))
		}
	}
	type rng struct{ off, n uint64 }
	var mu sync.Mutex
	got := make([][]rng, 2)
	calls := make([]*feedtest.Call, 2)
	for i, c := range e.clients {
		k, err := c.Start(feed.Request{Kind: feed.MsgAllReduce, Flags: feed.FlagStreamed, Buf: regs[i].Span(512, size), DType: reduce.Float32, Op: reduce.Sum, Peer: -1},
			func(off, n uint64) {
				mu.Lock()
				got[i] = append(got[i], rng{off, n})
				mu.Unlock()
			})
		require.NoError(t, err)
		calls[i] = k
	}
	// Goroutines waiting for the DONEs read the socket (PROGRESS too).
	dones := make([]chan error, 2)
	for i, k := range calls {
		dones[i] = make(chan error, 1)
		go func() {
			d, err := k.Wait(ctx)
			if err == nil && d.Bytes != size {
				err = fmt.Errorf("done says %d bytes", d.Bytes)
			}
			dones[i] <- err
		}()
	}
	// Nothing can finish before the input is ready.
	select {
	case <-calls[0].Finished():
		t.Fatal("a streamed all_reduce finished before any READY")
	case <-time.After(50 * time.Millisecond):
	}
	// Release the input in 7 uneven steps, member 1 lagging behind.
	steps := []int{1, 1000, 5000, 20000, 40000, 65535, size}
	for _, end := range steps {
		require.NoError(t, calls[0].Ready(end))
	}
	mu.Lock()
	assert.Empty(t, got[0], "progress before every member's input was ready")
	mu.Unlock()
	for _, end := range steps {
		require.NoError(t, calls[1].Ready(end))
		require.NoError(t, calls[1].Ready(end/2), "a READY going back is ignored")
	}
	for i := range calls {
		require.NoError(t, <-dones[i])
		// The PROGRESS ranges are disjoint and cover the result once.
		mu.Lock()
		rs := append([]rng(nil), got[i]...)
		mu.Unlock()
		sort.Slice(rs, func(a, b int) bool { return rs[a].off < rs[b].off })
		var at uint64
		for _, r := range rs {
			require.Equal(t, at, r.off, "member %d: gap or overlap at %d", i, at)
			at += r.n
		}
		assert.Equal(t, uint64(size), at, "member %d: progress covers %d of %d bytes", i, at, size)
		assert.Len(t, rs, size/chunk)
	}
	for _, r := range regs {
		for k := 0; k < size/4; k += 997 {
			assert.Equal(t, float32(3*k), math.Float32frombits(binary.LittleEndian.Uint32(r.Mem[512+4*k:])))
		}
	}
	// READY for a finished request is ignored.
	require.NoError(t, calls[0].Ready(size))
	parallel(t, 2, func(i int) error { return e.clients[i].Barrier(ctx) })
	e.closeAll()
}

// TestStreamedKinds streams broadcast, all_gather and reduce_scatter.
func TestStreamedKinds(t *testing.T) {
	e := startFeeds(t, bridges(newFakeGroup(2, 4)), nil)
	regs := mapRegions(t, e.clients, 256)
	ctx := context.Background()
	run := func(reqs func(i int) feed.Request, inLen int) [][2]uint64 {
		var mu sync.Mutex
		var cov [][2]uint64
		parallel(t, 2, func(i int) error {
			k, err := e.clients[i].Start(reqs(i), func(off, n uint64) {
				mu.Lock()
				cov = append(cov, [2]uint64{uint64(i), off + n})
				mu.Unlock()
			})
			if err != nil {
				return err
			}
			if err := k.Ready(inLen); err != nil {
				return err
			}
			_, err = k.Wait(ctx)
			return err
		})
		return cov
	}
	copy(regs[0].Mem, "rootdata")
	cov := run(func(i int) feed.Request {
		return feed.Request{Kind: feed.MsgBroadcast, Flags: feed.FlagStreamed, Buf: regs[i].Span(0, 8), Peer: 0}
	}, 8)
	assert.Len(t, cov, 4)
	assert.Equal(t, "rootdata", string(regs[1].Mem[:8]))

	copy(regs[0].Mem[16:], "abcd")
	copy(regs[1].Mem[16:], "efgh")
	run(func(i int) feed.Request {
		return feed.Request{Kind: feed.MsgAllGather, Flags: feed.FlagStreamed, Buf: regs[i].Span(16, 4), Out: regs[i].Span(32, 8), Peer: -1}
	}, 4)
	assert.Equal(t, "abcdefgh", string(regs[0].Mem[32:40]))
	assert.Equal(t, "abcdefgh", string(regs[1].Mem[32:40]))

	for i, r := range regs {
		for k := 0; k < 8; k++ {
			r.Mem[64+k] = byte(k + i)
		}
	}
	run(func(i int) feed.Request {
		return feed.Request{Kind: feed.MsgReduceScatter, Flags: feed.FlagStreamed, DType: reduce.Uint8, Op: reduce.Sum, Buf: regs[i].Span(64, 8), Out: regs[i].Span(80, 4), Peer: -1}
	}, 8)
	assert.Equal(t, []byte{1, 3, 5, 7}, regs[0].Mem[80:84])
	assert.Equal(t, []byte{9, 11, 13, 15}, regs[1].Mem[80:84])
	e.closeAll()
}

// limitedFeeds serves members over a fake bridge with at most 3 regions
// of 1 MiB, and maps two regions of 4 KiB on member 0.
func limitedFeeds(t *testing.T, members int) (*feedEnv, *feedtest.Region, *feedtest.Region) {
	t.Helper()
	e := startFeeds(t, bridges(newFakeGroup(members, 8)), func(o *ServerOptions) {
		o.MaxRegionBytes = 1 << 20
		o.MaxRegions = 3
	})
	regs := make([]*feedtest.Region, 2)
	for i := range regs {
		var err error
		regs[i], err = e.clients[0].Map(context.Background(), 4096)
		require.NoError(t, err)
	}
	return e, regs[0], regs[1]
}

func TestBadRequests(t *testing.T) {
	e, reg, reg2 := limitedFeeds(t, 2)
	ctx := context.Background()
	c := e.clients[0]
	f32 := func(sp feed.Span) feed.Request {
		return feed.Request{Kind: feed.MsgAllReduce, Buf: sp, DType: reduce.Float32, Op: reduce.Sum, Peer: -1}
	}
	cases := []struct {
		name string
		req  feed.Request
		want string
	}{
		{"offset past the end", f32(reg.Span(4096, 4)), "outside region"},
		{"length past the end", f32(reg.Span(4000, 100)), "outside region"},
		{"offset overflow", f32(feed.Span{Region: reg.ID, Off: math.MaxUint64 - 1, Len: 8}), "outside region"},
		{"unknown region", f32(feed.Span{Region: 99, Len: 4}), "region 99 is not mapped"},
		{"no region but bytes", f32(feed.Span{Off: 4, Len: 4}), "no region"},
		{"unknown codec", func() feed.Request { r := f32(reg.Span(0, 4)); r.Codec = 7; return r }(), "codec 7 is unknown to this gpubridge (it knows 0 raw, 1 bf16/v1, 2 fp8/v1, 3 zstd/v1)"},
		{"dtype length mismatch", f32(reg.Span(0, 6)), "not a whole number of float32"},
		{"unknown dtype", func() feed.Request { r := f32(reg.Span(0, 4)); r.DType = 42; return r }(), "unknown dtype 42"},
		{"no dtype", func() feed.Request { r := f32(reg.Span(0, 4)); r.DType = 0; return r }(), "needs a dtype"},
		{"avg of ints", func() feed.Request { r := f32(reg.Span(0, 4)); r.DType = reduce.Int32; r.Op = reduce.Avg; return r }(), "avg"},
		{"unknown op", func() feed.Request { r := f32(reg.Span(0, 4)); r.Op = 9; return r }(), "invalid op"},
		{"unknown flags", func() feed.Request { r := f32(reg.Span(0, 4)); r.Flags = 6; return r }(), "unknown flags"},
		{"all_reduce with output", func() feed.Request { r := f32(reg.Span(0, 4)); r.Out = reg.Span(8, 4); return r }(), "takes no output"},
		{"op on broadcast", feed.Request{Kind: feed.MsgBroadcast, Buf: reg.Span(0, 4), Op: reduce.Sum}, "does not reduce"},
		{"bad root", feed.Request{Kind: feed.MsgBroadcast, Buf: reg.Span(0, 4), Peer: 2}, "root 2 is not a member"},
		{"negative root", feed.Request{Kind: feed.MsgBroadcast, Buf: reg.Span(0, 4), Peer: -1}, "root -1 is not a member"},
		{"all_gather size", feed.Request{Kind: feed.MsgAllGather, Buf: reg.Span(0, 4), Out: reg.Span(8, 4), Peer: -1}, "want 2 members × 4"},
		{"reduce_scatter size", feed.Request{Kind: feed.MsgReduceScatter, DType: reduce.Uint8, Op: reduce.Sum, Buf: reg.Span(0, 5), Out: reg.Span(8, 2), Peer: -1}, "want 2 members × 2"},
		{"overlap", feed.Request{Kind: feed.MsgAllGather, Buf: reg.Span(0, 4), Out: reg.Span(2, 8), Peer: -1}, "overlap"},
		{"streamed barrier", feed.Request{Kind: feed.MsgBarrier, Flags: feed.FlagStreamed, Peer: -1}, "cannot be streamed"},
		{"barrier with buffer", feed.Request{Kind: feed.MsgBarrier, Buf: reg.Span(0, 4), Peer: -1}, "no buffer"},
		{"send to self", feed.Request{Kind: feed.MsgSend, Buf: reg.Span(0, 4), Peer: 0}, "is this member"},
		{"recv from nobody", feed.Request{Kind: feed.MsgRecv, Buf: reg.Span(0, 4), Peer: 5}, "peer 5 is not a member"},
		{"streamed send", feed.Request{Kind: feed.MsgSend, Flags: feed.FlagStreamed, Buf: reg.Span(0, 4), Peer: 1}, "cannot be streamed"},
		{"peer on all_reduce", func() feed.Request { r := f32(reg.Span(0, 4)); r.Peer = 1; return r }(), "no root, peer or tag"},
		{"caller reduces a broadcast", feed.Request{Kind: feed.MsgBroadcast, Flags: feed.FlagCallerReduces, Buf: reg.Span(0, 4), Peer: 0}, "flag caller-reduces is for all_reduce, not broadcast"},
		{"caller reduces: output size", func() feed.Request {
			r := f32(reg.Span(0, 4))
			r.Flags, r.Out = feed.FlagCallerReduces, reg.Span(8, 4)
			return r
		}(), "output of 4 bytes, want 2 members × 4 input bytes"},
		{"caller reduces: overlap", func() feed.Request {
			r := f32(reg.Span(4, 4))
			r.Flags, r.Out = feed.FlagCallerReduces, reg.Span(0, 8)
			return r
		}(), "overlap"},
		{"caller reduces: no dtype", func() feed.Request {
			r := f32(reg.Span(0, 4))
			r.Flags, r.Out, r.DType = feed.FlagCallerReduces, reg.Span(0, 8), 0
			return r
		}(), "needs a dtype"},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			_, err := c.Do(ctx, tc.req)
			var re *feedtest.RequestError
			require.ErrorAs(t, err, &re)
			assert.Equal(t, feed.StatusBadRequest, re.Status)
			assert.Contains(t, re.Msg, tc.want)
		})
	}

	t.Run("release unknown region", func(t *testing.T) {
		err := c.Release(ctx, &feedtest.Region{ID: 77})
		assert.ErrorContains(t, err, "region 77 is not mapped")
	})
	t.Run("malformed request body", func(t *testing.T) {
		k, err := c.StartMsg(feed.MsgAllReduce, nil, func(b []byte, id uint64) []byte {
			b = (&feed.Request{Kind: feed.MsgAllReduce, ID: id, Peer: -1}).Append(b)
			b[len(b)-64+11] = 1 // reserved byte
			return b
		})
		require.NoError(t, err)
		_, err = k.Wait(ctx)
		assert.ErrorContains(t, err, "reserved byte 11")
	})

	// The server kept serving: a good all_reduce on both members works.
	reg1, err := e.clients[1].Map(ctx, 64)
	require.NoError(t, err)
	putF32(reg.Mem, 1.5)
	putF32(reg1.Mem, 2)
	parallel(t, 2, func(i int) error {
		return e.clients[i].AllReduce(ctx, []feed.Span{reg.Span(0, 4), reg1.Span(0, 4)}[i], reduce.Float32, reduce.Sum)
	})
	assert.Equal(t, []float32{3.5}, getF32(reg.Mem[:4]))
	require.NoError(t, c.Release(ctx, reg2))
	assert.Nil(t, e.servers[0].Broken())
	e.closeAll()
}

func TestBadRegions(t *testing.T) {
	e, reg, _ := limitedFeeds(t, 1)
	ctx := context.Background()
	c := e.clients[0]
	t.Run("region without fd", func(t *testing.T) {
		k, err := c.StartMsg(feed.MsgRegion, nil, func(b []byte, id uint64) []byte {
			return (&feed.RegionMsg{ID: id, Region: 50, Size: 4096}).Append(b)
		})
		require.NoError(t, err)
		_, err = k.Wait(ctx)
		assert.ErrorContains(t, err, "no file descriptor")
	})
	sendRegion := func(fd int, rid uint32, size uint64) error {
		k, err := c.StartMsg(feed.MsgRegion, []int{fd}, func(b []byte, id uint64) []byte {
			return (&feed.RegionMsg{ID: id, Region: rid, Size: size}).Append(b)
		})
		require.NoError(t, err)
		_, err = k.Wait(ctx)
		return err
	}
	t.Run("region not sealed", func(t *testing.T) {
		f, err := os.CreateTemp("", "region")
		require.NoError(t, err)
		defer os.Remove(f.Name())
		defer f.Close()
		require.NoError(t, f.Truncate(4096))
		assert.ErrorContains(t, sendRegion(int(f.Fd()), 51, 4096), "not a sealable memfd")
		fd, err := unix.MemfdCreate("unsealed", unix.MFD_CLOEXEC)
		require.NoError(t, err)
		defer unix.Close(fd)
		require.NoError(t, unix.Ftruncate(fd, 4096))
		assert.ErrorContains(t, sendRegion(fd, 51, 4096), "F_SEAL_SHRINK")
	})
	t.Run("region smaller than said", func(t *testing.T) {
		fd, mem, err := feedtest.NewMemfd("small", 4096)
		require.NoError(t, err)
		defer unix.Munmap(mem)
		defer unix.Close(fd)
		assert.ErrorContains(t, sendRegion(fd, 52, 8192), "holds 4096 bytes, the message says 8192")
		assert.ErrorContains(t, sendRegion(fd, 52, 2<<20), "over the 1048576-byte limit")
		assert.ErrorContains(t, sendRegion(fd, reg.ID, 4096), "already mapped")
		assert.ErrorContains(t, sendRegion(fd, 0, 4096), "reserved")
		require.NoError(t, sendRegion(fd, 53, 4096))
		assert.ErrorContains(t, sendRegion(fd, 54, 4096), "3 regions are mapped, the limit is 3")
	})
	// The server kept serving.
	require.NoError(t, c.AllReduce(ctx, reg.Span(0, 4), reduce.Float32, reduce.Sum))
	assert.Nil(t, e.servers[0].Broken())
	e.closeAll()
}

func TestBridgeErrorBreaksTheBridge(t *testing.T) {
	ms := newFakeGroup(1, 8)
	cause := errors.New("member 1 (rank 1 on host-b): connection reset by peer")
	ms[0].g.failSeq, ms[0].g.failMember, ms[0].g.failErr = 2, 0, cause
	e := startFeeds(t, bridges(ms), nil)
	ctx := context.Background()
	c := e.clients[0]
	reg, err := c.Map(ctx, 64)
	require.NoError(t, err)
	require.NoError(t, c.Barrier(ctx))
	err = c.AllReduce(ctx, reg.Span(0, 8), reduce.Float64, reduce.Sum)
	var re *feedtest.RequestError
	require.ErrorAs(t, err, &re)
	assert.Equal(t, feed.StatusBridgeError, re.Status)
	assert.Equal(t, cause.Error(), re.Msg, "the bridge's error, naming the peer, reaches the client")
	assert.Equal(t, uint64(3), re.ID)
	// Later requests fail at once with the original cause.
	for _, req := range []feed.Request{
		{Kind: feed.MsgBarrier, Peer: -1},
		{Kind: feed.MsgAllReduce, Buf: reg.Span(0, 4), DType: reduce.Float32, Op: reduce.Min, Peer: -1},
	} {
		_, err = c.Do(ctx, req)
		require.ErrorAs(t, err, &re)
		assert.Equal(t, feed.StatusBroken, re.Status)
		assert.Contains(t, re.Msg, cause.Error())
	}
	assert.Equal(t, cause, e.servers[0].Broken())
	// The feed itself still closes in order.
	e.closeAll()
}

func TestReleaseWaitsForRequests(t *testing.T) {
	e := startFeeds(t, bridges(newFakeGroup(1, 8)), nil)
	ctx := context.Background()
	c := e.clients[0]
	reg, err := c.Map(ctx, 64)
	require.NoError(t, err)
	k, err := c.Start(feed.Request{Kind: feed.MsgAllReduce, Flags: feed.FlagStreamed, Buf: reg.Span(0, 64), DType: reduce.Int64, Op: reduce.Sum, Peer: -1}, nil)
	require.NoError(t, err)
	rel, err := c.StartMsg(feed.MsgRelease, nil, func(b []byte, id uint64) []byte { return (&feed.ReleaseMsg{ID: id, Region: reg.ID}).Append(b) })
	require.NoError(t, err)
	relDone := make(chan error, 1)
	go func() {
		_, err := rel.Wait(ctx)
		relDone <- err
	}()
	// A request sent after the release may not name the region.
	err = c.AllReduce(ctx, reg.Span(0, 8), reduce.Int64, reduce.Sum)
	assert.ErrorContains(t, err, "not mapped")
	select {
	case <-rel.Finished():
		t.Fatal("release finished while a request uses the region")
	case <-time.After(30 * time.Millisecond):
	}
	require.NoError(t, k.Ready(64))
	_, err = k.Wait(ctx)
	require.NoError(t, err)
	require.NoError(t, <-relDone)
	e.servers[0].rmu.Lock()
	assert.Empty(t, e.servers[0].regions)
	e.servers[0].rmu.Unlock()
	e.closeAll()
}

// startStreamed serves one member and starts a streamed 64-byte
// all_reduce on it whose input is not ready.
func startStreamed(t *testing.T) (*feedEnv, *feedtest.Call) {
	t.Helper()
	e := startFeeds(t, bridges(newFakeGroup(1, 8)), nil)
	reg, err := e.clients[0].Map(context.Background(), 4096)
	require.NoError(t, err)
	k, err := e.clients[0].Start(feed.Request{Kind: feed.MsgAllReduce, Flags: feed.FlagStreamed, Buf: reg.Span(0, 64), DType: reduce.Float32, Op: reduce.Sum, Peer: -1}, nil)
	require.NoError(t, err)
	return e, k
}

// rawFeed connects to a feed server without the Client, to break the
// protocol on purpose.
func rawFeed(t *testing.T, b Bridge, o ServerOptions) (net.Conn, chan error) {
	t.Helper()
	path := filepath.Join(sockDir(t), "raw.sock")
	ln, err := Listen(path)
	require.NoError(t, err)
	errc := make(chan error, 1)
	ctx, cancel := context.WithCancel(context.Background())
	go func() {
		conn, err := ln.Accept(ctx, 5*time.Second)
		if err != nil {
			errc <- err
			return
		}
		errc <- NewServer(conn, b, o).Serve(ctx)
	}()
	conn, err := net.Dial("unix", path)
	require.NoError(t, err)
	t.Cleanup(func() {
		cancel()
		conn.Close()
	})
	return conn, errc
}

func hello(t *testing.T, conn net.Conn) *feed.WelcomeMsg {
	t.Helper()
	_, err := conn.Write((&feed.HelloMsg{MinVersion: 1, MaxVersion: 1}).Append(nil))
	require.NoError(t, err)
	m := readMsg(t, conn)
	w, ok := m.(*feed.WelcomeMsg)
	require.True(t, ok, "got %T", m)
	return w
}

func readMsg(t *testing.T, conn net.Conn) feed.Message {
	t.Helper()
	_ = conn.SetReadDeadline(time.Now().Add(5 * time.Second))
	hdr := make([]byte, feed.HeaderSize)
	_, err := io.ReadFull(conn, hdr)
	require.NoError(t, err)
	h, err := feed.ParseHeader(hdr, feed.MaxMessage)
	require.NoError(t, err)
	body := make([]byte, h.Size-feed.HeaderSize)
	_, err = io.ReadFull(conn, body)
	require.NoError(t, err)
	m, err := feed.DecodeBody(h.Type, body)
	require.NoError(t, err)
	return m
}

func waitErr(t *testing.T, errc chan error) error {
	t.Helper()
	select {
	case err := <-errc:
		return err
	case <-time.After(testenv.Scale(20 * time.Second)):
		t.Fatal("the feed server did not stop")
		return nil
	}
}

func TestProtocolErrors(t *testing.T) {
	bad := map[string]func(t *testing.T, conn net.Conn){
		"garbage": func(t *testing.T, conn net.Conn) {
			_, err := conn.Write([]byte{0xff, 0xff, 0xff, 0xff, 1, 0, 0, 0})
			require.NoError(t, err)
		},
		"ids going back": func(t *testing.T, conn net.Conn) {
			_, err := conn.Write((&feed.Request{Kind: feed.MsgBarrier, ID: 5, Peer: -1}).Append(nil))
			require.NoError(t, err)
			_ = readMsg(t, conn) // its DONE
			_, err = conn.Write((&feed.Request{Kind: feed.MsgBarrier, ID: 5, Peer: -1}).Append(nil))
			require.NoError(t, err)
		},
		"ready for a request never sent": func(t *testing.T, conn net.Conn) {
			_, err := conn.Write((&feed.ReadyMsg{ID: 9, End: 4}).Append(nil))
			require.NoError(t, err)
		},
		"server message from the client": func(t *testing.T, conn net.Conn) {
			_, err := conn.Write((&feed.DoneMsg{ID: 1}).Append(nil))
			require.NoError(t, err)
		},
		"two descriptors with one message": func(t *testing.T, conn net.Conn) {
			fd1, mem1, err := feedtest.NewMemfd("a", 4096)
			require.NoError(t, err)
			defer unix.Munmap(mem1)
			defer unix.Close(fd1)
			_, _, err = conn.(*net.UnixConn).WriteMsgUnix((&feed.RegionMsg{ID: 1, Region: 1, Size: 4096}).Append(nil), unix.UnixRights(fd1, fd1), nil)
			require.NoError(t, err)
		},
		"half a message then EOF": func(t *testing.T, conn net.Conn) {
			b := (&feed.Request{Kind: feed.MsgBarrier, ID: 5, Peer: -1}).Append(nil)
			_, err := conn.Write(b[:20])
			require.NoError(t, err)
			require.NoError(t, conn.(*net.UnixConn).CloseWrite())
		},
	}
	for name, fn := range bad {
		t.Run(name, func(t *testing.T) {
			conn, errc := rawFeed(t, newFakeGroup(1, 8)[0], ServerOptions{Members: 1})
			hello(t, conn)
			fn(t, conn)
			m := readMsg(t, conn)
			em, ok := m.(*feed.ErrorMsg)
			require.True(t, ok, "got %T %v", m, m)
			assert.Equal(t, feed.ErrCodeProtocol, em.Code)
			var pe *ProtocolError
			require.ErrorAs(t, waitErr(t, errc), &pe)
			assert.Equal(t, em.Text, pe.Err.Error())
		})
	}
}

func TestHandshake(t *testing.T) {
	// answer says HELLO for versions lo..hi to a fresh server.
	answer := func(t *testing.T, lo, hi uint16) (feed.Message, chan error) {
		conn, errc := rawFeed(t, newFakeGroup(1, 8)[0], ServerOptions{Members: 1})
		_, err := conn.Write((&feed.HelloMsg{MinVersion: lo, MaxVersion: hi}).Append(nil))
		require.NoError(t, err)
		return readMsg(t, conn), errc
	}
	t.Run("version mismatch", func(t *testing.T) {
		m, errc := answer(t, 6, 7)
		em, ok := m.(*feed.ErrorMsg)
		require.True(t, ok)
		assert.Equal(t, feed.ErrCodeVersion, em.Code)
		assert.Contains(t, em.Text, "client speaks feed protocol 6..7, this gbbridge speaks 1..5")
		var pe *ProtocolError
		require.ErrorAs(t, waitErr(t, errc), &pe)
	})
	t.Run("newer client", func(t *testing.T) {
		m, _ := answer(t, 1, 9)
		w, ok := m.(*feed.WelcomeMsg)
		require.True(t, ok)
		assert.Equal(t, uint16(5), w.Version)
	})
	t.Run("version 5 client", func(t *testing.T) {
		m, _ := answer(t, 5, 5)
		w, ok := m.(*feed.WelcomeMsg)
		require.True(t, ok)
		assert.Equal(t, feed.P2POrderVersion, w.Version)
	})
	t.Run("version 4 client", func(t *testing.T) {
		m, _ := answer(t, 4, 4)
		w, ok := m.(*feed.WelcomeMsg)
		require.True(t, ok)
		assert.Equal(t, uint16(4), w.Version)
	})
	t.Run("version 3 client", func(t *testing.T) {
		m, _ := answer(t, 3, 3)
		w, ok := m.(*feed.WelcomeMsg)
		require.True(t, ok)
		assert.Equal(t, uint16(3), w.Version)
	})
	t.Run("version 2 client", func(t *testing.T) {
		m, _ := answer(t, 1, 2)
		w, ok := m.(*feed.WelcomeMsg)
		require.True(t, ok)
		assert.Equal(t, uint16(2), w.Version, "a version 2 client still gets version 2")
	})
	t.Run("version 1 client", func(t *testing.T) {
		m, _ := answer(t, 1, 1)
		w, ok := m.(*feed.WelcomeMsg)
		require.True(t, ok)
		assert.Equal(t, uint16(1), w.Version, "a version 1 client still gets version 1")
	})
	t.Run("no hello", func(t *testing.T) {
		_, errc := rawFeed(t, newFakeGroup(1, 8)[0], ServerOptions{Members: 1, HandshakeTimeout: 50 * time.Millisecond})
		err := waitErr(t, errc)
		assert.ErrorIs(t, err, ErrFeedLost)
		assert.ErrorContains(t, err, "no HELLO within 50ms")
	})
	t.Run("request before hello", func(t *testing.T) {
		conn, errc := rawFeed(t, newFakeGroup(1, 8)[0], ServerOptions{Members: 1})
		_, err := conn.Write((&feed.Request{Kind: feed.MsgBarrier, ID: 1, Peer: -1}).Append(nil))
		require.NoError(t, err)
		em, ok := readMsg(t, conn).(*feed.ErrorMsg)
		require.True(t, ok)
		assert.Contains(t, em.Text, "first message is barrier")
		var pe *ProtocolError
		require.ErrorAs(t, waitErr(t, errc), &pe)
	})
}

func TestClientDisappears(t *testing.T) {
	t.Run("idle", func(t *testing.T) {
		e := startFeeds(t, bridges(newFakeGroup(1, 8)), nil)
		_, err := e.clients[0].Map(context.Background(), 4096)
		require.NoError(t, err)
		e.clients[0].Abort()
		require.NoError(t, e.wait(0), "EOF with nothing in flight is a clean close")
	})
	t.Run("request in flight", func(t *testing.T) {
		e := startFeeds(t, bridges(newFakeGroup(2, 8)), nil)
		reg, err := e.clients[0].Map(context.Background(), 4096)
		require.NoError(t, err)
		// Member 0 waits in a collective member 1 never joins.
		_, err = e.clients[0].Start(feed.Request{Kind: feed.MsgAllReduce, Buf: reg.Span(0, 8), DType: reduce.Float32, Op: reduce.Sum, Peer: -1}, nil)
		require.NoError(t, err)
		time.Sleep(20 * time.Millisecond)
		start := time.Now()
		e.clients[0].Abort()
		err = e.wait(0)
		assert.ErrorIs(t, err, ErrFeedLost)
		assert.ErrorContains(t, err, "1 request(s) in flight")
		assert.Less(t, time.Since(start), testenv.Scale(5*time.Second))
		e.clients[1].Abort()
		require.NoError(t, e.wait(1))
	})
	t.Run("streamed request waiting for input", func(t *testing.T) {
		e, k := startStreamed(t)
		require.NoError(t, k.Ready(16))
		e.clients[0].Abort()
		assert.ErrorIs(t, e.wait(0), ErrFeedLost)
	})
	t.Run("bye with a streamed request short of input", func(t *testing.T) {
		e, k := startStreamed(t)
		ctx, cancel := context.WithTimeout(context.Background(), testenv.Scale(10*time.Second))
		defer cancel()
		require.NoError(t, e.clients[0].Close(ctx))
		_, err := k.Wait(ctx)
		assert.ErrorContains(t, err, "closed the feed before input bytes [0,8)")
		require.NoError(t, e.wait(0))
	})
}

func TestServeStopsWithContext(t *testing.T) {
	path := filepath.Join(sockDir(t), "ctx.sock")
	ln, err := Listen(path)
	require.NoError(t, err)
	ctx, cancel := context.WithCancelCause(context.Background())
	errc := make(chan error, 1)
	b := newFakeGroup(2, 8)[0]
	go func() {
		conn, err := ln.Accept(ctx, 5*time.Second)
		if err != nil {
			errc <- err
			return
		}
		errc <- NewServer(conn, b, ServerOptions{Members: 2}).Serve(ctx)
	}()
	c, err := feedtest.Dial(context.Background(), path)
	require.NoError(t, err)
	defer c.Abort()
	reg, err := c.Map(context.Background(), 64)
	require.NoError(t, err)
	k, err := c.Start(feed.Request{Kind: feed.MsgAllReduce, Buf: reg.Span(0, 8), DType: reduce.Float32, Op: reduce.Sum, Peer: -1}, nil)
	require.NoError(t, err)
	sig := errors.New("terminated by SIGTERM")
	cancel(sig)
	assert.ErrorIs(t, waitErr(t, errc), sig)
	_, err = k.Wait(context.Background())
	require.Error(t, err)
}

func TestListen(t *testing.T) {
	dir := sockDir(t)
	path := filepath.Join(dir, "l.sock")
	ln, err := Listen(path)
	require.NoError(t, err)
	st, err := os.Stat(path)
	require.NoError(t, err)
	assert.Equal(t, os.FileMode(0o600), st.Mode().Perm())
	_, err = Listen(path)
	assert.ErrorContains(t, err, "already exists")
	_, err = ln.Accept(context.Background(), 30*time.Millisecond)
	assert.ErrorContains(t, err, "no client connected")
	_, err = os.Stat(path)
	assert.True(t, os.IsNotExist(err), "the socket path is removed once the listener closes")

	_, err = Listen(filepath.Join(dir, string(make([]byte, 120))))
	assert.ErrorContains(t, err, "the limit is 107")

	ln, err = Listen(path)
	require.NoError(t, err)
	go func() {
		c, err := net.Dial("unix", path)
		if err == nil {
			defer c.Close()
			time.Sleep(50 * time.Millisecond)
		}
	}()
	conn, err := ln.Accept(context.Background(), 5*time.Second)
	require.NoError(t, err)
	conn.Close()
	_, err = os.Stat(path)
	assert.True(t, os.IsNotExist(err), "nobody else can connect after the one connection")
}

// TestClientWaitModes runs requests with every way a client can wait for
// replies, including a Wait whose context ends first and an Abort while a
// goroutine waits.
func TestClientWaitModes(t *testing.T) {
	modes := map[string]feedtest.WaitOptions{
		"poller":      {},
		"poller+spin": {Spin: 50 * time.Microsecond},
		"kernel":      {Kernel: true},
		"kernel+spin": {Kernel: true, Spin: 50 * time.Microsecond},
	}
	for name, w := range modes {
		t.Run(name, func(t *testing.T) {
			e := startFeeds(t, bridges(newFakeGroup(2, 8)), nil)
			for _, c := range e.clients {
				c.SetWait(w)
			}
			ctx := context.Background()
			regs := mapRegions(t, e.clients, 64)
			for k := 0; k < 20; k++ {
				parallel(t, 2, func(i int) error {
					putF32(regs[i].Mem, float32(k))
					return e.clients[i].AllReduce(ctx, regs[i].Span(0, 4), reduce.Float32, reduce.Sum)
				})
				assert.Equal(t, []float32{float32(2 * k)}, getF32(regs[0].Mem[:4]))
			}
			// Member 0 waits alone: its context ends first, then it waits
			// again and gets the DONE once member 1 joins.
			call, err := e.clients[0].Start(feed.Request{Kind: feed.MsgBarrier, Peer: -1}, nil)
			require.NoError(t, err)
			short, cancel := context.WithTimeout(ctx, 30*time.Millisecond)
			start := time.Now()
			_, err = call.Wait(short)
			cancel()
			assert.ErrorIs(t, err, context.DeadlineExceeded)
			assert.Less(t, time.Since(start), testenv.Scale(5*time.Second))
			require.NoError(t, e.clients[1].Barrier(ctx))
			_, err = call.Wait(ctx)
			require.NoError(t, err)
			// Abort while a goroutine waits.
			call, err = e.clients[0].Start(feed.Request{Kind: feed.MsgBarrier, Peer: -1}, nil)
			require.NoError(t, err)
			waited := make(chan error, 1)
			go func() {
				_, err := call.Wait(ctx)
				waited <- err
			}()
			time.Sleep(20 * time.Millisecond)
			start = time.Now()
			e.clients[0].Abort()
			select {
			case err := <-waited:
				assert.Error(t, err)
			case <-time.After(testenv.Scale(10 * time.Second)):
				t.Fatal("Wait did not return after Abort")
			}
			assert.Less(t, time.Since(start), testenv.Scale(5*time.Second))
			assert.ErrorIs(t, e.wait(0), ErrFeedLost)
		})
	}
}

// recordingRegistrar is a transport.Registrar that records what it holds;
// its releases read the memory, so a release after munmap would fault.
type recordingRegistrar struct {
	mu       sync.Mutex
	held     map[*byte]int // first byte of a registration -> its length
	released int
	refuse   bool
}

func (r *recordingRegistrar) Register(b []byte) (func(), error) {
	if r.refuse {
		return nil, errors.New("no RDMA device here")
	}
	r.mu.Lock()
	defer r.mu.Unlock()
	r.held[&b[0]] = len(b)
	var once sync.Once
	return func() {
		once.Do(func() {
			_ = b[0] + b[len(b)-1] // still mapped
			r.mu.Lock()
			defer r.mu.Unlock()
			delete(r.held, &b[0])
			r.released++
		})
	}, nil
}

func (r *recordingRegistrar) count() (held, released int) {
	r.mu.Lock()
	defer r.mu.Unlock()
	return len(r.held), r.released
}

// Every region is registered with the mesh's device while it is mapped
// (issue 15: sends from the feed's regions without a copy into staging),
// released once, before its munmap, on RELEASE and at the end; a device
// that refuses leaves the region served.
func TestRegionsAreRegistered(t *testing.T) {
	for _, refuse := range []bool{false, true} {
		t.Run(fmt.Sprint("refuse=", refuse), func(t *testing.T) {
			reg := &recordingRegistrar{held: map[*byte]int{}, refuse: refuse}
			e := startFeeds(t, bridges(newFakeGroup(1, 8)), func(o *ServerOptions) { o.Register = reg })
			ctx := context.Background()
			c := e.clients[0]
			a, err := c.Map(ctx, 4096)
			require.NoError(t, err)
			b, err := c.Map(ctx, 8192)
			require.NoError(t, err)
			held, _ := reg.count()
			if refuse {
				assert.Zero(t, held)
			} else {
				assert.Equal(t, 2, held)
			}
			require.NoError(t, c.AllReduce(ctx, a.Span(0, 64), reduce.Int64, reduce.Sum))
			require.NoError(t, c.Release(ctx, a))
			held, released := reg.count()
			if !refuse {
				assert.Equal(t, []int{1, 1}, []int{held, released}, "the released region's registration ended")
			}
			require.NoError(t, c.AllReduce(ctx, b.Span(0, 64), reduce.Int64, reduce.Sum))
			e.closeAll()
			held, released = reg.count()
			assert.Zero(t, held, "every registration ended")
			if !refuse {
				assert.Equal(t, 2, released)
			}
		})
	}
}
