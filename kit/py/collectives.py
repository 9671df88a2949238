"""Step 3: every collective x dtype x op through the gpubridge backend, bit
for bit against the exact result.

Every rank's input is a closed-form function of (rank, index, seed) with
integer values small enough that every sum any reduction order can form is
exact in the dtype (|sum| <= 256 for bfloat16, 2048 for float16, 127 for
int8, ...). So the result has one right answer whatever order NCCL, RCCL,
Gloo and the bridge add in, and each rank computes it itself from the
formula: a wrong bit is a real fault (a lost chunk, a wrong dtype or op, a
misplaced block), never rounding. AVG is checked as the exact sum divided
once by the world size (the backend's documented AVG).

Checked: all_reduce (SUM, AVG, MAX, MIN) at each --sizes, reduce_scatter_tensor
and reduce_scatter (list), broadcast from the first and last rank, every island's
leader and the rank after it, all_gather_into_tensor and all_gather (list), barrier; on
float32, float64, bfloat16, float16, int32, int64, int8, uint8 (AVG on the
floating types only).

Rank 0 prints one JSON line per check (schema gpubridge.kit-collectives/v1)
and a summary (gpubridge.kit-collectives-summary/v1). Exit 0 all exact,
1 a check was wrong or a collective failed, 2 could not run.
"""

from __future__ import annotations

import argparse
import sys
import time
from typing import Any

import torch
import torch.distributed as dist

import kitdist
from kitcommon import emit

DTYPES = [
    torch.float32,
    torch.float64,
    torch.bfloat16,
    torch.float16,
    torch.int32,
    torch.int64,
    torch.int8,
    torch.uint8,
]
OPS = {"SUM": dist.ReduceOp.SUM, "AVG": dist.ReduceOp.AVG, "MAX": dist.ReduceOp.MAX, "MIN": dist.ReduceOp.MIN}
# The largest magnitude every partial sum must stay within to be exact.
EXACT = {
    torch.float32: 1 << 24,
    torch.float64: 1 << 53,
    torch.bfloat16: 256,
    torch.float16: 2048,
    torch.int32: (1 << 31) - 1,
    torch.int64: (1 << 62),
    torch.int8: 127,
    torch.uint8: 255,
}
BITS = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


