"""An all_reduce over one of the bridges a rank JOINed (the flat and
sharded policies, gpubridge._policies), through its endpoint's staging
region: copy in, ALL_REDUCE on that bridge (gbbridge reduces), copy out.
The worker runs one collective at a time, so the staging region is this
call's; on GPUs the copy in is done before the request and the copy out
is queued on the worker's stream, like the leaders' broadcast."""

from __future__ import annotations

import torch

from gpubridge import _inflight as fl
from gpubridge._dtypes import DTYPES, as_bytes
from gpubridge._endpoint import BridgeEndpoint
from gpubridge._feed import Codec, FeedError, Kind, Op

__all__ = ["all_reduce_on"]


def all_reduce_on(
    ep: BridgeEndpoint,
    e: fl.Entry,
    t: torch.Tensor,
    name: str | None,
    members: tuple[int, ...],
    op: Op,
    codec: Codec,
) -> None:
    """All-reduces t in place over the bridge called name (JOINed now if it
    was not; None: bridge 0) whose members are these ranks, in order."""
    bridge = None if name is None else ep.join(name, members)
    staging = ep.staging
    raw = staging.raw(t)
    src = t if raw else as_bytes(t)
    n = src.nbytes
    host = staging.tensor(n)
    region = staging.region
    assert region is not None
    staging.copy_in(e, host, src, raw)
    e.set_step(fl.BRIDGE)
    try:
        d = ep.feed.request(
            Kind.ALL_REDUCE, None, buf=region.span(0, n), dtype=DTYPES[t.dtype], op=op, codec=codec,
            bridge=bridge,
        )  # fmt: skip
    except FeedError as exc:
        what = "the leaders' bridge" if name is None else f"bridge {name}"
        raise RuntimeError(f"all_reduce on {what}: {exc}") from exc
    e.bridge, e.bridge_ranks = d.bridge, members
    staging.copy_out(e, src, host, raw)
