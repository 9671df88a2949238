"""Compression on the bridge on a GPU host (issue 13): the leaders' GPU path
(quantize on the GPU, exchange the packed bytes, decode and sum on the GPU)
against gbbridge's host path bit for bit, and the bridged all_reduce's time
with each codec. A torchrun worker, one per rank, 2 ranks, each the leader
of its own island (bench/gpu/compress-bench.sh launches them: with ONE GPU
both ranks use it as two torchrun "nodes" of one rank: a split test of two
islands on ONE GPU, whose two leaders share its host link; the rows say so).

Usage:
    torchrun ... bench/gpu/compress_bench.py OUT.jsonl [--sizes 64M,256M,1G] [--iters 10]
        [--check-sizes 1,1000,300007,8388613] [--steps 3] [--device cuda|cpu]

Rank 0 appends JSON lines (schema gpubridge.compress-bench/v1) to OUT.jsonl:

  kind "layout"     the GPUs, whether both ranks share one, torch and NCCL.
  kind "check"      one codec, dtype and size: --steps consecutive
                    all_reduces with error feedback (a key per path) of
                    random data with special values mixed in (one in 64
                    values any bit pattern: NaNs, infinities, denormals, -0),
                    once through the GPU path (GPUBRIDGE_BRIDGE_REDUCE auto
                    on GPUs, caller on CPU) and once through gbbridge's host
                    path. "wrong" counts the elements whose bits differ
                    between the two paths over every step (the host path is
                    the Go codec: the reference); "ranks_equal" whether
                    every rank's results have the same SHA-256;
                    "gpu_path_calls" how many of the GPU path's calls the
                    leader reduced itself (sizes under 1 MiB go to gbbridge
                    in auto mode: then both paths are the host path).
  kind "zstd"       float32 all_reduce with zstd against raw: bits that
                    differ (must be 0).
  kind "allreduce"  float32 sum of integer-valued data in [-3, 3] (exact in
                    every codec, so every call is checked against the exact
                    sum), by mode: raw (the exact path), fp8, fp8 with error
                    feedback (fp8-ef), bf16; the modes alternate call by
                    call, each call timed between device syncs (the slowest
                    rank); time_ms the median; ratio_to_raw the median time
                    over raw's; wrong the largest count of wrong elements of
                    any rank over every checked call.

Exit status 0 when every check passed (no wrong bit, ranks equal, no wrong
element), 1 otherwise.
"""

from __future__ import annotations

import argparse
import hashlib
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
from plugin_bench import BITS, human, parse_size

