"""Calibration: this rank's own measure of how fast it computes, for the
rebalancer (gpubridge.RebalancingSampler, docs/REBALANCING.md).

A :class:`ThroughputMeter` is an observer: it keeps the steps the trainer
marks (``gpubridge.observe.step(samples)``) and the arrival and end of the
collectives this rank calls. A step's *ready time* is from its start to the
rank's call of its last collective (for DDP, the last gradient bucket, called
when backward ends), less the time blocked in synchronous collectives before
it: the work that scales with the samples, whatever the peers do (time
waiting for them is not in it; the optimizer step after the last call is a
per-step cost, left out). The rate is the median over the steps of samples
per second of ready time. On a GPU the host only queues the work, so the
times are the device's: CUDA events at the step's start and end
(gpubridge.observe.step) and at each collective's steps on its stream (a
collective "arrives" on the device when its stream has passed the work
queued before the call). ``gbtrace stragglers --hetero`` splits the same
steps offline, from every rank's records (docs/STRAGGLERS.md).
"""

from __future__ import annotations

import collections
import statistics
import threading
from dataclasses import dataclass
from typing import Any

__all__ = ["Measurement", "ThroughputMeter"]

_KEEP_STEPS = 4096
_KEEP_COLLECTIVES = 65536


@dataclass(frozen=True)
class Measurement:
    """What a meter measured since it was last taken: the steps, their
    samples, and the median samples per second of ready time (0.0 when no
    step could be measured)."""

    steps: int
    samples: int
    rate: float


class ThroughputMeter:
    """An observer (``gpubridge.add_observer``) of this rank's steps and
    collectives; :meth:`take` measures the steps recorded since the last
    take, but the newest (whose last collective's record may still be on
    its way from the worker thread) and any whose GPU times are not in yet.
    On a GPU it measures the device's timeline (the CUDA events of the step
    and of its collectives' steps: a step's host times are only when the
    host queued its work)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._steps: collections.deque[Any] = collections.deque(maxlen=_KEEP_STEPS)
        self._colls: collections.deque[Any] = collections.deque(maxlen=_KEEP_COLLECTIVES)

    def on_collective(self, record: Any) -> None:
        if record.result == "ok" and record.end_ns is not None:
            with self._lock:
                self._colls.append(record)

    def on_step(self, record: Any) -> None:
        with self._lock:
            self._steps.append(record)

    def take(self) -> Measurement:
        with self._lock:
            steps = list(self._steps)[:-1]
            done = 0
            while done < len(steps) and steps[done].ready():
                done += 1
            steps = steps[:done]
            for _ in range(done):
                self._steps.popleft()
            # Collectives before the first step still to measure are done with.
            keep = self._steps[0].start_ns if self._steps else None
            colls = sorted(self._colls, key=lambda c: c.arrived_ns)
            later = (c for c in colls if keep is not None and c.arrived_ns >= keep)
            self._colls = collections.deque(later, maxlen=_KEEP_COLLECTIVES)
        rates, samples = [], 0
        i = 0
        for st in steps:
            while i < len(colls) and colls[i].arrived_ns < st.start_ns:
                i += 1
            j = i
            while j < len(colls) and colls[j].arrived_ns < st.end_ns:
                j += 1
            ready = _ready_ns(st, colls[i:j])
            samples += st.samples
            if st.samples > 0 and ready is not None and ready > 0:
                rates.append(st.samples * 1e9 / ready)
        return Measurement(len(steps), samples, statistics.median(rates) if rates else 0.0)


def _device_times(c: Any) -> tuple[int, int] | None:
    """A collective's (arrival, end) on the device: when its stream passed
    the caller's work (the end of its "running" step) and its last step's
    end; None without device times (or not ready yet)."""
    if not c.ready():
        return None
    names = [p.name for p in c.phases]
    if "running" not in names:
        return None
    arrived, end = c.phases[names.index("running")].gpu_end_ns, c.phases[-1].gpu_end_ns
    return None if arrived is None or end is None else (arrived, end)


def _ready_ns(st: Any, colls: list[Any]) -> int | None:
    """From the step's start to its last collective's call, less the time
    blocked in synchronous calls before it; on the device's timeline when
    the step and its collectives have device times."""
    start, end = int(st.start_ns), int(st.end_ns)
    spans: list[tuple[int, int, bool]] = [(c.arrived_ns, c.end_ns, bool(c.asynchronous)) for c in colls]
    if st.gpu_start_ns is not None:
        dev = [_device_times(c) for c in colls]
        if any(d is None for d in dev):
            return None  # a GPU step whose collectives' device times are not in: not measured
        start, end = int(st.gpu_start_ns), int(st.gpu_end_ns)
        spans = [(d[0], d[1], bool(c.asynchronous)) for d, c in zip(dev, colls, strict=True) if d is not None]
    if not spans:
        return end - start
    last = max(s[0] for s in spans)
    blocked, reach = 0, start
    for arrived, done, asynchronous in sorted(spans):
        if asynchronous:
            continue
        lo, hi = max(arrived, reach), min(done, last)
        if hi > lo:
            blocked += hi - lo
            reach = hi
    return last - start - blocked
