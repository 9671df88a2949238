// Package collective runs the bridge's collectives — all_reduce,
// broadcast, all_gather, reduce_scatter, barrier — and tagged
// point-to-point messages between the members of a bridge (the island
// leaders), over a transport.Mesh (TCP, shared memory, or in memory for
// tests).
//
// # Calling it
//
// Every member creates a Comm with New over its mesh and calls the
// collectives one at a time, in the same order, with the same arguments
// (sizes, dtype, op, root) and the same Options.ChunkBytes and
// Options.SmallBytes, like NCCL.
// Collectives of one Comm are serialised; Send and Recv may run
// concurrently with them and with each other, from any number of
// goroutines. Buffers are raw little-endian elements (a torch tensor's
// storage); lengths must be whole elements of the dtype.
//
// Arguments are checked before anything is sent: a wrong length, an
// unsupported dtype/op pair (reduce.Supported: avg is for floating dtypes
// only), a root or peer out of range, or an overlap of input and output
// other than the allowed in-place forms fails at once with an *Error
// wrapping ErrInvalid; the call takes no sequence number and the Comm stays
// usable.
//
// Each call runs under its context's deadline, or Options.Timeout (default
// 5 minutes) when the context has none.
//
// # Sequence numbers and mismatches
//
// Every collective takes the next sequence number (Seq; the first is #1).
// Its frames carry the number, the collective (in the high bits of the
// frame's Step, with the algorithm step) and a 16-bit fingerprint of the
// arguments every member must agree on (byte count, dtype, op, root,
// chunk size, codec, and for an all_reduce of three or more members the
// SmallBytes threshold, which picks its algorithm and so its order of
// sums). A member that receives a frame of another collective or
// number fails with, for example,
//
//	all_reduce #12 (float32 sum, 64 MiB): member 1 sent all_gather #12, this member is in all_reduce #12: members called collectives in different orders
//
// and one whose peer passed other arguments with
//
//	all_reduce #12 (...): member 1 called all_reduce #12 with other arguments than this member's (float32 sum, 64 MiB, 4 MiB chunks): every member must pass the same sizes, dtype, op and root, and use the same ChunkBytes
//
// (an all_reduce of three or more members adds ", SmallBytes 32 KiB" and
// "and SmallBytes").
//
// Barrier tokens (on the control streams) are checked the same way. A
// collective that sends without receiving (a broadcast root) cannot see a
// mismatch; it learns in its next call.
//
// # all_reduce
//
// With one member AllReduce applies reduce.Finish with n = 1 (nothing
// changes). With two members it is a chunked exchange: each member sends
// its buffer in chunks of ChunkBytes, chunk k on data stream k mod Streams,
// and reduces each chunk of the peer's as it arrives, straight from the
// transport's receive buffer, while later chunks are on the wire. A chunk
// of its own is overwritten only once it has been sent. Both members
// compute, for every element,
//
//	x0 op x1   (member 0's value is the earlier operand, a, of reduce.Combine)
//
// then reduce.Finish with n = 2, so both hold the same bits, equal to
// reduce.Reference.
//
// From Options.SplitBytes on (default DefaultSplitBytes, 16 MiB) two
// members split instead: the ring below with n = 2, a reduce-scatter then
// an all-gather. Member r sends the half it does not own, reduces the
// peer's copy of its own half into its buffer as the chunks arrive, and
// sends the result; the peer's result lands straight in the other half.
// The same bytes cross the wire as in the exchange, but each member
// reduces half the buffer and reads half its destination back, and the
// half it sends second is still in cache from the reduction. It keeps the
// exchange's order, x0 op x1 in both halves (the ring's own order would
// put the partial first), so which of the two ran changes no bit.
//
// A raw exchange or ring cuts a segment of fewer than Streams chunks of
// ChunkBytes into a chunk per stream instead (at least 1 MiB: SpreadChunk),
// so that a 4 MiB exchange or a ring's 4 MiB segments do not ride on one
// stream of eight.
//
// With three or more members and more than Options.SmallBytes bytes
// (below: recursive doubling) it is a pipelined ring: a reduce-scatter of
// n-1 steps then an all-gather of n-1 steps. The buffer of E elements is
// cut into n segments of ceil(E/n) elements (segment j holds elements
// [j*ceil(E/n), (j+1)*ceil(E/n)), clipped to E; for small buffers the last
// segments are shorter or empty). At step t member r sends segment
// r-t-1 to member r+1 and receives segment r-t-2 from member r-1 (mod n).
// Each segment is cut into chunks, chunk c on stream c mod Streams, and
// every chunk moves on as soon as its previous step is done, so a chunk is
// being reduced while later ones travel. In the reduce-scatter the
// received partial is the earlier operand and the member's own input the
// later one, so segment j is reduced in the order
//
//	((x[j+1] op x[j+2]) op ...) op x[j]   (member indices mod n)
//
// and becomes final at member j, which applies reduce.Finish (for avg: the
// division by n, once) before the all-gather carries the final bytes to
// everyone. Every member ends with identical bits, equal to
// ReferenceAllReduceAlgo(AlgoRing, op, dt, inputs, n). With n = 3 and one
// element per segment: element 0 is (x1 op x2) op x0, element 1
// (x2 op x0) op x1, element 2 (x0 op x1) op x2.
//
// The all-gather's segments (with two members the second half; all_gather
// and the broadcast chain alike) arrive final, so no pass of ours is
// needed: over TCP each chunk is read off the socket straight into the
// destination (transport.IntoReceiver), as the exchange ceiling's frames
// land in its receive buffer. The exception is the last step's chunks
// (they travel no further) into a destination of Options.StreamBytes and
// more: the kernel's copy would read each of its lines from memory before
// writing it, so they come through a piece that stays in cache and are
// copied on with non-temporal stores (lib/ntcopy), like the direct
// collectives' copies and as over the other transports. (On the 16-core
// host the copy with non-temporal stores ran as fast as the kernel's
// straight into a 256 MiB or 1 GiB destination, or faster, while at 64
// MiB the read straight in made the 2-member ring 6% faster:
// docs/BENCHMARKS.md.) The bytes are the same either way.
//
// # Recursive doubling: small all_reduces
//
// With three or more members, a buffer of at most Options.SmallBytes
// bytes (default DefaultSmallBytes, 32 KiB; negative: never) runs
// recursive doubling instead (allreduce_rd.go), where every step moves the
// whole buffer between two members. Let p = 2^k be the largest power of
// two at most n. First each "extra" member r >= p sends its buffer to
// r-p (step 0), which reduces x[r-p] op x[r]. Then the core members
// 0..p-1 run k rounds: in round i (step 1+i) member r exchanges its
// partial with member r XOR 2^i and both compute lower op higher (the
// partial of the member with bit i clear is the earlier operand), so both
// hold the same bits. After the last round every core member applies
// reduce.Finish with n (avg divides once) and each partner of an extra
// sends it the result (step k+1). The sum tree is the same on every member:
// a balanced tree over the core, each core member's leaf being its input
// folded with its extra's, so every member ends with identical bits, equal
// to ReferenceAllReduceAlgo(AlgoRecursiveDoubling, ...). With n = 3:
// (x0 op x2) op x1; n = 4: (x0 op x1) op (x2 op x3); n = 5:
// ((x0 op x4) op x1) op (x2 op x3). Each step is the exchange's pipe with
// one peer (chunks of ChunkBytes over the streams, a chunk reduced as it
// arrives, over TCP piece by piece), the steps one after the other. With
// two members recursive doubling is the exchange (one round), which keeps
// that name.
//
// Cost, with a per-message latency α, a bandwidth β and a buffer of L
// bytes: k = log2(p) rounds, plus the fold and the unfold when n is no
// power of two, each moving all L bytes: (k + 2·[n≠p])·(α + L/β) in time,
// k·L bytes (+L for a fold partner) reduced per member. The ring takes
// 2(n-1)·α + 2·(n-1)/n·L/β (the direct path: a descriptor round trip and
// one pass of reduction over 1/n of the buffer). Recursive doubling wins
// where α dominates, and loses once the (k - 2(n-1)/n)·L/β it sends more
// outweighs the α it saves. Measured (BenchmarkAllReduceSizes: float32
// sum, 4 streams, default chunk, every member's buffer shared, all members
// in one process on a 2-core machine; µs per all_reduce, recursive
// doubling / the other):
//
//	         tcp (loopback), vs the ring          shm, vs the ring (< 64 KiB) or direct
//	size     3          4          8              3          4           8
//	4 B      57/67      87/71      220/156        123/438    322/643     1211/1714
//	64 B     54/84      84/119     209/406        98/497     327/661     1137/2185
//	4 KiB    57/83      94/131     222/424        94/429     342/665     1280/2367
//	16 KiB   76/98      109/138    291/449        109/461    332/630     933/1528
//	32 KiB   72/98      123/143    391/477        147/469    299/504     1306/2365
//	64 KiB   103/119    190/170    606/547        124/964    324/1571    1595/9091
//	128 KiB  154/153    294/223    944/724        164/993    447/1516    1973/8708
//	256 KiB  272/244    519/371    1399/954       343/962    572/1583    2390/8789
//
// A second run gave the same picture (each entry within about a third).
// Over TCP recursive doubling is ahead up to 32 KiB (0.5 to 0.97 of the
// ring's time) and behind from 64 KiB on 4 and 8 members: hence the
// default of 32 KiB. (At 4 bytes the ring sends only its one non-empty
// segment, 2(n-1) frames against recursive doubling's n·k, and on two
// cores the frame count weighs more than the depth.) Over shm, on this
// machine, it was ahead at every size measured, the direct path included;
// the default stays 32 KiB for every transport, below the direct path's
// 64 KiB, and a larger SmallBytes is there to try (it takes the buffers
// up to it off the direct path too). Two members: the exchange, 36 to
// 46 µs up to 32 KiB over TCP, 97 to 122 µs over shm.
//
// Lossy codecs (bf16, fp8) never take recursive doubling: their exchange
// and ring are what ReferenceAllReduceCodec and the error feedback follow.
// zstd takes it as raw does, so that its bits stay raw's.
//
// Integer results and max/min of non-NaN values do not depend on the
// order; sums and products of floats, and which NaN comes out, do (see
// lib/reduce for the arithmetic: IEEE operations in the dtype's own
// precision, no FMA, denormals kept, NaN propagation with a fixed choice of
// payload, -0 below +0 for max/min, float16 and bfloat16 computed in
// float32 and rounded once per step).
//
// The reductions run on several cores: every stream has its own receiving
// goroutine, and each reduces with reduce.CombineParallel over
// Workers/Streams goroutines (Options.Workers, default runtime.NumCPU()).
// Over a stream that hands a frame out in pieces as it arrives
// (transport.PieceReceiver: TCP) each piece is reduced at once, from a
// buffer that stays in cache, straight into the member's buffer; a piece
// that arrives before the member's own chunk was sent waits in a spill
// buffer until it is. With Options.Overlap on (not the default: measured
// slower, see Overlap.on) a stream that receives more than one piece in
// the call has a second goroutine: one reads the pieces off the socket (the
// kernel's copy), up to transport.MaxHeldPieces ahead in buffers of the
// stream (2 MiB over TCP), while the other reduces those already in, in
// the same order and from the same bytes, so the results do not change.
// With c the rate of the kernel's copy and r the reduction's, one
// goroutine that does both moves a stream's bytes at 1/(1/c + 1/r); two
// move them at min(c, r), on two cores.
//
// The overlap adds no pass through memory: the pieces stay in cache
// either way (the reducing core reads them from the reading core's cache
// rather than its own), and a spilled piece is copied once, as before.
//
// # Direct: reading each other's memory
//
// Over a mesh whose members share memory (transport.Sharer: shm), an
// all_reduce (that does not run recursive doubling) or all_gather of at
// least 64 KiB per member opens with one
// descriptor frame from every member to every other on data stream 0: where
// its buffer (all_gather: its input) lies in the memory it shares, or that
// it does not. When every member's does, every member runs the direct
// algorithm; otherwise every member runs the one above (exchange or ring),
// so all decide alike from the same descriptors. Buffers that are not
// shared — plain Go memory — therefore work as before, at the price of the
// descriptor round trip; gbbridge serve's feed regions and gbbridge bench's
// buffers are shared (memfds). With CRCs on (transport.Config.CRC) the shm
// mesh locates no buffer, so every byte travels in checked frames.
//
// The direct all_reduce cuts the buffer into the ring's segments (above)
// and each segment into pieces (about one per member and stream, 64 KiB to
// ChunkBytes); piece i is member (i mod n)'s to produce: it reads the piece
// from every member's buffer and reduces it in the order of the piece's
// segment — x0 op x1 for two members, x[j+1] op x[j+2] ... op x[j] for
// segment j of three or more, the partial the earlier operand, folded in a
// cache-resident block — and applies reduce.Finish. So the bits are
// ReferenceAllReduce's, as on the other paths. Then one of two modes:
//
//   - writing through (AlgoDirectWrite: every member's mesh maps its peers'
//     memory writable, transport.Config.PeerWrite, and says so in its
//     descriptor): the owner writes each finished block into every
//     member's buffer, its own and each peer's, at the same offsets, and
//     tells the others it is final; they copy nothing. One reduction pass
//     over a member's share and one write of every result;
//   - copying (AlgoDirect: any member's mesh maps peers read-only): the
//     owner writes the result into its own buffer and tells the others,
//     who copy it into theirs; each member tells every other at the end
//     that it copied what it needed (until then the others' buffers are
//     read: no member returns earlier).
//
// The frames carry no data: a streamed member tells a piece's owner when
// its input of the piece is ready (Progress.Ready was granted; the owner
// reads it, and writes the result there, only after), an owner tells the
// others when a piece is final. Writing through needs no closing round: an
// owner's final for a piece means it has read every input of the piece and
// written every result, so a member that produced its own pieces and got
// every final is touched by nobody any more. The all_gather copies (it has
// one mode): each member owns the pieces of its input, the others copy
// them into its slot. Piece i travels on stream (i/n) mod Streams, where
// one goroutine produces or announces the stream's pieces in order and one
// per peer receives that peer's frames (and copies its pieces), so
// reductions and copies run on up to Streams goroutines each.
//
// Writing into a peer's memory is safe for the same reasons reading it is:
// the peers are the job's own processes (the memfds travel only over
// sockets authenticated with the job's secret and the peer's SO_PEERCRED),
// and a member writes only into the bytes the peer announced for the call
// (transport.Sharer.PeerMem's view is exactly that range), after the
// peer's input there was read. A call that fails stops writing between
// blocks once it learns of the failure; the failed member's buffer is
// undefined then anyway. The mesh decides, not Options:
// transport.Config.PeerWrite off on any member keeps every mapping
// read-only and every member copying.
//
// Memory traffic of the direct all_reduce of n members, per call and per
// byte of the buffer, all members together, once the buffers are past the
// caches. Writing through, the owners read every input once (n) and write
// every result once (n): 2n, the floor, 4 for two members and 8 for four.
// Copying, the reductions read every input (n) and write the owners'
// results in place (1: the line was just read, so no read for ownership);
// the copies read the owners' results (n-1, less where they are still in
// cache) and write the copiers' buffers (n-1), which an ordinary store
// first reads (n-1): 4n-2, 6 for two members; from Options.StreamBytes on
// the copies stream (lib/ntcopy) and skip that read: 3n-1, 5 for two
// members and 11 for four. The owners' writes through are ordinary
// stores at every size: the owner has just read those lines, so they are
// in cache and need no read for ownership (streaming them was slower on
// the 16-core host: docs/BENCHMARKS.md).
//
// Comm.Algorithm names what the last collective ran: AlgoExchange,
// AlgoRing, AlgoRecursiveDoubling, AlgoChain (broadcast), AlgoDirect,
// AlgoLocal. Comm.AllReduceOrder says whose order of sums an all_reduce of
// a given size follows (for ReferenceAllReduceAlgo); ReferenceAllReduce
// is that of a Comm with the default SmallBytes.
//
// # reduce_scatter, all_gather, broadcast
//
// ReduceScatter(out, in) (len(in) = n*len(out)) leaves segment m of the
// reduction, bytes [m*len(out), (m+1)*len(out)), in member m's out. It is
// the first half of the ring above over segments of len(out): segment m is
// reduced in the order x[m+1], x[m+2], ..., x[m] (mod n) and finished at
// member m; with two members the order is x0 op x1 as in AllReduce. So
// when len(in) is a multiple of n elements its segments equal the ring
// AllReduce's bit for bit (not recursive doubling's). ReferenceReduceScatter computes it. in is not
// modified (partials wait in a scratch buffer of up to 2*len(out) bytes
// that the Comm keeps); out may be this member's own segment of in.
//
// AllGather(out, in) (len(out) = n*len(in)) is the second half of the ring:
// member order in out; in may be this member's own slot of out.
//
// Broadcast(buf, root) forwards chunks along the chain root, root+1, ...,
// root-1: each member passes every chunk on as soon as it has it, so the
// time is about one transfer of the buffer plus n-2 chunk hops.
//
// Buffers of 0 bytes send nothing (and check nothing).
//
// # Compression
//
// The *Codec variants (AllReduceCodec, BroadcastCodec, AllGatherCodec,
// ReduceScatterCodec) pack what they send with a Codec
// (docs/COMPRESSION.md): every data frame carries the codec's id in its
// header, and the codec is part of the argument fingerprint. A member that
// receives a frame of another codec than its call's fails with
//
//	member 1 sent fp8/v1 frames in all_reduce #12, this member's call uses raw: every member must compress alike
//
// (an id this build does not know: codec.UnknownError's text). A
// compressed call never takes the direct path; its frames are received
// whole (not in a stream's pieces).
//
// zstd (lossless, every collective): the sender packs each chunk into one
// zstd/v1 chunk (chunks are capped so that one fits a frame), the receiver
// unpacks it into exactly the chunk's bytes and hands that to the
// collective's own consumer, so the results are raw's bit for bit. A
// frame that does not unpack so is corrupt (an error naming the peer that
// matches wire.ErrCorrupt). Broadcast and all_gather pack byte planes of
// Codec.DType (0: plain bytes).
//
// bf16 and fp8 (lossy: floating sum and avg all_reduce, dtypes the codec
// takes; anything else is refused with ErrInvalid): chunks are multiples
// of codec.ChunkAlign values, so packed chunks are consecutive pieces of
// the buffer's packing, and a frame's payload is exactly the chunk's
// packed length. Two members run the compressed exchange: each packs its
// chunk Q(x + r) and both compute dec(q0) + dec(q1) in float32 (member
// 0's first), Finish for 2, then the dtype. Three or more run the
// low-precision ring on ringAllReduce's schedule over segments of
// multiples of 1024 values: the first hop packs the input, each later hop
// packs dec(received) + x in float32 (the received partial first), the
// owner applies Finish once and packs the sum once more, and the
// all-gather forwards those final bytes unchanged; every member, the
// owner included, sets its result to their decoding. Each member
// quantizes each value once per call, so Codec.Residual (float32 per
// value, nil: none) carries one error-feedback residual per value:
// u = x + r, r' = u - dec(Q(u)), or +0 where either is not finite. Every
// member ends with the same bits, ReferenceAllReduceCodec's. Packing and
// unpacking run inside the pipe, chunk by chunk, in cache-sized blocks on
// the streams' goroutines (large chunks over up to Workers/Streams of
// them), so the codec overlaps the wire; Stats.Codec counts their time,
// BytesSent and BytesReceived the packed bytes. In the ring a result range
// is reported Done once it is decoded (the owner's after its last
// reduce-scatter step). The packing of the buffer is kept by the Comm and
// reused by the next lossy call; with one member nothing is quantized.
//
// # Barrier
//
// Barrier runs on the control streams: a dissemination barrier, in round k
// (k < ceil(log2 n)) member r sends a token to member r+2^k and waits for
// the one of member r-2^k. It returns once every member has entered it.
//
// # Progress: streaming the input and the result
//
// A Progress lets the feed (the torch plugin's GPU copies) overlap with the
// collective. Ready(ctx, end) must block until input bytes [0, end) hold
// their values; the collective calls it before it reads or sends any input
// byte below end (calls come from several goroutines at once, with ends not
// always increasing, so it must be safe for concurrent use). Done(off, n)
// reports that result bytes [off, off+n) are final and no longer written by
// the collective, here or on another member (on the direct path, copying,
// the other members may still read them until the call returns: the
// caller may read them, not change them); the
// ranges are disjoint and cover the result exactly once before a successful
// return, and may be reported from several goroutines at once. When they
// come: two-member all_reduce, as each chunk (over TCP: each piece) is
// reduced (roughly in input order, so the result streams back while later
// input streams in); recursive doubling, as each chunk of the last round
// is reduced (an extra member: as each chunk of the result arrives); ring
// all_reduce and all_gather, in the all-gather, once
// a chunk has been passed on (or has arrived, at the last step);
// reduce_scatter, as each chunk of out is final; broadcast, once a chunk
// was sent on (the last member of the chain: once it arrived); direct, as
// each piece is produced, copied, or (writing through) announced final by
// its owner. The input is the buffer
// (all_reduce, broadcast: only the root calls Ready) or in (all_gather,
// reduce_scatter); the result is buf or out.
//
// The ring needs segment r-1 (and so nearly the whole input, for member 0)
// ready before member r sends; streaming the input helps the two-member
// exchange most.
//
// # Point-to-point
//
// Send(peer, tag, buf) and Recv(peer, tag, buf) carry messages on the
// control stream to peer and, from 512 KiB, on the mesh's point-to-point
// streams (transport.Mesh.P2PStream), apart from the data streams, so they
// never wait for or disturb a collective running at the same time. Messages match by
// (source, tag): a Recv takes the next message from that peer with that
// tag, whatever is pending on other tags, so many tags can be in flight at
// once and a Recv for tag B completes while tag A's message waits for its
// Recv. Messages with the same (source, destination, tag) are delivered in
// the order sent, exactly once. A message is cut into frames of ChunkBytes
// (KindP2P, Step = the tag, Seq = the message's number on its
// (source, destination, tag), the last frame flagged FlagLast); frames of
// concurrent Sends on different tags may interleave, which the receiver
// undoes by tag; Sends on the same tag go one after the other.
//
// Order when many are in flight: PostSend and PostRecv fix a call's place
// in its (peer, tag) order without blocking, and the Pending they return
// runs it (Wait); Send and Recv are the two in one. Sends on a tag go out
// in the order they were posted (a tag's queue: the first holds the tag
// for its whole message; one that gives up leaves the queue, and message
// numbers have no gap); Recvs are matched in the order they were posted: a
// PostRecv takes the message at the head of the tag's queue, arrived whole
// (Wait copies it) or still arriving (what arrived is copied into its
// buffer and the rest lands there), else it waits in the tag's posted
// Recvs, which frames fill in order. So a caller that posts from one
// goroutine and waits from many (gbbridge serve, in the order it reads its
// requests) gets message i in Recv i.
//
// Striped messages: a message of at least 512 KiB, when the mesh has
// point-to-point streams (P of them; lib/bridge asks for 4), is announced
// on the control stream by one KindP2P frame flagged FlagStripe (Seq and
// Step as above, Chunk 0) whose 12-byte payload is the message's length
// (u64) and frame size (u32), about length/P rounded up to 64 bytes, at
// least 256 KiB, at most ChunkBytes; decoded within limits (1 byte to
// 2^20 frames of 1 B to wire.MaxPayload). Frame i (KindP2P, Chunk i, no
// flags) then goes on point-to-point stream i mod P, each stream written by
// a goroutine of the Send. Matching happens at the announcement, in order
// per tag with the control stream's messages; frames are checked against
// it (index, length, each once), and one that comes before its
// announcement (another stream) waits for it. Send returns when every
// frame was written; on an error after the announcement the communicator
// breaks, as for a message half sent.
//
// On each member one goroutine per peer reads the control stream, and one
// per point-to-point stream reads that: a frame for a posted Recv is copied
// straight from the transport's buffer into the Recv's buffer (striped
// frames in parallel, each at its offset); otherwise the message is queued
// (a striped one preallocated at its announced length and counted against
// the limit below at once). Queued ("unexpected")
// messages take memory: over 1 GiB (DefaultMaxUnexpected) in all, the
// communicator breaks with an error saying so. A message longer than the
// Recv's buffer fails that Recv with ErrTooLong (the message is consumed,
// its length returned). A Recv whose context ends before its message
// started consumes nothing; one that gives up while its message is
// arriving hands the message, as far as it came, to the next Recv on the
// tag or back to the head of the queue (a striped message with the frames
// not yet arrived as gaps, which the frames still to come fill). When the
// peer's control stream ends, a striped message already arriving is still
// completed by its point-to-point streams, which carry everything the peer
// sent before it closed.
//
// Send returns once buf may be reused, not when the peer has received the
// message.
//
// # Failures
//
// Every failure is an *Error naming the call, its number and arguments:
//
//	all_reduce #12 (float32 sum, 64 MiB): member 1 (rank 2 on host-b): connection closed
//
// A collective that fails for any reason but a local misuse — a transport
// error, a timeout, a mismatch, a cancelled context, an error from
// Progress.Ready — breaks the communicator: the mesh is aborted, so the
// peers fail promptly with this member's error as the reason ("member 0:
// failed: all_reduce #3 (...): ..."), and every later call fails at once
// with an error wrapping ErrBroken: "bridge broken by an earlier failure:
// <cause>". A point-to-point Send breaks it likewise when the transport failed
// or the message went out only in part; a Recv that times out does not.
//
// A peer that stops sending or never calls makes the call time out:
//
//	all_reduce #3 (float32 sum, 4 KiB): timed out after 5s waiting for member 1 (nothing received from it in this collective)
//
// In a ring or a barrier of three or more members a member waits on its
// neighbour, which may itself be waiting on the member at fault. A member
// whose own timeout points at a member that did send (or at a later barrier
// round) waits a short grace (a tenth of the timeout, 50 ms to 2 s) for
// another member's abort before reporting its own view, so the members
// usually all report the member that was not there. In recursive doubling
// a member whose first-round partner sent nothing waits half that grace:
// the partner never came, or waits for its extra member, whose fold
// partner then reports at once. Likewise a member whose
// data stream to a peer breaks waits up to that grace for the peer's abort
// message on the control stream, so it reports why the peer failed rather
// than only that its connection closed.
//
// When a peer's control stream ends (it closed, died or aborted), the
// collective in progress is left to finish or fail on its data streams —
// the peer may have closed right after finishing that very collective —
// and messages that arrived from it whole can still be received; but
// waiting Recvs and barriers on that peer fail, and the next collective
// fails at once and breaks the bridge, so nobody waits for a member that
// refuses.
//
// Close ends the communicator: calls in progress fail with ErrClosed, the
// mesh is closed, and the per-peer reader goroutines end before Close
// returns. No goroutine of a call outlives it.
package collective
