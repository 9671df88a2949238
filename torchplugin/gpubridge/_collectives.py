"""The collectives' algorithms on one rank, from the island steps and, when
the group spans islands, the bridged steps of the island leaders.

all_reduce: by the group's policy (gpubridge._policies, GPUBRIDGE_POLICY):
island reduce onto the leader, bridge all_reduce, island broadcast
(reduce-bridge-broadcast); every rank on one bridge (flat); or island
reduce_scatter, shard i over rank i's bridge, island all_gather (sharded).
broadcast: from the root inside its island, over the bridge from
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

import logging
from collections.abc import Hashable

import torch

from gpubridge import _inflight as fl
from gpubridge._bridged import all_reduce_on
from gpubridge._dtypes import as_bytes
from gpubridge._endpoint import BridgeEndpoint
from gpubridge._endpoints import Endpoints
from gpubridge._feed import Codec, Op
from gpubridge._island import IslandGroup
from gpubridge._layout import Layout
from gpubridge._policies import choose, flat_bridge, shard_bridge, shard_count
from gpubridge._policy import AUTO, FLAT, RBB, SHARDED, codec_name, for_all_reduce, for_transfer, is_lossy
from gpubridge._thresholds import BUILTIN, Thresholds

log = logging.getLogger("gpubridge")

__all__ = ["Collectives"]


class Collectives:
    """endpoints: this rank's endpoint of the group (the leaders' is up
    from the start; another rank's starts when a policy needs it); codec:
    the group's compression (GPUBRIDGE_COMPRESSION); policy, thresholds:
    GPUBRIDGE_POLICY and GPUBRIDGE_THRESHOLDS."""

    def __init__(
        self,
        layout: Layout,
        island: IslandGroup,
        endpoints: Endpoints | None,
        codec: Codec = Codec.RAW,
        policy: str = AUTO,
        thresholds: Thresholds = BUILTIN,
    ) -> None:
        self._layout = layout
        self._island = island
        self._endpoints = endpoints
        self.codec = codec
        self.policy = policy
        self.thresholds = thresholds
        # all_reduces across islands per policy that ran, for the stats
        self.policy_calls: dict[str, int] = {}
        self._flat_bridge = flat_bridge(layout)  # the layout never changes
        self.fallbacks: list[str] = []  # why a policy fell back, each said once

    def _bridge(self) -> BridgeEndpoint:
        """The leader's endpoint (bridge 0)."""
        ep = self._endpoints.current if self._endpoints is not None else None
        assert ep is not None
        return ep

    def all_reduce(
        self,
        e: fl.Entry,
        t: torch.Tensor,
        op: Op,
        codec: Codec | None = None,
        key: Hashable | None = None,
        policy: str | None = None,
    ) -> None:
        """codec: this call's compression instead of the group's; key: the
        error-feedback residual of a lossy one (None: none is kept);
        policy: this call's instead of the group's (gpubridge.tune)."""
        if t.numel() == 0:
            return
        lay = self._layout
        if not lay.bridged:
            self._island.all_reduce(e, t, op)
            if op == Op.AVG:
                t.div_(lay.size)
            return
        c = for_all_reduce(self.codec if codec is None else codec, t.dtype, op)
        e.codec = codec_name(c)
        ch = choose(policy or self.policy, self.thresholds, lay, t.numel() * t.element_size(), is_lossy(c))
        if ch.fallback is not None and ch.fallback not in self.fallbacks:
            self.fallbacks.append(ch.fallback)
            log.warning("gpubridge: rank %d: %s", lay.rank, ch.fallback)
        self.policy_calls[ch.policy] = self.policy_calls.get(ch.policy, 0) + 1
        if ch.policy == FLAT:
            self._flat(e, t, op, c)
        elif ch.policy == SHARDED:
            self._sharded(e, t, op, c)
        else:
            assert ch.policy == RBB, ch.policy
            self._reduce_bridge_broadcast(e, t, op, c, key)

    def _endpoint_now(self) -> BridgeEndpoint:
        """This rank's endpoint, started now if it has none yet."""
        assert self._endpoints is not None
        return self._endpoints.get()

    def _flat(self, e: fl.Entry, t: torch.Tensor, op: Op, c: Codec) -> None:
        """Every rank on the flat bridge, one all_reduce."""
        name, members = self._flat_bridge
        all_reduce_on(self._endpoint_now(), e, t, name, members, Op.SUM if op == Op.AVG else op, c)
        if op == Op.AVG:
            t.div_(self._layout.size)

    def _sharded(self, e: fl.Entry, t: torch.Tensor, op: Op, c: Codec) -> None:
        """Island reduce_scatter into k shards (t padded to k equal ones),
        shard i over rank i's bridge, island all_gather."""
        lay = self._layout
        k = shard_count(lay)
        assert k is not None
        n = t.numel()
        s = -(-n // k)
        flat = t.view(-1)
        full = flat if n == k * s else torch.zeros(k * s, dtype=t.dtype, device=t.device)
        if full is not flat:
            full[:n].copy_(flat)
        i = lay.island_rank
        if self._island.gloo:
            # Gloo's reduce_scatter all-reduces the whole input: k reduces of
            # one shard each (onto the rank that bridges it) move half as much.
            for j in range(k):
                self._island.reduce(e, full[j * s : (j + 1) * s], op, root_local=j)
            shard = full[i * s : (i + 1) * s].clone()
        else:
            shard = torch.empty(s, dtype=t.dtype, device=t.device)
            self._island.reduce_scatter(e, shard, full, op)  # full is scratch from here
        name, members = shard_bridge(lay, i)
        all_reduce_on(self._endpoint_now(), e, shard, name, members, Op.SUM if op == Op.AVG else op, c)
        if op == Op.AVG:
            shard.div_(lay.size)
        self._island.all_gather(e, full, shard, fl.ISLAND_GATHER)
        if full is not flat:
            flat.copy_(full[:n])

    def _reduce_bridge_broadcast(
        self, e: fl.Entry, t: torch.Tensor, op: Op, c: Codec, key: Hashable | None
    ) -> None:
        lay = self._layout
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
