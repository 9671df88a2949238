"""The GPU leaders' bridged all_reduce with the reduction on the GPU (issue
12): the bridge exchanges the two islands' partials, each leader copies the
peer's to its GPU and adds there (gpubridge._endpoint, "exchange, reduce on
the caller", feed protocol 2), against the old path that reduces in
gbbridge on the host, in one run. A torchrun worker, one per rank, 2 ranks
(bench/gpu/exchange-bench.sh launches them: two torchrun "nodes" of one
rank; with one GPU both ranks use it: a split test of two islands on ONE
GPU, whose two leaders share that GPU's one host link).

Usage:
    torchrun ... bench/gpu/exchange_bench.py OUT.jsonl [--sizes 256M,1G] [--iters 10] [--device cuda|cpu]

Rank 0 appends JSON lines (schema gpubridge.plugin-exchange/v1) to OUT.jsonl:

  kind "layout"     the GPUs, whether both ranks share one (the split test
                    on one GPU), torch and NCCL versions.
  kind "allreduce"  dist.all_reduce of float32 over the gpubridge group, by
                    mode: "gpu-reduce" (the new path), "host-reduce" (the
                    old: GPUBRIDGE_BRIDGE_REDUCE=host, gbbridge reduces), and
                    "nccl" (a world NCCL group; only where every rank has its
                    own GPU: NCCL refuses two ranks of one communicator on one
                    GPU, and the row says so). The modes alternate call by
                    call. Each call is timed on its own between device syncs;
                    the row's time is the median over the timed calls of the
                    slowest rank. Every call, warm-up and timed, is checked
                    element by element against the exact sum (integer-valued
                    data) on the device; "wrong" is the largest count of any
                    rank, "checked_iterations" how many calls were checked.
                    gpu-reduce rows carry where the time went, medians over
                    the timed calls of rank 0 (CUDA events; _endpoint's
                    profile): d2h_ms (the chunked copy of the partial into the
                    region, from the call's start), wire_ms (from the request
                    to the last peer byte arriving, host clock), h2d_ms and
                    add_ms (GPU busy time of the peer partial's copies to the
                    GPU and of the adds), *_first_ms / *_last_ms (when they
                    began and ended after the call's start), server_ms
                    (gbbridge's own time for the request).
  kind "part"       each part alone, both ranks at once, median ms: d2h
                    (the chunked copy into the page-locked region), h2d, d2h
                    and h2d at once on two streams ("duplex": what one call of
                    the new path must move per rank; with both ranks on one
                    GPU, the split test's ceiling), the bridge's exchange of
                    the partials alone and its host all_reduce alone (data in
                    place, through the feed), the GPU add alone.
  kind "specials"   for float32, bfloat16 and float16, sum, max and min: one
                    all_reduce of random bits (NaNs with payloads, infinities,
                    signed zeros, denormals mixed in) through the new path and
                    the same input through the old; "wrong" counts elements
                    whose bits differ (the old path is lib/reduce: the
                    reference).

It prints a summary (the ceiling the duplex copy implies, the split of the
new path, the ratios) on stderr.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import sys
import time
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
# The sizes' spelling and the NVLink settings are plugin_bench's.
from plugin_bench import BITS, human, parse_size

SCHEMA = "gpubridge.plugin-exchange/v1"


def op_name(op: object) -> str:
    return str(getattr(op, "op", op)).rsplit(".", 1)[-1]


class Bench:
    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.rank = int(os.environ["RANK"])
        self.world = int(os.environ["WORLD_SIZE"])
        self.cuda = args.device == "cuda"
        if self.cuda:
            ngpu = torch.cuda.device_count()
            self.device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")) % ngpu)
            torch.cuda.set_device(self.device)
        else:
            self.device = torch.device("cpu")
            os.environ.setdefault("GPUBRIDGE_VENDOR", "nvidia" if self.rank < self.world // 2 else "amd")
        import gpubridge  # noqa: PLC0415  (registers the backend; after the vendor is set)

        dist.init_process_group("gpubridge", timeout=timedelta(seconds=300))
        pg = dist.distributed_c10d._get_default_group()
        assert isinstance(pg, gpubridge.GpubridgeProcessGroup), type(pg)
        self.ep = pg._endpoint
        assert self.ep is not None, "every rank must lead its island (2 ranks, split half)"
        self.gloo = dist.new_group(backend="gloo")
        self.rows: list[dict[str, Any]] = []
        self.layout = self._layout()
        # The new path: on GPUs the default; CPU tensors (the smoke test)
        # take it only when asked.
        self.new_mode = "auto" if self.cuda else "caller"

    def _layout(self) -> dict[str, Any]:
        ident = "cpu"
        if self.cuda:
            props = torch.cuda.get_device_properties(self.device)
            ident = str(getattr(props, "uuid", f"{os.uname().nodename}/{self.device.index}"))
        ids: list[Any] = [None] * self.world
        dist.all_gather_object(ids, ident, group=self.gloo)
        shared = len(set(ids)) < self.world
        return {
            "kind": "layout", "gpus": torch.cuda.device_count() if self.cuda else 0, "ranks": self.world,
            "same_gpu": shared if self.cuda else None,
            "gpu": torch.cuda.get_device_name(self.device) if self.cuda else "cpu",
            "torch": torch.__version__,
            "nccl": ".".join(map(str, torch.cuda.nccl.version())) if self.cuda else None,
            "note": "CPU smoke test (simulation): no figure means anything" if not self.cuda else (
                "split test: two islands of one rank on ONE GPU, both leaders share its host link"
                if shared else "split test: two islands of one rank, one GPU each"),
        }  # fmt: skip

    def sync(self) -> None:
        if self.cuda:
            torch.cuda.synchronize(self.device)

    def barrier(self) -> None:
        self.sync()
        dist.barrier(group=self.gloo)

    def slowest(self, v: float) -> float:
        t = torch.tensor([v], dtype=torch.float64)
        dist.all_reduce(t, op=dist.ReduceOp.MAX, group=self.gloo)
        return float(t.item())

    def timed(self, fn: Callable[[], None]) -> float:
        """One call between syncs, ms; the slowest rank's."""
        self.barrier()
        t = time.perf_counter()
        fn()
        self.sync()
        return self.slowest((time.perf_counter() - t) * 1e3)

    def row(self, **kw: Any) -> None:
        r = {"schema": SCHEMA, "commit": os.environ.get("GB_COMMIT", "unknown"), **kw}
        self.rows.append(r)
        if self.rank == 0:
            with open(self.args.out, "a") as f:
                f.write(json.dumps(r) + "\n")

    # ---- the all_reduce, new and old ----

    def allreduce(self, n: int) -> None:
        dt = torch.float32
        count = n // 4
        base = torch.arange(count, dtype=torch.int32, device=self.device)
        x0 = ((base + 3 * self.rank) % 7 - 3).to(dt)
        want = sum(((base + 3 * r) % 7 - 3) for r in range(self.world)).to(dt).view(torch.int32)
        x = torch.empty_like(x0)
        nccl = None
        can_nccl = self.cuda and not self.layout["same_gpu"]
        if can_nccl:
            nccl = dist.new_group(backend="nccl")
        modes = ["gpu-reduce", "host-reduce"] + (["nccl"] if nccl is not None else [])
        times: dict[str, list[float]] = {m: [] for m in modes}
        wrong = {m: torch.zeros((), dtype=torch.int64, device=self.device) for m in modes}
        checked = dict.fromkeys(modes, 0)
        used = dict.fromkeys(modes, 0)
        self.ep.profile = []
        iters = max(3, min(self.args.iters, int(self.args.budget // n)))
        for it in range(self.args.warmup + iters):
            for m in modes:
                self.ep.reduce_mode = "host" if m == "host-reduce" else self.new_mode
                x.copy_(x0)
                before = self.ep.exchanged
                group = nccl if m == "nccl" else None
                ms = self.timed(lambda g=group: dist.all_reduce(x, group=g))
                used[m] += self.ep.exchanged - before
                wrong[m] += (x.view(torch.int32) != want).sum()
                checked[m] += 1
                if it >= self.args.warmup:
                    times[m].append(ms)
        prof = self.ep.profile[self.args.warmup :]
        self.ep.profile = None
        self.ep.reduce_mode = "auto"
        for m in modes:
            bad = torch.tensor([int(wrong[m].item())], dtype=torch.int64)
            dist.all_reduce(bad, op=dist.ReduceOp.MAX, group=self.gloo)
            t = statistics.median(times[m])
            r: dict[str, Any] = {
                "kind": "allreduce", "mode": m, "dtype": "float32", "size": n, "time_ms": t,
                "algbw_gbps": n / t / 1e6, "iters": len(times[m]), "wrong": int(bad.item()),
                "checked_iterations": checked[m], "exchanged_calls": used[m], **self.layout_note(),
            }  # fmt: skip
            if m == "gpu-reduce" and prof:
                for k in prof[0]:
                    r[k] = statistics.median(p[k] for p in prof)
            self.row(**r)
        if not can_nccl:
            self.row(kind="allreduce", mode="nccl", dtype="float32", size=n, skipped=(
                "NCCL refuses two ranks of one communicator on one GPU (the split test on one GPU)"
                if self.cuda else "no GPU"), **self.layout_note())  # fmt: skip

    def layout_note(self) -> dict[str, Any]:
        return {"same_gpu": self.layout["same_gpu"], "note": self.layout["note"]}

    # ---- the parts alone ----

    def parts(self, n: int) -> None:
        from gpubridge._combine import combine  # noqa: PLC0415
        from gpubridge._feed import DType, Op  # noqa: PLC0415

        ep = self.ep
        me = ep._members.index(ep._rank)
        host = ep.staging.tensor(2 * n)
        region = ep.staging.region
        assert region is not None
        mine = host[me * n : (me + 1) * n]
        src = torch.ones(n // 4, device=self.device).view(torch.uint8)
        dst = torch.empty_like(src)
        chunk = 8 << 20
        s1 = torch.cuda.Stream(self.device) if self.cuda else None
        s2 = torch.cuda.Stream(self.device) if self.cuda else None

        def copy(a: torch.Tensor, b: torch.Tensor, stream: Any) -> None:
            with torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext():
                for off in range(0, n, chunk):
                    a[off : off + chunk].copy_(b[off : off + chunk], non_blocking=self.cuda)

        peer = host[(1 - me) * n : (2 - me) * n]
        a = torch.ones(n // 4, device=self.device)
        b = torch.ones(n // 4, device=self.device)

        def duplex() -> None:
            copy(mine, src, s1)
            copy(dst, peer, s2)

        def exchange() -> None:
            inp, out = region.span(me * n, n), region.span(0, 2 * n)
            ep.feed.start_exchange(inp, out, DType.FLOAT32, Op.SUM, streamed=False).wait()

        what: dict[str, Callable[[], None]] = {
            "d2h": lambda: copy(mine, src, s1),
            "h2d": lambda: copy(dst, peer, s1),
            "duplex": duplex,
            "bridge-exchange": exchange,
            "bridge-allreduce": lambda: ep.feed.all_reduce(region, me * n, n, DType.FLOAT32, Op.SUM),
            "gpu-add": lambda: combine(Op.SUM, a, b, a),
        }
        iters = max(3, min(self.args.iters, int(self.args.budget // n)))
        for name, fn in what.items():
            fn()  # warm up
            ms = statistics.median(self.timed(fn) for _ in range(iters))
            self.row(kind="part", part=name, size=n, time_ms=ms, gbps=n / ms / 1e6, **self.layout_note())

    # ---- bit for bit on special values ----

    def specials(self, n: int) -> None:
        g = torch.Generator().manual_seed(100 + self.rank)
        for dt in (torch.float32, torch.bfloat16, torch.float16):
            bits = BITS[dt.itemsize]
            count = n // dt.itemsize
            x = (torch.randn(count, generator=g, dtype=torch.float64) * 8).to(dt)
            raw = torch.randint(-(1 << (8 * dt.itemsize - 1)), 1 << (8 * dt.itemsize - 1), (count,),
                                generator=g, dtype=torch.int64).to(bits)  # fmt: skip
            mask = torch.randint(0, 8, (count,), generator=g) == 0
            xv = x.view(bits)
            xv[mask] = raw[mask]  # one in eight: any bit pattern (NaNs, infinities, denormals)
            x = x.to(self.device)
            for op in (dist.ReduceOp.SUM, dist.ReduceOp.MAX, dist.ReduceOp.MIN):
                out = {}
                for mode in ("new", "host"):
                    self.ep.reduce_mode = self.new_mode if mode == "new" else "host"
                    y = x.clone()
                    dist.all_reduce(y, op=op)
                    out[mode] = y.view(bits)
                self.ep.reduce_mode = "auto"
                bad = torch.tensor([int((out["new"] != out["host"]).sum().item())], dtype=torch.int64)
                dist.all_reduce(bad, op=dist.ReduceOp.MAX, group=self.gloo)
                name = str(dt).removeprefix("torch.")
                nans = int(torch.isnan(x).sum().item())
                self.row(
                    kind="specials",
                    dtype=name,
                    op=op_name(op),
                    size=n,
                    wrong=int(bad.item()),
                    nan_inputs=nans,
                )

    def summary(self) -> None:
        if self.rank != 0:
            return
        lay = self.layout
        lines = [f"== {lay['note']}; {lay['gpu']} x{lay['gpus']}, torch {lay['torch']}"]
        for r in self.rows:
            size = f"{human(r.get('size', 0)):>5s}"
            if r["kind"] == "allreduce" and "time_ms" in r:
                lines.append(
                    f"allreduce {r['mode']:12s} {size}: {r['time_ms']:8.2f} ms {r['algbw_gbps']:6.2f} GB/s, "
                    f"wrong {r['wrong']} in {r['checked_iterations']} checked calls"
                )
                if r["mode"] == "gpu-reduce" and "d2h_ms" in r:
                    lines.append(
                        f"    d2h {r['d2h_ms']:.1f}, wire {r['wire_ms']:.1f}, h2d {r['h2d_ms']:.1f} "
                        f"(ends {r['h2d_last_ms']:.1f}), add {r['add_ms']:.1f} "
                        f"(ends {r['add_last_ms']:.1f}) ms"
                    )
            elif r["kind"] == "allreduce":
                lines.append(f"allreduce {r['mode']:12s} {size}: {r['skipped']}")
            elif r["kind"] == "part":
                lines.append(f"part {r['part']:17s} {size}: {r['time_ms']:8.2f} ms {r['gbps']:6.2f} GB/s")
            elif r["kind"] == "specials":
                lines.append(f"specials {r['dtype']:9s} {r['op']:4s}: {r['wrong']} bits differ")
        for d in (r for r in self.rows if r["kind"] == "part" and r["part"] == "duplex"):
            lines.append(
                f"ceiling of the copies at {human(d['size'])}: {d['gbps']:.1f} GB/s algbw (a call moves "
                "n bytes in and n out per rank; the duplex part does just that, both ranks at once)"
            )
        print("\n".join(lines), file=sys.stderr)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("out")
    ap.add_argument("--sizes", default="256M,1G")
    ap.add_argument("--iters", type=int, default=10)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument(
        "--budget", type=parse_size, default=parse_size("16G"), help="timed bytes per size and mode"
    )
    ap.add_argument("--specials", type=parse_size, default=parse_size("4M"))
    ap.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    args = ap.parse_args()
    b = Bench(args)
    b.row(**b.layout)
    sizes = [parse_size(s) for s in args.sizes.split(",")]
    b.specials(args.specials)
    for n in sizes:
        b.allreduce(n)
    b.parts(max(sizes))
    b.summary()
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
