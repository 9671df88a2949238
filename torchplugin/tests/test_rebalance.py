"""Rebalancing in process: the plan (gpubridge._rebalance.plan_shares), the
meter's ready times (gpubridge._calibrate), RebalancingSampler's batches
and plans with its exchange done by threads standing in for ranks, and
SampleWeights' arithmetic. The jobs are in test_weighted.py (one step with
uneven shares against one process, through the backend) and
test_hetero.py (a mixed job rebalanced, and diagnosed by gbtrace)."""

from __future__ import annotations

import itertools
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import pytest
import torch
from torch.utils.data import DistributedSampler

import gpubridge
from gpubridge import _rebalance
from gpubridge._calibrate import ThroughputMeter
from gpubridge._rebalance import RebalancingSampler, plan_shares, step_time

# ---- the plan ----


def test_plan_is_proportional_and_sums_to_the_batch() -> None:
    assert plan_shares([2.0, 2.0, 1.0, 1.0], 48) == [16, 16, 8, 8]
    assert plan_shares([1.0, 1.0, 1.0, 1.0], 10) == [3, 3, 2, 2]  # ties: the lower ranks first
    assert plan_shares([1000.0, 1.0], 10, min_share=2) == [8, 2]
    for rates in ([3.0, 1.0, 2.0], [1.0, 1.7, 2.9, 0.4], [5.0]):
        for total in (len(rates), 7, 64, 1001):
            s = plan_shares(rates, total)
            assert sum(s) == total and min(s) >= 1


def test_plan_is_optimal() -> None:
    """No other split of a small batch has a shorter slowest step."""
    for rates in ([3.0, 1.0, 2.0], [1.0, 1.25, 0.5], [2.0, 2.0, 1.0]):
        for total in range(3, 13):
            best = min(
                step_time(s, rates)
                for s in itertools.product(range(1, total + 1), repeat=3)
                if sum(s) == total
            )
            assert step_time(plan_shares(rates, total), rates) == best, (rates, total)


def test_plan_refuses() -> None:
    with pytest.raises(ValueError, match="cannot give 4 ranks 1 of 3"):
        plan_shares([1.0] * 4, 3)
    with pytest.raises(ValueError, match="positive and finite"):
        plan_shares([1.0, 0.0], 4)
    with pytest.raises(ValueError, match="positive and finite"):
        plan_shares([1.0, float("nan")], 4)


# ---- the meter ----


@dataclass
class Phase:
    name: str
    gpu_start_ns: int | None = None
    gpu_end_ns: int | None = None


@dataclass
class Coll:
    arrived_ns: int
    end_ns: int | None
    asynchronous: bool
    result: str = "ok"
    phases: list[Phase] = field(default_factory=list)
    done: bool = True

    def ready(self) -> bool:
        return self.done


@dataclass
class Step:
    start_ns: int
    end_ns: int
    samples: int
    gpu_start_ns: int | None = None
    gpu_end_ns: int | None = None
    done: bool = True

    def ready(self) -> bool:
        return self.done


MS = 1_000_000


def test_meter_measures_ready_time() -> None:
    m = ThroughputMeter()
    # Step 0: 10 samples; a synchronous call at 2-5 ms (blocked 3 ms), the
    # last bucket (async) called at 12 ms: ready = 12 - 3 = 9 ms.
    m.on_step(Step(0, 20 * MS, 10))
    for c in (Coll(2 * MS, 5 * MS, False), Coll(8 * MS, 15 * MS, True), Coll(12 * MS, 18 * MS, True)):
        m.on_collective(c)
    # Step 1: no collective: all 10 ms is ready time; 20 samples.
    m.on_step(Step(20 * MS, 30 * MS, 20))
    m.on_collective(Coll(25 * MS, None, True, "error"))  # not counted
    m.on_step(Step(30 * MS, 40 * MS, 5))  # the newest: kept for the next take
    got = m.take()
    assert (got.steps, got.samples) == (2, 30)
    assert got.rate == pytest.approx((10 / 0.009 + 20 / 0.010) / 2)
    m.on_step(Step(40 * MS, 45 * MS, 5))
    got = m.take()
    assert (got.steps, got.samples, got.rate) == (1, 5, pytest.approx(500.0))
    assert m.take().steps == 0


