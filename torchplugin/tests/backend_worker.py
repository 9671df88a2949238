"""A rank of a test job over the gpubridge backend (run by torchrun from
test_backend.py).

argv: VENDORS OUTDIR [MODE]. VENDORS is a comma-separated vendor per rank
(GPUBRIDGE_VENDOR is set from RANK before gpubridge initialises). The rank
writes OUTDIR/rank<R>.json: {"ok": true, "checks": n} or {"error": text}.
MODE "badbridge": rank 1 asks for another bridge transport.
"""

from __future__ import annotations

import json
import os
import sys
import traceback
from pathlib import Path

import torch
import torch.distributed as dist

rank = int(os.environ["RANK"])
vendors = sys.argv[1].split(",")
outdir = Path(sys.argv[2])
mode = sys.argv[3] if len(sys.argv) > 3 else ""
os.environ["GPUBRIDGE_VENDOR"] = vendors[rank]
if mode == "badbridge" and rank == 1:
    os.environ["GPUBRIDGE_BRIDGE"] = "tcp"

import gpubridge  # noqa: E402  (registers the backend)

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
OPS = [dist.ReduceOp.SUM, dist.ReduceOp.AVG, dist.ReduceOp.MAX, dist.ReduceOp.MIN]


def data(dtype: torch.dtype, n: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    # Small integers: every partial sum is exact in the dtype (bfloat16 holds
    # integers exactly up to 256), so sums agree in any order.
    hi = {torch.int8: 10, torch.uint8: 10, torch.bfloat16: 50, torch.float16: 50}.get(dtype, 200)
    lo = 0 if dtype == torch.uint8 else -hi
    return torch.randint(lo, hi, (n,), generator=g).to(dtype)


def same(a: torch.Tensor, b: torch.Tensor, what: str) -> None:
    if not torch.equal(a.view(-1).view(torch.uint8), b.view(-1).view(torch.uint8)):
        raise AssertionError(f"rank {rank}: {what}: {a[:8]} != {b[:8]}")


def main() -> int:
    try:
        dist.init_process_group(backend="gpubridge")
    except RuntimeError as e:
        (outdir / f"rank{rank}.json").write_text(json.dumps({"error": str(e)}))
        return 3
    world = dist.get_world_size()
    assert dist.get_backend() == "gpubridge", dist.get_backend()
    pg = dist.distributed_c10d._get_default_group()
    assert isinstance(pg, gpubridge.GpubridgeProcessGroup), type(pg)
    info = {
        "transport": pg.topology["bridge"]["transport"],
        "islands": [i["ranks"] for i in pg.topology["islands"]],
        "role": pg.topology["self"]["role"],
        "bridge_pid": pg._bridge.proc.pid if pg._bridge is not None else None,
    }
    flat = dist.new_group(backend="gloo")
    checks = 0
    for dtype in DTYPES:
        for op in OPS:
            if op == dist.ReduceOp.AVG and not dtype.is_floating_point:
                continue
            for n in (1, 1000, 70000):
                x = data(dtype, n, seed=1000 * rank + n)
                ref = x.clone()
                gop = dist.ReduceOp.SUM if op == dist.ReduceOp.AVG else op
                dist.all_reduce(ref, op=gop, group=flat)
                if op == dist.ReduceOp.AVG:
                    ref.div_(world)
                dist.all_reduce(x, op=op)
                same(x, ref, f"all_reduce {dtype} {op} n={n}")
                checks += 1
        for root in range(world):
            x = data(dtype, 3000, seed=77 + rank)
            ref = x.clone()
            dist.broadcast(ref, src=root, group=flat)
            dist.broadcast(x, src=root)
            same(x, ref, f"broadcast {dtype} root={root}")
            checks += 1
    dist.barrier()
    # Refusals: before any communication, the same on every rank.
    refused = []
    for what, fn in [
        ("PRODUCT", lambda: dist.all_reduce(torch.ones(4), op=dist.ReduceOp.PRODUCT)),
        ("non-contiguous", lambda: dist.all_reduce(torch.ones(4, 4).t())),
        ("dtype", lambda: dist.all_reduce(torch.ones(4, dtype=torch.bool))),
        ("allgather", lambda: dist.all_gather([torch.ones(2) for _ in range(world)], torch.ones(2))),
    ]:
        try:
            fn()
        except RuntimeError as e:
            refused.append(f"{what}: {e}")
        else:
            raise AssertionError(f"{what} was not refused")
    x = torch.full((5,), float(rank + 1))
    dist.all_reduce(x)  # still works after the refusals
    same(x, torch.full((5,), float(world * (world + 1) // 2)), "after refusals")
    dist.barrier()
    dist.destroy_process_group()  # says BYE to gbbridge serve and waits for its exit
    info["bridge_exit"] = pg.bridge_exit
    (outdir / f"rank{rank}.json").write_text(
        json.dumps({"ok": True, "checks": checks, "refused": refused, **info})
    )
    return 0


if __name__ == "__main__":
    try:
        sys.exit(main())
    except Exception:
        (outdir / f"rank{rank}.json").write_text(json.dumps({"error": traceback.format_exc()}))
        raise
