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
per second of ready time. ``gbtrace stragglers --hetero`` splits the same
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
    its way from the worker thread)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._steps: collections.deque[tuple[int, int, int]] = collections.deque(maxlen=_KEEP_STEPS)
        self._colls: collections.deque[tuple[int, int, bool]] = collections.deque(maxlen=_KEEP_COLLECTIVES)

    def on_collective(self, record: Any) -> None:
        if record.result != "ok" or record.end_ns is None:
            return
        with self._lock:
            self._colls.append((record.arrived_ns, record.end_ns, bool(record.asynchronous)))

    def on_step(self, record: Any) -> None:
        with self._lock:
            self._steps.append((record.start_ns, record.end_ns, record.samples))

    def take(self) -> Measurement:
        with self._lock:
            if len(self._steps) < 2:
                return Measurement(0, 0, 0.0)
            newest = self._steps.pop()
            steps, self._steps = list(self._steps), collections.deque([newest], maxlen=_KEEP_STEPS)
            colls = sorted(self._colls)
            self._colls = collections.deque((c for c in colls if c[0] >= newest[0]), maxlen=_KEEP_COLLECTIVES)
        rates, samples = [], 0
        i = 0
        for start, end, n in steps:
            while i < len(colls) and colls[i][0] < start:
                i += 1
            j = i
            while j < len(colls) and colls[j][0] < end:
                j += 1
            ready = _ready_ns(start, end, colls[i:j])
            samples += n
            if n > 0 and ready > 0:
                rates.append(n * 1e9 / ready)
        return Measurement(len(steps), samples, statistics.median(rates) if rates else 0.0)


def _ready_ns(start: int, end: int, colls: list[tuple[int, int, bool]]) -> int:
    """From start to the last call, less the time blocked in synchronous
    calls before it (colls: (arrived, end, async), by arrival)."""
    if not colls:
        return end - start
    last = max(c[0] for c in colls)
    blocked, reach = 0, start
    for arrived, done, asynchronous in colls:
        if asynchronous:
            continue
        lo, hi = max(arrived, reach), min(done, last)
        if hi > lo:
            blocked += hi - lo
            reach = hi
    return last - start - blocked
