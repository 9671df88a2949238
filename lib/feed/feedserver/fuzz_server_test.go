package feedserver

import (
	"context"
	"net"
	"os"
	"testing"
	"time"

	"github.com/gpubridge/gpubridge/lib/feed"
	"github.com/gpubridge/gpubridge/lib/reduce"
	"github.com/gpubridge/gpubridge/lib/testenv"
	"golang.org/x/sys/unix"
)

// socketPair returns the two ends of a Unix stream socket pair.
func socketPair(t testing.TB) (*net.UnixConn, *net.UnixConn) {
	t.Helper()
	fds, err := unix.Socketpair(unix.AF_UNIX, unix.SOCK_STREAM|unix.SOCK_CLOEXEC, 0)
	if err != nil {
		t.Fatal(err)
	}
	conn := func(fd int) *net.UnixConn {
		f := os.NewFile(uintptr(fd), "feed")
		defer f.Close()
		c, err := net.FileConn(f)
		if err != nil {
			t.Fatal(err)
		}
		return c.(*net.UnixConn)
	}
	return conn(fds[0]), conn(fds[1])
}

// FuzzServerInput sends HELLO (the newest version) and then arbitrary
// bytes to a server over a one-member fake bridge, then closes the feed: the server must answer
// what it can, never panic or touch memory out of bounds, and stop.
func FuzzServerInput(f *testing.F) {
	f.Add((&feed.RegionMsg{ID: 1, Region: 1, Size: 8}).Append(nil))
	f.Add((&feed.ReleaseMsg{ID: 1, Region: 1}).Append(nil))
	f.Add((&feed.Request{Kind: feed.MsgSend, ID: 1, Peer: 0, Tag: 7, Buf: feed.Span{Region: 1, Len: 4}}).Append(nil))
	f.Add((&feed.HelloMsg{MinVersion: 1, MaxVersion: 1}).Append(nil))
	var seq []byte
	seq = (&feed.Request{Kind: feed.MsgAllReduce, ID: 1, DType: reduce.Float32, Op: reduce.Sum, Peer: -1}).Append(seq)
	seq = (&feed.Request{Kind: feed.MsgAllReduce, ID: 2, Flags: feed.FlagStreamed, DType: reduce.Float32, Op: reduce.Sum, Buf: feed.Span{Region: 1, Len: 8}, Peer: -1}).Append(seq)
	seq = (&feed.ReadyMsg{ID: 2, End: 4}).Append(seq)
	seq = (&feed.ReleaseMsg{ID: 3, Region: 1}).Append(seq)
	seq = (&feed.ByeMsg{}).Append(seq)
	f.Add(seq)
	// Version 3: codecs, feedback keys (empty buffers: no region needed;
	// the second changes the key's dtype), a lossy caller-reduces exchange
	// (refused: one member).
	seq = (&feed.Request{Kind: feed.MsgAllReduce, ID: 1, Codec: 2, DType: reduce.Float32, Op: reduce.Sum, Peer: -1,
		FeedbackKey: 1, HasFeedbackKey: true}).Append(nil)
	seq = (&feed.Request{Kind: feed.MsgAllReduce, ID: 2, Codec: 1, DType: reduce.BFloat16, Op: reduce.Avg, Peer: -1,
		FeedbackKey: 1, HasFeedbackKey: true}).Append(seq)
	seq = (&feed.Request{Kind: feed.MsgAllReduce, ID: 3, Codec: 2, Flags: feed.FlagCallerReduces, DType: reduce.Float32, Op: reduce.Sum,
		Buf: feed.Span{Region: 1, Len: 2}, Out: feed.Span{Region: 1, Off: 2, Len: 2}, Peer: -1}).Append(seq)
	seq = (&feed.Request{Kind: feed.MsgAllGather, ID: 4, Codec: 3, Buf: feed.Span{Region: 1, Len: 4}, Out: feed.Span{Region: 1, Off: 4, Len: 4}, Peer: -1}).Append(seq)
	f.Add(seq)
	// Version 4: a JOIN, requests on the joined bridge and on one that is
	// not, a JOIN of an id in use.
	seq = (&feed.JoinMsg{ID: 1, Bridge: 1, Name: "pair/0-1", Members: []uint32{0, 1}}).Append(nil)
	seq = (&feed.Request{Kind: feed.MsgSend, ID: 2, Peer: 1, Tag: 3, Bridge: 1, HasBridge: true}).Append(seq)
	seq = (&feed.Request{Kind: feed.MsgBarrier, ID: 3, Peer: -1, Bridge: 2, HasBridge: true}).Append(seq)
	seq = (&feed.JoinMsg{ID: 4, Bridge: 1, Name: "x", Members: []uint32{1, 0}}).Append(seq)
	f.Add(seq)
	f.Fuzz(func(t *testing.T, b []byte) {
		a, z := socketPair(t)
		defer a.Close()
		errc := make(chan error, 1)
		go func() {
			errc <- NewServer(z, newFakeGroup(1, 4)[0], ServerOptions{Members: 1, WriteTimeout: time.Second,
				Rank: 0, WorldSize: 2, Joiner: fakeJoiner{}}).Serve(context.Background())
		}()
		// Drain what the server writes so that it never blocks.
		drained := make(chan struct{})
		go func() {
			defer close(drained)
			buf := make([]byte, 4096)
			for {
				if _, err := a.Read(buf); err != nil {
					return
				}
			}
		}()
		_, _ = a.Write((&feed.HelloMsg{MinVersion: 1, MaxVersion: feed.Version}).Append(nil))
		_, _ = a.Write(b)
		_ = a.CloseWrite()
		select {
		case <-errc:
		case <-time.After(testenv.Scale(20 * time.Second)):
			t.Fatal("the server did not stop")
		}
		a.Close()
		<-drained
	})
}

// fakeJoiner joins every bridge as a fake group of its own, whose other
// members never come: its collectives wait until the feed ends.
type fakeJoiner struct{}

func (fakeJoiner) Join(_ context.Context, j JoinRequest) (*Joined, error) {
	return &Joined{Bridge: newFakeGroup(len(j.Ranks), 4)[j.Member], Transport: "fake", Close: func(error) {}}, nil
}
