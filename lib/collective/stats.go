package collective

import (
	"sync/atomic"
	"time"
)

// Stats is what one collective measured on this member: the bridge's part
// of its trace record (docs/TRACING.md §7). Comm.LastStats returns the
// last collective's.
type Stats struct {
	// Seq is the collective's sequence number; 0: none ran yet.
	Seq uint64
	// Start is when the collective began here, after this member's
	// earlier collectives; End when it ended.
	Start, End time.Time
	// AllArrived is when the first frame of the collective had arrived
	// from every peer it heard from (Start when it heard from none: a
	// broadcast root).
	AllArrived time.Time
	// BytesSent and BytesReceived count the payloads of the frames as
	// they travel (packed, for a compressed call; the direct path's
	// descriptors included) and, on the direct path, where
	// members read each other's buffers in place, the bytes this member
	// read of its peers' buffers (received) and they of its (sent).
	BytesSent, BytesReceived uint64
	// Reduce is the time spent in lib/reduce's kernels, summed over the
	// goroutines that ran them.
	Reduce time.Duration
	// Codec is the time spent packing and unpacking frames (lib/codec's
	// encoders and decoders, decode-and-add included), summed over the
	// goroutines that ran them; 0 for a raw call.
	Codec time.Duration
	// SendWait is how long this member's receivers held frames that had
	// arrived while they waited for this member's own send of the bytes
	// the frames overwrite (an in-place exchange or ring), summed over
	// the streams; Spilled the bytes they copied aside meanwhile, to be
	// consumed once the send was out (after spillAfter).
	SendWait time.Duration
	Spilled  uint64
	// Streams is the data streams per peer.
	Streams int
	// Peers holds every other member, in member order.
	Peers []PeerStats

	buf []time.Duration // the peers' Blocked, reused
}

// PeerStats is one peer's part of a collective's Stats.
type PeerStats struct {
	// Member is the peer's member index.
	Member int
	// Heard says whether a frame of this collective came from the peer
	// (in a ring a member hears only from its predecessor).
	Heard bool
	// Arrival is when its first frame came, after Start (negative: it
	// was waiting here already).
	Arrival time.Duration
	// Blocked is, per stream, how long this member's receivers waited
	// for the peer's frames: from asking the transport for a frame until
	// its header was in (a stream that holds frames: the whole frame).
	Blocked []time.Duration
}

// callStats is a call's counters; every goroutine of the call adds to
// them without a lock.
type callStats struct {
	start    time.Time
	first    []atomic.Int64 // per member: ns after start of its first frame + 1; 0: none
	blocked  []atomic.Int64 // per member × stream, ns
	reduce   []paddedInt64  // per stream, ns
	codec    []paddedInt64  // per stream, ns
	sendWait []paddedInt64  // per stream, ns
	spilled  atomic.Int64
	sent     atomic.Int64
	received atomic.Int64
}

// paddedInt64 keeps per-stream counters on cache lines of their own.
type paddedInt64 struct {
	atomic.Int64
	_ [56]byte
}

func (c *Comm) newCallStats() *callStats {
	return &callStats{
		start:    time.Now(),
		first:    make([]atomic.Int64, c.size),
		blocked:  make([]atomic.Int64, c.size*c.streams),
		reduce:   make([]paddedInt64, c.streams),
		codec:    make([]paddedInt64, c.streams),
		sendWait: make([]paddedInt64, c.streams),
	}
}

// frameIn notes the header of a frame from peer on stream s: the receive
// began at asked. It is the one clock read per received frame.
func (cl *call) frameIn(peer, s int, asked time.Time, n int) {
	st := cl.st
	now := time.Now()
	st.blocked[peer*cl.c.streams+s].Add(int64(now.Sub(asked)))
	st.received.Add(int64(n))
	if st.first[peer].Load() == 0 {
		st.first[peer].CompareAndSwap(0, int64(now.Sub(st.start))+1)
	}
}

// reduced adds the time since t0 to stream s's reduce time.
func (cl *call) reduced(s int, t0 time.Time) {
	cl.st.reduce[s%len(cl.st.reduce)].Add(int64(time.Since(t0)))
}

// waitedSend adds the time since t0 to stream s's SendWait.
func (cl *call) waitedSend(s int, t0 time.Time) {
	cl.st.sendWait[s%len(cl.st.sendWait)].Add(int64(time.Since(t0)))
}

// coded adds the time since t0 to stream s's codec time.
func (cl *call) coded(s int, t0 time.Time) {
	cl.st.codec[s%len(cl.st.codec)].Add(int64(time.Since(t0)))
}

// snapshot writes the call's stats into out, reusing out's slices.
func (cl *call) snapshot(out *Stats, end time.Time) {
	st, c := cl.st, cl.c
	out.set(Stats{Seq: cl.seq, Start: st.start, End: end, AllArrived: st.start, Streams: c.streams,
		BytesSent: uint64(st.sent.Load()), BytesReceived: uint64(st.received.Load()), Spilled: uint64(st.spilled.Load())}, c.size-1)
	for i := range st.reduce {
		out.Reduce += time.Duration(st.reduce[i].Load())
		out.Codec += time.Duration(st.codec[i].Load())
		out.SendWait += time.Duration(st.sendWait[i].Load())
	}
	i := 0
	for m := range c.size {
		if m == c.self {
			continue
		}
		p := &out.Peers[i]
		i++
		p.Member = m
		if f := st.first[m].Load(); f > 0 {
			p.Heard, p.Arrival = true, time.Duration(f-1)
			if at := st.start.Add(p.Arrival); at.After(out.AllArrived) {
				out.AllArrived = at
			}
		}
		for s := range c.streams {
			p.Blocked[s] = time.Duration(st.blocked[m*c.streams+s].Load())
		}
	}
}

// set makes out v with n zero peers of v.Streams streams each, reusing
// out's slices.
func (out *Stats) set(v Stats, n int) {
	peers, buf := out.Peers, out.buf
	*out = v
	s := v.Streams
	if cap(buf) < n*s {
		buf = make([]time.Duration, n*s)
	}
	if cap(peers) < n {
		peers = make([]PeerStats, n)
	}
	out.buf, out.Peers = buf[:n*s], peers[:n]
	clear(out.buf)
	for i := range out.Peers {
		out.Peers[i] = PeerStats{Blocked: out.buf[i*s : (i+1)*s : (i+1)*s]}
	}
}

// LastStats copies the stats of the last collective that ended (with or
// without an error) into out, reusing out's slices, and reports whether
// there was one. Call it from the goroutine that calls the collectives,
// between them; it allocates nothing once out has held stats of as many
// members.
func (c *Comm) LastStats(out *Stats) bool {
	c.mu.Lock()
	defer c.mu.Unlock()
	if c.last.Seq == 0 {
		return false
	}
	v := c.last
	v.Peers, v.buf = nil, nil
	out.set(v, len(c.last.Peers))
	for i, p := range c.last.Peers {
		q := &out.Peers[i]
		q.Member, q.Heard, q.Arrival = p.Member, p.Heard, p.Arrival
		copy(q.Blocked, p.Blocked)
	}
	return true
}
