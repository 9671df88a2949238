// Command gbtrace reads gpubridge's per-collective trace records (and
// torch's Flight Recorder dumps) and answers what a slow or hung job needs:
// merged records, a summary, the hang, the stragglers, a Perfetto timeline.
package main

import (
	"github.com/gpubridge/gpubridge/lib/cli"
)

type grammar struct {
	Merge      mergeCmd      `cmd:"" help:"Every rank's record of each collective, aligned by group and sequence number, on one clock."`
	Summary    summaryCmd    `cmd:"" help:"Per op and size: count, p50/p99 time, algbw and busbw (nccl-tests), each phase's share."`
	Hang       hangCmd       `cmd:"" help:"From flight-recorder dumps: the last collective every rank completed, who never arrived at the next, where each rank is, mismatched calls."`
	Stragglers stragglersCmd `cmd:"" help:"Ranks that arrive late at the collectives, scored over windows, with the phase their time goes to; --hetero: on mixed hardware, degraded compute and slow links told from expected differences between hardware classes."`
	Perfetto   perfettoCmd   `cmd:"" help:"A Chrome trace (JSON) that opens in ui.perfetto.dev: a process per rank, tracks for collectives, phases, GPU phases."`
	FR         frCmd         `cmd:"" name:"fr" help:"Convert torch Flight Recorder dumps (JSON or pickle) into gpubridge trace records."`
	Simulate   simulateCmd   `cmd:"" help:"Simulated multi-rank traces with jitter and slowed ranks; --roc measures the straggler detector."`
}

