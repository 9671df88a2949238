// Command gbbridge is the bridge data plane between the island leaders of a
// gpubridge job. `gbbridge serve` runs on each leader, spawned and fed by
// the rank's torch plugin through a Unix socket and shared memory.
package main

import "github.com/gpubridge/gpubridge/lib/cli"

type grammar struct {
	Serve    serveCmd    `cmd:"" help:"Join the bridge as this rank's member and serve the plugin's feed (spawned by the torch plugin on each island leader)."`
	Selftest selftestCmd `cmd:"" help:"Check every collective, dtype and op, and point-to-point, bit for bit, on 2 and 4 members on this host (or as one member across hosts with --store); then a short bandwidth sweep."`
	Bench    benchCmd    `cmd:"" help:"Time a collective over sizes, nccl-tests style (size count type redop time algbw busbw #wrong algorithm)."`
}

var tool = cli.Tool{
	Name:    "gbbridge",
	Summary: "the bridge data plane between island leaders: collectives over TCP or shared memory, fed by the torch plugin",
	Description: `gbbridge carries the cross-vendor step of a gpubridge job: the island leaders (the lowest rank of each vendor's island, "bridge members") all-reduce, broadcast, all-gather, reduce-scatter and exchange tagged messages over TCP (several connections per pair of members) or same-host shared memory.

gbbridge serve runs on every leader. The rank's torch plugin spawns it with the topology gbdiscover printed, and a path for the feed socket in a private directory. serve finds this rank's member index among bridge.members (a rank that is not a leader, or a job whose bridge is "none", is refused), connects to the other members through the job's c10d store (--store, GPUBRIDGE_STORE or MASTER_ADDR:MASTER_PORT; keys under /gpubridge/<namespace>/bridge/), listens on the feed socket, prints one JSON line on stdout when ready, and accepts exactly one feed connection, which must come within --setup-timeout.

The feed (docs/FEED.md): control messages on the Unix socket (binary, little-endian, length-prefixed, versioned in HELLO/WELCOME, at most 64 KiB each) and data in shared-memory regions: the plugin creates a memfd sealed against shrinking, maps it, pins it (cudaHostRegister) so its GPU-to-host copy lands where gbbridge reads, and passes it with SCM_RIGHTS; gbbridge maps it. Requests (all_reduce, broadcast, all_gather, reduce_scatter, barrier, send, recv) name byte ranges of regions; a streamed request lets the plugin report its input chunk by chunk (READY) while gbbridge reports final result ranges (PROGRESS), so the copies overlap the wire. Collectives run one at a time in request order, the same order on every member; send and recv run alongside them. A bad request gets an error reply and the server keeps serving; a bridge failure is reported in the request's DONE, naming the peer, and every later request fails at once with that cause.

serve exits when the feed closes: 0 after BYE (or EOF with nothing in flight) if the bridge never failed. It dies with its parent (PR_SET_PDEATHSIG) and on SIGTERM or SIGINT, aborting the bridge so that the other members learn at once.

gbbridge selftest is for new nodes and new HCAs. With no arguments it starts an embedded store and runs 2 and then 4 members as processes on this host (shm, or tcp with --transport tcp): every collective × dtype × op, broadcast from several roots, all_gather, barrier and tagged point-to-point, at 1, 7, 1021, 65537 and 1048579 elements and at 64 MiB, on random data with NaN, ±Inf, -0 and denormals, each member checking its result bit for bit against the reference reduction in the documented order; then a short all_reduce bandwidth sweep. With --store HOST:PORT --rank R --world-size N, run on each host, it joins a selftest across hosts (tcp). Progress goes to stderr when it is a terminal.

gbbridge bench times one collective over sizes (default 8 B … 1 GiB) and prints nccl-tests' columns, or JSON lines with --json. busbw uses nccl-tests' factors: all_reduce 2(n-1)/n, all_gather and reduce_scatter (n-1)/n, broadcast 1. Every size is checked after timing (#wrong). Two anchors run through the same harness: --collective exchange (both members send each other the buffer over the bridge's streams, nothing reduced: the ceiling of a 2-member all_reduce) and --collective memcpy (one core copying the buffer). GPUBRIDGE_CPUPROFILE=FILE writes each member's CPU profile to FILE.<rank>.`,
	Output: `selftest: one JSON object {"schema": "gpubridge.selftest/v1", "version", "ok", "runs": [{"members", "transport", "cases", "failed", "failures": [{"case", "wrong_elements", "error"}], "bandwidth": [bench rows], "seconds"}]}; a member of a run across hosts (--store) prints its run's object on member 0 only.

bench: with --json one line per size {"schema": "gpubridge.bench/v1", "collective", "members", "transport", "size" (bytes), "count", "type", "redop", "root", "time_us", "algbw_gbps", "busbw_gbps", "wrong", "checked" (every row is checked element by element), "algorithm" (what ran: exchange, ring, chain or direct, where the members read each other's shared memory; exchange and memcpy for the anchors)}; without, nccl-tests' columns and the algorithm after "#" header lines. Over shm the buffers live in memory shared with the other members, as gbbridge serve's feed regions do. Member 0 prints; time is the slowest member's mean over --iters calls.

serve: one JSON line once the bridge is set up and the feed socket listens: {"schema": "gpubridge.bridge-serve/v1", "feed": PATH, "member": INDEX, "members": N, "rank": GLOBAL_RANK, "pid": PID, "transport": "tcp, 8 streams per peer, no crc", "feed_version": 1}. Nothing else goes to stdout; logs go to stderr (GPUBRIDGE_LOG_LEVEL). Fields may be added within v1.`,
	ExitCodes: []cli.ExitCode{
		{Code: cli.ExitOK, Meaning: "selftest: every check passed; bench: every size ran and was exact; serve: the feed closed cleanly (BYE, or EOF with no request in flight) and the bridge never failed"},
		{Code: cli.ExitFail, Meaning: "selftest: a check failed (stderr and the JSON say which); bench: a collective failed or a result was wrong; serve: the bridge failed during the session, the feed was lost with requests in flight, the client broke the feed protocol, or a signal (or the parent's death) stopped it; the cause is on stderr"},
		{Code: cli.ExitUsage, Meaning: "could not start: bad usage, members that could not set up the bridge, unreadable topology, this rank is not a bridge member, the store or a member unreachable, the bridge setup failed, or no feed connection within --setup-timeout"},
	},
	Examples: []cli.Example{
		{Command: "gbbridge selftest", Text: "Check this node: 2 and 4 members over shared memory, every collective, dtype and op, bit for bit."},
		{Command: "gbbridge selftest --store head:29500 --rank $SLURM_PROCID --world-size $SLURM_NTASKS", Text: "Check the network between nodes: one member per node (start gbdiscover serve --listen 0.0.0.0:29500 on head first)."},
		{Command: "gbbridge bench --members 2 --transport tcp --streams 8 --sizes 1M,64M,1G", Text: "all_reduce float32 sum over loopback TCP with 8 connections per pair."},
		{Command: "gbbridge bench --json --collective exchange --transport tcp --sizes 256M | jq .algbw_gbps", Text: "The ceiling the all_reduce is compared with: the raw exchange, in GB/s per direction."},
		{Command: "gbbridge serve --topology topo.json --feed /run/user/$UID/gpubridge.XXXX/feed.sock",
			Text: "What the plugin runs on a leader (store from MASTER_ADDR and MASTER_PORT); it reads the ready line, connects to the socket, says HELLO, and feeds."},
		{Command: "gbprobe --json | gbdiscover --store $MASTER_ADDR:$MASTER_PORT > topo.json && jq -e '.self.role == \"leader\"' topo.json && gbbridge serve --topology topo.json --feed $DIR/feed.sock --streams 8 --chunk 8M",
			Text: "Start-up of a leader by hand, with 8 connections per peer and 8 MiB chunks (every member must use the same chunk)."},
		{Command: "GPUBRIDGE_LOG_LEVEL=debug gbbridge serve --topology - --feed $DIR/feed.sock --crc --timeout 30s < topo.json",
			Text: "With CRC32C on every frame (every member must pass --crc), a 30 s limit per collective, and debug logs."},
	},
	SeeAlso: []string{"gbdiscover", "gbprobe"},
}

func main() { cli.Main(tool, &grammar{}) }
