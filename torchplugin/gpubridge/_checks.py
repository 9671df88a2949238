"""Checks of a call's arguments. They depend only on the arguments, which
every rank passes alike, so every rank reaches the same verdict before any
communication."""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from gpubridge._dtypes import DTYPES, FLOATS, feed_op, op_name
from gpubridge._feed_protocol import Op

__all__ = ["Checks"]


class Checks:
    """The checks of a group of size ranks whose tensors live on device."""

    def __init__(self, size: int, device: torch.device) -> None:
        self._size = size
        self._device = device
        self._cpu = device.type == "cpu"  # any CPU tensor will do (no torch.device made per call)

    def tensor(self, op: str, t: torch.Tensor, dtype_ok: bool = True) -> torch.Tensor:
        if not (t.is_cpu if self._cpu else t.device == self._device):
            raise RuntimeError(
                f"gpubridge: {op}: the tensor is on {t.device}, this rank's device is {self._device}"
            )
        if dtype_ok and t.dtype not in DTYPES:
            raise RuntimeError(f"gpubridge: {op}: unsupported dtype {t.dtype}")
        if not t.is_contiguous():
            raise RuntimeError(f"gpubridge: {op}: the tensor must be contiguous")
        return t

    def one(self, op: str, tensors: list[torch.Tensor]) -> torch.Tensor:
        if len(tensors) != 1:
            raise RuntimeError(
                f"gpubridge: {op}: exactly one tensor per call is supported, got {len(tensors)}"
            )
        return self.tensor(op, tensors[0])

    def one_list(
        self, op: str, lists: list[list[torch.Tensor]], like: torch.Tensor, names: tuple[str, str, str]
    ) -> list[torch.Tensor]:
        """The one list of group-size tensors of a list-of-tensors call, each
        of like's size and dtype. names: what the list, each of its tensors
        and like are called in this call."""
        what, each, other = names
        if len(lists) != 1 or len(lists[0]) != self._size:
            raise RuntimeError(f"gpubridge: {op}: the {what} must be one list of {self._size} tensors")
        for t in lists[0]:
            self.tensor(op, t)
            if t.numel() != like.numel() or t.dtype != like.dtype:
                raise RuntimeError(f"gpubridge: {op}: {each} must match the {other}'s size and dtype")
        return lists[0]

    def sizes(self, op: str, big: torch.Tensor, small: torch.Tensor, names: tuple[str, str]) -> None:
        """Checks both tensors, and that big holds group-size x small of its
        dtype (names: what big and small are called in this call)."""
        self.tensor(op, big)
        self.tensor(op, small)
        if big.numel() != self._size * small.numel() or big.dtype != small.dtype:
            raise RuntimeError(
                f"gpubridge: {op}: the {names[0]} must hold {self._size} x the {names[1]} "
                f"({self._size * small.numel()} elements of {small.dtype}), got {big.numel()} of {big.dtype}"
            )

    @staticmethod
    def same_count(op: str, outputs: list[torch.Tensor], inputs: list[torch.Tensor]) -> None:
        """A coalesced call's outputs and inputs pair up."""
        if len(outputs) != len(inputs):
            raise RuntimeError(f"gpubridge: {op}: as many outputs as inputs are needed")

    @staticmethod
    def reduce_op(op: str, opts: Any, dtype: torch.dtype) -> Op:
        """The feed op of a call's options (SUM without options), refused
        unless supported for dtype."""
        rop = opts.reduceOp if opts is not None else dist.ReduceOp.SUM
        o = feed_op(rop)
        if o is None:
            raise RuntimeError(f"gpubridge: {op}: unsupported reduce op {op_name(rop)} (SUM, AVG, MAX, MIN)")
        if o == Op.AVG and dtype not in FLOATS:
            raise RuntimeError(f"gpubridge: {op}: AVG needs a floating-point tensor, got {dtype}")
        return o
