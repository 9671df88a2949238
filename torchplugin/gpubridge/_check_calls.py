"""Call checks (GPUBRIDGE_CHECK_CALLS=1, or torch's
TORCH_DISTRIBUTED_DEBUG=DETAIL): before each collective every rank's call
(op, dtypes, sizes, reduce op, root) is all-gathered and compared, so a
mismatch is an error naming the ranks instead of wrong data or a crash
inside the native library. Costs one all_gather of SIG_BYTES per rank per
collective."""

from __future__ import annotations

import hashlib
import os
from collections.abc import Callable

import torch

from gpubridge import _inflight as fl

__all__ = ["SIG_BYTES", "compare", "enabled", "signature"]

SIG_BYTES = 128


def enabled() -> bool:
    return (
        os.environ.get("GPUBRIDGE_CHECK_CALLS", "") not in ("", "0")
        or os.environ.get("TORCH_DISTRIBUTED_DEBUG", "").upper() == "DETAIL"
    )


def signature(op: str, tensors: list[torch.Tensor], detail: str) -> bytes:
    """What a call looks like to its peers, at most SIG_BYTES bytes."""
    shapes = ", ".join(f"{str(t.dtype).removeprefix('torch.')}{list(t.shape)}" for t in tensors)
    text = f"{op}({shapes}{', ' + detail if detail else ''})".encode()
    if len(text) > SIG_BYTES:
        text = text[: SIG_BYTES - 20] + b"...#" + hashlib.sha1(text).hexdigest()[:16].encode()
    return text


AllGather = Callable[[fl.Entry, torch.Tensor, torch.Tensor], None]


def compare(e: fl.Entry, sig: bytes, size: int, device: torch.device, all_gather: AllGather) -> None:
    """Every rank's signature of this call, all-gathered through the group
    itself; a difference is an error naming the ranks of each call (the
    same text on every rank)."""
    step = e.step
    e.set_step(fl.CHECK)
    mine = torch.zeros(SIG_BYTES, dtype=torch.uint8)
    mine[: len(sig)] = torch.frombuffer(bytearray(sig), dtype=torch.uint8)
    mine = mine.to(device)
    every = torch.empty(size * SIG_BYTES, dtype=torch.uint8, device=device)
    all_gather(e, every, mine)
    rows = every.cpu().view(size, SIG_BYTES)
    calls: dict[bytes, list[int]] = {}
    for r in range(size):
        calls.setdefault(bytes(rows[r].tolist()).rstrip(b"\0"), []).append(r)
    if len(calls) > 1:
        parts = [
            f"{c.decode('utf-8', 'replace')} on {'ranks' if len(rs) > 1 else 'rank'} "
            + ", ".join(map(str, rs))
            for c, rs in sorted(calls.items(), key=lambda kv: kv[1][0])
        ]
        raise RuntimeError(f"mismatched calls: {'; '.join(parts)}")
    e.set_step(step)