var tool = cli.Tool{
	Name:    "gbtrace",
	Summary: "merge, summarize and analyse gpubridge's collective trace records (and torch Flight Recorder dumps)",
	Description: `A job run with GPUBRIDGE_TRACE=DIR writes DIR/rank-<r>.jsonl on every rank: one JSON record per collective (schema gpubridge.trace/v1, docs/TRACING.md): its group and sequence number (the same on every rank), op, bytes, dtype, the time the rank arrived (called it), its phases (island reduce, copy, bridge, copy back, island broadcast, ...) with start and end, and the result. Every rank also keeps its last GPUBRIDGE_TRACE_BUFFER records in memory, tracing on or off, and dumps them with what is in flight into GPUBRIDGE_TRACE_DUMP_DIR when a collective fails or times out, on SIGUSR1, or on gpubridge.dump_trace().

Every command reads files, directories (every file in them but hidden ones) or, with no path, stdin; trace files, dumps and torch's Flight Recorder dumps (the pickle files TORCH_NCCL_DUMP_ON_TIMEOUT writes, or the JSON of torch._C._distributed_c10d._dump_fr_trace_json()) are told apart by their content; a torch dump's rank is the number its file name ends in. Times are put on the reference rank's clock with each rank's offset, measured at set-up (ranks of one boot share the clock exactly; others are aligned within the error the rank's header states).

Output is JSON Lines on stdout, each line with a schema field, for jq; --format text prints a table for people. Logs go to stderr.`,
	Output: `merge: one line per collective, schema gpubridge.trace-merged/v1: group, seq, op, bytes, dtype, size (ranks in the group), seen (ranks with a record), complete, first_arrival, last_arrival, last_rank, end, time_ns (last arrival to last end), skew_ns, align_error_ns, mismatches, with gbbridge's parts of the leaders' records (docs/TRACING.md §7) bridge_start (the last leader's all_arrived: when the bridged step could start), bridge_waited_for (the rank the leaders waited for there) and bridge_wait_ns, ranks[] (rank, arrived, start, end, wait_ns, result, phases, and a leader's bridge).

summary: one line per op, group size and size bucket, schema gpubridge.trace-summary/v1: count, failed, bytes (median), time_p50_us, time_p99_us, algbw_gbps, busbw_gbps, wait_p50_us, phases (share of the ranks' time per phase).

hang: one line per group, schema gpubridge.trace-hang/v1: status (ok, hang, failed, mismatch), all_completed, first_incomplete, op, arrived, never_arrived, no_dump, furthest (the last seq any rank called), furthest_op, behind (ranks that never called it), where[] (rank, seq, op, state, step, error), mismatches[], verdict.

stragglers: one line per flagged rank and window (every window with --all), schema gpubridge.trace-straggler/v1: group, rank, window, first_seq, last_seq, score, threshold, confidence, late_us, sd_us, phase, flagged, and with bridge parts bridge_waited_for (the rank the leaders waited for most at the bridge over the window) and bridge_wait_us (per collective); then a line with kind "summary": windows, ranks, flagged.

stragglers --hetero: schema gpubridge.trace-hetero/v1. A line per hardware class (kind "class": class, ranks, expected_us_per_sample learned in the calibration, samples_per_s); a line per rank and window of steps, flagged ones only unless --all (kind "window": rank, class, window, first_step, last_step, samples, step_us, compute_us, ready_us, post_us, comm_us, wait_us, transfer_us, expected_us_per_sample, observed_us_per_sample, slowdown, score, link_slowdown, link_score, link, verdict (ok, degraded compute, slow link, calibrating), confidence, phases_us, flagged); a line per rank over the run (kind "rank": verdict, confidence, first_flagged_window, first_flagged_step, degraded_windows, slow_link_windows, expected and observed compute per sample, wait_us, transfer_us, samples); and a summary (kind "summary": ranks, classes, steps, windows, calibrate, degraded, slow_link).

perfetto: one JSON document (Chrome trace event format) on one line; otherData.schema is gpubridge.trace-perfetto/v1.

fr: gpubridge.trace/v1 records (a dump header, group and collective records per rank).

simulate: gpubridge.trace/v1 records of every rank (with --classes also step records and each rank's hardware class); with --roc one line per slowdown and threshold, schema gpubridge.trace-roc/v1 (with --classes gpubridge.trace-hetero-roc/v1).`,
	ExitCodes: []cli.ExitCode{
		{Code: cli.ExitOK, Meaning: "done; hang: every group completed everything and the ranks agree; stragglers: no rank flagged (--hetero: none degraded, no slow link)"},
		{Code: cli.ExitFail, Meaning: "hang: a collective is incomplete, failed, or called differently by the ranks; stragglers: a rank was flagged (--hetero: degraded compute or a slow link)"},
		{Code: cli.ExitUsage, Meaning: "could not run: bad usage, an unreadable or malformed input (the file and line are named), a limit exceeded"},
	},
	Examples: []cli.Example{
		{Command: "GPUBRIDGE_TRACE=trace torchrun --nproc-per-node 4 train.py\ngbtrace summary trace/ | jq -c '{op, bucket_label, count, time_p50_us, busbw_gbps}'",
			Text: "Trace a job, then the time and bus bandwidth per op and size."},
		{Command: "gbtrace summary trace/ | jq -r 'select(.op == \"all_reduce\") | .phases | to_entries | sort_by(-.value)[] | \"\\(.key) \\(.value)\"'",
			Text: "Where an all_reduce's time goes, by phase."},
		{Command: "gbtrace merge trace/ | jq -c 'select(.skew_ns > 1e6) | {seq, op, last_rank, skew_ms: (.skew_ns / 1e6)}'",
			Text: "Collectives some rank was more than 1 ms late to, and who."},
		{Command: "pkill -USR1 -f train.py; sleep 2; gbtrace hang /tmp/gpubridge-trace-$(id -u)/*/ | jq -r .verdict",
			Text: "A job that hangs: every rank dumps its flight recorder on SIGUSR1; who never arrived where."},
		{Command: "gbtrace stragglers --window 100 trace/ | jq -c 'select(.kind == \"straggler\") | {rank, window, score, late_us, phase}'",
			Text: "Ranks that keep the others waiting."},
		{Command: "gbtrace stragglers --hetero trace/ | jq -c 'select(.kind == \"rank\") | {rank, class, expected_us_per_sample, observed_us_per_sample, wait_us, verdict, confidence}'",
			Text: "A mixed job whose steps are marked (gpubridge.observe.step): per rank, its hardware class, expected and observed compute per sample, time waiting for peers, and the verdict."},
		{Command: "gbtrace perfetto trace/ > job.json   # open job.json in ui.perfetto.dev",
			Text: "A timeline of every rank."},
		{Command: "TORCH_NCCL_TRACE_BUFFER_SIZE=2000 TORCH_NCCL_DUMP_ON_TIMEOUT=1 TORCH_FR_DUMP_TEMP_FILE=/tmp/fr/rank_ torchrun ... ; gbtrace hang /tmp/fr/ | jq -r .verdict",
			Text: "A plain NCCL job: torch's Flight Recorder dumps, read directly."},
		{Command: "gbtrace simulate --ranks 64 --steps 10000 --jitter 0.05 --slow 7:0.02@5000 | gbtrace stragglers | jq -c 'select(.kind==\"summary\")'",
			Text: "A simulated job of 64 ranks where rank 7 is 2% slower from step 5000."},
		{Command: "gbtrace simulate --classes h100:32:1,mi300x:24:1.3,a100:8:2.1 --uniform --steps 2000 --slow 5:0.05@1000 | gbtrace stragglers --hetero | jq -c 'select(.kind==\"summary\")'",
			Text: "A simulated mixed job of three hardware classes where rank 5 computes 5% more from step 1000: degraded, and no class flagged for being slower than another."},
	},
	SeeAlso: []string{"gbbridge", "gbprobe", "gbdiscover"},
}

func main() { cli.Main(tool, &grammar{}) }