SCHEMA = "gpubridge.compress-bench/v1"
DTYPES = {"fp8": (torch.float32, torch.bfloat16, torch.float16), "bf16": (torch.float32, torch.bfloat16)}


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
            os.environ.setdefault("GPUBRIDGE_SPLIT_TEST", "half")
        else:
            self.device = torch.device("cpu")
            os.environ.setdefault("GPUBRIDGE_VENDOR", "nvidia" if self.rank < self.world // 2 else "amd")
        import gpubridge  # noqa: PLC0415  (registers the backend; after the vendor is set)

        dist.init_process_group("gpubridge", timeout=timedelta(seconds=300))
        pg = dist.distributed_c10d._get_default_group()
        assert isinstance(pg, gpubridge.GpubridgeProcessGroup), type(pg)
        self.pg = pg
        self.ep = pg._endpoint
        assert self.ep is not None, "every rank must lead its island (2 ranks, split half)"
        self.gloo = dist.new_group(backend="gloo")
        self.gpu_mode = "auto" if self.cuda else "caller"
        self.failed = 0
        ident = "cpu"
        if self.cuda:
            props = torch.cuda.get_device_properties(self.device)
            ident = str(getattr(props, "uuid", f"{os.uname().nodename}/{self.device.index}"))
        ids: list[Any] = [None] * self.world
        dist.all_gather_object(ids, ident, group=self.gloo)
        shared = len(set(ids)) < self.world
        self.note = (
            "CPU smoke test (simulation): no figure means anything" if not self.cuda else
            "split test: two islands of one rank on ONE GPU, both leaders share its host link" if shared else
            "split test: two islands of one rank, one GPU each"
        )  # fmt: skip
        self.row(kind="layout", gpus=torch.cuda.device_count() if self.cuda else 0, ranks=self.world,
                 same_gpu=shared if self.cuda else None,
                 gpu=torch.cuda.get_device_name(self.device) if self.cuda else "cpu", torch=torch.__version__,
                 nccl=".".join(map(str, torch.cuda.nccl.version())) if self.cuda else None)  # fmt: skip

    def row(self, **kw: Any) -> None:
        r = {"schema": SCHEMA, "commit": os.environ.get("GB_COMMIT", "unknown"), "note": self.note, **kw}
        if self.rank == 0:
            with open(self.args.out, "a") as f:
                f.write(json.dumps(r) + "\n")
            print(json.dumps({k: v for k, v in r.items() if k not in ("schema", "note")}), file=sys.stderr)

    def sync(self) -> None:
        if self.cuda:
            torch.cuda.synchronize(self.device)

    def most(self, v: float) -> float:
        t = torch.tensor([v], dtype=torch.float64)
        dist.all_reduce(t, op=dist.ReduceOp.MAX, group=self.gloo)
        return float(t.item())

    def ranks_equal(self, tensors: list[torch.Tensor]) -> bool:
        h = hashlib.sha256()
        for t in tensors:
            h.update(t.contiguous().view(torch.uint8).cpu().numpy().tobytes())
        got: list[Any] = [None] * self.world
        dist.all_gather_object(got, h.hexdigest(), group=self.gloo)
        return len(set(got)) == 1

    def reduce(self, y: torch.Tensor, codec: str, key: Any) -> None:
        self.pg.allreduce_compressed(y, dist.ReduceOp.SUM, codec, key).wait()

    # ---- the GPU path against the host path, bit for bit ----

    def data(self, dt: torch.dtype, n: int, seed: int) -> torch.Tensor:
        """n values of dt: normal values whose scale changes block by block
        (fp8's scales differ), one in 64 any bit pattern."""
        g = torch.Generator().manual_seed(seed)
        scale = torch.exp(torch.randn((n + 31) // 32, generator=g, dtype=torch.float64) * 3)
        x = (torch.randn(n, generator=g, dtype=torch.float64) * scale.repeat_interleave(32)[:n]).to(dt)
        bits = BITS[dt.itemsize]
        raw = torch.randint(-(1 << (8 * dt.itemsize - 1)), 1 << (8 * dt.itemsize - 1), (n,), generator=g,
                            dtype=torch.int64).to(bits)  # fmt: skip
        mask = torch.randint(0, 64, (n,), generator=g) == 0
        x.view(bits)[mask] = raw[mask]
        return x.to(self.device)

    def check(self) -> None:
        sizes = [int(parse_size(s)) for s in self.args.check_sizes.split(",")]
        for codec, dtypes in DTYPES.items():
            for dt in dtypes:
                for n in sizes:
                    ins = [self.data(dt, n, 7919 * s + 31 * self.rank + n) for s in range(self.args.steps)]
                    outs: dict[str, list[torch.Tensor]] = {}
                    gpu_calls = 0
                    for path in ("gpu", "host"):
                        self.ep.reduce_mode = self.gpu_mode if path == "gpu" else "host"
                        before = self.ep.exchanged
                        outs[path] = []
                        for x in ins:
                            y = x.clone()
                            self.reduce(y, codec, ("check", path, codec, str(dt), n))
                            outs[path].append(y)
                        if path == "gpu":
                            gpu_calls = self.ep.exchanged - before
                    self.ep.reduce_mode = "auto"
                    bits = BITS[dt.itemsize]
                    wrong = sum(int((a.view(bits) != b.view(bits)).sum().item())
                                for a, b in zip(outs["gpu"], outs["host"], strict=True))  # fmt: skip
                    wrong = int(self.most(float(wrong)))
                    equal = self.ranks_equal(outs["gpu"] + outs["host"])
                    nans = int(sum(torch.isnan(x).sum().item() for x in ins))
                    self.failed += wrong != 0 or not equal
                    self.row(kind="check", codec=codec, dtype=str(dt).removeprefix("torch."), values=n,
                             steps=self.args.steps, error_feedback=True, wrong=wrong, ranks_equal=equal,
                             gpu_path_calls=gpu_calls, nan_inputs=nans)  # fmt: skip
        n = sizes[-1]
        x = self.data(torch.float32, n, 99 + self.rank)
        y_raw, y_z = x.clone(), x.clone()
        for path in ("gpu", "host"):
            self.ep.reduce_mode = self.gpu_mode if path == "gpu" else "host"
            self.reduce(y_raw, "none", None)
            self.reduce(y_z, "zstd", None)
            wrong = int(self.most(float((y_raw.view(torch.int32) != y_z.view(torch.int32)).sum().item())))
            self.failed += wrong != 0
            self.row(kind="zstd", path=path, dtype="float32", values=n, wrong=wrong)
            y_raw.copy_(x)
            y_z.copy_(x)
        self.ep.reduce_mode = "auto"

    # ---- the time of a bridged all_reduce, by codec ----

    def timed(self, fn: Callable[[], None]) -> float:
        self.sync()
        dist.barrier(group=self.gloo)
        t = time.perf_counter()
        fn()
        self.sync()
        return self.most((time.perf_counter() - t) * 1e3)

    def speed(self) -> None:
        modes: dict[str, tuple[str, bool]] = {
            "raw": ("none", False), "fp8": ("fp8", False), "fp8-ef": ("fp8", True), "bf16": ("bf16", False),
        }  # fmt: skip
        self.ep.reduce_mode = self.gpu_mode
        for size in self.args.sizes.split(","):
            n = int(parse_size(size))
            count = n // 4
            base = torch.arange(count, dtype=torch.int32, device=self.device)
            x0 = ((base + 3 * self.rank) % 7 - 3).to(torch.float32)
            want = sum(((base + 3 * r) % 7 - 3) for r in range(self.world)).to(torch.float32)
            x = torch.empty_like(x0)
            times: dict[str, list[float]] = {m: [] for m in modes}
            wrong = dict.fromkeys(modes, 0)
            checked = dict.fromkeys(modes, 0)
            iters = max(3, min(self.args.iters, int(self.args.budget // n)))
            for it in range(self.args.warmup + iters):
                for m, (codec, ef) in modes.items():
                    x.copy_(x0)
                    key = ("speed", m, n) if ef else None
                    ms = self.timed(lambda x=x, c=codec, k=key: self.reduce(x, c, k))
                    wrong[m] += int((x != want).sum().item())
                    checked[m] += 1
                    if it >= self.args.warmup:
                        times[m].append(ms)
            del x, x0, want, base
            raw = statistics.median(times["raw"])
            for m, (codec, ef) in modes.items():
                t = statistics.median(times[m])
                bad = int(self.most(float(wrong[m])))
                self.failed += bad != 0
                self.row(kind="allreduce", mode=m, codec=codec, error_feedback=ef, dtype="float32", size=n,
                         time_ms=t, time_min_ms=min(times[m]), time_max_ms=max(times[m]),
                         algbw_gbps=n / t / 1e6, ratio_to_raw=t / raw, iters=len(times[m]), wrong=bad,
                         checked_iterations=checked[m], path=self.gpu_mode)  # fmt: skip
            if self.rank == 0:
                print(f"== {human(n)}: " + ", ".join(
                    f"{m} {statistics.median(times[m]):.1f} ms" for m in modes), file=sys.stderr)  # fmt: skip
        self.ep.reduce_mode = "auto"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("out")
    ap.add_argument("--sizes", default="64M,256M,1G")
    ap.add_argument("--check-sizes", default="1,1000,300007,8388613")
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--iters", type=int, default=10)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--budget", type=float, default=16e9, help="bytes per mode and size at most (iterations)")
    ap.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    ap.add_argument("--skip", default="", help="comma-separated parts to skip: check, speed")
    args = ap.parse_args()
    b = Bench(args)
    skip = set(filter(None, args.skip.split(",")))
    if "check" not in skip:
        b.check()
    if "speed" not in skip:
        b.speed()
    dist.barrier(group=b.gloo)
    failed = b.failed
    dist.destroy_process_group()
    if b.rank == 0:
        print(f"compress_bench: {'FAILED' if failed else 'passed'} ({b.note})", file=sys.stderr)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
