"""Compressed gradient all_reduce for DDP, with error feedback:
:class:`CompressionState` and :func:`compressed_hook`, registered as torch's
PowerSGD state and hook are::

    state = gpubridge.CompressionState(codec="fp8")
    model.register_comm_hook(state, gpubridge.compressed_hook)

Each bucket is all-reduced through the gpubridge group with the state's
codec on the bridge (docs/COMPRESSION.md); with error feedback each island
leader keeps, per bucket, a float32 residual of what quantizing lost and
adds it to the next step's bucket, so that nothing is lost for good, only
late. The residual is keyed by the state and the bucket's index, and
starts again from zero when DDP rebuilds its buckets (after the first
iteration) with other sizes.

No ``from __future__ import annotations`` here: DDP checks the hook's
annotations at registration and needs the real types, not strings.
"""

import itertools
from typing import Any

import torch
import torch.distributed as dist

from gpubridge._group import GpubridgeProcessGroup, find_group
from gpubridge._policy import parse_codec

__all__ = ["CompressionState", "compressed_hook"]

_IDS = itertools.count()


class CompressionState:
    """The state of :func:`compressed_hook`: the gpubridge group (None: the
    default group), the codec of its bridged step ("fp8", "bf16", "zstd" or
    "none"; any name GPUBRIDGE_COMPRESSION takes) and whether the lossy
    codecs use error feedback.

    Memory: with error feedback, each island leader keeps one float32
    residual per bucket: 4 bytes per gradient value (as much again as a
    float32 model's gradients, twice a bfloat16 one's), in GPU memory on
    the two-island GPU path, else in gbbridge's host memory; freed when the
    group is destroyed. Other ranks keep nothing."""

    def __init__(self, process_group: Any = None, codec: str = "fp8", error_feedback: bool = True) -> None:
        self.process_group = process_group
        self.codec = str(parse_codec(codec))
        self.error_feedback = bool(error_feedback)
        self.id = next(_IDS)  # the residuals' keys: (this, the bucket's index)

    def group(self) -> GpubridgeProcessGroup:
        """The gpubridge group the hook all-reduces through."""
        return find_group(self.process_group, "gpubridge.compressed_hook")

    def __repr__(self) -> str:
        return f"CompressionState(codec={self.codec!r}, error_feedback={self.error_feedback}, id={self.id})"


def compressed_hook(state: CompressionState, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:  # type: ignore[name-defined]
    """A DDP communication hook: all-reduces the bucket to its mean with the
    state's codec on the bridge (``model.register_comm_hook(state,
    gpubridge.compressed_hook)``). As gpubridge.ddp_comm_hook, the sum is
    taken first and divided once at the end; island steps stay exact."""
    if not isinstance(state, CompressionState):
        raise TypeError("gpubridge.compressed_hook: its state must be a gpubridge.CompressionState")
    key = ("hook", state.id, bucket.index()) if state.error_feedback else None
    work = state.group().allreduce_compressed(bucket.buffer(), dist.ReduceOp.AVG, state.codec, key)
    fut: torch.futures.Future[torch.Tensor] = work.get_future().then(lambda f: f.value()[0])
    return fut