class Data:
    """Rank r's input for a check: integers in [-h, h] ([0, h] for uint8),
    with h and the contributing ranks chosen so that no partial sum leaves
    the dtype's exact range."""

    def __init__(self, world: int, device: torch.device) -> None:
        self.world = world
        self.device = device

    def half_range(self, dtype: torch.dtype) -> int:
        return max(1, min(1000, EXACT[dtype] // self.world))

    def values(self, dtype: torch.dtype, n: int, rank: int, seed: int) -> torch.Tensor:
        """As int64 (exact), before the cast."""
        h = self.half_range(dtype)
        if rank >= max(1, EXACT[dtype] // h):  # past that many ranks, the rest add zeros
            return torch.zeros(n, dtype=torch.int64, device=self.device)
        i = torch.arange(n, dtype=torch.int64, device=self.device)
        span = h + 1 if dtype == torch.uint8 else 2 * h + 1
        v = (i * 2654435761 + (rank + 1) * 40503 + seed * 977) % span
        return v if dtype == torch.uint8 else v - h

    def input(self, dtype: torch.dtype, n: int, rank: int, seed: int) -> torch.Tensor:
        return self.values(dtype, n, rank, seed).to(dtype)

    def reduced(self, dtype: torch.dtype, n: int, seed: int, op: str) -> torch.Tensor:
        acc = self.values(dtype, n, 0, seed)
        for r in range(1, self.world):
            x = self.values(dtype, n, r, seed)
            if op in ("SUM", "AVG"):
                acc = acc + x
            elif op == "MAX":
                acc = torch.maximum(acc, x)
            else:
                acc = torch.minimum(acc, x)
        out = acc.to(dtype)
        if op == "AVG":
            out.div_(self.world)
        return out


class Checks:
    def __init__(self, rank: int) -> None:
        self.rank = rank
        self.names: list[dict[str, Any]] = []
        self.wrong: dict[int, dict[str, Any]] = {}

    def compare(self, got: torch.Tensor, want: torch.Tensor, **what: Any) -> None:
        idx = len(self.names)
        self.names.append(what)
        g = got.detach().reshape(-1).contiguous()
        w = want.detach().reshape(-1).contiguous().to(g.device)
        if g.dtype != w.dtype or g.numel() != w.numel():
            self.wrong[idx] = {"error": f"got {g.dtype} x {g.numel()}, want {w.dtype} x {w.numel()}"}
            return
        bits = BITS[g.element_size()]
        diff = g.view(bits) != w.view(bits)
        n = int(diff.sum().item())
        if n:
            i = int(diff.nonzero()[0].item())
            self.wrong[idx] = {"elements_wrong": n, "index": i, "got": g[i].item(), "want": w[i].item()}


def roots(job: kitdist.Job) -> list[int]:
    """The first and last rank, every island's leader, and the rank after
    each leader when it is in the same island (a root that is not a leader
    reaches the bridge through its island first)."""
    out = {0, job.world - 1}
    for i in job.topo["islands"]:
        lead = int(i["leader"])
        out.add(lead)
        if lead + 1 in i["ranks"]:
            out.add(lead + 1)
    return sorted(out)


def run(job: kitdist.Job, sizes: list[int], rs_size: int, ag_size: int) -> tuple[Checks, int]:
    rank, world, dev = job.rank, job.world, job.device
    data = Data(world, dev)
    checks = Checks(rank)
    seed = 0
    for dtype in DTYPES:
        dt = name(dtype)
        for opname, op in OPS.items():
            if opname == "AVG" and not dtype.is_floating_point:
                continue
            for n in sizes:
                seed += 1
                x = data.input(dtype, n, rank, seed)
                dist.all_reduce(x, op=op)
                checks.compare(
                    x,
                    data.reduced(dtype, n, seed, opname),
                    collective="all_reduce",
                    dtype=dt,
                    op=opname,
                    elements=n,
                )
            seed += 1
            inp = data.input(dtype, rs_size * world, rank, seed)
            want = data.reduced(dtype, rs_size * world, seed, opname)[rank * rs_size : (rank + 1) * rs_size]
            out = torch.empty(rs_size, dtype=dtype, device=dev)
            dist.reduce_scatter_tensor(out, inp, op=op)
            checks.compare(
                out, want, collective="reduce_scatter_tensor", dtype=dt, op=opname, elements=rs_size
            )
            out = torch.empty(rs_size, dtype=dtype, device=dev)
            dist.reduce_scatter(out, list(inp.chunk(world)), op=op)
            checks.compare(out, want, collective="reduce_scatter", dtype=dt, op=opname, elements=rs_size)
        for root in roots(job):
            seed += 1
            x = data.input(dtype, ag_size, rank, seed)
            dist.broadcast(x, src=root)
            checks.compare(
                x,
                data.input(dtype, ag_size, root, seed),
                collective="broadcast",
                dtype=dt,
                root=root,
                elements=ag_size,
            )
        seed += 1
        x = data.input(dtype, ag_size, rank, seed)
        want = torch.cat([data.input(dtype, ag_size, r, seed) for r in range(world)])
        out = torch.empty(world * ag_size, dtype=dtype, device=dev)
        dist.all_gather_into_tensor(out, x)
        checks.compare(out, want, collective="all_gather_into_tensor", dtype=dt, elements=ag_size)
        outs = [torch.empty(ag_size, dtype=dtype, device=dev) for _ in range(world)]
        dist.all_gather(outs, x)
        checks.compare(torch.cat(outs), want, collective="all_gather", dtype=dt, elements=ag_size)
    dist.barrier()
    return checks, len(checks.names)


def main() -> int:
    p = argparse.ArgumentParser(description="Step 3: every collective x dtype x op, bit for bit")
    p.add_argument(
        "--sizes",
        default="",
        help="all_reduce sizes in elements, comma-separated (default: 1,4097,3145729 on GPUs; 1,4097 on CPU)",
    )
    p.add_argument("--timeout", type=float, default=600, help="seconds, for the process group")
    args = p.parse_args()
    t0 = time.monotonic()
    job = kitdist.start(args.timeout)
    gpu = job.device.type == "cuda"
    sizes = [int(s) for s in args.sizes.split(",") if s] or ([1, 4097, 3 << 20 | 1] if gpu else [1, 4097])
    rs_size = 65537 if gpu else 1031
    ag_size = 50001 if gpu else 1031
    checks, total = run(job, sizes, rs_size, ag_size)
    if gpu:
        torch.cuda.synchronize()
    every = kitdist.gather_objects(checks.wrong, job.device)
    wrong: dict[int, dict[int, dict[str, Any]]] = {}
    for r, w in enumerate(every):
        for idx, detail in w.items():  # JSON made the check numbers strings
            wrong.setdefault(int(idx), {})[r] = detail
    if job.lead:
        for idx, what in enumerate(checks.names):
            bad = wrong.get(idx, {})
            emit(
                {
                    "schema": "gpubridge.kit-collectives/v1",
                    **what,
                    "ok": not bad,
                    "ranks_wrong": sorted(bad),
                    **({"first": bad[min(bad)]} if bad else {}),
                }
            )
        ops = {w.get("collective") for w in checks.names}
        summary = job.summary()
        islands = ", ".join(i["label"] + str(i["ranks"]) for i in summary["islands"])
        bridge = summary["bridge"]["transport"]
        where = f"{job.world} ranks, islands {islands}, bridge {bridge}, on {job.device.type}"
        if wrong:
            idx = min(wrong)
            desc = " ".join(f"{k}={v}" for k, v in checks.names[idx].items())
            first = wrong[idx][min(wrong[idx])]
            ranks = sorted(wrong[idx])
            reason = (
                f"{len(wrong)} of {total} checks wrong; first: {desc} on ranks {ranks}: {first} ({where})"
            )
        else:
            names = ", ".join(sorted(o for o in ops if o))
            reason = (
                f"{total} checks bit for bit ({names}; {len(DTYPES)} dtypes; "
                f"all_reduce sizes {sizes}; {where})"
            )
        emit(
            {
                "schema": "gpubridge.kit-collectives-summary/v1",
                "ok": not wrong,
                "checks": total,
                "failed": len(wrong),
                "sizes": sizes,
                "reason": reason,
                **summary,
                "seconds": round(time.monotonic() - t0, 2),
            }
        )
    dist.destroy_process_group()
    return 1 if wrong else 0


if __name__ == "__main__":
    sys.exit(kitdist.run_main(main))