def test_meter_on_a_gpu_reads_the_device() -> None:
    """The host queued the step in 1 ms; the device ran it from 3 ms, and
    passed the work before the last bucket at 24 ms: 21 ms of ready time,
    not 1. A step whose device times are not in waits for the next take."""
    m = ThroughputMeter()
    dev = [Phase("queued"), Phase("running", 23 * MS, 24 * MS), Phase("bridge", 24 * MS, 30 * MS)]
    m.on_step(Step(0, 2 * MS, 21, gpu_start_ns=3 * MS, gpu_end_ns=31 * MS))
    m.on_collective(Coll(MS, 2 * MS, True, phases=dev))
    late = Step(2 * MS, 4 * MS, 8, gpu_start_ns=31 * MS, gpu_end_ns=40 * MS, done=False)
    m.on_step(late)
    m.on_step(Step(4 * MS, 6 * MS, 8))
    got = m.take()
    assert (got.steps, got.rate) == (1, pytest.approx(1000.0))
    late.done = True
    m.on_step(Step(6 * MS, 8 * MS, 8))
    got = m.take()
    assert (got.steps, got.samples) == (2, 16)


# ---- the sampler, with threads for ranks ----


class Threads:
    """n threads standing in for ranks: all_gather_into_tensor through a
    barrier (the real exchange runs in test_weighted.py's job)."""

    def __init__(self, n: int) -> None:
        self.n = n
        self.barrier = threading.Barrier(n, timeout=30)
        self.rows: dict[int, torch.Tensor] = {}
        self.local = threading.local()

    def all_gather(self, out: torch.Tensor, t: torch.Tensor, group: Any = None) -> None:
        r = self.local.rank
        self.rows[r] = t.clone()
        self.barrier.wait()
        out.copy_(torch.cat([self.rows[i] for i in range(self.n)]))
        self.barrier.wait()

    def run(self, fn: Callable[[int], Any]) -> list[Any]:
        results: list[Any] = [None] * self.n

        def body(r: int) -> None:
            self.local.rank = r
            try:
                results[r] = fn(r)
            except Exception as e:  # every rank's outcome is compared (a lost rank: the barrier's timeout)
                results[r] = e

        ts = [threading.Thread(target=body, args=(r,)) for r in range(self.n)]
        for t in ts:
            t.start()
        for t in ts:
            t.join(60)
        return results


@pytest.fixture
def threads(monkeypatch: pytest.MonkeyPatch) -> Threads:
    th = Threads(4)
    monkeypatch.setattr(_rebalance.dist, "all_gather_into_tensor", th.all_gather)
    monkeypatch.setattr(_rebalance, "_device", lambda group: torch.device("cpu"))
    monkeypatch.setattr(_rebalance._trace, "add_observer", lambda obj: None)
    return th


def sampler(r: int, **kw: Any) -> RebalancingSampler:
    args: dict[str, Any] = {"dataset": 100, "global_batch_size": 16, "num_replicas": 4, "rank": r, "seed": 3}
    args.update(kw)
    return RebalancingSampler(**args)


def test_global_batches_are_distributed_samplers(threads: Threads) -> None:
    """Every step's batches over the ranks are DistributedSampler's global
    batch (batch_size 4 on 4 ranks), whatever the split; the epoch pads to
    whole global batches as DistributedSampler pads."""

    def epoch(r: int) -> list[list[int]]:
        s = sampler(r)
        s.set_epoch(2)
        return list(s)

    per_rank = threads.run(epoch)
    assert all(len(b) == 7 for b in per_rank)  # ceil(100 / 16)
    ds = []
    for r in range(4):
        d = DistributedSampler(range(100), 4, r, shuffle=True, seed=3)
        d.set_epoch(2)
        ds.append(list(d))
    for k in range(6):  # DistributedSampler pads to 100, ours to 112: the full batches agree
        want = sorted(i for r in range(4) for i in ds[r][4 * k : 4 * k + 4])
        got = sorted(i for r in range(4) for i in per_rank[r][k])
        assert got == want, k
    every = [i for r in range(4) for b in per_rank[r] for i in b]
    assert len(every) == 112 and set(every) == set(range(100))


def test_drop_last_and_no_shuffle(threads: Threads) -> None:
    got = threads.run(lambda r: list(sampler(r, shuffle=False, drop_last=True)))
    assert [len(b) for b in got[0]] == [4] * 6
    assert got[1][0] == [4, 5, 6, 7] and got[3][5] == [92, 93, 94, 95]


