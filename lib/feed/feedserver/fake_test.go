package feedserver

import (
	"bytes"
	"context"
	"encoding/binary"
	"errors"
	"fmt"
	"math"
	"sync"
	"sync/atomic"
	"time"

	"github.com/gpubridge/gpubridge/lib/reduce"
	"github.com/gpubridge/gpubridge/lib/transport"
)

// fakeGroup is an in-memory bridge of n members with the semantics of
// lib/collective: collectives meet by sequence number, results equal
// reduce.Reference, streamed collectives wait for input chunk by chunk and
// report result chunks from two goroutines. It lets the feed be tested
// without a transport, and injects failures.
type fakeGroup struct {
	n     int
	chunk int

	mu     sync.Mutex
	rounds map[uint64]*fakeRound
	boxes  map[[3]int]*fakeBox

	// failSeq makes the collective with this sequence number fail on
	// failMember with failErr.
	failSeq    uint64
	failMember int
	failErr    error
}

type fakeRound struct {
	in   [][]byte
	got  int
	left int
	all  chan struct{}
}

type fakeMember struct {
	g    *fakeGroup
	self int
	seq  atomic.Uint64

	mu    sync.Mutex
	calls []fakeCall // the collectives' codecs, in order
}

// fakeCall is what the fake saw of one collective's codec. The fake does
// not pack anything (compression is lib/collective's, tested there and
// here end to end over Comms): it reduces exactly, and adds 1 to every
// value of a residual, so that a test sees which calls shared it.
type fakeCall struct {
	kind     string
	cd       Codec
	residual float32       // the residual's first value before the call; -1: none
	spin     time.Duration // the shm waits' spin its context set (transport.WithSpin); -1: none
}

func (m *fakeMember) record(ctx context.Context, kind string, cd Codec) {
	fc := fakeCall{kind: kind, cd: cd, residual: -1, spin: -1}
	if d, ok := transport.SpinFrom(ctx); ok {
		fc.spin = d
	}
	if len(cd.Residual) >= 4 {
		fc.residual = math.Float32frombits(binary.LittleEndian.Uint32(cd.Residual))
		for i := 0; i+4 <= len(cd.Residual); i += 4 {
			v := math.Float32frombits(binary.LittleEndian.Uint32(cd.Residual[i:]))
			binary.LittleEndian.PutUint32(cd.Residual[i:], math.Float32bits(v+1))
		}
	}
	m.mu.Lock()
	m.calls = append(m.calls, fc)
	m.mu.Unlock()
}

// recorded returns what the fake saw of every collective so far.
func (m *fakeMember) recorded() []fakeCall {
	m.mu.Lock()
	defer m.mu.Unlock()
	return append([]fakeCall(nil), m.calls...)
}

// lastCall returns the last collective's codec.
func (m *fakeMember) lastCall() fakeCall {
	m.mu.Lock()
	defer m.mu.Unlock()
	if len(m.calls) == 0 {
		return fakeCall{}
	}
	return m.calls[len(m.calls)-1]
}

func newFakeGroup(n, chunk int) []*fakeMember {
	g := &fakeGroup{n: n, chunk: chunk, rounds: map[uint64]*fakeRound{}, boxes: map[[3]int]*fakeBox{}}
	out := make([]*fakeMember, n)
	for i := range out {
		out[i] = &fakeMember{g: g, self: i}
	}
	return out
}

func bridges(ms []*fakeMember) []Bridge {
	out := make([]Bridge, len(ms))
	for i, m := range ms {
		out[i] = m
	}
	return out
}

func (m *fakeMember) Seq() uint64 { return m.seq.Load() }

func (m *fakeMember) begin() (uint64, error) {
	seq := m.seq.Add(1)
	if m.g.failSeq == seq && m.g.failMember == m.self {
		return seq, m.g.failErr
	}
	return seq, nil
}

// input waits for the input chunk by chunk and copies it.
func (m *fakeMember) input(ctx context.Context, buf []byte, p *Progress) ([]byte, error) {
	if p != nil {
		for end := 0; end < len(buf); {
			end = min(end+m.g.chunk, len(buf))
			if err := p.Ready(ctx, end); err != nil {
				return nil, err
			}
		}
	}
	return append([]byte{}, buf...), nil
}

// output copies res into buf and reports it chunk by chunk, alternating
// between two goroutines.
func (m *fakeMember) output(buf, res []byte, p *Progress) {
	copy(buf, res)
	if p == nil {
		return
	}
	var wg sync.WaitGroup
	for g := 0; g < 2; g++ {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for i, off := 0, 0; off < len(buf); i, off = i+1, off+m.g.chunk {
				if i%2 == g {
					p.Done(off, min(m.g.chunk, len(buf)-off))
				}
			}
		}()
	}
	wg.Wait()
}

