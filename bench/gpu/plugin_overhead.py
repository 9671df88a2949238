"""Per-call overhead of the gpubridge backend (issue 4): a 4-byte all_reduce
through dist.init_process_group("gpubridge") in simulation (CPU tensors;
GPUBRIDGE_VENDOR defaults to nvidia for the first half of the ranks and amd
for the rest) against torch Gloo's all_reduce of the same tensor over every
rank, in the same run (a Gloo group of the world made with
dist.new_group(backend="gloo") after init). One torchrun worker per rank.

Usage:
    torchrun --standalone --nproc-per-node 4 bench/gpu/plugin_overhead.py OUT.jsonl
        [--iters 2000] [--warmup 200] [--rounds 10] [--size 4] [--check-calls]
        [--policies flat,reduce-bridge-broadcast]

With --check-calls a second gpubridge group, made with GPUBRIDGE_CHECK_CALLS=1,
is timed in the same alternating blocks: the row then gives the call checks'
cost per call (check_calls_cost_median_us) against the same group without them.

With --policies, one more gpubridge group per policy, made with
GPUBRIDGE_POLICY set to it (the default group runs the job's own, auto
unless set), is timed in the same blocks: rows "policy:<name>";
--policies-first times those groups first in each block (the row's
"order"), to tell a group's own tail from its place in the block.

The groups are warmed up, then timed in --rounds alternating blocks (the
order flips every round, so drift and neighbours hit both alike); every call
is timed on its own with a monotonic clock, back to back, the tensor refilled
(untimed) before each call and checked after the last. The row gives median,
p90 and mean microseconds per call on rank 0 and the slowest rank's median,
and the ratios gpubridge / Gloo. Rank 0 appends one JSON line (schema
gpubridge.plugin-overhead/v1) to OUT.jsonl and prints a summary on stderr.
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import socket
import statistics
import sys
import time
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

SCHEMA = "gpubridge.plugin-overhead/v1"


def pct(xs: list[float], q: float) -> float:
    s = sorted(xs)
    return s[min(len(s) - 1, int(q * len(s)))]


def timed_calls(t: torch.Tensor, group: Any, n: int, fill: float) -> list[float]:
    """n all_reduces of t on group; microseconds of each."""
    out: list[float] = []
    clock = time.perf_counter_ns
    for _ in range(n):
        t.fill_(fill)
        a = clock()
        dist.all_reduce(t, group=group)
        out.append((clock() - a) / 1e3)
    return out


def main() -> int:
    p = argparse.ArgumentParser(description="per-call overhead: gpubridge vs Gloo, 4-byte all_reduce on CPU")
    p.add_argument("out", help="JSON lines file rank 0 appends to")
    p.add_argument("--iters", type=int, default=2000)
    p.add_argument("--warmup", type=int, default=200)
    p.add_argument("--rounds", type=int, default=10)
    p.add_argument("--size", type=int, default=4, help="bytes (float32 elements x 4)")
    p.add_argument("--timeout", type=int, default=300, help="seconds, for the process groups")
    p.add_argument(
        "--check-calls",
        action="store_true",
        help="also time a second gpubridge group made with GPUBRIDGE_CHECK_CALLS=1 (the cost of call checks)",
    )
    p.add_argument(
        "--policies",
        default="",
        help="comma-separated GPUBRIDGE_POLICY values: one more gpubridge group timed per policy",
    )
    p.add_argument("--policies-first", action="store_true", help="time --policies groups first")
    args = p.parse_args()

    rank = int(os.environ["RANK"])
    world = int(os.environ["WORLD_SIZE"])
    os.environ.setdefault("GPUBRIDGE_VENDOR", "nvidia" if rank < world // 2 else "amd")
    gb = importlib.import_module("gpubridge")
    endpoint = importlib.import_module("gpubridge._endpoint")
    dist.init_process_group(backend="gpubridge", timeout=timedelta(seconds=args.timeout))
    gloo = dist.new_group(backend="gloo", timeout=timedelta(seconds=args.timeout))
    groups: dict[str, Any] = {"gpubridge": None, "gloo": gloo}  # None: the default (gpubridge) group
    if args.check_calls:
        # Call checks are a group's setting, read when it is made.
        os.environ["GPUBRIDGE_CHECK_CALLS"] = "1"
        timeout = timedelta(seconds=args.timeout)
        groups["gpubridge_checked"] = dist.new_group(backend="gpubridge", timeout=timeout)
        os.environ["GPUBRIDGE_CHECK_CALLS"] = "0"
    for pol in [x for x in args.policies.split(",") if x]:
        # The policy is a group's setting, read when it is made.
        old = os.environ.get("GPUBRIDGE_POLICY")
        os.environ["GPUBRIDGE_POLICY"] = pol
        groups[f"policy:{pol}"] = dist.new_group(backend="gpubridge", timeout=timedelta(seconds=args.timeout))
        if old is None:
            del os.environ["GPUBRIDGE_POLICY"]
        else:
            os.environ["GPUBRIDGE_POLICY"] = old

    if args.policies_first:
        groups = {k: groups[k] for k in sorted(groups, key=lambda k: not k.startswith("policy:"))}
    t = torch.empty(max(1, args.size // 4), dtype=torch.float32)
    fill = float(rank + 1)
    want = float(world * (world + 1) // 2)
    for name, g in groups.items():
        timed_calls(t, g, args.warmup, fill)
        if not bool((t == want).all()):
            raise SystemExit(f"rank {rank}: {name} all_reduce gave {t[:4].tolist()}, want {want}")
    times: dict[str, list[float]] = {k: [] for k in groups}
    per_round = max(1, args.iters // args.rounds)
    for r in range(args.rounds):
        order = list(groups) if r % 2 == 0 else list(reversed(groups))
        for name in order:
            times[name] += timed_calls(t, groups[name], per_round, fill)
            if not bool((t == want).all()):
                raise SystemExit(f"rank {rank}: {name} all_reduce gave {t[:4].tolist()}, want {want}")

    stats: dict[str, dict[str, float]] = {}
    for name, xs in times.items():
        stats[name] = {
            "median_us": statistics.median(xs),
            "p90_us": pct(xs, 0.9),
            "p99_us": pct(xs, 0.99),
            "mean_us": statistics.fmean(xs),
            "min_us": min(xs),
        }
    # The slowest rank's median, per group (over Gloo: it measures nothing here).
    meds = torch.tensor([stats[k]["median_us"] for k in groups], dtype=torch.float64)
    dist.all_reduce(meds, op=dist.ReduceOp.MAX, group=gloo)
    for k, v in zip(groups, meds.tolist(), strict=True):
        stats[k]["slowest_rank_median_us"] = float(v)

    pg = dist.group.WORLD
    topo = getattr(pg, "topology", None)
    row: dict[str, Any] = {
        "schema": SCHEMA,
        "collective": "all_reduce",
        "size": t.numel() * 4,
        "type": "float32",
        "world": world,
        "vendors": os.environ.get("GPUBRIDGE_VENDOR"),
        "iters": per_round * args.rounds,
        "order": list(groups),  # of the first round's blocks (the next round reverses it)
        "warmup": args.warmup,
        "rounds": args.rounds,
        "gpubridge": stats["gpubridge"],
        "gloo": stats["gloo"],
        "ratio_median": stats["gpubridge"]["median_us"] / stats["gloo"]["median_us"],
        "ratio_p90": stats["gpubridge"]["p90_us"] / stats["gloo"]["p90_us"],
        "ratio_p99": stats["gpubridge"]["p99_us"] / stats["gloo"]["p99_us"],
        "ratio_slowest_rank_median": stats["gpubridge"]["slowest_rank_median_us"]
        / stats["gloo"]["slowest_rank_median_us"],
        "gpubridge_version": getattr(gb, "__version__", None),
        "commit": os.environ.get("GB_COMMIT", "unknown"),
        "host": socket.gethostname(),
        "cores": os.cpu_count(),
        "torch": torch.__version__,
        "spin_us": os.environ.get("GPUBRIDGE_SPIN_US"),  # as set; None: auto
        "tiny_spin_us": os.environ.get("GPUBRIDGE_TINY_SPIN_US"),  # as set; None: auto
        # What those resolved to on this rank: serve's --spin-us and
        # --tiny-spin-us, which the feed client spins too (None: serve's
        # defaults, no spin in the client).
        "resolved_spin_us": endpoint.spin_us(),
        "resolved_tiny_spin_us": endpoint.tiny_spin_us(),
    }
    if "gpubridge_checked" in stats:
        c = stats["gpubridge_checked"]
        row["gpubridge_checked"] = c
        row["check_calls_cost_median_us"] = c["median_us"] - stats["gpubridge"]["median_us"]
        row["check_calls_ratio_median"] = c["median_us"] / stats["gpubridge"]["median_us"]
    for k in groups:
        if k.startswith("policy:"):
            row[k] = stats[k]
            row[f"{k}:ratio_median"] = stats[k]["median_us"] / stats["gloo"]["median_us"]
            row[f"{k}:ratio_p99"] = stats[k]["p99_us"] / stats["gloo"]["p99_us"]
    if isinstance(topo, dict):
        row["islands"] = [i.get("ranks") for i in topo.get("islands", [])]
        row["bridge"] = (topo.get("bridge") or {}).get("transport")
        row["run_kind"] = topo.get("run_kind")
    stats_fn = getattr(pg, "stats", None)
    if callable(stats_fn):
        try:
            row["backend_stats"] = json.loads(json.dumps(stats_fn(), default=str))
        except Exception as e:  # best effort: optional in the backend
            row["backend_stats"] = {"error": repr(e)}
    if rank == 0:
        del row["vendors"]
        with open(args.out, "a") as f:
            f.write(json.dumps(row) + "\n")
        g, o = stats["gpubridge"], stats["gloo"]
        print(
            f"plugin_overhead: {world} ranks, {row['size']}-byte all_reduce x {row['iters']}: "
            f"gpubridge median {g['median_us']:.1f} us p90 {g['p90_us']:.1f} us; "
            f"gloo median {o['median_us']:.1f} us p90 {o['p90_us']:.1f} us; "
            f"ratio median {row['ratio_median']:.2f}x p90 {row['ratio_p90']:.2f}x p99 {row['ratio_p99']:.2f}x"
            + "".join(
                f"; {k} median {stats[k]['median_us']:.1f} us p99 {stats[k]['p99_us']:.1f} us"
                for k in groups
                if k.startswith("policy:")
            )
            + (
                f"; with call checks median {row['gpubridge_checked']['median_us']:.1f} us "
                f"(+{row['check_calls_cost_median_us']:.1f} us)"
                if "gpubridge_checked" in row
                else ""
            ),
            file=sys.stderr,
        )
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
