"""The native API: gpubridge without torch.distributed's group machinery.

``gpubridge.init()`` builds the same group ``init_process_group(backend=
"gpubridge")`` builds (same discovery, same islands, same bridge), from the
same environment (MASTER_ADDR, MASTER_PORT, RANK, WORLD_SIZE, as torchrun
and the env:// method set them). A process uses one or the other: the first
one taken refuses the second.
"""

from __future__ import annotations

import datetime
import json
import subprocess
from typing import Any

import torch
import torch.distributed as dist
from torch._C import _distributed_c10d as _c10d

from gpubridge import _tools
from gpubridge._group import GpubridgeProcessGroup, live_groups

__all__ = [
    "all_gather_into_tensor",
    "all_reduce",
    "barrier",
    "broadcast",
    "destroy",
    "get_topology",
    "init",
    "is_initialized",
    "probe",
    "reduce_scatter_tensor",
]

_pg: GpubridgeProcessGroup | None = None
_OPS = {
    "sum": dist.ReduceOp.SUM,
    "avg": dist.ReduceOp.AVG,
    "max": dist.ReduceOp.MAX,
    "min": dist.ReduceOp.MIN,
}


def refuse_if_native(what: str) -> None:
    if _pg is not None:
        raise RuntimeError(
            f"gpubridge: {what} in a process that called gpubridge.init(): use one or the other"
        )


def init(
    *,
    rank: int | None = None,
    world_size: int | None = None,
    timeout: datetime.timedelta = datetime.timedelta(minutes=10),
    url: str = "env://",
) -> dict[str, Any]:
    """Joins the job (rendezvous at url, env:// by default) and returns the
    topology. Raises the same RuntimeError on every rank when discovery
    fails."""
    global _pg  # noqa: PLW0603 - one group per process
    if _pg is not None:
        raise RuntimeError("gpubridge.init(): already initialized (call gpubridge.destroy() first)")
    if live_groups():
        raise RuntimeError(
            "gpubridge.init(): this process already has a gpubridge group from "
            "torch.distributed.init_process_group: use one or the other"
        )
    kw: dict[str, Any] = {}
    if rank is not None:
        kw["rank"] = rank
    if world_size is not None:
        kw["world_size"] = world_size
    store, r, n = next(
        dist.rendezvous(  # type: ignore[attr-defined]
            url, timeout=timeout, **kw
        )
    )
    store.set_timeout(timeout)
    _pg = GpubridgeProcessGroup(_c10d.PrefixStore("gpubridge-native/", store), r, n, timeout, "native")
    return _pg.topology


def is_initialized() -> bool:
    return _pg is not None


def _group() -> GpubridgeProcessGroup:
    if _pg is None:
        raise RuntimeError("gpubridge: not initialized: call gpubridge.init() first")
    return _pg


def _op(op: str | Any) -> Any:
    if isinstance(op, str):
        if op.lower() not in _OPS:
            raise RuntimeError(f"gpubridge: unknown reduce op {op!r} (sum, avg, max, min)")
        return _OPS[op.lower()]
    return op


def _done(work: Any, async_op: bool) -> Any:
    if async_op:
        return work
    work.wait()
    return None


def all_reduce(
    tensor: torch.Tensor,
    op: str | Any = "sum",
    async_op: bool = False,
    compression: str | None = None,
    feedback_key: int | str | None = None,
) -> Any:
    """All-reduces tensor in place. compression ("none", "bf16", "fp8",
    "zstd") overrides GPUBRIDGE_COMPRESSION for this call (every rank must
    pass the same); feedback_key (an int or a string) names the buffer
    whose error-feedback residual a lossy codec keeps between calls (4
    bytes a value on each island leader, freed by destroy()); without one
    nothing is kept (docs/COMPRESSION.md, "Error feedback keys")."""
    if compression is None and feedback_key is None:
        o = dist.AllreduceOptions()
        o.reduceOp = _op(op)
        return _done(_group().allreduce([tensor], o), async_op)
    if feedback_key is not None and (
        isinstance(feedback_key, bool) or not isinstance(feedback_key, (int, str))
    ):
        raise RuntimeError(f"gpubridge: all_reduce: feedback_key is an int or a string, not {feedback_key!r}")
    key = None if feedback_key is None else ("native", feedback_key)
    work = _group().allreduce_compressed(tensor, _op(op), compression, key, async_op)
    return _done(work, async_op)


def broadcast(tensor: torch.Tensor, src: int, async_op: bool = False) -> Any:
    o = dist.BroadcastOptions()
    o.rootRank = src
    o.rootTensor = 0
    return _done(_group().broadcast([tensor], o), async_op)


def all_gather_into_tensor(output: torch.Tensor, input: torch.Tensor, async_op: bool = False) -> Any:
    return _done(_group()._allgather_base(output, input), async_op)


def reduce_scatter_tensor(
    output: torch.Tensor, input: torch.Tensor, op: str | Any = "sum", async_op: bool = False
) -> Any:
    o = dist.ReduceScatterOptions()
    o.reduceOp = _op(op)
    return _done(_group()._reduce_scatter_base(output, input, o), async_op)


def barrier() -> None:
    _group().barrier().wait()


def destroy() -> None:
    """Closes the native group (BYE to gbbridge, waits for its exit)."""
    global _pg
    pg, _pg = _pg, None
    if pg is not None:
        pg.shutdown()


def get_topology(group: Any = None) -> dict[str, Any]:
    """The topology of the native group, of a torch.distributed gpubridge
    group (``group``), or of the first gpubridge group this process made."""
    if _pg is not None and group is None:
        return _pg.topology
    groups = live_groups()
    if isinstance(group, GpubridgeProcessGroup):
        return group.topology
    if group is not None:
        name = getattr(group, "group_name", None)
        for g in groups:
            if g._group == name:
                return g.topology
        raise RuntimeError(f"gpubridge: get_topology: {name!r} is not a gpubridge group of this process")
    if not groups:
        raise RuntimeError("gpubridge: get_topology: no gpubridge group in this process")
    return min(groups, key=lambda g: g.created).topology


def probe(args: list[str] | None = None, timeout: float = 60.0) -> dict[str, Any]:
    """gbprobe --json on this node (with extra gbprobe args), as a dict."""
    p = subprocess.run(
        [_tools.find_tool("gbprobe"), "--json", *(args or [])],
        stdin=subprocess.DEVNULL, capture_output=True, timeout=timeout, check=False,
    )  # fmt: skip
    try:
        doc = json.loads(p.stdout)
    except ValueError:
        raise RuntimeError(
            f"gpubridge: gbprobe exited {p.returncode}: {p.stderr.decode('utf-8', 'replace').strip()}"
        ) from None
    if not isinstance(doc, dict):
        raise RuntimeError("gpubridge: gbprobe printed no JSON object")
    return doc
