"""The ``gpubridge`` torch.distributed backend: its registration with torch.

``import gpubridge`` registers the name for CPU and GPU tensors with torch's
extended creator API, so the creator gets the group's store, rank, size,
timeout and name; the group is :class:`gpubridge._group.GpubridgeProcessGroup`.
"""

from __future__ import annotations

from typing import Any

import torch.distributed as dist

from gpubridge import _native
from gpubridge._group import BACKEND_NAME, GpubridgeProcessGroup

__all__ = ["register"]


def _create(opts: Any, backend_options: Any = None) -> GpubridgeProcessGroup:
    """The creator torch calls (extended API: the group's name comes too)."""
    _native.refuse_if_native("init_process_group(backend='gpubridge')")
    return GpubridgeProcessGroup(
        opts.store, int(opts.group_rank), int(opts.group_size), opts.timeout, str(opts.group_id or "default")
    )


def register() -> None:
    """Registers the backend name "gpubridge" (once), for CPU and GPU tensors."""
    if BACKEND_NAME.upper() in dist.Backend._plugins:
        return
    dist.Backend.register_backend(BACKEND_NAME, _create, extended_api=True, devices=["cpu", "cuda"])
