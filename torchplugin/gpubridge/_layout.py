"""Where a rank stands in its group, from the topology gbdiscover agreed on:
the islands, this rank's island and leader, the bridge's members, and what
the rank computes on (its hardware class, for the trace records)."""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Any

__all__ = ["Island", "Layout"]


@dataclass(frozen=True)
class Island:
    """An island of the topology: ranks of one vendor on one native
    library (backend "nccl" or "gloo"), led by leader."""

    label: str
    ranks: tuple[int, ...]
    leader: int
    backend: str

    @classmethod
    def of(cls, d: dict[str, Any]) -> Island:
        return cls(
            str(d["label"]), tuple(int(r) for r in d["ranks"]), int(d["leader"]), str(d.get("backend"))
        )


@dataclass(frozen=True)
class Layout:
    """This rank's place in a group of size ranks."""

    rank: int
    size: int
    mode: str  # "gpu", or a CPU mode
    islands: tuple[Island, ...]
    island: Island  # this rank's
    members: tuple[int, ...]  # the bridge's members (island leaders), in member order
    bridged: bool  # the group spans islands joined by a bridge
    hardware: dict[str, Any]  # vendor, model, class (see hardware_of)
    _by_rank: dict[int, Island] = field(repr=False, compare=False)

    @classmethod
    def of(cls, topo: dict[str, Any], rank: int, size: int) -> Layout:
        islands = tuple(Island.of(i) for i in topo["islands"])
        label = topo["self"]["island"]
        bridge = topo["bridge"]
        members = tuple(int(m) for m in bridge.get("members") or [])
        return cls(
            rank=rank,
            size=size,
            mode=str(topo.get("mode")),
            islands=islands,
            island=next(i for i in islands if i.label == label),
            members=members,
            bridged=bridge.get("transport", "none") != "none" and len(members) > 1,
            hardware=hardware_of(topo),
            _by_rank={r: i for i in islands for r in i.ranks},
        )

    def island_of(self, rank: int) -> Island:
        return self._by_rank[rank]

    @property
    def island_rank(self) -> int:
        """This rank's rank in its island's native group."""
        return self.island.ranks.index(self.rank)

    @property
    def leader_local(self) -> int:
        """The island leader's rank in the island's native group."""
        return self.island.ranks.index(self.island.leader)

    @property
    def is_leader(self) -> bool:
        return self.rank == self.island.leader

    @property
    def islands_by_member(self) -> list[Island]:
        """The island of each bridge member, in member order."""
        return [self._by_rank[m] for m in self.members]

    @property
    def max_island(self) -> int:
        """Ranks in the largest island."""
        return max(len(i.ranks) for i in self.islands)


def hardware_of(topo: dict[str, Any]) -> dict[str, Any]:
    """What this rank computes on, from the topology's probe records: its
    vendor (the island's, so the simulated one in simulation) and GPU model,
    and the class the heterogeneity-aware diagnosis groups it in
    (docs/STRAGGLERS.md): "<vendor> <model>", "<vendor> (simulated)" in
    simulation, or what GPUBRIDGE_HW_CLASS declares (tests, split tests)."""
    me = topo.get("self") or {}
    label = me.get("island")
    vendor = next((str(i.get("vendor", "")) for i in topo.get("islands", []) if i.get("label") == label), "")
    gpu = me.get("gpu") or {}
    model = str(gpu.get("name") or "")
    simulated = bool(topo.get("simulated"))
    hw: dict[str, Any] = {"vendor": vendor}
    if model:
        hw["model"] = model
    declared = os.environ.get("GPUBRIDGE_HW_CLASS", "").strip()
    if declared:
        hw["class"], hw["declared"] = declared, True
    elif model:
        hw["class"] = f"{vendor} {model}"
    else:
        hw["class"] = f"{vendor} (simulated)" if simulated else vendor or "unknown"
    if simulated:
        hw["simulated"] = True
    return hw
