// Command gbdiscover is gpubridge's start-up agreement over the job's c10d
// store: every rank's record in, the same verdict and topology out. It also
// serves a c10d-compatible store for jobs without torch.
package main

import (
	"github.com/gpubridge/gpubridge/lib/cli"
	"github.com/gpubridge/gpubridge/lib/transport"
)

type grammar struct {
	Run   runCmd   `cmd:"" default:"withargs" help:"Publish this rank's record, gather every rank's, print the topology (the default command)."`
	Serve serveCmd `cmd:"" help:"Serve a c10d-compatible TCPStore (the embedded store for jobs and tests without torch)."`
}

var tool = cli.Tool{
	Name:    "gbdiscover",
	Vars:    map[string]string{"transports": transport.RequestableEnum()},
	Summary: "agree on the job's islands, leaders and bridge through the c10d store",
	Description: `Every rank runs gbprobe --json | gbdiscover. gbdiscover writes the rank's record (vendor or simulated vendor, probe summary, hostname, requested bridge, settings, version, the GPU the rank will use) under the job's namespace in the c10d TCPStore that torchrun or init_process_group created, reads every rank's record, and decides.

The decision is a pure function of the records, so every rank computes the same topology: islands (one per vendor, or per split-test label), their leaders (the lowest rank of each island), the bridge members and transport (auto picks shm when all leaders share a host, else tcp), and the run kind (gpu-mixed, gpu-single-vendor, split-test, cpu).

Any problem on any rank (a probe problem, a CPU/GPU mix, different bridge requests or settings, two ranks of one island on one GPU, no detectable vendor) gives every rank the same error listing every problem, naming ranks and hosts. A rank that never reports is named when the timeout passes. On failure rank 0, whose process may host the store, waits for the other ranks to read the verdict before it exits, within the same deadline.

The namespace must be fresh for every job and restart attempt: by default it is made from TORCHELASTIC_RUN_ID (or SLURM_JOB_ID) and TORCHELASTIC_RESTART_COUNT. Before anything else each rank claims its rank in the namespace for its process (--pid: host, pid and the process's start time). A second process claiming a rank another one holds (a second job that reached this job's store through the same MASTER_PORT, without a run id) fails naming the pid and host holding it; if the exchange has not decided yet, every rank fails with that message rather than start with a stranger among its peers. The same process may run discovery again.`,
	Output: `run: on success one JSON object, schema "gpubridge.topology/v1": namespace, world_size, run_kind, mode (gpu or cpu), simulated, split_test, version, settings, islands[] (label, vendor, backend, ranks, leader, hosts), bridge (members, hosts, requested, transport, reason), ranks[] (rank, local_rank, hostname, island, role, gpu), digest (equal on every rank for the same job), self (this rank's entry). On failure one JSON object {"schema": "gpubridge.discover-failure/v1", "namespace", "problems": [...]}, and the same problems on stderr.

serve: one JSON line {"schema": "gpubridge.store-serve/v1", "listen": "HOST:PORT"} once the store listens; logs on stderr.`,
	ExitCodes: []cli.ExitCode{
		{Code: cli.ExitOK, Meaning: "run: the job can start and the topology is on stdout; serve: stopped by SIGINT or SIGTERM"},
		{Code: cli.ExitFail, Meaning: "run: the job cannot start; every rank prints the same problems"},
		{Code: cli.ExitUsage, Meaning: "could not run: bad usage, unreadable probe input, the store unreachable or failing"},
	},
	Examples: []cli.Example{
		{Command: "gbprobe --json | gbdiscover --store $MASTER_ADDR:$MASTER_PORT --rank $RANK --world-size $WORLD_SIZE",
			Text: "Discover the topology of a torchrun job from inside one of its ranks."},
		{Command: "gbdiscover serve --listen 127.0.0.1:29500 &\nfor r in 0 1 2 3; do GPUBRIDGE_VENDOR=$([ $r -lt 2 ] && echo nvidia || echo amd) gbprobe --json | gbdiscover --store 127.0.0.1:29500 --rank $r --world-size 4 --namespace demo & done; wait",
			Text: "Four simulated ranks (2 NVIDIA, 2 AMD) against the embedded store."},
		{Command: "gbdiscover ... | jq -r '.islands[] | \"\\(.label): \\(.ranks)\"'", Text: "List the islands."},
	},
	SeeAlso: []string{"gbprobe", "gbbridge"},
}

func main() { cli.Main(tool, &grammar{}) }
