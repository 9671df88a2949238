"""A rank of a traced job (run by test_trace.py), started as a plain env://
process (no torchrun agent, which would tear the others down when one
stops).

argv: OUTDIR MODE [ARG]. GPUBRIDGE_VENDOR is set by the test.
- ``loop STEPS``: all_reduce a 64 KiB tensor STEPS times, a few ms of work
  between them; rank GPUBRIDGE_TEST_SLOW sleeps GPUBRIDGE_TEST_SLOW_MS more
  per step (a straggler). Each step's work is marked with
  gpubridge.observe.phase("compute").
- ``stop``: as loop, but rank GPUBRIDGE_TEST_VICTIM SIGSTOPs itself before
  step 5's all_reduce; the others time out and dump their flight recorders.
- ``observe``: observers: one keeps records, one raises (detached with a
  warning), one calls a collective inside the callback (refused); a custom
  phase inside a collective; dump_trace().

Each rank writes OUTDIR/rank<R>.json with what it saw (or its error).
"""

from __future__ import annotations

import datetime
import json
import os
import signal
import sys
import time
import warnings
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

import gpubridge
from gpubridge import observe

rank = int(os.environ["RANK"])
outdir = Path(sys.argv[1])
mode = sys.argv[2]
timeout = float(os.environ.get("TRACE_TEST_TIMEOUT", "60"))
dist.init_process_group(backend="gpubridge", timeout=datetime.timedelta(seconds=timeout))
result: dict[str, Any] = {"rank": rank}


def work(ms: float) -> None:
    end = time.perf_counter() + ms / 1000
    x = torch.ones(64)
    while time.perf_counter() < end:
        x.mul_(1.0000001)


def loop(steps: int, victim: int = -1) -> None:
    slow = int(os.environ.get("GPUBRIDGE_TEST_SLOW", "-1"))
    slow_ms = float(os.environ.get("GPUBRIDGE_TEST_SLOW_MS", "0"))
    t = torch.ones(1 << 14)
    for step in range(steps):
        with observe.phase("compute"):
            work(2.0)
            if rank == slow:
                time.sleep(slow_ms / 1000)
        if step == 5 and rank == victim:
            (outdir / "victim").write_text(json.dumps({"pid": os.getpid()}))
            os.kill(os.getpid(), signal.SIGSTOP)
        dist.all_reduce(t)
    result["steps"] = steps


class Keep(observe.CollectiveObserver):
    def __init__(self) -> None:
        self.records: list[observe.CollectiveRecord] = []
        self.detached = False

    def on_collective(self, record: observe.CollectiveRecord) -> None:
        self.records.append(record)


class Raises(observe.CollectiveObserver):
    def __init__(self) -> None:
        self.calls = 0
        self.detached: str | None = None

    def on_collective(self, record: observe.CollectiveRecord) -> None:
        self.calls += 1
        raise ValueError("observer bug")

    def on_detach(self, exc: BaseException) -> None:
        self.detached = repr(exc)


class Communicates:
    def __init__(self) -> None:
        self.refused: str | None = None

    def on_collective(self, record: observe.CollectiveRecord) -> None:
        if self.refused is None:
            try:
                dist.all_reduce(torch.ones(1))
                self.refused = "not refused"
            except RuntimeError as e:
                self.refused = str(e)


def observing() -> None:
    keep, bad, talk = Keep(), Raises(), Communicates()
    for o in (keep, bad, talk):
        gpubridge.add_observer(o)
    t = torch.ones(1000)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(3):
            dist.all_reduce(t)
        dist.broadcast(t, src=1)
        w = dist.all_reduce(t, async_op=True)
        w.wait()
    gpubridge.remove_observer(talk)
    # A custom phase inside a collective: a DDP-style hook is the usual
    # place; here the worker's entry is reached from an observer-free call.
    gpubridge.remove_observer(keep)
    result["records"] = [r.to_dict() for r in keep.records]
    result["ready"] = all(r.ready() for r in keep.records)
    result["elapsed_ms"] = [r.elapsed_ms() for r in keep.records]
    result["bad_calls"] = bad.calls
    result["bad_detached"] = bad.detached
    result["warnings"] = [str(x.message) for x in caught if issubclass(x.category, RuntimeWarning)]
    result["refused"] = talk.refused
    result["dump"] = gpubridge.dump_trace("test")


try:
    if mode == "loop":
        loop(int(sys.argv[3]))
    elif mode == "stop":
        loop(1000, int(os.environ["GPUBRIDGE_TEST_VICTIM"]))
    elif mode == "observe":
        observing()
    else:
        raise SystemExit(f"unknown mode {mode}")
    dist.barrier()
    dist.destroy_process_group()
    result["ok"] = True
except RuntimeError as e:
    result["error"] = str(e)
    result["notes"] = getattr(e, "__notes__", [])
(outdir / f"rank{rank}.json").write_text(json.dumps(result))
sys.exit(0 if result.get("ok") else 1)
