"""Measures the all_reduce policies on the live job and writes the
thresholds ``GPUBRIDGE_POLICY=auto`` uses (gpubridge._thresholds).

Usage (one process per rank, as the job runs)::

    torchrun ... -m gpubridge.tune --write-thresholds FILE [--sizes 4,64,4K,...] [--iters 20]

Every rank makes a gpubridge group as the job would (its environment:
GPUBRIDGE_VENDOR, the bridge, …; GPUBRIDGE_POLICY does not matter, each
call forces its policy), and a Gloo group for the bookkeeping. For each
size, float32 SUM all_reduces under reduce-bridge-broadcast, flat and (equal
islands of 2+ ranks) sharded take turns, a round of each at a time, every
result checked; a policy's time at a size is the slowest rank's median.
Then flat_max_bytes is the largest size up to which flat beat
reduce-bridge-broadcast at every size measured, and sharded_min_bytes the
smallest size from which sharded beat the others at every larger size (-1:
never). Rank 0 writes FILE (schema gpubridge.thresholds/v1, with every
measurement) and prints it on stdout; progress goes to stderr. Point
GPUBRIDGE_THRESHOLDS at FILE on every rank (discovery checks that all read
the same bytes).
"""

from __future__ import annotations

import argparse
import os
import socket
import statistics
import sys
import time
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from gpubridge._group import GpubridgeProcessGroup
from gpubridge._policies import shard_count
from gpubridge._policy import FLAT, RBB, SHARDED, parse_bytes
from gpubridge._thresholds import Thresholds

DEFAULT_SIZES = "4,64,1K,4K,16K,32K,64K,256K,1M,4M,16M"


def _timed(pg: GpubridgeProcessGroup, t: torch.Tensor, policy: str, iters: int, want: float) -> list[float]:
    """Seconds of each of iters all_reduces of t under policy."""
    out = []

    # On a GPU wait() returns once the work is queued on the stream: time
    # until the device is done, or the island steps go unmeasured.
    def sync() -> None:
        if t.is_cuda:
            torch.cuda.synchronize(t.device)

    for _ in range(iters):
        t.fill_(float(pg.rank() + 1))
        sync()
        a = time.perf_counter()
        pg.allreduce_with_policy(t, policy).wait()
        sync()
        out.append(time.perf_counter() - a)
    if not bool((t == want).all()):
        raise SystemExit(f"rank {pg.rank()}: {policy} all_reduce gave {t[:4].tolist()}, want {want}")
    return out


def pick(rows: list[dict[str, Any]]) -> Thresholds:
    """The thresholds of the measured rows (sizes ascending; each row has a
    median per policy in "us")."""
    flat_max = -1
    for r in rows:
        if r["us"][FLAT] < r["us"][RBB]:
            flat_max = r["bytes"]
        else:
            break
    sharded_min = -1
    for r in reversed(rows):
        us = r["us"]
        if SHARDED not in us or r["bytes"] <= flat_max or us[SHARDED] >= min(us[RBB], us[FLAT]):
            break
        sharded_min = r["bytes"]
    return Thresholds(flat_max, sharded_min)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m gpubridge.tune", description=__doc__.split("\n\n")[0])
    p.add_argument("--write-thresholds", metavar="FILE", required=True, help="where rank 0 writes them")
    p.add_argument("--sizes", default=DEFAULT_SIZES, help=f"bytes per all_reduce (default {DEFAULT_SIZES})")
    p.add_argument(
        "--iters", type=int, default=20, help="calls per policy and size, in 4 rounds (at least 4)"
    )
    p.add_argument("--timeout", type=int, default=600, help="seconds, for the process groups")
    args = p.parse_args(argv)
    sizes = sorted({max(4, parse_bytes(s) // 4 * 4) for s in args.sizes.split(",") if s.strip()})

    timeout = timedelta(seconds=args.timeout)
    dist.init_process_group(backend="gpubridge", timeout=timeout)
    pg = dist.group.WORLD
    if not isinstance(pg, GpubridgeProcessGroup):
        raise SystemExit("gpubridge.tune: the default group is not a gpubridge group")
    gloo = dist.new_group(backend="gloo", timeout=timeout)
    rank, world = pg.rank(), pg.size()
    lay = pg._layout
    if not lay.bridged:
        raise SystemExit("gpubridge.tune: the job has one island: no bridge to tune")
    policies = [RBB, FLAT] + ([SHARDED] if shard_count(lay) else [])
    want = float(world * (world + 1) // 2)
    rows = []
    for size in sizes:
        t = torch.empty(size // 4, dtype=torch.float32, device=pg.device)
        iters = max(4, min(args.iters, (256 << 20) // size))
        times: dict[str, list[float]] = {k: [] for k in policies}
        for k in policies:  # warm-up: endpoints, bridges, regions
            _timed(pg, t, k, 2, want)
        for rnd in range(4):
            for k in policies if rnd % 2 == 0 else reversed(policies):
                times[k] += _timed(pg, t, k, max(1, iters // 4), want)
        med = torch.tensor([statistics.median(times[k]) for k in policies], dtype=torch.float64)
        dist.all_reduce(med, op=dist.ReduceOp.MAX, group=gloo)
        us = {k: round(v * 1e6, 1) for k, v in zip(policies, med.tolist(), strict=True)}
        rows.append({"bytes": size, "iters": len(times[RBB]), "us": us})
        if rank == 0:
            line = ", ".join(f"{k} {v} us" for k, v in us.items())
            print(f"gpubridge.tune: {size} bytes: {line}", file=sys.stderr)
    th = pick(rows)
    if rank == 0:
        doc = th.to_json(
            {
                "world": world,
                "islands": [list(i.ranks) for i in lay.islands],
                "device": str(pg.device),
                "transport": pg.topology.get("bridge", {}).get("transport"),
                "host": socket.gethostname(),
                "cores": os.cpu_count(),
                "torch": torch.__version__,
                "measured": rows,
            }
        )
        with open(args.write_thresholds, "w") as f:
            f.write(doc)
        sys.stdout.write(doc)
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