class FakeMeter:
    """Reports a fixed rate per rank."""

    def __init__(self, rate: float) -> None:
        self.rate = rate

    def take(self) -> Any:
        return type("M", (), {"steps": 10, "samples": 10, "rate": self.rate})()


Rates = list[float] | Callable[[int, int], float]


def run_plans(threads: Threads, rates: Rates, steps: int, **kw: Any) -> list[Any]:
    def body(r: int) -> tuple[list[tuple[int, tuple[int, ...]]], list[list[int]]]:
        s = sampler(r, dataset=16 * steps, replan_every=10, **kw)
        s.meter = FakeMeter(0.0)  # type: ignore[assignment]
        out = []
        for b in s:
            out.append(b)
            s.meter.rate = rates(r, s.steps_done) if callable(rates) else rates[r]  # type: ignore[attr-defined]
        return s.plans, out

    return threads.run(body)


def test_shares_follow_the_rates_the_same_on_every_rank(threads: Threads) -> None:
    res = run_plans(threads, [2.0, 2.0, 1.0, 1.0], 40)
    plans = [p for p, _ in res]
    assert all(p == plans[0] for p in plans)
    assert plans[0] == [(0, (4, 4, 4, 4)), (10, tuple(plan_shares([2.0, 2.0, 1.0, 1.0], 16)))]
    for k in range(40):  # each step's batches still tile its global batch
        assert sum(len(res[r][1][k]) for r in range(4)) == 16


def test_hysteresis_keeps_a_plan(threads: Threads) -> None:
    # 3% slower from step 20: a new plan would gain less than 5%: kept.
    res = run_plans(threads, lambda r, k: 2.0 * (0.97 if r == 1 and k >= 20 else 1.0), 60)
    assert res[0][0] == [(0, (4, 4, 4, 4))]
    # 30% slower after the plan at step 20: re-planned at the next one.
    res = run_plans(threads, lambda r, k: 2.0 * (0.7 if r == 1 and k > 20 else 1.0), 60)
    assert [k for k, _ in res[0][0]] == [0, 30]
    assert all(p == res[0][0] for p, _ in res)


def test_every_rank_fails_the_same_way(threads: Threads) -> None:
    got = threads.run(lambda r: list(sampler(r, global_batch_size=16 if r != 2 else 20)))
    msgs = {str(e) for e in got}
    assert len(msgs) == 1, msgs
    assert "disagree on global_batch_size: rank(s) [0, 1, 3]: 16; rank(s) [2]: 20" in msgs.pop()
    res = run_plans(threads, [2.0, 0.0, 1.0, 1.0], 20)
    msgs = {str(e) for e in res}
    assert len(msgs) == 1 and "no training step measured on rank(s) [1]" in msgs.pop()


def test_rebalance_off_keeps_even_shares(threads: Threads) -> None:
    res = run_plans(threads, [2.0, 2.0, 1.0, 1.0], 30, rebalance=False)
    assert all(p == [(0, (4, 4, 4, 4))] for p, _ in res)


def test_one_rank_takes_every_sample_without_a_group() -> None:
    s = RebalancingSampler(10, 4, num_replicas=1, rank=0, shuffle=False)
    assert list(s) == [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9, 0, 1]] and s.plans == [(0, (4,))]


def test_sampler_refuses_bad_settings() -> None:
    with pytest.raises(ValueError, match="cannot give 4 ranks 1 sample"):
        RebalancingSampler(100, 3, num_replicas=4, rank=0)
    with pytest.raises(ValueError, match="rank 4 of 4"):
        RebalancingSampler(100, 16, num_replicas=4, rank=4)
    with pytest.raises(ValueError, match="hysteresis"):
        RebalancingSampler(100, 16, num_replicas=4, rank=0, hysteresis=1.5)


# ---- the weights ----


def test_sample_weights() -> None:
    w = gpubridge.SampleWeights()
    with pytest.raises(RuntimeError, match=r"set\(local_samples, global_samples\) was not called"):
        _ = w.weight
    w.set(12, 48)
    assert (w.weight, w.loss_scale(), w.loss_scale(3)) == (0.25, 0.25, 0.0625)
    for bad in ((5, 4), (-1, 4), (0, 0)):
        with pytest.raises(ValueError, match="local of"):
            w.set(*bad)
