"""Observing collectives: a record of each collective this rank runs, handed
to the observers attached, and steps of one's own.

```python
class Timings(gpubridge.observe.CollectiveObserver):
    def __init__(self):
        self.records = []

    def on_collective(self, record):
        self.records.append(record)  # keep it cheap; read the times later

gpubridge.add_observer(Timings())
```

Rules: observers never communicate (gpubridge refuses its collectives from
inside ``on_collective``), they are local (sequence numbers count every
collective, observed or not), and one that raises is detached on its own
rank with a RuntimeWarning and a call to its ``on_detach(exc)``, while
collectives carry on. Async collectives are observed on the worker thread,
in submission order. On GPUs a record's device times are CUDA events read
later: check ``record.ready()`` first; with no observer and no trace file,
no event is created. ``phase("name")`` marks a step of one's own: inside a
collective (a custom policy's step) it is a phase of that collective's
record; outside one (forward, backward, optimizer), a record of its own in
the trace file, which ``gbtrace perfetto`` shows on its own track.
``step(samples=n)`` marks a training step and the samples it computed: a
``step`` record in the trace file (what ``gbtrace stragglers --hetero``
splits into compute and communication) and ``on_step(record)`` on the
observers that have it (gpubridge.RebalancingSampler's meter).
"""

from __future__ import annotations

import operator
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from gpubridge import _inflight as fl
from gpubridge import _trace
from gpubridge._record import CollectiveRecord, Phase, StepRecord

__all__ = [
    "CollectiveObserver",
    "CollectiveRecord",
    "Phase",
    "StepRecord",
    "add_observer",
    "dump_trace",
    "phase",
    "remove_observer",
    "step",
]


class CollectiveObserver:
    """A base class for observers (any object with on_collective will do)."""

    def on_collective(self, record: CollectiveRecord) -> None:
        """Called after each collective of this rank, on the thread that ran
        it. Keep it cheap; never communicate."""

    def on_step(self, record: StepRecord) -> None:
        """Called after each training step this rank marked with
        gpubridge.observe.step, on the thread that marked it."""

    def on_detach(self, exc: BaseException) -> None:
        """Called once this observer was detached for raising exc."""


def add_observer(observer: Any) -> None:
    """Start handing this rank's collective records to observer."""
    _trace.add_observer(observer)


def remove_observer(observer: Any) -> None:
    _trace.remove_observer(observer)


def dump_trace(reason: str = "gpubridge.dump_trace()") -> str | None:
    """Writes the flight recorder (this rank's last collectives and what is
    in flight) to the dump directory (GPUBRIDGE_TRACE_DUMP_DIR); returns the
    file's path, or None when it could not be written."""
    p = _trace.dump(reason)
    return str(p) if p is not None else None


@contextmanager
def phase(name: str) -> Iterator[None]:
    """Marks a step of one's own (see the module's doc)."""
    e = fl.current()
    if e is not None:
        prev = e.step
        e.set_step(name)
        try:
            yield
        finally:
            e.set_step(prev)
        return
    start = time.monotonic()
    try:
        yield
    finally:
        _trace.add_phase(name, start, time.monotonic())


@contextmanager
def step(samples: int) -> Iterator[None]:
    """Marks one training step of this rank and the samples it computed
    (its share of the global batch, over every micro-batch of a step with
    gradient accumulation): ``with gpubridge.observe.step(len(batch)):``
    around forward, backward and the optimizer. Every rank marks the same
    steps, in the same order. On a GPU (with tracing or an observer) it also
    records a CUDA event on the current stream at the step's start and end:
    the device's times, read later (the record's ready())."""
    try:
        n = -1 if isinstance(samples, bool) else operator.index(samples)
    except TypeError:
        n = -1
    if n < 0:
        raise ValueError(f"gpubridge.observe.step: samples must be an integer >= 0, not {samples!r}")
    marker = _trace.step_marker()
    if marker is not None:
        marker("start")
    start = time.monotonic()
    yield  # a step that raises is not recorded: it did not end
    end = time.monotonic()
    if marker is not None:
        marker("end")
    _trace.add_step(n, start, end, marker)
