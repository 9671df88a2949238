"""Which way an all_reduce across islands goes (``GPUBRIDGE_POLICY``), and
the bridges the every-rank policies run on.

- ``reduce-bridge-broadcast``: island reduce onto the leader, the leaders'
  bridge (bridge 0), island broadcast. Only the leaders run gbbridge. On
  GPUs the leader's copies into the region, the bridge and the copies back
  are chunked and overlapped (the streamed all_reduce of
  gpubridge._endpoint); the island reduce finishes before the bridge starts,
  so there is no separate "pipelined" policy.
- ``flat``: every rank of the group on one bridge, ``flat`` (members: the
  group's ranks in rank order), and the all_reduce in one step over it:
  gbbridge's recursive doubling for buffers up to its SmallBytes (32 KiB),
  its ring above. One dependent step instead of three: the tiny-call path.
- ``sharded`` (islands of equal size k >= 2): island reduce_scatter into k
  shards on the native group, rank i of every island all-reduces shard i
  over ``shard/<i>`` (members: rank i of each island, in the leaders'
  bridge's member order; shard 0 reuses bridge 0 when its members are the
  leaders), all k bridges at once, island all_gather. Islands of unequal
  size (3+1) or of one rank fall back to reduce-bridge-broadcast (said once
  in the log and in the group's stats, ``all_reduce_fallbacks``; the stats
  count the calls under the policy that ran).
- ``auto``: flat up to the thresholds' flat_max_bytes, sharded from
  sharded_min_bytes when the islands are equal, reduce-bridge-broadcast
  between (gpubridge._thresholds).

A lossy codec (bf16, fp8: GPUBRIDGE_COMPRESSION or a call's) always takes
reduce-bridge-broadcast: its error feedback is the leaders'. The choice is
a function of the call and the group, the same on every rank.

The reference order of each policy's sums (what the results equal, bit for
bit, on every rank), for islands I_0 … I_{m-1} in bridge member order:

- reduce-bridge-broadcast: S_j = the island reduce of I_j (the native
  library's order), then the bridge all_reduce of S_0 … S_{m-1}
  (lib/collective: S_0 op S_1 for two islands; the ring or recursive
  doubling order of the whole buffer for more).
- sharded: S_j = the island reduce_scatter of I_j (the native library's
  order; on Gloo islands k reduces instead, shard i onto the island's rank
  i, each in Gloo's reduce order), then shard i's bridge all_reduce
  of S_0[i] … S_{m-1}[i] (two islands: S_0 op S_1, as above; more: the
  ring order taken over the shard, whose segments start at the shard's
  start). With two ranks per island both island steps are a single a op b,
  so sharded equals reduce-bridge-broadcast bit for bit on two islands.
- flat: lib/collective's all_reduce order over the group's ranks:
  recursive doubling up to 32 KiB (4 ranks: (x0 op x1) op (x2 op x3), which
  is also what reduce-bridge-broadcast gives on 2 + 2 with islands {0, 1}
  and {2, 3}), the ring above.

AVG is a SUM with one division by the group's size at the end, as
everywhere in gpubridge.
"""

from __future__ import annotations

import logging

from gpubridge._layout import Layout
from gpubridge._policy import AUTO, FLAT, RBB, SHARDED
from gpubridge._thresholds import Thresholds

__all__ = ["Choice", "choose", "flat_bridge", "shard_bridge", "shard_count"]

log = logging.getLogger("gpubridge")


class Choice:
    """The policy an all_reduce runs and, when it is not the one asked
    for, why (one sentence, for the log)."""

    __slots__ = ("fallback", "policy")

    def __init__(self, policy: str, fallback: str | None = None) -> None:
        self.policy, self.fallback = policy, fallback


def shard_count(layout: Layout) -> int | None:
    """k when every island has k >= 2 ranks (the sharded policy's shards),
    else None."""
    sizes = {len(i.ranks) for i in layout.islands}
    k = sizes.pop() if len(sizes) == 1 else 0
    return k if k >= 2 else None


def _no_shards(layout: Layout) -> str:
    sizes = "+".join(str(len(i.ranks)) for i in layout.islands)
    return (
        f"the islands ({sizes} ranks) are not of one size of at least 2: sharded all_reduce "
        "falls back to reduce-bridge-broadcast"
    )


# The choices without a fallback: one object each, not one per call.
_RBB = Choice(RBB)
_FLAT = Choice(FLAT)
_SHARDED = Choice(SHARDED)


def choose(policy: str, thresholds: Thresholds, layout: Layout, nbytes: int, lossy: bool) -> Choice:
    """The policy of an all_reduce of nbytes across islands under policy
    (GPUBRIDGE_POLICY); lossy: its bridged step uses a lossy codec."""
    if lossy or policy == RBB:
        return _RBB
    if policy == FLAT:
        return _FLAT
    if policy == SHARDED:
        return _SHARDED if shard_count(layout) is not None else Choice(RBB, _no_shards(layout))
    assert policy == AUTO, policy
    if nbytes <= thresholds.flat_max_bytes:
        return _FLAT
    if 0 <= thresholds.sharded_min_bytes <= nbytes and shard_count(layout) is not None:
        return _SHARDED
    return _RBB


def flat_bridge(layout: Layout) -> tuple[str | None, tuple[int, ...]]:
    """The flat policy's bridge: its name (None: bridge 0, when the
    leaders are every rank, in rank order) and members (the group's ranks
    in rank order)."""
    members = tuple(range(layout.size))
    return (None if layout.members == members else "flat"), members


def shard_bridge(layout: Layout, i: int) -> tuple[str | None, tuple[int, ...]]:
    """Shard i's bridge: its name (None: bridge 0, when its members are the
    leaders in member order) and members (rank i of each island, islands in
    the leaders' bridge's member order)."""
    members = tuple(isl.ranks[i] for isl in layout.islands_by_member)
    return (None if members == layout.members else f"shard/{i}"), members
