"""Device times of a collective's steps when tracing on a GPU: a CUDA event
(with timing) recorded on the group's stream at each step, read once it
has completed; never a device sync. Made only with tracing on.

Device times are mapped onto the host's monotonic clock through an
*anchor*: an event recorded on a stream of its own with nothing queued, so
that the device passes it at once; its host time is the time it was
recorded, which is early by the device's launch latency (a few
microseconds). A new anchor is taken every second, so that the float
milliseconds cudaEventElapsedTime gives stay exact to about a microsecond.
"""

from __future__ import annotations

import threading
import time
from typing import Any

import torch

__all__ = ["Marker"]

_ANCHOR_EVERY_S = 1.0
_lock = threading.Lock()
_anchors: dict[int, tuple[float, Any, Any]] = {}  # device index -> (host monotonic s, event, stream)


def _timed_event() -> Any:
    return torch.cuda.Event(enable_timing=True)  # type: ignore[no-untyped-call]


def _anchor(device: torch.device) -> tuple[int, Any]:
    """(host ns, event) of a recent anchor on device."""
    idx = device.index if device.index is not None else torch.cuda.current_device()
    with _lock:
        a = _anchors.get(idx)
        now = time.monotonic()
        if a is None or now - a[0] > _ANCHOR_EVERY_S:
            stream = a[2] if a is not None else torch.cuda.Stream(device)  # type: ignore[no-untyped-call]
            ev = _timed_event()
            now = time.monotonic()
            ev.record(stream)
            a = (now, ev, stream)
            _anchors[idx] = a
    return round(a[0] * 1e9), a[1]


class Marker:
    """The events of one collective: set as its in-flight entry's mark,
    called with each new step on the thread that runs it."""

    __slots__ = ("_anchor", "_events", "_stream")

    def __init__(self, device: torch.device, stream: Any) -> None:
        self._stream = stream
        self._anchor = _anchor(device)
        self._events: list[Any] = []

    def __call__(self, step: str) -> None:
        ev = _timed_event()
        ev.record(self._stream)
        self._events.append(ev)

    def ready(self) -> bool:
        return self._anchor[1].query() and all(ev.query() for ev in self._events)

    def times(self) -> list[int]:
        """Host-clock ns of each event, in order (only once ready)."""
        base_ns, base = self._anchor
        return [base_ns + round(base.elapsed_time(ev) * 1e6) for ev in self._events]
