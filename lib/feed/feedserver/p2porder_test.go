package feedserver

import (
	"bytes"
	"context"
	"fmt"
	"sync"
	"testing"
	"time"

	"github.com/gpubridge/gpubridge/lib/collective"
	"github.com/gpubridge/gpubridge/lib/feed"
	"github.com/gpubridge/gpubridge/lib/feed/feedtest"
	"github.com/gpubridge/gpubridge/lib/testenv"
	"github.com/gpubridge/gpubridge/lib/transport"
)

// reverseP2P makes member 0's server hold the waits of its first n SENDs
// and RECVs and then start them last first, a millisecond apart: a server
// that took a request's place in its (peer, tag) order only when its wait
// ran would send and match them in reverse.
func reverseP2P(n int) func(*ServerOptions) {
	return func(o *ServerOptions) {
		if o.Member != 0 {
			return
		}
		var mu sync.Mutex
		var held []func()
		o.goP2P = func(f func()) {
			mu.Lock()
			held = append(held, f)
			if len(held) != n {
				mu.Unlock()
				return
			}
			fs := held
			mu.Unlock()
			for i := len(fs) - 1; i >= 0; i-- {
				go fs[i]()
				time.Sleep(time.Millisecond)
			}
		}
	}
}

// TestP2PRequestOrder: both members start n SENDs and n RECVs on one tag
// to and from each other without waiting, sizes small to striped; member
// 0's server starts their waits in reverse. Message i of each direction
// lands in RECV i, as the requests were read.
func TestP2PRequestOrder(t *testing.T) {
	const chunk = 4096
	sizes := []int{10, 3*chunk + 1, 600 << 10, 1, 700<<10 + 3, chunk}
	n := len(sizes)
	for _, c := range []struct {
		name string
		p2p  int // point-to-point streams: messages from 512 KiB are striped
	}{{"control", 0}, {"striped", 2}} {
		t.Run(c.name, func(t *testing.T) {
			var bs []Bridge
			for _, m := range transport.NewMemP2P(2, 2, c.p2p, true) {
				cm := collective.New(m, collective.Options{ChunkBytes: chunk, Workers: 2})
				t.Cleanup(func() { _ = cm.Close() })
				bs = append(bs, cm)
			}
			e := startFeeds(t, bs, reverseP2P(2*n))
			ctx, cancel := context.WithTimeout(context.Background(), testenv.Scale(30*time.Second))
			defer cancel()
			offs := make([]int, n+1)
			for i, s := range sizes {
				offs[i+1] = offs[i] + s
			}
			total := offs[n]
			regs := mapRegions(t, e.clients, 2*total)
			fill := func(m, i int) []byte {
				b := make([]byte, sizes[i])
				for k := range b {
					b[k] = byte(m*101 + i*7 + k*13)
				}
				return b
			}
			for m, reg := range regs {
				for i := range sizes {
					copy(reg.Mem[offs[i]:], fill(m, i))
				}
			}
			parallel(t, 2, func(m int) error {
				cl, peer := e.clients[m], 1-m
				var calls []*feedtest.Call
				for i, s := range sizes {
					for _, r := range []feed.Request{
						{Kind: feed.MsgRecv, Buf: regs[m].Span(total+offs[i], s), Peer: int32(peer), Tag: 7},
						{Kind: feed.MsgSend, Buf: regs[m].Span(offs[i], s), Peer: int32(peer), Tag: 7},
					} {
						k, err := cl.Start(r, nil)
						if err != nil {
							return err
						}
						calls = append(calls, k)
					}
				}
				for k, call := range calls {
					d, err := call.Wait(ctx)
					if err != nil {
						return fmt.Errorf("request %d: %w", k, err)
					}
					if i := k / 2; k%2 == 0 && d.Bytes != uint64(sizes[i]) {
						return fmt.Errorf("recv %d: a message of %d bytes, want message %d of %d", i, d.Bytes, i, sizes[i])
					}
				}
				for i := range sizes {
					if !bytes.Equal(regs[m].Mem[total+offs[i]:total+offs[i+1]], fill(peer, i)) {
						return fmt.Errorf("recv %d: not message %d", i, i)
					}
				}
				return nil
			})
			e.closeAll()
		})
	}
}
