"""The bridge's reduction of two members' values, on tensors (the GPU, or
the CPU in simulation): the caller's half of the feed's "exchange, reduce on
the caller" all_reduce (docs/FEED.md, version 2).

The arithmetic is lib/reduce's (Go), which the host path runs and which
defines the bits every member must end with: one IEEE operation per
element in the dtype's precision (float16 and bfloat16 widened to float32
and rounded once, to nearest even), max and min returning an operand with
-0 below +0, and a fixed NaN: ``a`` quieted if it is a NaN, else ``b``
quieted, else the default NaN. Hardware picks NaNs its own way (NVIDIA GPUs
return one canonical NaN), so the NaN rule and the signed zeros are
applied explicitly. Only the floating dtypes and sum, prod, max, min are
done here; integers stay on the host path.
"""

from __future__ import annotations

from typing import Final

import torch

from gpubridge._feed_protocol import Op

__all__ = ["OPS", "can_combine", "combine"]

OPS: Final = (Op.SUM, Op.PROD, Op.MAX, Op.MIN)

# dtype: (the integer dtype of its bits, the quiet bit, the default NaN)
_BITS: Final[dict[torch.dtype, tuple[torch.dtype, int, int]]] = {
    torch.float16: (torch.int16, 0x0200, 0x7E00),
    torch.bfloat16: (torch.int16, 0x0040, 0x7FC0),
    torch.float32: (torch.int32, 0x0040_0000, 0x7FC0_0000),
    torch.float64: (torch.int64, 0x0008_0000_0000_0000, 0x7FF8_0000_0000_0000),
}


def can_combine(dtype: torch.dtype, op: Op) -> bool:
    """Whether combine does dtype and op (the others take the host path)."""
    return dtype in _BITS and op in OPS


def _arith(op: Op, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """a op b for sum and prod, in float32 for the 16-bit dtypes, rounded
    once to the dtype."""
    if a.dtype in (torch.float16, torch.bfloat16):
        wa, wb = a.float(), b.float()
        r = wa + wb if op == Op.SUM else wa * wb
        return r.to(a.dtype)
    return a + b if op == Op.SUM else a * b


def _select(op: Op, a: torch.Tensor, b: torch.Tensor, ibits: torch.dtype) -> torch.Tensor:
    """max or min as an operand: equal values (so +0 and -0) pick the bits
    with the sign of the larger (max: AND) or smaller (min: OR)."""
    ia, ib = a.view(ibits), b.view(ibits)
    tie = (ia & ib) if op == Op.MAX else (ia | ib)
    pick = torch.where(a > b, a, b) if op == Op.MAX else torch.where(a < b, a, b)
    return torch.where(a == b, tie.view(a.dtype), pick)


def combine(op: Op, a: torch.Tensor, b: torch.Tensor, out: torch.Tensor) -> None:
    """out = a op b, element by element, bit for bit as lib/reduce's
    Combine(op, dt, out, a, b): a is the earlier operand (member 0's value).
    a, b and out have one floating dtype and shape; out may be a or b."""
    ibits, quiet, default = _BITS[a.dtype]
    r = _arith(op, a, b) if op in (Op.SUM, Op.PROD) else _select(op, a, b, ibits)
    qa = (a.view(ibits) | quiet).view(a.dtype)
    qb = (b.view(ibits) | quiet).view(a.dtype)
    nan = torch.tensor(default, dtype=ibits, device=a.device).view(a.dtype)
    r = torch.where(torch.isnan(r), nan, r)
    out.copy_(torch.where(torch.isnan(a), qa, torch.where(torch.isnan(b), qb, r)))
