"""The collectives' algorithms on one rank, from the island steps and, when
the group spans islands, the bridged steps of the island leaders.

all_reduce: island reduce onto the leader, bridge all_reduce, island
broadcast. broadcast: from the root inside its island, over the bridge from
its island's leader, inside the other islands. all_gather: island
all_gather, the leaders all-gather their islands' blocks over the bridge
(each padded to the largest island, so 3+1 works), the leader puts the
blocks in global rank order, island broadcast. reduce_scatter: island
reduce of the whole input onto the leader, bridge all_reduce, island
scatter. AVG is a SUM everywhere with one division at the end.

The bridged steps are compressed as the group's setting (or a call's
override) says, for what gpubridge._policy lets each take: lossy codecs
only on floating sums and averages, zstd on every bridged collective."""

from __future__ import annotations

from collections.abc import Hashable

import torch

from gpubridge import _inflight as fl
from gpubridge._dtypes import as_bytes
from gpubridge._endpoint import BridgeEndpoint
from gpubridge._feed import Codec, Op
from gpubridge._island import IslandGroup
from gpubridge._layout import Layout
from gpubridge._policy import for_all_reduce, for_transfer

__all__ = ["Collectives"]


class Collectives:
    """endpoint: this rank's end of the bridge (leaders of a bridged group),
    or None; codec: the group's compression (GPUBRIDGE_COMPRESSION)."""

    def __init__(
        self, layout: Layout, island: IslandGroup, endpoint: BridgeEndpoint | None, codec: Codec = Codec.RAW
    ) -> None:
        self._layout = layout
        self._island = island
        self._endpoint = endpoint
        self.codec = codec

    def _bridge(self) -> BridgeEndpoint:
        assert self._endpoint is not None
        return self._endpoint

    def all_reduce(
        self, e: fl.Entry, t: torch.Tensor, op: Op, codec: Codec | None = None, key: Hashable | None = None
    ) -> None:
        """codec: this call's compression instead of the group's; key: the
        error-feedback residual of a lossy one (None: none is kept)."""
        if t.numel() == 0:
            return
        lay = self._layout
        if not lay.bridged:
            self._island.all_reduce(e, t, op)
            if op == Op.AVG:
                t.div_(lay.size)
            return
        c = for_all_reduce(self.codec if codec is None else codec, t.dtype, op)
        e.codec = str(c)
        self._island.reduce(e, t, op)
        if lay.is_leader:
            self._bridge().all_reduce(e, t, Op.SUM if op == Op.AVG else op, c, key if c.lossy else None)
            if op == Op.AVG:
                t.div_(lay.size)
        self._island.broadcast(e, t)

    def broadcast(self, e: fl.Entry, t: torch.Tensor, root: int) -> None:
        if t.numel() == 0:
            return
        lay = self._layout
        root_island = lay.island_of(root)
        mine = root_island.label == lay.island.label
        if mine:  # hop 1: from the root inside its island
            self._island.broadcast(e, t, lay.island.ranks.index(root))
        if not lay.bridged:
            return
        c = for_transfer(self.codec)
        e.codec = str(c)
        if lay.is_leader:  # hop 2: from the root island's leader over the bridge
            self._bridge().broadcast(e, t, lay.members.index(root_island.leader), mine, c)
        if not mine:  # hop 3: from the leader inside the other islands
            self._island.broadcast(e, t)

    def all_gather(self, e: fl.Entry, out: torch.Tensor, inp: torch.Tensor) -> None:
        """out (size x n, flat) = every rank's inp (n, flat) in rank order."""
        n = inp.numel()
        if n == 0:
            return
        lay = self._layout
        if not lay.bridged:
            self._island.all_gather(e, out, inp, fl.NATIVE)
            return
        # Island all_gather into this island's block (island order = rank order).
        block = torch.empty(len(lay.island.ranks) * n, dtype=inp.dtype, device=inp.device)
        self._island.all_gather(e, block, inp, fl.ISLAND_GATHER)
        c = for_transfer(self.codec)
        e.codec = str(c)
        if lay.is_leader:
            nb = n * inp.element_size()
            slot = lay.max_island * nb  # every island's block padded to the largest
            host = self._bridge().all_gather(e, as_bytes(block), slot, inp.dtype, c)
            e.set_step(fl.COPY_BACK)
            dst = as_bytes(out)
            gpu = out.device.type == "cuda"
            for k, isl in enumerate(lay.islands_by_member):
                for j, r in enumerate(isl.ranks):
                    dst[r * nb : (r + 1) * nb].copy_(
                        host[k * slot + j * nb : k * slot + (j + 1) * nb], non_blocking=gpu
                    )
        self._island.broadcast(e, out)

    def reduce_scatter(self, e: fl.Entry, out: torch.Tensor, full: torch.Tensor, op: Op) -> None:
        """out = this rank's segment of the reduction of every rank's full
        (size x n; full is scratch)."""
        n = out.numel()
        if n == 0:
            return
        lay = self._layout
        if not lay.bridged:
            self._island.reduce_scatter(e, out, full, op)
        else:
            c = for_all_reduce(self.codec, full.dtype, op)
            e.codec = str(c)
            self._island.reduce(e, full, op)
            if lay.is_leader:
                self._bridge().all_reduce(e, full, Op.SUM if op == Op.AVG else op, c)
            if self._island.alone:
                out.copy_(full[lay.rank * n : (lay.rank + 1) * n])
            else:
                chunks = [full[r * n : (r + 1) * n] for r in lay.island.ranks] if lay.is_leader else []
                self._island.scatter(e, out, chunks)
        if op == Op.AVG:
            out.div_(lay.size)
