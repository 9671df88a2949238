"""What tracing costs (docs/BENCHMARKS.md, "Tracing"): rows on stdout (JSON
Lines, schema gpubridge.bench-trace/v1), progress on stderr.

    PYTHONPATH=torchplugin .venv/bin/python bench/trace_cost.py [--quick]

1. ``recorder``: the flight recorder's work per collective, which every rank
   does with tracing off (goal: at most 1 µs). A collective's in-flight
   entry goes through what the worker does to it, six steps from submission
   to its end, in three ways, alternating in blocks: the entry as it was
   before tracing (``anchor``: the same steps without the marks, the call's
   details or the ring), with the recorder (``ring``, GPUBRIDGE_TRACE_BUFFER's
   default of 2000), and with a trace file (``traced``: the record built,
   encoded and buffered for DIR/rank-<r>.jsonl). Each block is timed in the
   thread's CPU time, so that what a loaded machine preempts does not count;
   the cost is the median per-block difference to the anchor.
2. ``demo``: make demo's training job (4 simulated ranks, DDP, 200 steps) run
   alternately without and with GPUBRIDGE_TRACE, 3 times each: samples/s
   of each run, and the tracing cost per step from (1): records per step
   times the cost of a traced record, over the step time (goal: at most 2%).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
SCHEMA = "gpubridge.bench-trace/v1"
STEPS = ("running", "island reduce", "copy", "bridge", "copy back", "island broadcast")


def say(msg: str) -> None:
    print(f"trace_cost: {msg}", file=sys.stderr, flush=True)


@dataclass
class OldEntry:
    """gpubridge._inflight.Entry before tracing (the anchor)."""

    group: str
    seq: int
    op: str
    nbytes: int
    step: str
    submitted_by: str
    started: float = field(default_factory=time.monotonic)
    step_started: float = field(default_factory=time.monotonic)
    thread: str = ""
    steps: dict[str, float] = field(default_factory=dict)

    def set_step(self, step: str) -> None:
        now = time.monotonic()
        self.steps[self.step] = self.steps.get(self.step, 0.0) + now - self.step_started
        self.step = step
        self.step_started = now


def recorder(blocks: int, per_block: int) -> list[dict[str, object]]:
    import torch  # noqa: PLC0415

    from gpubridge import _inflight as fl  # noqa: PLC0415
    from gpubridge import _trace  # noqa: PLC0415
    from gpubridge._record import GroupInfo  # noqa: PLC0415

    info = GroupInfo(
        name="b", rank=0, size=4, island="nvidia", leader=True, local_peers=[1, 2], policy="hierarchical",
        device="cpu", submitted=lambda: 0, ranks_of=lambda: [0, 1, 2, 3],
    )  # fmt: skip
    _trace._groups["b"] = info
    _trace._rank = 0
    dtype = torch.float32
    name = threading.current_thread().name
    tmp = Path(tempfile.mkdtemp(prefix="gpubridge-trace-cost-"))

    def anchor(n: int) -> None:
        for i in range(n):
            e = OldEntry("b", i, "allreduce", 4096, "queued", name)
            for s in STEPS:
                e.set_step(s)
            e.set_step("done")

    def with_ring(n: int) -> None:
        for i in range(n):
            e = fl.Entry("b", i, "allreduce", 4096, "queued", name)
            e.dtype, e.detail = dtype, "SUM"
            for s in STEPS:
                e.set_step(s)
            e.set_step("done")
            _trace.finish(e, None)

    import collections  # noqa: PLC0415

    ring: collections.deque[tuple[fl.Entry, str | None]] = collections.deque(maxlen=2000)
    writer = _trace._Writer(tmp)
    runs = {"anchor": anchor, "ring": with_ring, "traced": with_ring}
    per: dict[str, list[float]] = {k: [] for k in runs}
    for b in range(blocks):
        for k, fn in runs.items():
            _trace._ring = ring
            _trace._writer = writer if k == "traced" else None
            t0 = time.thread_time_ns()  # CPU time: what a shared, loaded machine preempts is not counted
            fn(per_block)
            per[k].append((time.thread_time_ns() - t0) / per_block)
        if b % 10 == 0:
            say(f"recorder block {b}/{blocks}")
    _trace._writer = None
    writer.flush()
    lines = sum(1 for _ in writer.path.open())
    med = {k: statistics.median(v) for k, v in per.items()}
    rows: list[dict[str, object]] = []
    for k in ("ring", "traced"):
        diffs = [a - b for a, b in zip(per[k], per["anchor"], strict=True)]
        rows.append({
            "schema": SCHEMA, "kind": "recorder", "config": k, "blocks": blocks, "per_block": per_block,
            "anchor_ns": round(med["anchor"], 1), "ns": round(med[k], 1),
            "cost_ns_p50": round(statistics.median(diffs), 1),
            "cost_ns_p10": round(sorted(diffs)[len(diffs) // 10], 1),
            "cost_ns_p90": round(sorted(diffs)[len(diffs) * 9 // 10], 1),
            "lines_written": lines if k == "traced" else 0,
        })  # fmt: skip
    return rows


def demo_run(bin_dir: Path, trace: Path | None, steps: int) -> dict[str, object]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("GPUBRIDGE_")}
    env.update(GPUBRIDGE_SIM_VENDORS="nvidia,nvidia,amd,amd", GPUBRIDGE_BIN_DIR=str(bin_dir),
               PYTHONPATH=str(REPO / "torchplugin"), OMP_NUM_THREADS="1")  # fmt: skip
    if trace is not None:
        env["GPUBRIDGE_TRACE"] = str(trace)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "4",
           str(REPO / "examples" / "ddp_train.py"), "--json", "--epochs", "4", "--max-steps", str(steps),
           "--log-every", str(steps)]  # fmt: skip
    p = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=900, check=True)
    res = next(json.loads(x) for x in p.stdout.splitlines() if '"kind": "result"' in x)
    return res


def demo(bin_dir: Path, rounds: int, steps: int, traced_ns: float) -> list[dict[str, object]]:
    rows: list[dict[str, object]] = []
    records = []
    for i in range(rounds):
        for traced in (False, True):
            d = Path(tempfile.mkdtemp(prefix="gpubridge-trace-demo-")) / "trace" if traced else None
            res = demo_run(bin_dir, d, steps)
            row = {
                "schema": SCHEMA, "kind": "demo", "round": i, "traced": traced, "steps": res["steps"],
                "samples_per_s": res["samples_per_s"], "seconds": res["seconds"],
            }  # fmt: skip
            if d is not None:
                n = sum(1 for x in (d / "rank-0.jsonl").open() if '"kind":"collective"' in x)
                row["records_rank0"] = n
                records.append(n / res["steps"])
            say(f"demo round {i} traced={traced}: {res['samples_per_s']} samples/s")
            rows.append(row)
    plain = statistics.median(r["samples_per_s"] for r in rows if not r["traced"])  # type: ignore[misc]
    traced_sps = statistics.median(r["samples_per_s"] for r in rows if r["traced"])  # type: ignore[misc]
    step_s = 4 * 64 / plain  # samples per step (4 ranks x batch 64) / samples per s
    per_step = statistics.median(records)
    rows.append({
        "schema": SCHEMA, "kind": "demo-cost", "step_ms": round(step_s * 1e3, 3),
        "records_per_step": round(per_step, 3), "traced_record_ns": round(traced_ns, 1),
        "cost_share": round(per_step * traced_ns * 1e-9 / step_s, 6),
        "samples_per_s_plain": plain, "samples_per_s_traced": traced_sps,
        "ab_share": round(plain / traced_sps - 1, 4),
    })  # fmt: skip
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    ap.add_argument("--quick", action="store_true", help="fewer blocks and one demo round")
    ap.add_argument("--bin", default=str(REPO / "bin"))
    args = ap.parse_args()
    git = ["git", "rev-parse", "--short", "HEAD"]
    commit = subprocess.run(git, capture_output=True, text=True, cwd=REPO, check=False)
    host = {
        "schema": SCHEMA, "kind": "host", "host": os.uname().nodename, "cpus": os.cpu_count(),
        "load_before": round(os.getloadavg()[0], 2), "commit": commit.stdout.strip() or "unknown",
    }  # fmt: skip
    rows = recorder(20 if args.quick else 200, 2000)
    for r in rows:
        print(json.dumps(r), flush=True)
    traced = next(r for r in rows if r["config"] == "traced")["cost_ns_p50"]
    more = demo(Path(args.bin), 1 if args.quick else 3, 200, float(traced))  # type: ignore[arg-type]
    host["load_after"] = round(os.getloadavg()[0], 2)
    for r in [host, *more]:
        print(json.dumps(r), flush=True)


if __name__ == "__main__":
    main()
