"""This rank's island group: one native ProcessGroup (NCCL, which is RCCL on
ROCm builds, on GPUs; Gloo on CPU) over the island's ranks, created directly
on a PrefixStore of the group's store (``gpubridge/island/<label>``). An
island of one rank has none, and its steps are copies or nothing."""

from __future__ import annotations

import contextlib
import datetime
import os
from typing import Any

import torch
import torch.distributed as dist
from torch._C import _distributed_c10d as _c10d
from torch._C._distributed_c10d import PrefixStore, ProcessGroupGloo

from gpubridge import _inflight as fl
from gpubridge._dtypes import NATIVE_OP
from gpubridge._feed_protocol import Op
from gpubridge._layout import Layout

__all__ = ["IslandGroup"]


class IslandGroup:
    """The steps of a collective inside this rank's island."""

    def __init__(self, pg: Any, layout: Layout) -> None:
        self._pg = pg
        self._leader_local = layout.leader_local
        self._island_rank = layout.island_rank

    @classmethod
    def join(cls, store: Any, layout: Layout, timeout: datetime.timedelta) -> IslandGroup:
        """Creates the island's native group once every rank of the island
        is here (none for an island of one rank)."""
        ranks = layout.island.ranks
        if len(ranks) == 1:
            return cls(None, layout)
        pstore = PrefixStore(f"gpubridge/island/{layout.island.label}", store)
        _arrive(pstore, layout, max(1.0, timeout.total_seconds()))
        n = len(ranks)
        if layout.island.backend == "nccl":
            o = _c10d.ProcessGroupNCCL.Options()
            o._timeout = timeout
            return cls(_c10d.ProcessGroupNCCL(pstore, layout.island_rank, n, o), layout)
        return cls(ProcessGroupGloo(pstore, layout.island_rank, n, timeout), layout)

    @property
    def alone(self) -> bool:
        """No native group: an island of one rank (or one dropped after a
        failure)."""
        return self._pg is None

    def _run(self, e: fl.Entry, step: str, work: Any) -> None:
        e.set_step(step)
        work.wait()

    def reduce(self, e: fl.Entry, t: torch.Tensor, op: Op, root_local: int | None = None) -> None:
        """Reduces onto root_local (default: the island's leader)."""
        if self._pg is None:
            return
        o = dist.ReduceOptions()
        o.reduceOp = NATIVE_OP[op]
        o.rootRank = self._leader_local if root_local is None else root_local
        o.rootTensor = 0
        self._run(e, fl.ISLAND_REDUCE, self._pg.reduce([t], o))

    def broadcast(self, e: fl.Entry, t: torch.Tensor, root_local: int | None = None) -> None:
        """Broadcasts from root_local (default: the island's leader)."""
        if self._pg is None:
            return
        o = dist.BroadcastOptions()
        o.rootRank = self._leader_local if root_local is None else root_local
        o.rootTensor = 0
        self._run(e, fl.ISLAND_BROADCAST, self._pg.broadcast([t], o))

    def all_reduce(self, e: fl.Entry, t: torch.Tensor, op: Op) -> None:
        if self._pg is None:
            return
        o = dist.AllreduceOptions()
        o.reduceOp = NATIVE_OP[op]
        self._run(e, fl.NATIVE, self._pg.allreduce([t], o))

    def all_gather(self, e: fl.Entry, out: torch.Tensor, inp: torch.Tensor, step: str) -> None:
        """out (island size x n, flat) = every island rank's inp in island
        order."""
        if self._pg is None:
            out.copy_(inp)
            return
        e.set_step(step)
        self._pg._allgather_base(out, inp).wait()

    def reduce_scatter(self, e: fl.Entry, out: torch.Tensor, full: torch.Tensor, op: Op) -> None:
        """out = this rank's segment of the reduction of every island rank's
        full (island size x n; full is scratch)."""
        pg = self._pg
        if pg is None:
            out.copy_(full)
        elif isinstance(pg, ProcessGroupGloo):
            # Gloo's reduce-scatter is an all_reduce and a slice anyway, and
            # torch 2.8's passes no op to that all_reduce (MAX and MIN came
            # out as SUM): the same here, with the op.
            n = out.numel()
            ao = dist.AllreduceOptions()
            ao.reduceOp = NATIVE_OP[op]
            self._run(e, fl.NATIVE, pg.allreduce([full], ao))  # type: ignore[attr-defined]
            out.copy_(full[self._island_rank * n : (self._island_rank + 1) * n])
        else:
            o = dist.ReduceScatterOptions()
            o.reduceOp = NATIVE_OP[op]
            self._run(e, fl.NATIVE, pg._reduce_scatter_base(out, full, o))

    @property
    def gloo(self) -> bool:
        """The native group is Gloo's (whose reduce_scatter is an all_reduce
        of the whole input)."""
        return isinstance(self._pg, ProcessGroupGloo)

    def scatter(self, e: fl.Entry, out: torch.Tensor, chunks: list[torch.Tensor]) -> None:
        """Scatters the leader's chunks (one per island rank; none elsewhere)."""
        so = dist.ScatterOptions()
        so.rootRank = self._leader_local
        self._run(e, fl.ISLAND_SCATTER, self._pg.scatter([out], [chunks] if chunks else [], so))

    def send(self, t: torch.Tensor, peer_local: int, tag: int) -> Any:
        return self._pg.send([t], peer_local, tag)

    def recv(self, t: torch.Tensor, peer_local: int, tag: int) -> Any:
        return self._pg.recv([t], peer_local, tag)

    def abort(self) -> None:
        """Aborts and drops the native group, whose closed connections wake
        the island's peers at once instead of at their timeout."""
        self.close(abort=True)

    def close(self, abort: bool) -> None:
        pg, self._pg = self._pg, None
        if pg is not None:
            with contextlib.suppress(Exception):
                pg.abort() if abort else pg.shutdown()


def _arrive(pstore: Any, layout: Layout, secs: float) -> None:
    """Waits, within the timeout, until every rank of the island is here:
    a native group's constructor can wait far longer for a peer that never
    comes (Gloo's did, 5x its timeout)."""
    ranks = layout.island.ranks
    pstore.set(f"arrived/{layout.island_rank}", str(os.getpid()))
    keys = [f"arrived/{i}" for i in range(len(ranks))]
    try:
        pstore.wait(keys, datetime.timedelta(seconds=secs))
    except Exception as e:
        missing = [str(r) for i, r in enumerate(ranks) if not pstore.check([f"arrived/{i}"])]
        raise RuntimeError(
            f"island {layout.island.label}: rank(s) {', '.join(missing)} did not arrive "
            f"within {secs:g}s ({e})"
        ) from None
