"""Step 4: the bridged all_reduce over every rank (the gpubridge backend:
island reduce, bridge, island broadcast) against the all-native all_reduce
inside each island (NCCL on NVIDIA, RCCL on AMD: a new_group of the
island's ranks with backend "nccl"), over a sweep of sizes. Needs GPUs.

Per size: --warmup untimed calls, then --iters timed calls back to back;
time = the slowest rank's mean (islands run their native all_reduce at the
same time, as in training). algbw = bytes / time, busbw = algbw * 2(n-1)/n
(nccl-tests' factor, n the ranks of the call). An island of one rank has
nothing to reduce: its row says so, and the bridged/native ratio takes the
islands of two or more ranks only. After timing, each size is checked
exactly (every rank adds rank+1: the sum is exact in float32).

Rank 0 prints one row per size (gpubridge.kit-sweep/v1) and a summary
(gpubridge.kit-sweep-summary/v1; not_run when the job has no GPUs). Exit
0 ran and exact, 1 a result was wrong or a collective failed, 2 could not
run.
"""

from __future__ import annotations

# ruff: noqa: E402 - --help answers before torch is imported
import argparse
import sys
import time
from typing import Any


def parse_size(s: str) -> int:
    units = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}
    s = s.strip().upper().removesuffix("B")
    return int(s[:-1]) * units[s[-1]] if s and s[-1] in units else int(s)


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description="Step 4: bridged all_reduce vs all-native in each island")
    p.add_argument(
        "--sizes", default="4K,64K,1M,16M,64M,256M,1G", help="bytes, comma-separated, K/M/G suffixes"
    )
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--timeout", type=float, default=600, help="seconds, for the process group")
    return p.parse_args()


if __name__ == "__main__":
    ARGS = parse_args()

import torch
import torch.distributed as dist

import kitdist
from kitcommon import emit, log


def timed(x: torch.Tensor, iters: int, warmup: int, group: Any) -> float:
    """Mean seconds per all_reduce on this rank."""
    for _ in range(warmup):
        dist.all_reduce(x, group=group)
    torch.cuda.synchronize()
    dist.barrier()
    t0 = time.perf_counter()
    for _ in range(iters):
        dist.all_reduce(x, group=group)
    torch.cuda.synchronize()
    return (time.perf_counter() - t0) / iters


def figures(nbytes: int, seconds: float, n: int) -> dict[str, Any]:
    alg = nbytes / seconds / 1e9
    return {
        "ranks": n,
        "time_us": round(seconds * 1e6, 2),
        "algbw_gbps": round(alg, 4),
        "busbw_gbps": round(alg * 2 * (n - 1) / n, 4),
    }


def main() -> int:
    args = ARGS
    t0 = time.monotonic()
    job = kitdist.start(args.timeout)
    if job.topo.get("mode") != "gpu" or job.device.type != "cuda":
        if job.lead:
            emit(
                {
                    "schema": "gpubridge.kit-sweep-summary/v1",
                    "not_run": True,
                    "ok": True,
                    "reason": f"needs GPUs: the job runs in {job.topo.get('mode')} mode "
                    f"({job.topo.get('run_kind')})",
                }
            )
        dist.destroy_process_group()
        return 0
    islands = job.topo["islands"]
    # Every rank creates every island's native group, in the same order.
    groups = {i["label"]: dist.new_group(ranks=i["ranks"], backend="nccl") for i in islands}
    mine = next(i for i in islands if job.rank in i["ranks"])
    dev = job.device
    exact = True
    rows = []
    for nbytes in [parse_size(s) for s in args.sizes.split(",") if s.strip()]:
        n = max(1, nbytes // 4)
        x = torch.zeros(n, dtype=torch.float32, device=dev)
        t_bridged = timed(x, args.iters, args.warmup, None)
        t_native = timed(x, args.iters, args.warmup, groups[mine["label"]])
        times = torch.tensor([t_bridged, t_native], dtype=torch.float64, device=dev)
        per_rank = torch.zeros(job.world, 2, dtype=torch.float64, device=dev)
        per_rank[job.rank] = times
        dist.all_reduce(per_rank)
        x.fill_(float(job.rank + 1))
        dist.all_reduce(x)
        ok = bool(torch.all(x == float(job.world * (job.world + 1) // 2)).item())
        flag = torch.tensor([0 if ok else 1], device=dev)
        dist.all_reduce(flag)
        exact = exact and int(flag.item()) == 0
        if job.lead:
            pr = per_rank.cpu()
            native = []
            for i in islands:
                t = max(float(pr[r, 1]) for r in i["ranks"])
                native.append(
                    {"island": i["label"], "backend": i["backend"], **figures(n * 4, t, len(i["ranks"]))}
                )
            bridged = figures(n * 4, float(pr[:, 0].max()), job.world)
            # An island of one rank reduces nothing: no time to compare with.
            multi = [nat["time_us"] for nat in native if nat["ranks"] > 1]
            slowest = max(multi) if multi else 0.0
            row = {
                "schema": "gpubridge.kit-sweep/v1",
                "bytes": n * 4,
                "dtype": "float32",
                "iters": args.iters,
                "bridged": bridged,
                "native": native,
                "bridged_over_native": round(bridged["time_us"] / slowest, 3) if slowest > 0 else None,
                "exact": int(flag.item()) == 0,
            }
            rows.append(row)
            emit(row)
            log(
                f"{n * 4:>12} B: bridged {bridged['busbw_gbps']:8.2f} GB/s busbw "
                f"({bridged['time_us']:.0f} us); "
                + ", ".join(
                    f"{nat['island']} {nat['busbw_gbps']:.2f} GB/s ({nat['time_us']:.0f} us)"
                    for nat in native
                )
            )
    if job.lead:
        big = rows[-1] if rows else None
        if not exact:
            bad = [r["bytes"] for r in rows if not r["exact"]]
            reason = f"all_reduce result wrong at sizes {bad} bytes"
        elif big:
            b = big["bridged"]
            reason = (
                f"{len(rows)} sizes exact; at {big['bytes'] >> 20} MiB the bridged all_reduce over "
                f"{job.world} ranks: {b['busbw_gbps']:.2f} GB/s busbw ({b['time_us']:.0f} us)"
            )
            if big["bridged_over_native"] is None:
                reason += "; every island has one rank: no native all_reduce to compare with"
            else:
                nat = ", ".join(
                    f"{v['island']} {v['busbw_gbps']:.2f} GB/s" for v in big["native"] if v["ranks"] > 1
                )
                reason += (
                    f", native in the islands: {nat}; bridged takes {big['bridged_over_native']}x "
                    "the slowest island's time"
                )
        else:
            reason = "no sizes given"
        emit(
            {
                "schema": "gpubridge.kit-sweep-summary/v1",
                "ok": exact and bool(rows),
                "reason": reason,
                **job.summary(),
                "seconds": round(time.monotonic() - t0, 2),
            }
        )
    dist.destroy_process_group()
    return 0 if exact else 1


if __name__ == "__main__":
    sys.exit(kitdist.run_main(main))
