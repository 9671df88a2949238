"""The anchor of gbbridge's benchmarks: torch Gloo all_reduce on host float32
tensors, N ranks on this host, the same sizes and row format as
`gbbridge bench --json` (schema gpubridge.bench/v1, transport "torch gloo").

Usage: python gloo_allreduce.py --members 2 --sizes 1M,16M --iters 5

--min-time S: where --iters calls take less than S seconds, times as many
calls again as fill it (the rule of `gbbridge bench --min-time`, at most
MAX_TIMED_CALLS); the row's iters says how many.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import socket
import sys
import time
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

MAX_TIMED_CALLS = 10000  # gbbridge bench's bound (harness.MaxTimedCalls)


def timed_calls(iters: int, min_time: float, per: float) -> int:
    """How many calls of per seconds fill min_time: at least iters, at most
    MAX_TIMED_CALLS."""
    if per <= 0:
        return max(iters, MAX_TIMED_CALLS)
    return max(iters, min(math.ceil(min_time / per), MAX_TIMED_CALLS))


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def worker(rank: int, n: int, port: int, sizes: list[int], iters: int, warmup: int, min_time: float) -> None:
    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=n, timeout=timedelta(seconds=300)
    )
    for size in sizes:
        count = max(size // 4, 1)
        t = torch.full((count,), float(rank + 1), dtype=torch.float32)
        for _ in range(warmup):
            dist.all_reduce(t)
        timed = iters
        while True:
            dist.barrier()
            start = time.perf_counter()
            for _ in range(timed):
                dist.all_reduce(t)
            slowest = torch.tensor([(time.perf_counter() - start) / timed], dtype=torch.float64)
            dist.all_reduce(slowest, op=dist.ReduceOp.MAX)  # every rank gets the same count
            mean = float(slowest.item())
            if min_time <= 0 or timed * mean >= min_time or timed >= MAX_TIMED_CALLS:
                break
            timed = timed_calls(timed, min_time, mean)
        t.fill_(float(rank + 1))
        dist.all_reduce(t)
        wrong = int((t != float(n * (n + 1) // 2)).sum())
        if rank == 0:
            sec = mean
            algbw = count * 4 / sec / 1e9
            print(
                json.dumps(
                    {
                        "schema": "gpubridge.bench/v1",
                        "collective": "all_reduce",
                        "members": n,
                        "transport": "torch gloo",
                        "size": count * 4,
                        "count": count,
                        "type": "float32",
                        "redop": "sum",
                        "time_us": sec * 1e6,
                        "algbw_gbps": algbw,
                        "busbw_gbps": algbw * 2 * (n - 1) / n,
                        "wrong": wrong,
                        "checked": True,
                        "iters": timed,
                    }
                ),
                flush=True,
            )
    dist.destroy_process_group()


def parse_size(s: str) -> int:
    """'4M' -> 4194304; plain bytes pass through (gbbridge bench's --sizes)."""
    units = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}
    s = s.strip()
    if s and s[-1].upper() in units:
        return int(s[:-1]) * units[s[-1].upper()]
    return int(s)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--members", type=int, default=2)
    p.add_argument(
        "--sizes", default="1M,16M,256M", help="bytes, comma-separated; K/M/G: powers of 1024, as gbbridge's"
    )
    p.add_argument("--iters", type=int, default=5)
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--min-time", type=float, default=0.0, help="seconds (0: --iters calls at every size)")
    a = p.parse_args()
    if a.min_time < 0:
        p.error("--min-time must be 0 or more")
    try:
        sizes = [parse_size(s) for s in a.sizes.split(",")]
    except ValueError as e:
        p.error(f"--sizes: {e}")
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    mp.start_processes(
        worker,
        args=(a.members, free_port(), sizes, a.iters, a.warmup, a.min_time),
        nprocs=a.members,
        start_method="spawn",
    )


if __name__ == "__main__":
    sys.exit(main())