// exchange deposits in for round seq and returns every member's input.
func (m *fakeMember) exchange(ctx context.Context, seq uint64, in []byte) ([][]byte, error) {
	g := m.g
	g.mu.Lock()
	r := g.rounds[seq]
	if r == nil {
		r = &fakeRound{in: make([][]byte, g.n), all: make(chan struct{}), left: g.n}
		g.rounds[seq] = r
	}
	r.in[m.self] = in
	r.got++
	if r.got == g.n {
		close(r.all)
	}
	g.mu.Unlock()
	select {
	case <-r.all:
	case <-ctx.Done():
		return nil, fmt.Errorf("fake collective %d: %w", seq, context.Cause(ctx))
	}
	g.mu.Lock()
	r.left--
	if r.left == 0 {
		delete(g.rounds, seq)
	}
	g.mu.Unlock()
	return r.in, nil
}

// round is one collective: this member's input (from buf, streamed
// through p; none when give is false) exchanged for every member's.
func (m *fakeMember) round(ctx context.Context, buf []byte, p *Progress, give bool) ([][]byte, error) {
	seq, err := m.begin()
	if err != nil {
		return nil, err
	}
	var in []byte
	if give {
		if in, err = m.input(ctx, buf, p); err != nil {
			return nil, err
		}
	}
	return m.exchange(ctx, seq, in)
}

func (m *fakeMember) AllReduceCodec(ctx context.Context, buf []byte, dt reduce.DType, op reduce.Op, cd Codec, p *Progress) error {
	m.record(ctx, "all_reduce", cd)
	all, err := m.round(ctx, buf, p, true)
	if err != nil {
		return err
	}
	res, err := reduce.Reference(op, dt, all)
	if err != nil {
		return err
	}
	m.output(buf, res, p)
	return nil
}

func (m *fakeMember) BroadcastCodec(ctx context.Context, buf []byte, root int, cd Codec, p *Progress) error {
	m.record(ctx, "broadcast", cd)
	all, err := m.round(ctx, buf, p, m.self == root)
	if err != nil {
		return err
	}
	m.output(buf, all[root], p)
	return nil
}

func (m *fakeMember) AllGatherCodec(ctx context.Context, out, in []byte, cd Codec, p *Progress) error {
	m.record(ctx, "all_gather", cd)
	all, err := m.round(ctx, in, p, true)
	if err != nil {
		return err
	}
	m.output(out, bytes.Join(all, nil), p)
	return nil
}

func (m *fakeMember) ReduceScatterCodec(ctx context.Context, out, in []byte, dt reduce.DType, op reduce.Op, cd Codec, p *Progress) error {
	m.record(ctx, "reduce_scatter", cd)
	all, err := m.round(ctx, in, p, true)
	if err != nil {
		return err
	}
	res, err := reduce.Reference(op, dt, all)
	if err != nil {
		return err
	}
	m.output(out, res[m.self*len(out):(m.self+1)*len(out)], p)
	return nil
}

func (m *fakeMember) Barrier(ctx context.Context) error {
	m.record(ctx, "barrier", Codec{})
	_, err := m.round(ctx, nil, nil, false)
	return err
}

// fakeBox carries the messages of one (from, to, tag) in the order their
// sends were posted, to the recvs in the order they were posted: send i
// is recv i's.
type fakeBox struct {
	mu           sync.Mutex
	sends, recvs int
	msgs         map[int][]byte
	wake         chan struct{} // closed (and replaced) when a message is put
}

func (m *fakeMember) box(from, to int, tag uint32) *fakeBox {
	m.g.mu.Lock()
	defer m.g.mu.Unlock()
	k := [3]int{from, to, int(tag)}
	b := m.g.boxes[k]
	if b == nil {
		b = &fakeBox{msgs: map[int][]byte{}, wake: make(chan struct{})}
		m.g.boxes[k] = b
	}
	return b
}

// fakePending is a posted send or recv: its run is Wait.
type fakePending func(ctx context.Context) (int, error)

func (f fakePending) Wait(ctx context.Context) (int, error) { return f(ctx) }

func (m *fakeMember) PostSend(peer int, tag uint32, buf []byte) Pending {
	b := m.box(m.self, peer, tag)
	b.mu.Lock()
	i := b.sends
	b.sends++
	b.mu.Unlock()
	return fakePending(func(ctx context.Context) (int, error) {
		b.mu.Lock()
		b.msgs[i] = append([]byte{}, buf...)
		close(b.wake)
		b.wake = make(chan struct{})
		b.mu.Unlock()
		return len(buf), nil
	})
}

func (m *fakeMember) PostRecv(peer int, tag uint32, buf []byte) Pending {
	b := m.box(peer, m.self, tag)
	b.mu.Lock()
	i := b.recvs
	b.recvs++
	b.mu.Unlock()
	return fakePending(func(ctx context.Context) (int, error) {
		for {
			b.mu.Lock()
			msg, ok := b.msgs[i]
			wake := b.wake
			delete(b.msgs, i)
			b.mu.Unlock()
			if ok {
				if len(msg) > len(buf) {
					return 0, errors.New("fake recv: message longer than the buffer")
				}
				return copy(buf, msg), nil
			}
			select {
			case <-wake:
			case <-ctx.Done():
				return 0, context.Cause(ctx)
			}
		}
	})
}
