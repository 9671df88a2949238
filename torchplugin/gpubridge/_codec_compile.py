"""gpubridge._codec compiled on GPUs.

The codec is dozens of elementwise torch ops on the float32 bits; run one
by one on a GPU, each a pass over memory, fp8 with error feedback takes 14
ms for 64 Mi float32 values on an H200. torch.compile fuses them into a few
Triton kernels: 1.2 ms, with the same bits (integer ops, and float ops that
are single IEEE operations either way; bench/gpu/codec_compile.py checks
every operation against the eager one, bench/gpu/codec_check.py against the
Go codec's vectors).

GPUBRIDGE_CODEC_COMPILE: ``auto`` (default) compiles on CUDA tensors when
Triton can be imported, and a compile that fails falls back to the eager
ops with one warning; ``1`` compiles on CUDA tensors and a failure is an
error; ``0`` never compiles. CPU tensors always run eagerly. Only whole
groups of 1024 values are compiled (``_codec`` runs a tail eagerly: a
buffer's packing is its whole groups' followed by the tail's), so sizes
stay dynamic and nothing recompiles per size. The first call of each
operation and dtype compiles it: seconds, once per process (inductor's
cache keeps the kernels across runs).
"""

from __future__ import annotations

import importlib.util
import logging
import os
import threading
from collections.abc import Callable
from typing import Any

import torch

__all__ = ["MODES", "enabled", "run"]

log = logging.getLogger("gpubridge")

MODES = ("auto", "0", "1")
_lock = threading.Lock()
_compiled: dict[Callable[..., Any], Callable[..., Any]] = {}
_failed: set[Callable[..., Any]] = set()
_triton: bool | None = None


def mode() -> str:
    m = os.environ.get("GPUBRIDGE_CODEC_COMPILE", "auto").strip().lower() or "auto"
    if m not in MODES:
        raise ValueError(f"GPUBRIDGE_CODEC_COMPILE={m!r}: want one of {', '.join(MODES)}")
    return m


def _has_triton() -> bool:
    global _triton  # noqa: PLW0603
    if _triton is None:
        _triton = importlib.util.find_spec("triton") is not None
    return _triton


def enabled(t: torch.Tensor) -> bool:
    """Whether the codec runs compiled on t's device."""
    if t.device.type != "cuda":
        return False
    m = mode()
    return m == "1" or (m == "auto" and _has_triton())


def run(fn: Callable[..., Any], *args: Any) -> Any:
    """fn(*args), compiled. In auto mode a failure to compile makes fn run
    eagerly from then on (the same bits), unless the eager call fails too:
    then that is the caller's error, raised as the eager op raises it."""
    if fn in _failed:
        return fn(*args)
    with _lock:  # compiling from two threads at once is not supported
        c = _compiled.get(fn)
        if c is None:
            c = _compiled[fn] = torch.compile(fn, dynamic=True)
        try:
            return c(*args)
        except Exception as e:
            if mode() == "1":
                raise
            err = e
    out = fn(*args)
    _failed.add(fn)
    log.warning("gpubridge: the codec's %s did not compile, it runs eagerly (the same bits, slower): %s",
                getattr(fn, "__name__", fn), err)  # fmt: skip
    return out
