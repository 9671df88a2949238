"""Rebalancing: a batch sampler that gives each rank a share of the global
batch in proportion to its measured throughput (docs/REBALANCING.md).

The epoch's samples and each step's global batch are DistributedSampler's
(the same seeded permutation, padded or cut to whole global batches); only
how a global batch is split between the ranks changes. Every rank decides
the split from the same data: at each plan point (the first iteration, then
every ``replan_every`` steps, or each epoch's start with ``replan_every=0``)
the ranks all-gather, through their group, their settings and what their
:class:`~gpubridge._calibrate.ThroughputMeter` measured since the last plan,
and each computes the plan with the same arithmetic: a pure function of the
gathered bytes. A new plan is taken only when it would shorten the step by
more than ``hysteresis``, so shares do not oscillate.
"""

from __future__ import annotations

import heapq
import math
from collections.abc import Iterator, Sequence, Sized
from typing import Any

import torch
import torch.distributed as dist

from gpubridge import _trace
from gpubridge._calibrate import ThroughputMeter

__all__ = ["RebalancingSampler", "plan_shares", "step_time"]

# What every rank puts in a plan exchange (float64 each); the settings
# first, which must agree.
_SETTINGS = ("version", "global_batch_size", "dataset", "seed", "shuffle", "drop_last", "epoch", "step")
_VERSION = 1.0


def plan_shares(rates: Sequence[float], total: int, min_share: int = 1) -> list[int]:
    """The split of total samples that makes the slowest rank's step
    shortest, for ranks computing rates[r] samples per second: min_share
    each, then every further sample to the rank that would finish it
    soonest ((share + 1) / rate, ties to the lower rank). Optimal for
    samples of equal cost; a pure function, the same on every rank."""
    n = len(rates)
    if n == 0 or total < n * min_share:
        raise ValueError(f"cannot give {n} ranks {min_share} of {total} samples each")
    if any(not (r > 0 and math.isfinite(r)) for r in rates):
        raise ValueError(f"rates must be positive and finite: {list(rates)}")
    shares = [min_share] * n
    heap = [((min_share + 1) / r, i) for i, r in enumerate(rates)]
    heapq.heapify(heap)
    for _ in range(total - n * min_share):
        _, i = heapq.heappop(heap)
        shares[i] += 1
        heapq.heappush(heap, ((shares[i] + 1) / rates[i], i))
    return shares


def step_time(shares: Sequence[int], rates: Sequence[float]) -> float:
    """The predicted step: the slowest rank's share over its rate."""
    return max(s / r for s, r in zip(shares, rates, strict=True))


