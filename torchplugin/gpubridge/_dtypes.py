"""torch's dtypes and reduce ops in the feed's terms and the native groups'."""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from gpubridge._feed_protocol import DType, Op

__all__ = ["DTYPES", "FLOATS", "NATIVE_OP", "OP_NAMES", "as_bytes", "feed_op", "op_name"]

DTYPES: dict[torch.dtype, DType] = {
    torch.float32: DType.FLOAT32,
    torch.float64: DType.FLOAT64,
    torch.bfloat16: DType.BFLOAT16,
    torch.float16: DType.FLOAT16,
    torch.int32: DType.INT32,
    torch.int64: DType.INT64,
    torch.int8: DType.INT8,
    torch.uint8: DType.UINT8,
}
FLOATS = {torch.float32, torch.float64, torch.bfloat16, torch.float16}
_OPS: list[tuple[Any, Op]] = [
    (dist.ReduceOp.SUM, Op.SUM),
    (dist.ReduceOp.AVG, Op.AVG),
    (dist.ReduceOp.MAX, Op.MAX),
    (dist.ReduceOp.MIN, Op.MIN),
]
# Each op's name (a call's detail), without the Enum's name lookup per call.
OP_NAMES: dict[Op, str] = {o: o.name for o in Op}
# AVG is a SUM on the native groups too, divided once at the end.
NATIVE_OP: dict[Op, Any] = {
    Op.SUM: dist.ReduceOp.SUM,
    Op.AVG: dist.ReduceOp.SUM,
    Op.MAX: dist.ReduceOp.MAX,
    Op.MIN: dist.ReduceOp.MIN,
}


def feed_op(rop: Any) -> Op | None:
    """The feed op of a torch ReduceOp (options carry a ReduceOp object that
    compares equal to, but does not hash like, ReduceOp.SUM and friends)."""
    for t, op in _OPS:
        if rop == t:
            return op
    return None


def op_name(rop: Any) -> str:
    return str(getattr(rop, "op", rop)).rsplit(".", 1)[-1]


def as_bytes(t: torch.Tensor) -> torch.Tensor:
    """A flat uint8 view of a contiguous tensor (one view, not two, of a
    flat one: every call's copy into the region makes one)."""
    if t.dim() == 1:
        return t.view(torch.uint8)
    return t.reshape(-1).view(torch.uint8)
