"""A rank of a test job of the all_reduce policies (run by torchrun from
test_policies.py).

argv: VENDORS OUTDIR POLICY [MODE [THRESHOLDS]]. VENDORS as in backend_worker.py
(VENDOR:NAME for a third island); POLICY goes to GPUBRIDGE_POLICY ("rank1:P"
gives rank 1 policy P and the others "sharded": a mismatch). MODE:

- ``check`` (default): all_reduces of every op over a few dtypes and sizes,
  bit for bit against a flat Gloo group (small integers: exact in any
  order), and of random float32 data bit for bit against the policy's
  documented reference order (gpubridge._policies), computed here from
  every rank's input, and the same on every rank;
- ``tiny``: a 4-byte and a 4000-byte all_reduce (the thresholds file
  THRESHOLDS sends the first flat);
- ``leaders``: all_reduces of a few sizes only.

Writes OUTDIR/rank<R>.json: {"ok": true, ...} or {"error": text}.
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
policy = sys.argv[3]
mode = sys.argv[4] if len(sys.argv) > 4 else "check"
os.environ["GPUBRIDGE_VENDOR"], _, island = vendors[rank].partition(":")
if island:
    os.environ["GPUBRIDGE_SIM_ISLAND"] = island
if policy.startswith("rank1:"):
    policy = policy.removeprefix("rank1:") if rank == 1 else "sharded"
os.environ["GPUBRIDGE_POLICY"] = policy
if len(sys.argv) > 5:
    os.environ["GPUBRIDGE_THRESHOLDS"] = sys.argv[5]

import gpubridge  # noqa: E402,F401  (registers the backend)

DTYPES = [torch.float32, torch.bfloat16, torch.int64, torch.uint8]
OPS = [dist.ReduceOp.SUM, dist.ReduceOp.AVG, dist.ReduceOp.MAX, dist.ReduceOp.MIN]
SMALL_BYTES = 32 << 10  # gbbridge's recursive doubling up to here (lib/collective)


def data(dtype: torch.dtype, n: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    hi = {torch.uint8: 10, torch.bfloat16: 50}.get(dtype, 200)
    lo = 0 if dtype == torch.uint8 else -hi
    return torch.randint(lo, hi, (n,), generator=g).to(dtype)


def same(a: torch.Tensor, b: torch.Tensor, what: str) -> None:
    if not torch.equal(a.reshape(-1).view(torch.uint8), b.reshape(-1).view(torch.uint8)):
        diff = (a != b).nonzero()[:4].view(-1).tolist()
        raise AssertionError(f"rank {rank}: {what}: differ at {diff}: {a[diff]} != {b[diff]}")


# ---- the documented reference orders (gpubridge._policies, lib/collective) ----


def rd(xs: list[torch.Tensor]) -> torch.Tensor:
    """Recursive doubling: extras folded into r - p, then a balanced tree."""
    n, p = len(xs), 1 << (len(xs).bit_length() - 1)
    part = [xs[r] + xs[r + p] if r + p < n else xs[r] for r in range(p)]
    bit = 1
    while bit < p:
        part = [part[min(r, r ^ bit)] + part[max(r, r ^ bit)] for r in range(p)]
        bit <<= 1
    return part[0]


def ring(xs: list[torch.Tensor]) -> torch.Tensor:
    """The ring: segment j is ((x[j+1] + x[j+2]) + ...) + x[j]."""
    n, e = len(xs), xs[0].numel()
    seg = -(-e // n)
    out = torch.empty_like(xs[0])
    for j in range(n):
        a, b = min(e, j * seg), min(e, (j + 1) * seg)
        acc = xs[(j + 1) % n][a:b].clone()
        for t in range(2, n + 1):
            acc = acc + xs[(j + t) % n][a:b]
        out[a:b] = acc
    return out


def bridge(xs: list[torch.Tensor]) -> torch.Tensor:
    """gbbridge's all_reduce (SUM) of the members' buffers, in member order."""
    if len(xs) == 2:
        return xs[0] + xs[1]
    return rd(xs) if xs[0].numel() * xs[0].element_size() <= SMALL_BYTES else ring(xs)


def reference(got: str, xs: list[torch.Tensor], islands: list[list[int]], members: list[int]) -> torch.Tensor:
    """What policy got gives for every rank's input xs (islands of at most
    two ranks: an island's reduce and reduce_scatter are a single a + b)."""
    by_member = [next(i for i in islands if m in i) for m in members]
    if got == "flat":
        return bridge(xs)
    partial = [xs[i[0]] + xs[i[1]] if len(i) == 2 else xs[i[0]] for i in by_member]
    if got == "reduce-bridge-broadcast":
        return bridge(partial)
    k, e = len(by_member[0]), xs[0].numel()
    s = -(-e // k)
    out = torch.empty_like(xs[0])
    for i in range(k):
        out[i * s : (i + 1) * s] = bridge([p[i * s : (i + 1) * s] for p in partial])
    return out


def check(world: int, flat: object, topo: dict, pg: object) -> int:
    checks = 0
    for dtype in DTYPES:
        for op in [o for o in OPS if dtype.is_floating_point or o != dist.ReduceOp.AVG]:
            for n in (1, 1001, 9001):  # 9001 float32: over SMALL_BYTES (the ring)
                x = data(dtype, n, seed=1000 * rank + n)
                ref = x.clone()
                dist.all_reduce(ref, op=dist.ReduceOp.SUM if op == dist.ReduceOp.AVG else op, group=flat)
                if op == dist.ReduceOp.AVG:
                    ref.div_(world)
                dist.all_reduce(x, op=op)
                same(x, ref, f"all_reduce {dtype} {op} n={n}")
                checks += 1
    islands = [i["ranks"] for i in topo["islands"]]
    members = [int(m) for m in topo["bridge"]["members"]]
    for n in (3, 1001, 9001):
        g = torch.Generator().manual_seed(7 * n + rank)
        x = torch.randn(n, generator=g, dtype=torch.float32) * 1e3
        xs = [torch.empty_like(x) for _ in range(world)]
        dist.all_gather(xs, x, group=flat)
        before = dict(pg.stats()["all_reduce_policies"])  # type: ignore[attr-defined]
        dist.all_reduce(x)
        after = pg.stats()["all_reduce_policies"]  # type: ignore[attr-defined]
        ran = [p for p in after if after[p] != before.get(p, 0)]
        assert len(ran) == 1, (before, after)
        if max(len(i) for i in islands) <= 2:
            same(x, reference(ran[0], xs, islands, members), f"{ran[0]} float32 n={n} vs its order")
        every = [torch.empty_like(x) for _ in range(world)]
        dist.all_gather(every, x, group=flat)
        for r in range(world):
            same(every[r], x, f"float32 n={n}: rank {r}'s result")
        checks += 2
    return checks


def main() -> int:
    try:
        dist.init_process_group(backend="gpubridge")
    except RuntimeError as e:
        (outdir / f"rank{rank}.json").write_text(json.dumps({"error": str(e)}))
        return 3
    world = dist.get_world_size()
    pg = dist.distributed_c10d._get_default_group()
    flat = dist.new_group(backend="gloo")
    topo = pg.topology
    checks = 0
    if mode == "check":
        checks = check(world, flat, topo, pg)
    elif mode == "tiny":
        for n in (1, 1000):
            x = torch.full((n,), float(rank))
            dist.all_reduce(x)
            same(x, torch.full((n,), float(world * (world - 1) // 2)), f"all_reduce n={n}")
            checks += 1
    else:
        for n in (1, 1000, 100000):
            x = torch.full((n,), float(rank))
            dist.all_reduce(x)
            same(x, torch.full((n,), float(world * (world - 1) // 2)), f"all_reduce n={n}")
            checks += 1
    ep = pg._endpoint
    info = {
        "role": topo["self"]["role"],
        "islands": [i["ranks"] for i in topo["islands"]],
        "policies": pg.stats()["all_reduce_policies"],
        "fallbacks": pg.stats()["all_reduce_fallbacks"],
        "endpoint": ep is not None,
        "lazily_started": pg._endpoints.lazily_started,
        "bridges": ep.bridges if ep is not None else [],
    }
    dist.destroy_process_group()
    info["bridge_exit"] = pg.bridge_exit
    (outdir / f"rank{rank}.json").write_text(json.dumps({"ok": True, "checks": checks, **info}))
    return 0


if __name__ == "__main__":
    try:
        sys.exit(main())
    except Exception:
        (outdir / f"rank{rank}.json").write_text(json.dumps({"error": traceback.format_exc()}))
        raise
