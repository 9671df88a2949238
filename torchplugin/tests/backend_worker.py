"""A rank of a test job over the gpubridge backend (run by torchrun from
test_backend.py).

argv: VENDORS OUTDIR [MODE]. VENDORS is a comma-separated vendor per rank
(VENDOR:NAME puts the rank in the simulated island VENDOR-NAME)
(GPUBRIDGE_VENDOR is set from RANK before gpubridge initialises). The rank
writes OUTDIR/rank<R>.json: {"ok": true, "checks": n} or {"error": text}.
MODE "badbridge": rank 1 asks for another bridge transport; "mismatch-op":
rank 1 all-reduces with MAX while the others use SUM; "mismatch-size": rank 1
all-reduces 5 elements, the others 4 (the job runs with
GPUBRIDGE_CHECK_CALLS=1, which must catch both); "zstd": the job compresses
every bridged collective with zstd (GPUBRIDGE_COMPRESSION), every check
still bit for bit; the result counts the records of each codec.
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
# VENDOR or VENDOR:ISLAND (a simulated island name, for three islands)
# ("real": leave the vendor to detection, as in a CPU-only run on GPU nodes)
os.environ["GPUBRIDGE_VENDOR"], _, island = vendors[rank].partition(":")
if os.environ["GPUBRIDGE_VENDOR"] == "real":
    del os.environ["GPUBRIDGE_VENDOR"]
if island:
    os.environ["GPUBRIDGE_SIM_ISLAND"] = island
if mode == "badbridge" and rank == 1:
    os.environ["GPUBRIDGE_BRIDGE"] = "tcp"
if mode == "zstd":
    os.environ["GPUBRIDGE_COMPRESSION"] = "zstd"

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


def ref_reduce(x: torch.Tensor, op: object, flat: object) -> None:
    """The flat Gloo group's all_reduce, AVG as a SUM divided once."""
    gop = dist.ReduceOp.SUM if op == dist.ReduceOp.AVG else op
    dist.all_reduce(x, op=gop, group=flat)
    if op == dist.ReduceOp.AVG:
        x.div_(dist.get_world_size())


def run_checks(world: int, flat: object) -> int:
    """Every collective x dtype x op through the backend, bit for bit against
    the flat Gloo group on the same data."""
    checks = 0
    for dtype in DTYPES:
        ops = [op for op in OPS if dtype.is_floating_point or op != dist.ReduceOp.AVG]
        for op in ops:
            for n in (1, 1000, 70000):
                x = data(dtype, n, seed=1000 * rank + n)
                ref = x.clone()
                ref_reduce(ref, op, flat)
                dist.all_reduce(x, op=op)
                same(x, ref, f"all_reduce {dtype} {op} n={n}")
                checks += 1
            # reduce_scatter_tensor and the list form
            n = 777
            inp = data(dtype, n * world, seed=31 * rank + 5)
            ref = inp.clone()
            ref_reduce(ref, op, flat)
            out = torch.empty(n, dtype=dtype)
            dist.reduce_scatter_tensor(out, inp, op=op)
            same(out, ref[rank * n : (rank + 1) * n], f"reduce_scatter_tensor {dtype} {op}")
            out2 = torch.empty(n, dtype=dtype)
            dist.reduce_scatter(out2, list(inp.chunk(world)), op=op)
            same(out2, out, f"reduce_scatter {dtype} {op}")
            checks += 2
        # coalesced all_reduce (the coalescing manager gathers the calls)
        xs = [data(dtype, k, seed=rank * 7 + k) for k in (3, 1000, 17)]
        refs = [x.clone() for x in xs]
        for r in refs:
            ref_reduce(r, dist.ReduceOp.SUM, flat)
        with dist._coalescing_manager(async_ops=True) as cm:
            for x in xs:
                dist.all_reduce(x)
        cm.wait()
        for x, r in zip(xs, refs, strict=True):
            same(x, r, f"coalesced all_reduce {dtype}")
        checks += 1
        for root in range(world):
            x = data(dtype, 3000, seed=77 + rank)
            ref = x.clone()
            dist.broadcast(ref, src=root, group=flat)
            dist.broadcast(x, src=root)
            same(x, ref, f"broadcast {dtype} root={root}")
            checks += 1
        for n in (1, 999):
            inp = data(dtype, n, seed=rank + 3 * n)
            ref = torch.empty(world * n, dtype=dtype)
            dist.all_gather_into_tensor(ref, inp, group=flat)
            out = torch.zeros(world * n, dtype=dtype)
            dist.all_gather_into_tensor(out, inp)
            same(out, ref, f"all_gather_into_tensor {dtype} n={n}")
            outs = [torch.zeros(n, dtype=dtype) for _ in range(world)]
            dist.all_gather(outs, inp)
            same(torch.cat(outs), ref, f"all_gather {dtype} n={n}")
            checks += 2
    # async: many collectives in flight, waited in reverse; in_flight() on
    # another thread meanwhile never blocks.
    xs = [torch.full((50000,), float(rank + i)) for i in range(6)]
    works = [dist.all_reduce(x, async_op=True) for x in xs]
    seen = gpubridge.in_flight()
    assert isinstance(seen, list)
    for w in reversed(works):
        w.wait()
        assert w.is_completed()
    for i, x in enumerate(xs):
        expect = float(sum(r + i for r in range(world)))
        same(x, torch.full((50000,), expect), f"async all_reduce {i}")
    fut = dist.all_reduce(torch.ones(3), async_op=True).get_future()
    same(fut.wait()[0], torch.full((3,), float(world)), "future value")
    checks += 1
    if world == 4:
        checks += subgroups(world)
    # point to point with tags: inside islands, and between island leaders
    # (not counted: only the ranks of a pair take part)
    p2p(world)
    return checks


