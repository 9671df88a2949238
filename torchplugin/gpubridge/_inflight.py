"""Which collective each thread is inside, readable from any thread.

Every collective of a gpubridge group gets a sequence number at submission
(the group's call count, the same on every rank because every rank submits
the same collectives in the same order). The thread that runs it (the
group's worker) updates its entry at each step; :func:`in_flight` copies the
table without taking a lock the worker could hold, so it never blocks — a
hang finder can call it from a signal handler or a watchdog thread while a
collective is stuck.

Each entry also keeps its closed steps with their ends (``marks``), which
the flight recorder and the trace records read (:mod:`gpubridge._trace`);
with tracing on a GPU, ``mark`` records a CUDA event at each step as well
(one branch when it is off).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

__all__ = ["Entry", "in_flight"]

# Steps of a collective, in the order an all_reduce goes through them.
QUEUED = "queued"
RUNNING = "running"  # started, before its first step
CHECK = "check calls"  # GPUBRIDGE_CHECK_CALLS: every rank's call compared
ISLAND_REDUCE = "island reduce"
COPY = "copy"
BRIDGE = "bridge"
COPY_BACK = "copy back"
ISLAND_BROADCAST = "island broadcast"
ISLAND_GATHER = "island allgather"
ISLAND_SCATTER = "island scatter"
NATIVE = "native"  # the whole collective on the native group (one island)
P2P = "p2p"
DONE = "done"


@dataclass(slots=True)
class Entry:
    """One collective in flight on one thread."""

    group: str
    seq: int
    op: str
    nbytes: int
    step: str
    submitted_by: str
    started: float = field(default_factory=time.monotonic)
    step_started: float = field(default_factory=time.monotonic)
    thread: str = ""

    # Seconds spent in each step so far (the group's statistics take them
    # when the collective ends).
    steps: dict[str, float] = field(default_factory=dict)
    # The steps taken so far, flat: a step's name, then the time it ended
    # (monotonic seconds; it began when the one before ended, the first at
    # started). Flat, of strings and floats: no object the garbage collector
    # tracks is made per step.
    marks: list[str | float] = field(default_factory=list)
    # What the trace records say about the call, set at submission: its
    # dtype, its options as its signature has them, whether it is async.
    dtype: Any = None
    detail: str = ""
    asynchronous: bool = False
    # How the bridged step packed its transfers (gpubridge._policy chose it
    # for the call: "raw", "bf16", "fp8", "zstd"), set by the algorithm.
    codec: str = "raw"
    error: str | None = None  # set when it ended with one
    # Tracing on a GPU: called with each new step (records a CUDA event).
    mark: Callable[[str], None] | None = None
    # On a leader, what gbbridge measured of the bridged step (the DONE's
    # gpubridge._feed_protocol.BridgeStats), and the global rank of each
    # bridge member, in member order.
    bridge: Any = None
    bridge_ranks: Sequence[int] = ()

    def set_step(self, step: str) -> None:
        now = time.monotonic()
        self.steps[self.step] = self.steps.get(self.step, 0.0) + now - self.step_started
        self.marks.append(self.step)
        self.marks.append(now)
        self.step = step
        self.step_started = now
        if self.mark is not None:
            self.mark(step)

    def phases(self) -> list[tuple[str, float, float]]:
        """The steps taken, as (name, start, end)."""
        m, out, start = self.marks, [], self.started
        for i in range(0, len(m) - 1, 2):
            end = float(m[i + 1])
            out.append((str(m[i]), start, end))
            start = end
        return out


# What in_flight() shows of an entry (with its seconds).
_SHOWN = ("group", "seq", "op", "nbytes", "step", "submitted_by", "thread")

# thread ident -> entry. Written only by the thread it names (a dict item
# assignment is atomic under the GIL); read by anyone with dict.copy().
_table: dict[int, Entry] = {}


def enter(e: Entry) -> None:
    e.thread = threading.current_thread().name
    _table[threading.get_ident()] = e


def leave() -> None:
    _table.pop(threading.get_ident(), None)


def current() -> Entry | None:
    """The collective the calling thread is inside, if any."""
    return _table.get(threading.get_ident())


def entries() -> list[Entry]:
    """The entries in flight (a copy of the table, never blocking)."""
    return list(_table.copy().values())


def in_flight() -> list[dict[str, Any]]:
    """The collectives running right now, one dict per thread inside one:
    group, seq (equal on every rank), op, nbytes, step (island reduce, copy,
    bridge, copy back, island broadcast, …), the thread running it and the
    thread that submitted it, and seconds since it and its step started.
    Never blocks."""
    now = time.monotonic()
    out = []
    for e in entries():
        d: dict[str, Any] = {k: getattr(e, k) for k in _SHOWN}
        d["seconds"] = round(now - e.started, 6)
        d["step_seconds"] = round(now - e.step_started, 6)
        out.append(d)
    out.sort(key=lambda d: (d["group"], d["seq"]))
    return out
