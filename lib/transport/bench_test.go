package transport

import (
	"context"
	"fmt"
	"net"
	"sync"
	"testing"
	"time"

	"github.com/gpubridge/gpubridge/lib/wire"
)

const (
	benchTotal = 256 << 20 // bytes each way per exchange
	benchFrame = 4 << 20
)

// benchExchange has both members of a 2-member bridge send benchTotal bytes
// to each other at once, in benchFrame frames spread over every data
// stream, and reports GB/s per direction. sink, when set, is called with
// each received payload (to model a consumer that reads the data).
func benchExchange(b *testing.B, meshes []Mesh, sink func(dst, p []byte)) {
	benchFlow(b, meshes, sink, 2)
}

// benchFlow is benchExchange with dirs directions: 2 (both members send)
// or 1 (member 0 sends, member 1 receives).
func benchFlow(b *testing.B, meshes []Mesh, sink func(dst, p []byte), dirs int) {
	ctx := context.Background()
	streams := meshes[0].Streams()
	frames := benchTotal / benchFrame
	src := make([][]byte, streams)
	dst := make([][]byte, 2*streams)
	for i := range src {
		src[i] = make([]byte, benchFrame)
		pattern(src[i], 0, 1, i, 0)
	}
	for i := range dst {
		dst[i] = make([]byte, benchFrame)
	}
	round := func() error {
		var wg sync.WaitGroup
		errc := make(chan error, 4*streams)
		for a := range 2 {
			for s := range streams {
				sending, receiving := a < dirs, a >= 2-dirs
				n := frames / streams
				if s < frames%streams {
					n++
				}
				if sending {
					wg.Go(func() {
						out := meshes[a].Stream(1-a, s)
						for k := range n {
							if err := out.Send(ctx, wire.Header{Kind: wire.KindData, Seq: uint64(k)}, src[s]); err != nil {
								errc <- err
								return
							}
						}
					})
				}
				if !receiving {
					continue
				}
				wg.Go(func() {
					in := meshes[a].Stream(1-a, s)
					d := dst[a*streams+s]
					for range n {
						if err := in.Recv(ctx, func(_ wire.Header, p []byte) error {
							if sink != nil {
								sink(d, p)
							}
							return nil
						}); err != nil {
							errc <- err
							return
						}
					}
				})
			}
		}
		wg.Wait()
		close(errc)
		return <-errc
	}
	if err := round(); err != nil { // warm up: buffers, windows, page faults
		b.Fatal(err)
	}
	b.ResetTimer()
	start := time.Now()
	for range b.N {
		if err := round(); err != nil {
			b.Fatal(err)
		}
	}
	el := time.Since(start)
	b.ReportMetric(float64(benchTotal)*float64(b.N)/el.Seconds()/1e9, "GB/s/dir")
	b.SetBytes(benchTotal)
}

// go test -run '^$' -bench 'TCPExchange' -benchtime 3x ./lib/transport/
func BenchmarkTCPExchange(b *testing.B) {
	for _, buf := range []int{sockBuf, 0} {
		for _, crc := range []bool{false, true} {
			for _, streams := range []int{1, 2, 4, 8} {
				name := fmt.Sprintf("streams=%d/crc=%v/sockbuf=%dM", streams, crc, buf>>20)
				b.Run(name, func(b *testing.B) {
					old := sockBufSize
					sockBufSize = buf
					defer func() { sockBufSize = old }()
					meshes := newBridge(b, "tcp", 2, streams, crc).mustEstablish(b)
					benchExchange(b, meshes, nil)
				})
			}
		}
	}
}

// go test -run '^$' -bench 'SHM' -benchtime 3x ./lib/transport/
func BenchmarkSHM(b *testing.B) {
	for _, crc := range []bool{false, true} {
		for _, streams := range []int{1, 2, 4} {
			for _, consume := range []bool{false, true} {
				b.Run(fmt.Sprintf("streams=%d/crc=%v/copyout=%v", streams, crc, consume), func(b *testing.B) {
					meshes := newBridge(b, "shm", 2, streams, crc).mustEstablish(b)
					var sink func(d, p []byte)
					if consume {
						sink = func(d, p []byte) { copy(d, p) }
					}
					benchExchange(b, meshes, sink)
				})
			}
		}
	}
}

