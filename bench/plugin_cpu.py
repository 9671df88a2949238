"""The plugin's own CPU per call (issue 16): a 4-byte all_reduce of CPU
ranks through the gpubridge backend (GPUBRIDGE_POLICY, flat unless set;
GPUBRIDGE_VENDOR: the first half of the ranks nvidia, the rest amd), in the
calling thread's CPU time, which a loaded machine's preemption does not
inflate. Two measurements, alternating in --rounds rounds:

- ``live``: every rank calls; each call's CPU is split around the feed
  request: before it (torch's call, the checks, the entry, the copy in),
  inside it (the feed client with its system calls and wake-up, as the
  kernel charges them) and after it (the copy back, the bookkeeping, the
  Work and its wait). Medians over the round's calls, rank 0's.
- ``stub``: rank 0 alone (the others wait in a Gloo barrier), its feed
  request answered at once with a DONE the bridge gave earlier: the
  whole call's CPU without the feed, warm (its caches are not someone
  else's between calls). Mean over the round's calls.

    torchrun --standalone --nproc-per-node 4 bench/plugin_cpu.py [OUT.jsonl]
        [--iters 2000] [--stub-iters 20000] [--rounds 5] [--size 4]

Rank 0 prints one JSON line (schema gpubridge.plugin-cpu/v1) on stdout and
appends it to OUT.jsonl when given. The feed request is wrapped by this
script (two clock reads a call), the same way before and after a change.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import sys
import time
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

SCHEMA = "gpubridge.plugin-cpu/v1"


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    p.add_argument("out", nargs="?", help="JSON lines file rank 0 appends to")
    p.add_argument("--iters", type=int, default=2000, help="live calls per round")
    p.add_argument("--stub-iters", type=int, default=20000, help="stub calls per round")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--warmup", type=int, default=300)
    p.add_argument("--size", type=int, default=4, help="bytes (float32 elements x 4)")
    a = p.parse_args()

    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    os.environ.setdefault("GPUBRIDGE_VENDOR", "nvidia" if rank < world // 2 else "amd")
    os.environ.setdefault("GPUBRIDGE_POLICY", "flat")
    import gpubridge  # noqa: PLC0415  (registers the backend; after the environment is set)

    dist.init_process_group(backend="gpubridge", timeout=timedelta(seconds=300))
    gloo = dist.new_group(backend="gloo")
    pg: Any = dist.group.WORLD
    t = torch.empty(max(1, a.size // 4), dtype=torch.float32)
    want = float(world * (world + 1) // 2)
    fill = float(rank + 1)
    t.fill_(fill)
    dist.all_reduce(t)  # a rank that leads no island starts its endpoint here (flat)
    ep = pg._endpoints.current
    if ep is None:
        raise SystemExit(f"rank {rank}: no endpoint after a call: the policy does not run flat here")
    feed = ep.feed
    request: Callable[..., Any] = feed.request
    clock = time.thread_time_ns
    marks: list[int] = []
    last: list[Any] = [None]

    def timed(*args: Any, **kw: Any) -> Any:
        marks.append(clock())
        try:
            d = last[0] = request(*args, **kw)
            return d
        finally:
            marks.append(clock())

    feed.request = timed
    for _ in range(a.warmup):
        t.fill_(fill)
        dist.all_reduce(t)
    if float(t[0]) != want:
        raise SystemExit(f"rank {rank}: all_reduce gave {t[0].item()}, want {want}")

    rounds: list[dict[str, float]] = []
    for _ in range(a.rounds):
        dist.barrier(group=gloo)
        before, inside, after = [], [], []
        p0, w0 = time.process_time_ns(), time.perf_counter_ns()
        for _ in range(a.iters):
            t.fill_(fill)
            marks.clear()
            c0 = clock()
            dist.all_reduce(t)
            c1 = clock()
            before.append(marks[0] - c0)
            inside.append(marks[1] - marks[0])
            after.append(c1 - marks[1])
        p1, w1 = time.process_time_ns(), time.perf_counter_ns()
        if float(t[0]) != want:
            raise SystemExit(f"rank {rank}: all_reduce gave {t[0].item()}, want {want}")
        row = {
            "live_before_us": statistics.median(before) / 1e3,
            "live_request_us": statistics.median(inside) / 1e3,
            "live_after_us": statistics.median(after) / 1e3,
            "live_process_cpu_us": (p1 - p0) / a.iters / 1e3,
            "live_wall_us": (w1 - w0) / a.iters / 1e3,
        }
        row["live_outside_request_us"] = row["live_before_us"] + row["live_after_us"]
        dist.barrier(group=gloo)
        if rank == 0:
            done = last[0]

            def answered(*args: Any, done: Any = done, **kw: Any) -> Any:
                return done

            feed.request = answered
            try:
                c0 = clock()
                for _ in range(a.stub_iters):
                    t.fill_(1.0)
                    dist.all_reduce(t)
                row["stub_call_us"] = (clock() - c0) / a.stub_iters / 1e3
            finally:
                feed.request = timed
            if float(t[0]) != 1.0:
                raise SystemExit(f"rank 0: stub all_reduce gave {t[0].item()}, want 1.0")
        rounds.append(row)
    dist.barrier(group=gloo)

    if rank == 0:
        keys = list(rounds[0])
        out = {
            "schema": SCHEMA,
            "policy": os.environ["GPUBRIDGE_POLICY"],
            "size": t.numel() * 4,
            "world": world,
            "rounds": a.rounds,
            "iters": a.iters,
            "stub_iters": a.stub_iters,
            "median_us": {k: round(statistics.median(r[k] for r in rounds), 2) for k in keys},
            "min_us": {k: round(min(r[k] for r in rounds), 2) for k in keys},
            "max_us": {k: round(max(r[k] for r in rounds), 2) for k in keys},
            "gpubridge": os.path.dirname(gpubridge.__file__),
            "commit": os.environ.get("GB_COMMIT", "unknown"),
            "host": socket.gethostname(),
            "cores": os.cpu_count(),
            "torch": torch.__version__,
        }
        line = json.dumps(out)
        print(line, flush=True)
        if a.out:
            with open(a.out, "a") as f:
                f.write(line + "\n")
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
