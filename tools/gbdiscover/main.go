// Command gbdiscover is gpubridge's start-up agreement over the job's c10d
// store: every rank's record in, the same verdict and topology out. It also
// serves a c10d-compatible store for jobs without torch.
package main

import (
	"fmt"
	"os"
	"time"

	"github.com/gpubridge/gpubridge/lib/cli"
	"github.com/gpubridge/gpubridge/lib/discover"
)

type grammar struct {
	Run   runCmd   `cmd:"" default:"withargs" help:"Publish this rank's record, gather every rank's, print the topology (the default command)."`
	Serve serveCmd `cmd:"" help:"Serve a c10d-compatible TCPStore (the embedded store for jobs and tests without torch)."`
}

type runCmd struct {
	Store     string            `help:"The job's c10d store as HOST:PORT. Default: MASTER_ADDR:MASTER_PORT." env:"GPUBRIDGE_STORE" placeholder:"HOST:PORT"`
	Rank      *int              `help:"This rank's global rank, from 0 to the world size - 1." env:"GPUBRIDGE_RANK,RANK"`
	WorldSize *int              `help:"Number of ranks in the job." env:"GPUBRIDGE_WORLD_SIZE,WORLD_SIZE"`
	PID       int               `help:"The rank's process: gbdiscover claims the rank in the store for it, and a second process claiming the same rank (another job on the same store) fails naming it. Default: gbdiscover's parent process." env:"GPUBRIDGE_RANK_PID" placeholder:"PID"`
	LocalRank int               `help:"This rank's index on its node; picks its GPU. -1: unknown." env:"LOCAL_RANK,SLURM_LOCALID" default:"-1"`
	Namespace string            `help:"Key namespace of this job and attempt. Default: job-<TORCHELASTIC_RUN_ID or SLURM_JOB_ID or default>/attempt-<TORCHELASTIC_RESTART_COUNT or 0>." env:"GPUBRIDGE_NAMESPACE"`
	Timeout   time.Duration     `help:"Deadline of the whole discovery, store connection included." env:"GPUBRIDGE_DISCOVER_TIMEOUT" default:"60s"`
	Bridge    string            `help:"Bridge transport to ask for." enum:"auto,tcp,shm,verbs" env:"GPUBRIDGE_BRIDGE" default:"auto"`
	Vendor    string            `help:"Vendor of this rank's GPU stack (the torch build); auto takes the vendor of the node's GPUs." enum:"auto,nvidia,amd" default:"auto"`
	CPUOnly   bool              `help:"Run this rank on CPU (Gloo islands) while keeping real vendor detection." env:"GPUBRIDGE_CPU_ONLY"`
	SplitTest string            `help:"Label a single-vendor job as two vendors: half, alternate or node." env:"GPUBRIDGE_SPLIT_TEST" placeholder:"MODE"`
	Setting   map[string]string `help:"A policy setting that must be equal on every rank (repeatable)." placeholder:"KEY=VALUE" env:"GPUBRIDGE_SETTINGS"`
	Hostname  string            `help:"Host name a simulated rank reports, so processes on one machine can stand in for several nodes; ignored on GPUs." env:"GPUBRIDGE_SIM_HOSTNAME"`
	SimIsland string            `help:"In simulation, put this rank in island <vendor>-NAME instead of <vendor>, so one machine can stand in for three or more islands; ignored on GPUs." env:"GPUBRIDGE_SIM_ISLAND" placeholder:"NAME"`
	Probe     string            `help:"gbprobe --json output to read; - is stdin." default:"-" type:"path"`
	Problem   []string          `help:"A problem the caller found on this rank (repeatable); it goes into this rank's record, so every rank's discovery fails naming it. The torch plugin passes a bad LOCAL_RANK and missing tools this way." sep:"none" placeholder:"TEXT"`
}

func (c *runCmd) Run(env *cli.Env) error {
	o := discover.RunOptions{
		Store: c.Store, Rank: orUnset(c.Rank), WorldSize: orUnset(c.WorldSize), LocalRank: c.LocalRank, PID: c.PID,
		Namespace: c.Namespace, Timeout: c.Timeout, Bridge: c.Bridge, Vendor: c.Vendor,
		CPUOnly: c.CPUOnly, SplitTest: c.SplitTest, Settings: c.Setting, SimHostname: c.Hostname, SimIsland: c.SimIsland,
		Problems: c.Problem, Log: env.Log,
	}
	in := env.Stdin
	if c.Probe != "-" {
		f, err := os.Open(c.Probe)
		if err != nil {
			return cli.CannotRun(fmt.Errorf("open probe input: %w", err))
		}
		defer f.Close()
		in = f
	}
	return discover.RunCLI(env.Ctx, o, in, env.Stdout, env.Stderr)
}

func orUnset(p *int) int {
	if p == nil {
		return discover.Unset
	}
	return *p
}

type serveCmd struct {
	Listen        string `help:"Address to listen on; port 0 picks a free port (printed on stdout)." env:"GPUBRIDGE_STORE_LISTEN" default:"127.0.0.1:29500"`
	DieWithParent bool   `help:"Exit when the parent process dies (PR_SET_PDEATHSIG)." default:"true" negatable:""`
	MaxValueBytes int    `help:"Largest value a client may store." default:"8388608"`
	MaxTotalBytes int64  `help:"Memory bound of all keys and values together." default:"1073741824"`
}

func (c *serveCmd) Run(env *cli.Env) error {
	return discover.Serve(env.Ctx, discover.ServeOptions{
		Listen: c.Listen, DieWithParent: c.DieWithParent,
		MaxValueBytes: c.MaxValueBytes, MaxTotalBytes: c.MaxTotalBytes, Log: env.Log,
	}, env.Stdout)
}

var tool = cli.Tool{
	Name:    "gbdiscover",
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