// go test -run '^$' -bench 'SHMOneWay' -benchtime 5x ./lib/transport/
func BenchmarkSHMOneWay(b *testing.B) {
	for _, ring := range []int{8 << 20, 16 << 20} {
		for _, streams := range []int{1, 2} {
			b.Run(fmt.Sprintf("streams=%d/ring=%dM", streams, ring>>20), func(b *testing.B) {
				br := newBridge(b, "shm", 2, streams, false)
				for i := range br.cfgs {
					br.cfgs[i].RingBytes = ring
				}
				benchFlow(b, br.mustEstablish(b), nil, 1)
			})
		}
	}
}

// BenchmarkMemcpy is the anchor: one core copying 4 MiB frames, and two
// goroutines doing so at once (what two members exchanging over shm do).
// "stream" copies 256 MiB into 256 MiB (memory-bound); "ring" copies one
// 4 MiB frame into the two halves of an 8 MiB buffer in turn, as a shm
// sender with a warm source and the default ring does (cache-bound).
func BenchmarkMemcpy(b *testing.B) {
	for _, kind := range []string{"stream", "ring"} {
		for _, par := range []int{1, 2} {
			b.Run(fmt.Sprintf("%s/goroutines=%d", kind, par), func(b *testing.B) {
				benchMemcpy(b, kind == "ring", par)
			})
		}
	}
}

func benchMemcpy(b *testing.B, ring bool, par int) {
	{
		{
			src := make([][]byte, par)
			dst := make([][]byte, par)
			for i := range src {
				src[i] = make([]byte, benchTotal)
				dst[i] = make([]byte, benchTotal)
				if ring {
					src[i] = src[i][:benchFrame]
					dst[i] = dst[i][:2*benchFrame]
				}
				pattern(src[i], 0, 0, i, 0)
				copy(dst[i], src[i])
			}
			b.SetBytes(benchTotal)
			b.ResetTimer()
			start := time.Now()
			for range b.N {
				var wg sync.WaitGroup
				for g := range par {
					wg.Go(func() {
						for off := 0; off < benchTotal; off += benchFrame {
							if ring {
								k := off / benchFrame % 2 * benchFrame
								copy(dst[g][k:k+benchFrame], src[g])
								continue
							}
							copy(dst[g][off:off+benchFrame], src[g][off:off+benchFrame])
						}
					})
				}
				wg.Wait()
			}
			b.ReportMetric(float64(benchTotal)*float64(b.N)/time.Since(start).Seconds()/1e9, "GB/s/goroutine")
		}
	}
}

// BenchmarkTCPRaw is the ceiling: two Go endpoints exchanging benchTotal
// bytes each way at once over plain loopback connections (no framing, no
// bridge), with default socket settings.
func BenchmarkTCPRaw(b *testing.B) {
	for _, streams := range []int{1, 4} {
		b.Run(fmt.Sprintf("streams=%d", streams), func(b *testing.B) {
			ln, err := net.Listen("tcp", "127.0.0.1:0")
			if err != nil {
				b.Fatal(err)
			}
			defer ln.Close()
			var left, right []net.Conn
			for range streams {
				c, err := net.Dial("tcp", ln.Addr().String())
				if err != nil {
					b.Fatal(err)
				}
				s, err := ln.Accept()
				if err != nil {
					b.Fatal(err)
				}
				left, right = append(left, c), append(right, s)
			}
			defer func() {
				for i := range left {
					_ = left[i].Close()
					_ = right[i].Close()
				}
			}()
			round := func() {
				var wg sync.WaitGroup
				per := benchTotal / streams
				for _, side := range [][]net.Conn{left, right} {
					for _, c := range side {
						wg.Go(func() {
							buf := make([]byte, benchFrame)
							for off := 0; off < per; off += benchFrame {
								if _, err := c.Write(buf[:min(benchFrame, per-off)]); err != nil {
									b.Error(err)
									return
								}
							}
						})
						wg.Go(func() {
							buf := make([]byte, benchFrame)
							for got := 0; got < per; {
								n, err := c.Read(buf)
								if err != nil {
									b.Error(err)
									return
								}
								got += n
							}
						})
					}
				}
				wg.Wait()
			}
			round()
			b.SetBytes(benchTotal)
			b.ResetTimer()
			start := time.Now()
			for range b.N {
				round()
			}
			b.ReportMetric(float64(benchTotal)*float64(b.N)/time.Since(start).Seconds()/1e9, "GB/s/dir")
		})
	}
}
