"""One collective's trace record (schema ``gpubridge.trace/v1``, docs/TRACING.md)
from its in-flight entry: what was called, by whom, and each step with its
start and end.

Times are nanoseconds of the host's CLOCK_MONOTONIC (``time.monotonic``,
the clock the entries keep), which every process of one boot shares; the
rank's header record says how that clock maps onto the reference rank's
(``clock``). On GPUs a record may carry device times too (``gpu_start``,
``gpu_end`` per phase), read from CUDA events once they have completed
(:meth:`CollectiveRecord.ready`); until then it has host times only. A
leader's record also has ``bridge``: what gbbridge measured of the bridged
step (DONE's tag 1, docs/TRACING.md §7), on the same clock.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from gpubridge import _inflight as fl

__all__ = ["SCHEMA", "CollectiveRecord", "GroupInfo", "Phase", "StepRecord", "ns"]

SCHEMA = "gpubridge.trace/v1"

# The plugin's entry points, by the collective they run (the record's op;
# "call" keeps the entry point).
_OPS = {
    "allreduce": "all_reduce",
    "allreduce_coalesced": "all_reduce",
    "allreduce_compressed": "all_reduce",
    "broadcast": "broadcast",
    "barrier": "barrier",
    "allgather": "all_gather",
    "all_gather_into_tensor": "all_gather",
    "allgather_into_tensor_coalesced": "all_gather",
    "allgather_coalesced": "all_gather",
    "reduce_scatter": "reduce_scatter",
    "reduce_scatter_tensor": "reduce_scatter",
    "reduce_scatter_tensor_coalesced": "reduce_scatter",
}


def ns(t: float) -> int:
    """Monotonic seconds (an entry's) as integer nanoseconds."""
    return round(t * 1e9)


@dataclass(slots=True)
class GroupInfo:
    """What every record of one group shares: its name, this rank's place
    in it, how its collectives run (policy), and who this rank exchanges
    data with (peers). Global ranks come from torch once it has registered
    the group (ranks_of; None before, or for a group torch does not know,
    whose ranks are then 0 … size-1)."""

    name: str
    rank: int
    size: int
    island: str
    leader: bool
    local_peers: list[int]  # group ranks
    policy: str
    device: str
    submitted: Callable[[], int]  # the group's collectives submitted so far
    ranks_of: Callable[[], list[int] | None]
    completed: int = 0  # the last sequence number that ended here without an error
    failed_dumped: bool = field(default=False, repr=False)
    written: bool = field(default=False, repr=False)  # its record is in the trace file
    _ranks: list[int] | None = field(default=None, repr=False)

    @property
    def ranks(self) -> list[int]:
        """The group's global ranks, in group rank order."""
        if self._ranks is None:
            got = self.ranks_of()
            if got is None or len(got) != self.size:
                return list(range(self.size))
            self._ranks = got
        return self._ranks

    @property
    def peers(self) -> list[int]:
        ranks = self.ranks
        return [ranks[p] for p in self.local_peers]

    def to_dict(self) -> dict[str, Any]:
        return {
            "schema": SCHEMA, "kind": "group", "name": self.name, "rank": self.rank, "size": self.size,
            "ranks": self.ranks, "island": self.island, "leader": self.leader, "peers": self.peers,
            "policy": self.policy, "device": self.device,
        }  # fmt: skip


@dataclass
class Phase:
    """One step of a collective on this rank: host times (ns) and, on a GPU
    once the record is ready, device times mapped onto the host clock."""

    name: str
    start_ns: int
    end_ns: int | None
    gpu_start_ns: int | None = None
    gpu_end_ns: int | None = None

    def elapsed_ms(self) -> float:
        """The device's time when there is one, else the host's."""
        if self.gpu_start_ns is not None and self.gpu_end_ns is not None:
            return (self.gpu_end_ns - self.gpu_start_ns) / 1e6
        end = self.end_ns if self.end_ns is not None else self.start_ns
        return (end - self.start_ns) / 1e6

    def to_dict(self) -> dict[str, Any]:
        d: dict[str, Any] = {"name": self.name, "start": self.start_ns, "end": self.end_ns}
        if self.gpu_start_ns is not None:
            d["gpu_start"], d["gpu_end"] = self.gpu_start_ns, self.gpu_end_ns
        return d


def _options(detail: str) -> tuple[str | None, int | None]:
    """(reduce op, root) from a call's options as its signature has them
    ("SUM", "root 3", "SUM,SUM")."""
    if detail.startswith("root "):
        return None, int(detail[5:])
    if not detail:
        return None, None
    ops = set(detail.split(","))
    return (ops.pop().lower() if len(ops) == 1 else detail.lower()), None


class CollectiveRecord:
    """What an observer gets, and what a trace file holds one line of: one
    collective on this rank. Read device times only once ready() is true."""

    def __init__(
        self, e: fl.Entry, g: GroupInfo, rank: int, error: str | None, in_flight: bool = False
    ) -> None:
        self.rank = rank
        self.group = g
        self.seq = e.seq
        self.call = e.op
        self.op = _OPS.get(e.op, e.op)
        self.nbytes = e.nbytes
        self.dtype = str(e.dtype).removeprefix("torch.") if e.dtype is not None else None
        self.reduce_op, self.root = _options(e.detail)
        self.asynchronous = e.asynchronous
        self.codec = e.codec
        self.thread = e.thread or e.submitted_by
        marks: list[tuple[str, float, float | None]] = list(e.phases())
        self.step: str | None = None
        if in_flight:
            self.result = "in flight"
            self.step = e.step
            marks.append((e.step, e.step_started, None))
        else:
            self.result = "ok" if error is None else "error"
        self.error = error
        self.phases = [Phase(n, ns(a), None if b is None else ns(b)) for n, a, b in marks]
        q = marks[0] if marks and marks[0][0] == fl.QUEUED else None
        self.arrived_ns = ns(e.started)
        self.start_ns = ns(q[2]) if q is not None and q[2] is not None else None
        last = marks[-1][2] if marks else None
        self.end_ns = None if in_flight or last is None else ns(last)
        self._gpu = e.mark  # tracing on a GPU: the step events (gpubridge._trace_gpu.Marker)
        self.bridge = e.bridge  # a gpubridge._feed_protocol.BridgeStats, on leaders
        self._bridge_ranks = e.bridge_ranks

    def ready(self) -> bool:
        """True once the device times can be read (always on CPU); never
        blocks. Then the phases carry them."""
        m = self._gpu
        if m is None:
            return True
        if not m.ready():  # type: ignore[attr-defined]
            return False
        times = m.times()  # type: ignore[attr-defined]  # device ns of each step's start, the end last
        # The events mark each step from "running" on: phase k (after the
        # queue) runs from event k-1 to event k.
        for k, p in enumerate(self.phases[1:], start=1):
            if k < len(times):
                p.gpu_start_ns, p.gpu_end_ns = times[k - 1], times[k]
        self._gpu = None
        return True

    def elapsed_ms(self) -> float:
        """From the call to the end on this rank (host time)."""
        end = self.end_ns if self.end_ns is not None else self.arrived_ns
        return (end - self.arrived_ns) / 1e6

    def to_dict(self) -> dict[str, Any]:
        g = self.group
        d: dict[str, Any] = {
            "schema": SCHEMA, "kind": "collective", "rank": self.rank,
            "group": {"name": g.name, "rank": g.rank, "size": g.size},
            "seq": self.seq, "op": self.op, "call": self.call, "async": self.asynchronous,
            "bytes": self.nbytes, "dtype": self.dtype, "reduce_op": self.reduce_op, "root": self.root,
            "policy": g.policy, "codec": self.codec, "island": g.island, "leader": g.leader, "peers": g.peers,
            "device": g.device, "thread": self.thread,
            "arrived": self.arrived_ns, "start": self.start_ns, "end": self.end_ns,
            "phases": [p.to_dict() for p in self.phases], "result": self.result,
        }  # fmt: skip
        if self.error is not None:
            d["error"] = self.error
        if self.step is not None:
            d["step"] = self.step
        if self.bridge is not None:
            d["bridge"] = _bridge(self.bridge, self._bridge_ranks)
        return d


def _bridge(b: Any, ranks: Sequence[int]) -> dict[str, Any]:
    """The record's ``bridge`` from a BridgeStats; a peer's rank is its
    member's global rank (None if the bridge has more members than ranks
    are known)."""
    return {
        "start": b.start_ns, "all_arrived": b.all_arrived_ns, "end": b.end_ns,
        "bytes_sent": b.bytes_sent, "bytes_received": b.bytes_received,
        "codec_ns": b.codec_ns, "reduce_ns": b.reduce_ns,
        "peers": [
            {"member": p.member, "rank": ranks[p.member] if p.member < len(ranks) else None,
             "arrival_skew_ns": p.arrival_skew_ns, "blocked_ns": list(p.blocked_ns)}
            for p in b.peers
        ],
        **({"peers_cut": True} if b.peers_cut else {}),
    }  # fmt: skip


class StepRecord:
    """A training step this rank marked (gpubridge.observe.step): its index
    (steps marked on this rank, from 0: the same step has the same index on
    every rank), the samples it computed, its start and end (host ns), and
    on a GPU, once ready(), when the current stream reached its start and
    its end (gpu_start_ns, gpu_end_ns: CUDA events, as a collective's
    phases have them)."""

    __slots__ = ("_gpu", "end_ns", "gpu_end_ns", "gpu_start_ns", "rank", "samples", "start_ns", "step")

    def __init__(
        self, rank: int, step: int, samples: int, start_ns: int, end_ns: int, gpu: Any = None
    ) -> None:
        self.rank, self.step, self.samples = rank, step, samples
        self.start_ns, self.end_ns = start_ns, end_ns
        self.gpu_start_ns: int | None = None
        self.gpu_end_ns: int | None = None
        self._gpu = gpu  # a gpubridge._trace_gpu.Marker with the start and end events, or None

    def ready(self) -> bool:
        """True once the device times can be read (always without a GPU);
        never blocks."""
        m = self._gpu
        if m is None:
            return True
        if not m.ready():
            return False
        self.gpu_start_ns, self.gpu_end_ns = m.times()[:2]
        self._gpu = None
        return True

    def to_dict(self) -> dict[str, Any]:
        d: dict[str, Any] = {
            "schema": SCHEMA, "kind": "step", "rank": self.rank, "step": self.step, "samples": self.samples,
            "start": self.start_ns, "end": self.end_ns,
        }  # fmt: skip
        if self.gpu_start_ns is not None:
            d["gpu_start"], d["gpu_end"] = self.gpu_start_ns, self.gpu_end_ns
        return d