def subgroups(world: int) -> int:
    """new_group over the backend: every pair of ranks (single-vendor pairs
    run native-only, mixed ones bridged), and a 2 x 2 DeviceMesh."""
    from torch.distributed.device_mesh import init_device_mesh  # noqa: PLC0415

    checks = 0
    for a in range(world):
        for b in range(a + 1, world):
            g = dist.new_group([a, b], backend="gpubridge")
            ref = dist.new_group([a, b], backend="gloo")
            if rank in (a, b):
                x = data(torch.float32, 5000, seed=rank * 11 + a + b)
                y = x.clone()
                dist.all_reduce(y, group=ref)
                dist.all_reduce(x, group=g)
                same(x, y, f"subgroup {a},{b}")
                topo = gpubridge.get_topology(g)
                labels = {i["label"] for i in topo["islands"]}
                assert (topo["bridge"]["transport"] == "none") == (len(labels) == 1), topo["bridge"]
            checks += 1
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    for dim in ("dp", "tp"):
        g = mesh.get_group(dim)
        assert dist.get_backend(g) == "gpubridge", dist.get_backend(g)
        x = torch.full((7,), float(rank + 1))
        dist.all_reduce(x, group=g)
        members = dist.get_process_group_ranks(g)
        same(x, torch.full((7,), float(sum(r + 1 for r in members))), f"mesh {dim}")
        checks += 1
    return checks


def p2p(world: int) -> int:
    topo = gpubridge.get_topology()
    island = {r: i["label"] for i in topo["islands"] for r in i["ranks"]}
    leaders = [i["leader"] for i in topo["islands"]]
    pairs = []
    for i in topo["islands"]:  # the first two ranks of each island
        if len(i["ranks"]) > 1:
            pairs.append((i["ranks"][0], i["ranks"][1]))
    if len(leaders) > 1 and topo["bridge"]["transport"] != "none":
        pairs.append((leaders[0], leaders[1]))
    n = 0
    for a, b in pairs:
        if rank not in (a, b):
            continue
        peer = b if rank == a else a
        # two tags, sent in one order and received in the other: tags match
        mine = [torch.full((1000,), float(100 * rank + t)) for t in (1, 2)]
        got = [torch.zeros(1000) for _ in (1, 2)]
        reqs = [dist.isend(mine[0], peer, tag=1), dist.isend(mine[1], peer, tag=2)]
        reqs += [dist.irecv(got[1], peer, tag=2), dist.irecv(got[0], peer, tag=1)]
        for q in reqs:
            q.wait()
        for t in (1, 2):
            same(got[t - 1], torch.full((1000,), float(100 * peer + t)), f"p2p {peer}->{rank} tag {t}")
        ops = [dist.P2POp(dist.isend, mine[0], peer, tag=5), dist.P2POp(dist.irecv, got[0], peer, tag=5)]
        for q in dist.batch_isend_irecv(ops):
            q.wait()
        same(got[0], torch.full((1000,), float(100 * peer + 1)), f"batch p2p {peer}->{rank}")
        assert island[a] == island[b] or (a in leaders and b in leaders)
        n += 1
    return n


