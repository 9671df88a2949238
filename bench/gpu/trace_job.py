"""A traced job on GPUs (bench/gpu/trace-check.sh): a rank of a split test
(GPUBRIDGE_SPLIT_TEST) that all-reduces through the backend with tracing on
(GPUBRIDGE_TRACE), marks its compute with gpubridge.observe.phase, keeps
every record with an observer, and checks that the records' GPU phases
come (record.ready(), never a sync). It also times a 4-byte all_reduce
with no observer (no CUDA event made) and with one (six events per call).

argv: OUTDIR. Writes OUTDIR/rank<R>.json. TRACE_JOB_CPU=1 runs it on CPU
(simulated vendors; no GPU phases to expect): a dry run of the script.
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

import gpubridge
from gpubridge import observe

out = Path(sys.argv[1])
dist.init_process_group(backend="gpubridge")
rank = dist.get_rank()
CPU = os.environ.get("TRACE_JOB_CPU") == "1"
dev = torch.device("cpu") if CPU else torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))


def sync() -> None:
    if not CPU:
        torch.cuda.synchronize()


class Keep:
    def __init__(self) -> None:
        self.records: list[observe.CollectiveRecord] = []

    def on_collective(self, r: observe.CollectiveRecord) -> None:
        self.records.append(r)


def small_calls(n: int) -> float:
    t = torch.ones(1, device=dev)
    sync()
    t0 = time.perf_counter()
    for _ in range(n):
        dist.all_reduce(t)
    sync()
    return (time.perf_counter() - t0) / n * 1e6


res: dict[str, object] = {"rank": rank}
try:
    keep = Keep()
    gpubridge.add_observer(keep)
    a = torch.randn(256 if CPU else 4096, 256 if CPU else 4096, device=dev)
    big = torch.ones(16 << 20, device=dev)  # 64 MiB: the streamed copies
    for _ in range(10):
        with observe.phase("compute"):
            a = (a @ a).tanh_()
        dist.all_reduce(big)
        dist.all_reduce(torch.ones(1 << 10, device=dev))
    sync()
    end = time.monotonic() + 30
    while not all(r.ready() for r in keep.records) and time.monotonic() < end:
        time.sleep(0.01)
    recs = [r.to_dict() for r in keep.records]
    res["records"] = len(recs)
    res["ready"] = all(r.ready() for r in keep.records)
    gpu = [p for r in recs for p in r["phases"] if "gpu_start" in p]
    res["gpu_phases"] = len(gpu)
    res["gpu_phase_names"] = sorted({p["name"] for p in gpu})
    res["big_phases_ms"] = {p["name"]: round(p.get("gpu_end", 0) / 1e6 - p.get("gpu_start", 0) / 1e6, 3)
                            for p in recs[-2]["phases"] if "gpu_start" in p}  # fmt: skip
    res["host_phases_ms"] = {p["name"]: round((p["end"] - p["start"]) / 1e6, 3) for p in recs[-2]["phases"]}
    # Per-call cost of GPU marks: no observer (tracing still on: the trace file keeps them on).
    res["small_us_traced"] = small_calls(300)
    gpubridge.remove_observer(keep)
    res["dump"] = gpubridge.dump_trace("trace-check")
    dist.barrier()
    dist.destroy_process_group()
    res["ok"] = True
except Exception as e:  # the check reports what failed
    res["error"] = repr(e)
(out / f"rank{rank}.json").write_text(json.dumps(res, indent=1))
sys.exit(0 if res.get("ok") else 1)
