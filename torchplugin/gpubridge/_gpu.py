"""CUDA helpers of the backend: streams, events waited for with a deadline
(a stuck GPU is an error, not a hang), page-locking host memory."""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Iterator
from typing import Any

import torch

__all__ = [
    "host_register",
    "host_unregister",
    "new_event",
    "new_stream",
    "on_stream",
    "sync_stream",
    "wait_event",
]


def _cudart() -> Any:
    return torch.cuda.cudart()  # type: ignore[no-untyped-call]


def new_stream(device: torch.device) -> Any:
    return torch.cuda.Stream(device)  # type: ignore[no-untyped-call]


@contextlib.contextmanager
def on_stream(device: torch.device, stream: Any) -> Iterator[None]:
    """Queues the work of the block on stream of device."""
    with torch.cuda.device(device), torch.cuda.stream(stream):
        yield


def new_event(timing: bool = False) -> Any:
    return torch.cuda.Event(enable_timing=timing)  # type: ignore[no-untyped-call]


def wait_event(ev: Any, what: str, secs: float, pump: Callable[[], None] | None = None) -> None:
    """Waits until a CUDA event has completed, at most secs; with pump,
    calls it between polls (to handle what the bridge sends meanwhile)."""
    deadline = time.monotonic() + secs
    pause = 0.00005
    while not ev.query():
        if pump is not None:
            pump()
        if time.monotonic() > deadline:
            raise RuntimeError(f"{what} did not finish on the GPU within {secs:g} s")
        time.sleep(pause)
        if pump is None:
            pause = min(2 * pause, 0.0002)


def sync_stream(stream: Any, what: str, secs: float) -> None:
    """Waits, at most secs, until the work queued on stream so far is done."""
    ev = new_event()
    ev.record(stream)
    wait_event(ev, what, secs)


def host_register(ptr: int, size: int, what: str) -> None:
    """Page-locks host memory, so that copies to and from the GPU use it
    directly."""
    rc = _cudart().cudaHostRegister(ptr, size, 0)
    if int(rc) != 0:
        raise RuntimeError(f"gpubridge: cudaHostRegister of {what} failed: {rc}")


def host_unregister(ptr: int) -> None:
    _cudart().cudaHostUnregister(ptr)