def _even(total: int, n: int) -> list[int]:
    return [total // n + (1 if r < total % n else 0) for r in range(n)]


def _device(group: Any) -> torch.device:
    """Where the group's tensors live: a gpubridge group says; NCCL's are
    on the current CUDA device; others on the CPU."""
    dev = getattr(group, "device", None)
    if isinstance(dev, torch.device):
        return dev
    if dist.get_backend(group) == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


class RebalancingSampler:
    """A batch sampler (``DataLoader(ds, batch_sampler=sampler)``) for data
    parallel training on ranks of unequal speed: each step it yields this
    rank's part of the step's global batch, a share in proportion to the
    rank's measured throughput, the same split on every rank.

    DistributedSampler's arguments and ``set_epoch`` keep their meaning;
    ``global_batch_size`` is the batch over all ranks (a DistributedSampler
    job with ``batch_size=b`` on n ranks has b*n). The trainer marks each
    step, ``with gpubridge.observe.step(len(batch)):``, which is what the
    meter measures, and weights each rank's gradient by its share
    (:class:`gpubridge.SampleWeights`: ``weights.set(len(batch),
    sampler.global_batch_size)``). ``rebalance=False`` keeps even shares (a
    uniform job with the same batches)."""

    def __init__(
        self,
        dataset: Sized | int,
        global_batch_size: int,
        num_replicas: int | None = None,
        rank: int | None = None,
        shuffle: bool = True,
        seed: int = 0,
        drop_last: bool = False,
        *,
        group: Any = None,
        rebalance: bool = True,
        replan_every: int = 100,
        hysteresis: float = 0.05,
        min_share: int = 1,
    ) -> None:
        self.dataset_size = dataset if isinstance(dataset, int) else len(dataset)
        if num_replicas is None or rank is None:
            if not dist.is_available() or not dist.is_initialized():
                raise RuntimeError(
                    "RebalancingSampler: no process group: initialise one or pass num_replicas and rank"
                )
            num_replicas = dist.get_world_size(group) if num_replicas is None else num_replicas
            rank = dist.get_rank(group) if rank is None else rank
        if num_replicas < 1 or not 0 <= rank < num_replicas:
            raise ValueError(f"RebalancingSampler: rank {rank} of {num_replicas} replicas")
        if global_batch_size < num_replicas * min_share or min_share < 1:
            raise ValueError(
                f"RebalancingSampler: a global batch of {global_batch_size} cannot give {num_replicas} ranks "
                f"{min_share} sample(s) each"
            )
        if self.dataset_size < (global_batch_size if drop_last else 1):
            raise ValueError(
                f"RebalancingSampler: {self.dataset_size} samples, global batch {global_batch_size}"
            )
        if replan_every < 0 or not 0 <= hysteresis < 1:
            raise ValueError("RebalancingSampler: replan_every >= 0 and 0 <= hysteresis < 1")
        self.global_batch_size = global_batch_size
        self.num_replicas, self.rank = num_replicas, rank
        self.shuffle, self.seed, self.drop_last = shuffle, seed, drop_last
        self.group = group
        self.rebalance, self.replan_every, self.hysteresis, self.min_share = (
            rebalance, replan_every, hysteresis, min_share,
        )  # fmt: skip
        self.epoch = 0
        self.shares: tuple[int, ...] = tuple(_even(global_batch_size, num_replicas))
        self.plans: list[tuple[int, tuple[int, ...]]] = [(0, self.shares)]  # (global step, shares)
        self.steps_done = 0  # batches yielded, over every epoch
        self._agreed = False
        self.meter = ThroughputMeter()
        if rebalance and num_replicas > 1:
            _trace.add_observer(self.meter)

    # ---- DistributedSampler's ----

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    @property
    def total_size(self) -> int:
        """Samples per epoch: the dataset padded (or cut) to whole global
        batches."""
        b = self.global_batch_size
        return (self.dataset_size // b if self.drop_last else -(-self.dataset_size // b)) * b

    def __len__(self) -> int:
        return self.total_size // self.global_batch_size

    @property
    def local_batch_size(self) -> int:
        """This rank's share now."""
        return self.shares[self.rank]

    def indices(self) -> list[int]:
        """The epoch's samples in order: DistributedSampler's permutation
        (seed + epoch), padded by repeating from the start or cut."""
        if self.shuffle:
            g = torch.Generator()
            g.manual_seed(self.seed + self.epoch)
            idx: list[int] = torch.randperm(self.dataset_size, generator=g).tolist()
        else:
            idx = list(range(self.dataset_size))
        size = self.total_size
        if size <= len(idx):
            return idx[:size]
        pad = size - len(idx)
        return idx + (idx * math.ceil(pad / len(idx)))[:pad]

    def __iter__(self) -> Iterator[list[int]]:
        idx = self.indices()
        b = self.global_batch_size
        for i in range(len(self)):
            if self._plan_point(i):
                self._plan()
            off = sum(self.shares[: self.rank])
            start = i * b + off
            self.steps_done += 1
            yield idx[start : start + self.shares[self.rank]]

    # ---- planning ----

    def _plan_point(self, i: int) -> bool:
        if not self._agreed:
            return True
        if not self.rebalance:
            return False
        if self.replan_every == 0:
            return i == 0
        return self.steps_done > 0 and self.steps_done % self.replan_every == 0

    def _plan(self) -> None:
        """One plan exchange: every rank's settings and measurement,
        all-gathered; the same checks and the same plan on every rank."""
        m = self.meter.take() if self.rebalance else None
        if self.num_replicas == 1:  # no one to agree with; one rank takes the whole batch
            self._agreed = True
            return
        mine = [
            _VERSION, float(self.global_batch_size), float(self.dataset_size), float(self.seed % (1 << 52)),
            float(self.shuffle), float(self.drop_last), float(self.epoch), float(self.steps_done),
            float(m.steps if m else 0), m.rate if m else 0.0,
        ]  # fmt: skip
        dev = _device(self.group if self.group is not None else dist.group.WORLD)
        t = torch.tensor(mine, dtype=torch.float64, device=dev)
        out = torch.empty(self.num_replicas * len(mine), dtype=torch.float64, device=dev)
        dist.all_gather_into_tensor(out, t, group=self.group)
        rows = out.view(self.num_replicas, len(mine)).cpu().tolist()
        _check_agree(rows)
        first = not self._agreed
        self._agreed = True
        if first or not self.rebalance:
            return
        steps = [int(r[len(_SETTINGS)]) for r in rows]
        rates = [r[len(_SETTINGS) + 1] for r in rows]
        unmeasured = [i for i, (s, r) in enumerate(zip(steps, rates, strict=True)) if s == 0 or not r > 0]
        if unmeasured:
            raise RuntimeError(
                f"gpubridge.RebalancingSampler: no training step measured on rank(s) {unmeasured} since "
                "the last plan: mark each step with `with gpubridge.observe.step(len(batch)):` "
                "(or rebalance=False)"
            )
        proposal = plan_shares(rates, self.global_batch_size, self.min_share)
        if step_time(proposal, rates) < step_time(self.shares, rates) * (1 - self.hysteresis):
            self.shares = tuple(proposal)
            self.plans.append((self.steps_done, self.shares))


def _check_agree(rows: list[list[float]]) -> None:
    """Every rank must have the same settings and be at the same step; else
    the same error on every rank, naming who differs."""
    for k, name in enumerate(_SETTINGS):
        vals = [r[k] for r in rows]
        if len(set(vals)) > 1:
            by: dict[float, list[int]] = {}
            for i, v in enumerate(vals):
                by.setdefault(v, []).append(i)
            parts = "; ".join(f"rank(s) {rs}: {v:g}" for v, rs in sorted(by.items()))
            raise RuntimeError(f"gpubridge.RebalancingSampler: the ranks disagree on {name}: {parts}")