class Codecs(gpubridge.CollectiveObserver):
    """Records per codec ("op codec", the leaders' with a bridged step
    only: they carry gbbridge's stats)."""

    def __init__(self) -> None:
        self.count: dict[str, int] = {}

    def on_collective(self, record: object) -> None:
        if getattr(record, "bridge", None) is not None:
            k = f"{record.op} {record.codec}"  # type: ignore[attr-defined]
            self.count[k] = self.count.get(k, 0) + 1


def refusals(world: int, pg: object) -> list[str]:
    """Refusals: before any communication, the same on every rank."""
    out = []
    cases = [
        ("PRODUCT", lambda: dist.all_reduce(torch.ones(4), op=dist.ReduceOp.PRODUCT)),
        ("non-contiguous", lambda: dist.all_reduce(torch.ones(4, 4).t())),
        ("dtype", lambda: dist.all_reduce(torch.ones(4, dtype=torch.bool))),
        ("AVG of ints", lambda: dist.all_reduce(torch.ones(4, dtype=torch.int32), op=dist.ReduceOp.AVG)),
        ("all_to_all", lambda: dist.all_to_all_single(torch.ones(world), torch.ones(world))),
        ("reduce", lambda: dist.reduce(torch.ones(4), dst=0)),
        ("any-source recv", lambda: dist.recv(torch.ones(4))),
        ("gather size", lambda: dist.all_gather_into_tensor(torch.ones(world + 1), torch.ones(1))),
    ]
    for what, fn in cases:
        try:
            fn()
        except (RuntimeError, ValueError) as e:
            out.append(f"{what}: {e}".replace(f"rank {rank}", "rank R"))
        else:
            raise AssertionError(f"{what} was not refused")
    return out


def main() -> int:
    try:
        dist.init_process_group(backend="gpubridge")
    except RuntimeError as e:
        (outdir / f"rank{rank}.json").write_text(json.dumps({"error": str(e)}))
        return 3
    world = dist.get_world_size()
    assert dist.get_backend() == "gpubridge", dist.get_backend()
    if mode.startswith("mismatch"):
        x = torch.ones(5 if mode == "mismatch-size" and rank == 1 else 4)
        op = dist.ReduceOp.MAX if mode == "mismatch-op" and rank == 1 else dist.ReduceOp.SUM
        try:
            dist.all_reduce(x, op=op)
        except RuntimeError as e:
            (outdir / f"rank{rank}.json").write_text(json.dumps({"error": str(e)}))
            return 3
        raise AssertionError(f"rank {rank}: the mismatched all_reduce passed: {x.tolist()}")
    pg = dist.distributed_c10d._get_default_group()
    assert isinstance(pg, gpubridge.GpubridgeProcessGroup), type(pg)
    info = {
        "transport": pg.topology["bridge"]["transport"],
        "islands": [i["ranks"] for i in pg.topology["islands"]],
        "role": pg.topology["self"]["role"],
        "bridge_pid": pg._endpoint.process.proc.pid if pg._endpoint is not None else None,
    }
    ep = pg._endpoint
    try:  # one or the other in a process: the native API is refused now
        gpubridge.init()
    except RuntimeError as e:
        assert "use one or the other" in str(e), e
    else:
        raise AssertionError("gpubridge.init() next to init_process_group was not refused")
    flat = dist.new_group(backend="gloo")
    codecs = Codecs()
    gpubridge.add_observer(codecs)
    checks = run_checks(world, flat)
    gpubridge.remove_observer(codecs)
    info["codecs"] = codecs.count
    refused = refusals(world, pg)
    x = torch.full((5,), float(rank + 1))
    dist.all_reduce(x)  # still works after the refusals
    same(x, torch.full((5,), float(world * (world + 1) // 2)), "after refusals")
    dist.barrier()
    st = pg.stats()
    assert st["schema"] == "gpubridge.stats/v1" and st["ops"]["allreduce"]["calls"] > 0, st
    mine = next(i for i in info["islands"] if rank in i)
    if info["transport"] != "none" and len(mine) > 1:  # a bridged rank in an island of 2+
        assert "island reduce" in st["ops"]["allreduce"]["steps"], st
    # All-reduces this leader reduced itself (GPUBRIDGE_BRIDGE_REDUCE=caller).
    info["exchanged"] = ep.exchanged if ep is not None else 0
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
