"""Bridged all_reduce benchmark of the gpubridge plugin (issue 4), one torchrun
worker per rank (RANK, LOCAL_RANK, WORLD_SIZE from torchrun; the device is
cuda:LOCAL_RANK).

Usage:
    torchrun ... bench/gpu/plugin_bench.py MODE OUT.jsonl [--sizes 1M,4M,...] [--dtypes float32,bfloat16]
        [--iters 20] [--warmup 3] [--budget 6G] [--device cuda|cpu]

MODE:
  gpubridge    dist.init_process_group("gpubridge") and all_reduce of the
               tensor on the default group. On CUDA, GPUBRIDGE_SPLIT_TEST
               defaults to "half" (the first half of the ranks is one island,
               the rest the other); on --device cpu, GPUBRIDGE_VENDOR defaults
               to nvidia for the first half and amd for the rest (simulation).
  gloo-bridge  the straightforward implementation the plugin must beat: the
               same two islands (ranks [0, n/2) and [n/2, n)) as NCCL groups,
               and a torch Gloo group of the two leaders (ranks 0 and n/2) as
               the bridge. all_reduce = NCCL reduce onto the island leader,
               leader copies the tensor to pageable host memory (.cpu()), Gloo
               all_reduce between the leaders, copy back into the tensor
               (tensor.copy_(host), a pageable H2D copy), NCCL broadcast in the
               island. Each step ends with a device sync, so the row says where
               the time goes (reduce, d2h, wire, h2d, bcast; rank 0's view).
               Islands of one rank skip their reduce and broadcast.
  nccl         one NCCL group of every rank, plain all_reduce.

What is legal where. NCCL refuses a communicator in which two ranks use the
same GPU, so with 4 ranks on a 2-GPU host (two torchrun "nodes" of 2 ranks
each: ranks 0,1 and 2,3 on cuda:0,1) an all-NCCL world cannot exist: the
"nccl" mode needs one GPU per rank, and the script refuses (writes a
"skipped" row and exits 0) where two ranks of the world share a GPU. The
gloo-bridge mode is legal there: each island (ranks 0,1 and 2,3) has distinct
GPUs, and the only group spanning both islands is the Gloo group of leaders.
To build both baselines the same way in every layout, their default (world)
group is Gloo, used only for setup and for gathering timings; the NCCL groups
are made with dist.new_group(backend="nccl"), never the world. So the same
GPU identity check (hostname + GPU UUID of every rank, gathered over Gloo)
decides what runs. gpubridge itself creates no NCCL group spanning islands,
and its islands (split "half") are the same halves, so it runs in both layouts
as long as discovery accepts two islands sharing the GPUs.

Data: integer-valued tensors (rank r holds ((i + 3r) mod 7) - 3 at index i),
so every sum is exact in float32 and bfloat16 and all modes must give the
expected tensor bit for bit. Every call, warm-up and timed, is checked on
every rank: after its timing has ended (the last step's device sync), a
comparison of the result's bits (an integer view) with the expected tensor,
computed locally once, runs on the device and adds the differing elements
to a counter there; the counter is read once per row. The row's "wrong" is
the largest count of any rank, "checked_iterations" how many calls were
checked. The input is restored (untimed) before every iteration. Each iteration is timed on its own
(device sync before and after); the row's time is the median over the timed
iterations of the slowest rank's time. Large sizes run fewer iterations:
iters = clamp(budget / size, 5, --iters).

Rank 0 appends one JSON line per (dtype, size) to OUT.jsonl (schema
gpubridge.plugin-bench/v1) and prints a table on stderr.
``plugin_bench.py summary OUTDIR`` prints markdown tables (and the issue's
goals, met or not) from the JSON lines a plugin-bench.sh run left in OUTDIR.

--device cpu is a smoke test of the logic on a machine without GPUs: Gloo
takes NCCL's place, and gpubridge runs in simulation.
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
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

SCHEMA = "gpubridge.plugin-bench/v1"
MODES = ("gpubridge", "gloo-bridge", "nccl")
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
# The integer type of each element size: results are compared as bits.
BITS = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
UNITS = {"": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30}

# NVLink multicast stays off on the lent GPU hosts (see the device notes).
os.environ["NCCL_NVLS_ENABLE"] = "0"
os.environ["TORCH_SYMM_MEM_DISABLE_MULTICAST"] = "1"
os.environ["NVSHMEM_DISABLE_NVLS"] = "1"


def parse_size(s: str) -> int:
    s = s.strip().upper().removesuffix("IB").removesuffix("B")
    unit = s[-1] if s and s[-1] in UNITS else ""
    return int(float(s[: len(s) - len(unit)]) * UNITS[unit])


def human(n: int) -> str:
    for u in ("G", "M", "K"):
        if n >= UNITS[u] and n % UNITS[u] == 0:
            return f"{n // UNITS[u]}{u}"
    return str(n)


def pattern(n: int, rank: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    base = torch.arange(n, dtype=torch.int32, device=device)
    return ((base + 3 * rank) % 7 - 3).to(dtype)


def expected_sum(n: int, world: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    base = torch.arange(n, dtype=torch.int32, device=device)
    acc = torch.zeros(n, dtype=torch.int32, device=device)
    for r in range(world):
        acc += (base + 3 * r) % 7 - 3
    return acc.to(dtype)


class Steps:
    """Wall time of the named steps of one collective, a device sync at each mark."""

    def __init__(self, sync: Callable[[], None]) -> None:
        self.sync = sync
        self.t = 0.0
        self.times: dict[str, float] = {}

    def start(self) -> None:
        self.times = {}
        self.sync()
        self.t = time.perf_counter()

    def mark(self, name: str) -> None:
        self.sync()
        now = time.perf_counter()
        self.times[name] = self.times.get(name, 0.0) + now - self.t
        self.t = now


def numeric_delta(before: Any, after: Any) -> Any:
    """after - before for every number in two equally shaped JSON-like values."""
    if isinstance(after, dict) and isinstance(before, dict):
        return {k: numeric_delta(before.get(k), v) for k, v in after.items()}
    if isinstance(after, (int, float)) and isinstance(before, (int, float)) and not isinstance(after, bool):
        return after - before
    return after


class Bench:
    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.mode: str = args.mode
        self.rank = int(os.environ["RANK"])
        self.world = int(os.environ["WORLD_SIZE"])
        self.local = int(os.environ.get("LOCAL_RANK", "0"))
        if self.world < 2:
            raise SystemExit("plugin_bench: needs 2 or more ranks")
        self.cuda = args.device == "cuda"
        self.device = torch.device("cuda", self.local) if self.cuda else torch.device("cpu")
        if self.cuda:
            torch.cuda.set_device(self.device)
        half = self.world // 2
        self.islands = [list(range(half)), list(range(half, self.world))]
        self.leaders = [isl[0] for isl in self.islands]
        self.my_island = 0 if self.rank < half else 1
        self.is_leader = self.rank in self.leaders
        self.data_backend = "nccl" if self.cuda else "gloo"
        self.skipped = ""
        self.info: dict[str, Any] = {}
        self.stats_fn: Callable[[], Any] | None = None
        self.island_pg: Any = None
        self.leaders_pg: Any = None
        self.all_pg: Any = None
        timeout = timedelta(seconds=args.timeout)
        if self.mode == "gpubridge":
            self._init_gpubridge(timeout)
        else:
            self._init_baseline(timeout)

    # ---- set-up ----

    def _init_gpubridge(self, timeout: timedelta) -> None:
        if self.cuda:
            os.environ.setdefault("GPUBRIDGE_SPLIT_TEST", "half")
        else:
            os.environ.setdefault("GPUBRIDGE_VENDOR", "nvidia" if self.rank < self.world // 2 else "amd")
        gb = importlib.import_module("gpubridge")
        dist.init_process_group(backend="gpubridge", timeout=timeout)
        self.gb = gb
        pg = dist.group.WORLD
        topo = getattr(pg, "topology", None)
        if isinstance(topo, dict):
            self.info["run_kind"] = topo.get("run_kind")
            self.info["gpubridge_islands"] = [i.get("ranks") for i in topo.get("islands", [])]
            self.info["bridge"] = (topo.get("bridge") or {}).get("transport")
        stats = getattr(pg, "stats", None)
        if callable(stats):
            self.stats_fn = stats
        self.info["gpubridge_version"] = getattr(gb, "__version__", None)
        self.info["split_test"] = os.environ.get("GPUBRIDGE_SPLIT_TEST")

    def _init_baseline(self, timeout: timedelta) -> None:
        dist.init_process_group(backend="gloo", timeout=timeout)
        self.info["island_backend" if self.mode == "gloo-bridge" else "backend"] = self.data_backend
        if self.cuda:
            ident = f"{socket.gethostname()}/GPU-{torch.cuda.get_device_properties(self.device).uuid}"
        else:
            ident = f"{socket.gethostname()}/cpu-rank{self.rank}"
        idents: list[Any] = [None] * self.world
        dist.all_gather_object(idents, ident)

        def shared(ranks: list[int]) -> bool:
            seen = [idents[r] for r in ranks]
            return len(set(seen)) != len(seen)

        if self.mode == "nccl":
            if self.cuda and shared(list(range(self.world))):
                self.skipped = "two ranks of the world share a GPU: NCCL refuses such a communicator"
                return
            self.all_pg = dist.new_group(backend=self.data_backend)
            return
        if self.cuda and any(shared(isl) for isl in self.islands):
            self.skipped = "two ranks of one island share a GPU: NCCL refuses such a communicator"
            return
        # Every rank creates every group, in the same order.
        for i, isl in enumerate(self.islands):
            if len(isl) > 1:
                g = dist.new_group(ranks=isl, backend=self.data_backend)
                if i == self.my_island:
                    self.island_pg = g
        g = dist.new_group(ranks=self.leaders, backend="gloo")
        if self.is_leader:
            self.leaders_pg = g

    # ---- the collectives ----

    def sync(self) -> None:
        if self.cuda:
            torch.cuda.synchronize(self.device)

    def all_reduce(self, buf: torch.Tensor, steps: Steps) -> None:
        if self.mode == "gpubridge":
            dist.all_reduce(buf)
            steps.mark("all_reduce")
        elif self.mode == "nccl":
            dist.all_reduce(buf, group=self.all_pg)
            steps.mark("all_reduce")
        else:
            self._gloo_bridge(buf, steps)

    def _gloo_bridge(self, buf: torch.Tensor, steps: Steps) -> None:
        leader = self.leaders[self.my_island]
        if self.island_pg is not None:
            dist.reduce(buf, dst=leader, group=self.island_pg)
            steps.mark("reduce")
        if self.is_leader:
            host = buf.cpu()  # pageable (on --device cpu this is buf itself)
            steps.mark("d2h")
            dist.all_reduce(host, group=self.leaders_pg)
            steps.mark("wire")
            if host.data_ptr() != buf.data_ptr():
                buf.copy_(host)
            steps.mark("h2d")
        if self.island_pg is not None:
            dist.broadcast(buf, src=leader, group=self.island_pg)
            steps.mark("bcast")

    def slowest(self, values: list[float]) -> list[float]:
        """Element-wise maximum over the ranks, through the mode's world group."""
        if self.mode == "gpubridge":
            t = torch.tensor(values, dtype=torch.float64, device=self.device)
        else:
            t = torch.tensor(values, dtype=torch.float64)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        return [float(x) for x in t.tolist()]

    # ---- one (dtype, size) ----

    def iterations(self, size: int) -> tuple[int, int]:
        a = self.args
        iters = max(min(5, a.iters), min(a.iters, a.budget // size))
        warmup = max(1, min(a.warmup, a.budget // (4 * size)))
        return warmup, iters

    def run_one(self, dtype: torch.dtype, size: int) -> dict[str, Any]:
        esize = torch.empty(0, dtype=dtype).element_size()
        n = size // esize
        src = pattern(n, self.rank, dtype, self.device)
        bits = BITS[esize]
        want = expected_sum(n, self.world, dtype, self.device).view(bits)
        buf = torch.empty_like(src)
        warmup, iters = self.iterations(size)
        steps = Steps(self.sync)
        wrong_count = torch.zeros((), dtype=torch.int64, device=self.device)
        per_iter: list[dict[str, float]] = []
        stats_before: Any = None
        for i in range(warmup + iters):
            if i == warmup and self.stats_fn is not None:
                stats_before = self._stats()
            buf.copy_(src)
            steps.start()
            self.all_reduce(buf, steps)
            if i >= warmup:
                per_iter.append(dict(steps.times))
            # Outside the timed window (the last mark synchronised the
            # device; the next start waits for this): bit for bit, on the
            # device, no read back per call.
            wrong_count += (buf.view(bits) != want).sum()
        stats_after = self._stats() if self.stats_fn is not None else None
        totals = [sum(d.values()) for d in per_iter]
        agg = self.slowest([*totals, float(wrong_count.item())])
        times = agg[:iters]
        wrong = int(agg[iters])
        med = statistics.median(times)
        algbw = size / med / 1e9
        row: dict[str, Any] = {
            "schema": SCHEMA,
            "mode": self.mode,
            "collective": "all_reduce",
            "redop": "sum",
            "world": self.world,
            "islands": self.islands,
            "device": str(self.device.type),
            "type": str(dtype).removeprefix("torch."),
            "size": n * esize,
            "count": n,
            "warmup": warmup,
            "iters": iters,
            "time_us": med * 1e6,
            "min_us": min(times) * 1e6,
            "p90_us": sorted(times)[min(len(times) - 1, int(0.9 * len(times)))] * 1e6,
            "algbw_gbps": algbw,
            "busbw_gbps": algbw * 2 * (self.world - 1) / self.world,
            "wrong": wrong,
            "correct": wrong == 0,
            "checked_iterations": warmup + iters,
        }
        names = list(per_iter[0]) if per_iter else []
        if self.mode == "gloo-bridge" or len(names) > 1:
            row["steps_us_rank0"] = {
                k: statistics.median(d.get(k, 0.0) for d in per_iter) * 1e6 for k in names
            }
        if stats_after is not None:
            row["backend_stats"] = stats_after
            if stats_before is not None:
                row["backend_stats_delta"] = numeric_delta(stats_before, stats_after)
        row.update(self.info)
        del src, want, buf
        return row

    def _stats(self) -> Any:
        assert self.stats_fn is not None
        try:
            return json.loads(json.dumps(self.stats_fn(), default=str))
        except Exception as e:  # best effort: the backend's stats are optional
            return {"error": repr(e)}


def context(args: argparse.Namespace) -> dict[str, Any]:
    ctx: dict[str, Any] = {
        "commit": os.environ.get("GB_COMMIT", "unknown"),
        "host": socket.gethostname(),
        "torch": torch.__version__,
        "launch": os.environ.get("GB_LAUNCH", ""),
    }
    if os.environ.get("GB_NODE1_VISIBLE"):
        ctx["node1_cuda_visible_devices"] = os.environ["GB_NODE1_VISIBLE"]
    if args.device == "cuda":
        ctx["gpu"] = torch.cuda.get_device_name(0)
        ctx["gpus_visible"] = torch.cuda.device_count()
        nccl_version: Any = torch.cuda.nccl.version  # untyped in torch
        ctx["nccl"] = ".".join(str(x) for x in nccl_version())
    return ctx


def table_line(row: dict[str, Any]) -> str:
    steps = row.get("steps_us_rank0") or {}
    st = " ".join(f"{k}={v / 1e3:.2f}" for k, v in steps.items())
    ok = "ok" if row["correct"] else f"WRONG({row['wrong']})"
    return (
        f"{row['mode']:<11} {row['world']:>5} {row['type']:<8} {human(row['size']):>6} {row['iters']:>5} "
        f"{row['time_us'] / 1e3:>10.3f} {row['algbw_gbps']:>8.2f} {row['busbw_gbps']:>8.2f} {ok:<6} {st}"
    )


def read_rows(path: str) -> list[dict[str, Any]]:
    if not os.path.exists(path):
        return []
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


def summary(outdir: str) -> str:
    """Markdown tables and the issue's goals from bench.jsonl, train.jsonl and
    overhead.jsonl in outdir (the files bench/gpu/plugin-bench.sh writes)."""
    lines: list[str] = []
    bench = read_rows(os.path.join(outdir, "bench.jsonl"))
    skipped = [r for r in bench if "skipped" in r]
    rows = [r for r in bench if "skipped" not in r]
    keys = sorted({(r["world"], r["type"], r["size"]) for r in rows})
    by = {(r["world"], r["type"], r["size"], r["mode"]): r for r in rows}
    if keys:
        lines += [
            "### Bridged all_reduce: median ms (algbw GB/s); "
            + (
                "every call checked bit for bit"
                if all("checked_iterations" in r for r in rows)
                else "checked bit for bit after the first warm-up and the last timed call"
            ),
            "",
            "| ranks | type | size | gpubridge | gloo-bridge | nccl | gpubridge / gloo-bridge |",
            "| --- | --- | --- | --- | --- | --- | --- |",
        ]
    for world, typ, size in keys:
        cells = []
        for m in MODES:
            r = by.get((world, typ, size, m))
            bad = "" if r is None or r["correct"] else " WRONG"
            cells.append("-" if r is None else f"{r['time_us'] / 1e3:.3f} ({r['algbw_gbps']:.1f}){bad}")
        g, b = by.get((world, typ, size, "gpubridge")), by.get((world, typ, size, "gloo-bridge"))
        ratio = f"{g['time_us'] / b['time_us']:.3f}" if g and b else "-"
        lines.append(f"| {world} | {typ} | {human(size)} | {' | '.join(cells)} | {ratio} |")
    steps = [r for r in rows if r["mode"] == "gloo-bridge" and r["size"] == max(k[2] for k in keys)]
    if steps:
        lines += ["", "Where the gloo-bridge time goes at the largest size (rank 0, median ms per step):", ""]
        for r in steps:
            st = ", ".join(f"{k} {v / 1e3:.2f}" for k, v in r.get("steps_us_rank0", {}).items())
            lines.append(f"- {r['world']} ranks, {r['type']}: {st}")
    for r in rows:
        if r["mode"] == "gpubridge" and r["size"] == max(k[2] for k in keys) and "backend_stats_delta" in r:
            lines.append(
                f"- gpubridge {r['world']} ranks {r['type']} stats delta: {r['backend_stats_delta']}"
            )
    for r in skipped:
        lines.append(f"- {r['mode']} with {r['world']} ranks skipped: {r['skipped']}")
    big = [(k, by.get((*k, "gpubridge")), by.get((*k, "gloo-bridge"))) for k in keys if k[2] == 1 << 30]
    for (world, typ, _), g, b in big:
        if g and b:
            q = g["time_us"] / b["time_us"]
            verdict = "met" if q <= 0.2 else "NOT met"
            lines.append(
                f"- goal gpubridge <= 0.2x gloo-bridge at 1 GiB, {world} ranks {typ}: {q:.3f}x, {verdict}"
            )

    train = read_rows(os.path.join(outdir, "train.jsonl"))
    if train:
        lines += [
            "",
            "### Training throughput (LLaMA-style, bf16)",
            "",
            "| backend | parallel | comm hook | ranks | params | batch x seq | tokens/s total "
            "| step ms (median) | vs nccl | params in sync |",
            "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |",
        ]

        def key(r: dict[str, Any]) -> tuple[int, str]:
            return r["world"], r.get("parallel", "ddp")

        # The reference of a row: the last nccl row of as many ranks and the
        # same parallelism.
        refs = {key(r): r for r in train if r["backend"] == "nccl"}
        for r in train:
            ref = refs.get(key(r))
            q = f"{r['tokens_per_s_total'] / ref['tokens_per_s_total']:.3f}" if ref else "-"
            lines.append(
                f"| {r['backend']} | {key(r)[1]} | {r['comm_hook']} | {r['world']} "
                f"| {r['params'] / 1e6:.1f}M "
                f"| {r['batch_per_rank']}x{r['seq']} | {r['tokens_per_s_total']:,.0f} "
                f"| {r['step_ms_median']:.1f} | {q} | {r['params_in_sync']} |"
            )
        for r in train:
            ref = refs.get(key(r))
            if ref and r["backend"] == "gpubridge":
                q = r["tokens_per_s_total"] / ref["tokens_per_s_total"]
                verdict = "met" if q >= 0.85 else "NOT met"
                lines.append(
                    f"- goal >= 0.85 of nccl's tokens/s ({key(r)[1]}, {r['comm_hook']}): {q:.3f}, {verdict}"
                )

    over = read_rows(os.path.join(outdir, "overhead.jsonl"))
    if over:
        lines += ["", "### Per-call overhead, 4-byte all_reduce on CPU (simulation)", ""]
        for r in over:
            g, o = r["gpubridge"], r["gloo"]
            verdict = "met" if r["ratio_median"] <= 1.2 else "NOT met"
            lines.append(
                f"- {r['world']} ranks, {r['iters']} calls: gpubridge median {g['median_us']:.1f} us "
                f"(p90 {g['p90_us']:.1f}), gloo median {o['median_us']:.1f} us (p90 {o['p90_us']:.1f}); "
                f"ratio {r['ratio_median']:.2f}x (p90 {r['ratio_p90']:.2f}x); goal <= 1.2x {verdict}"
            )
    return "\n".join(lines) + "\n"


def main() -> int:
    if len(sys.argv) == 3 and sys.argv[1] == "summary":
        sys.stdout.write(summary(sys.argv[2]))
        return 0
    p = argparse.ArgumentParser(
        description="bridged all_reduce: gpubridge vs a Gloo bridge vs NCCL "
        "(or: plugin_bench.py summary OUTDIR, the tables of a plugin-bench.sh run)"
    )
    p.add_argument("mode", choices=MODES)
    p.add_argument("out", help="JSON lines file rank 0 appends to")
    p.add_argument("--sizes", default="1M,4M,16M,64M,256M,1G")
    p.add_argument("--dtypes", default="float32,bfloat16")
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument(
        "--budget", default="6G", help="bytes per (dtype, size) that set the iterations of large sizes"
    )
    p.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    p.add_argument("--timeout", type=int, default=300, help="seconds, for the process groups")
    args = p.parse_args()
    args.budget = parse_size(args.budget)
    sizes = [parse_size(s) for s in args.sizes.split(",") if s]
    dtypes = [DTYPES[d] for d in args.dtypes.split(",") if d]

    bench = Bench(args)
    rank0 = bench.rank == 0
    ctx = context(args)
    if rank0:
        print(
            f"plugin_bench {args.mode}: {bench.world} ranks, islands {bench.islands}, {ctx}", file=sys.stderr
        )
    if bench.skipped:
        if rank0:
            with open(args.out, "a") as f:
                row = {
                    "schema": SCHEMA,
                    "mode": args.mode,
                    "world": bench.world,
                    "skipped": bench.skipped,
                    **ctx,
                }
                f.write(json.dumps(row) + "\n")
            print(f"plugin_bench {args.mode}: skipped: {bench.skipped}", file=sys.stderr)
        dist.destroy_process_group()
        return 0
    if rank0:
        print(
            f"{'mode':<11} {'world':>5} {'type':<8} {'size':>6} {'iters':>5} {'time_ms':>10} "
            f"{'algbw':>8} {'busbw':>8} {'check':<6} steps (ms, rank 0)",
            file=sys.stderr,
        )
    failed = False
    for dtype in dtypes:
        for size in sizes:
            row = bench.run_one(dtype, size)
            row.update(ctx)
            failed = failed or not row["correct"]
            if rank0:
                with open(args.out, "a") as f:
                    f.write(json.dumps(row) + "\n")
                print(table_line(row), file=sys.stderr, flush=True)
            if bench.cuda:
                torch.cuda.empty_cache()
    dist.destroy_process_group()
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
