"""Where a bridged all_reduce's time goes on a GPU leader (run by
bench/gpu/plugin-profile.sh under torchrun, 2 ranks, split test: every rank is a
leader of a one-GPU island).

For each size, the median over iterations of:
  d2h      the chunked copy of the tensor into the page-locked feed region
           (cudaMemcpyAsync per chunk, then a stream synchronize);
  h2d      the copy back;
  bridge   gbbridge's all_reduce of the region alone (not streamed: the data
           are already there), through the feed;
  full     the backend's all_reduce (streamed: copies and wire overlap);
  nccl     a world NCCL all_reduce of the same tensor (the anchor).
Rank 0 prints one JSON line per size (schema gpubridge.plugin-profile/v1).
"""

from __future__ import annotations

import json
import os
import statistics
import sys
import time
from collections.abc import Callable

import torch
import torch.distributed as dist

import gpubridge
from gpubridge._feed import DType, Op

# A torchrun worker: --help is the only thing it does outside torchrun.
if __name__ == "__main__" and sys.argv[1:2] in (["-h"], ["--help"]):
    print(__doc__)
    sys.exit(0)
rank = int(os.environ["RANK"])
SIZES = [1 << 20, 4 << 20, 16 << 20, 25 << 20, 64 << 20, 256 << 20]


def timed(fn: Callable[[], None], iters: int) -> float:
    out = []
    for _ in range(iters):
        torch.cuda.synchronize()
        t = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        out.append(time.perf_counter() - t)
    return statistics.median(out) * 1e3


def profile(pg: gpubridge.GpubridgeProcessGroup, nccl: object, n: int, chunk: int) -> dict[str, object]:
    """One size: each part alone, then the whole, then NCCL."""
    t = torch.ones(n // 4, device=pg.device)
    src = t.view(torch.uint8)
    ep = pg._endpoint  # this leader's end of the bridge (gpubridge._endpoint)
    assert ep is not None
    host = ep.staging.tensor(n)
    region, feed = ep.staging.region, ep.feed
    assert region is not None
    stream = torch.cuda.current_stream()

    def d2h() -> None:
        for off in range(0, n, chunk):
            host[off : off + chunk].copy_(src[off : off + chunk], non_blocking=True)
        stream.synchronize()

    def h2d() -> None:
        for off in range(0, n, chunk):
            src[off : off + chunk].copy_(host[off : off + chunk], non_blocking=True)
        stream.synchronize()

    def bridge() -> None:
        feed.all_reduce(region, 0, n, DType.FLOAT32, Op.MAX)

    def full() -> None:
        dist.all_reduce(t, op=dist.ReduceOp.MAX)

    def anchor() -> None:
        dist.all_reduce(t, op=dist.ReduceOp.MAX, group=nccl)

    iters = 20 if n <= (64 << 20) else 8
    row: dict[str, object] = {"schema": "gpubridge.plugin-profile/v1", "bytes": n, "chunk": chunk}
    for name, fn in (("d2h", d2h), ("h2d", h2d), ("bridge", bridge), ("full", full), ("nccl", anchor)):
        fn()
        ms = timed(fn, iters)
        row[f"{name}_ms"] = round(ms, 3)
        row[f"{name}_gbps"] = round(n / ms / 1e6, 2)
    return row


def main() -> int:
    dist.init_process_group("gpubridge")
    pg = dist.distributed_c10d._get_default_group()
    assert isinstance(pg, gpubridge.GpubridgeProcessGroup)
    nccl = dist.new_group(backend="nccl")
    chunk = int(os.environ.get("GPUBRIDGE_COPY_CHUNK", str(8 << 20)))
    for n in SIZES:
        row = profile(pg, nccl, n, chunk)
        if rank == 0:
            print(json.dumps(row), flush=True)
            parts = "  ".join(f"{k} {row[k + '_ms']} ms" for k in ("d2h", "h2d", "bridge", "full", "nccl"))
            print(f"{n >> 20:5d} MiB: {parts}", file=sys.stderr)
    if rank == 0:
        print(json.dumps({"schema": "gpubridge.plugin-profile/v1", "stats": pg.stats()}), flush=True)
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
