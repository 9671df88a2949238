package harness

import (
	"context"
	"fmt"

	"github.com/gpubridge/gpubridge/lib/bridge"
	"github.com/gpubridge/gpubridge/lib/wire"
)

// exchange is the ceiling the bridge is measured against: the two members
// send each other buf at the same time over every data stream, in frames of
// chunk bytes, and neither reduces nor copies what arrives — the traffic of
// a 2-member all_reduce without its arithmetic. With got non-nil (the
// checked call after timing) each frame is checked for its place in the
// buffer and copied into got, so the caller can compare got with what the
// peer sent.
func exchange(ctx context.Context, m *bridge.Member, buf []byte, chunk int, got []byte) error {
	if m.Size != 2 {
		return fmt.Errorf("bench: the exchange needs 2 members, not %d", m.Size)
	}
	peer, streams := 1-m.Self, m.Mesh.Streams()
	chunks := (len(buf) + chunk - 1) / chunk
	// The first failure stops the other streams rather than leaving them
	// waiting for frames that will not come.
	ctx, cancel := context.WithCancel(ctx)
	defer cancel()
	errc := make(chan error, 2*streams)
	for s := 0; s < streams; s++ {
		st := m.Mesh.Stream(peer, s)
		go func() {
			for k := s; k < chunks; k += streams {
				end := min((k+1)*chunk, len(buf))
				if err := st.Send(ctx, wire.Header{Kind: wire.KindData, Chunk: uint32(k)}, buf[k*chunk:end]); err != nil {
					errc <- err
					return
				}
			}
			errc <- nil
		}()
		go func() {
			for k := s; k < chunks; k += streams {
				keep := func(wire.Header, []byte) error { return nil }
				if got != nil {
					start, end := k*chunk, min((k+1)*chunk, len(buf))
					keep = func(h wire.Header, p []byte) error {
						if int(h.Chunk) != k || len(p) != end-start {
							return fmt.Errorf("bench: exchange stream %d: got chunk %d of %d bytes, want chunk %d of %d bytes",
								s, h.Chunk, len(p), k, end-start)
						}
						copy(got[start:end], p)
						return nil
					}
				}
				if err := st.Recv(ctx, keep); err != nil {
					errc <- err
					return
				}
			}
			errc <- nil
		}()
	}
	var first error
	for i := 0; i < 2*streams; i++ {
		if err := <-errc; err != nil && first == nil {
			first = err
			cancel()
		}
	}
	return first
}
