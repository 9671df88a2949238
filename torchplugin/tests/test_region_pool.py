"""gpubridge._staging.RegionPool: which free regions it keeps (CPU; the
feed is a stand-in that only hands out and takes back regions)."""

from __future__ import annotations

import mmap

import pytest
import torch

from gpubridge._feed import Region
from gpubridge._staging import MIN_REGION, RegionPool


class _Feed:
    """map_region and release as a FeedClient does them, counted."""

    error = None

    def __init__(self) -> None:
        self.mapped: list[int] = []
        self.released: list[int] = []
        self._next = 0

    def map_region(self, size: int) -> Region:
        self._next += 1
        self.mapped.append(size)
        return Region(self._next, size, mmap.mmap(-1, size))

    def release(self, region: Region) -> None:
        self.released.append(region.size)


def _pool(keep: int, max_keep: int = 4 << 30) -> tuple[RegionPool, _Feed]:
    f = _Feed()
    return RegionPool(f, torch.device("cpu"), keep_bytes=keep, max_keep_bytes=max_keep), f  # type: ignore[arg-type]


def test_a_region_over_the_keep_is_reused() -> None:
    """A transfer larger than keep_bytes, repeated, maps (and on GPUs pins)
    its region once."""
    pool, f = _pool(keep=4 * MIN_REGION)
    for _ in range(3):
        r, t = pool.acquire(16 * MIN_REGION)
        assert t.numel() == r.size == 16 * MIN_REGION
        pool.release(r, t)
    assert f.mapped == [16 * MIN_REGION]
    assert f.released == []
    assert pool.free_sizes == [16 * MIN_REGION]


def test_least_recently_given_back_go_first() -> None:
    pool, f = _pool(keep=4 * MIN_REGION)
    held = [pool.acquire(n * MIN_REGION) for n in (1, 2, 1)]
    for r, t in held:
        pool.release(r, t)
    assert pool.free_sizes == [MIN_REGION, 2 * MIN_REGION, MIN_REGION]  # 4 MiB: within the keep
    big = pool.acquire(8 * MIN_REGION)
    pool.release(*big)  # over the keep: every older one goes, the newest stays
    assert pool.free_sizes == [8 * MIN_REGION]
    assert sorted(f.released) == [MIN_REGION, MIN_REGION, 2 * MIN_REGION]
    again = pool.acquire(MIN_REGION)  # a size it no longer has: mapped anew
    assert f.mapped[-1] == MIN_REGION
    pool.release(*again)
    assert pool.free_sizes == [MIN_REGION]  # 9 MiB > keep: the 8 MiB one went
    pool.close()
    assert pool.free_sizes == []
    assert sorted(f.released) == sorted([MIN_REGION, MIN_REGION, 2 * MIN_REGION, 8 * MIN_REGION, MIN_REGION])


def test_regions_held_together_are_all_kept() -> None:
    """A send and a recv over the keep in flight together (both directions
    of 1F1B at once), repeated: each region is mapped (and on GPUs pinned)
    once, not one of them again every step (the H200's 1 GiB exchange both
    ways took 0.8 s a call, re-pinning 1 GiB, at 38377d4)."""
    pool, f = _pool(keep=4 * MIN_REGION)
    for _ in range(3):
        a = pool.acquire(16 * MIN_REGION)
        b = pool.acquire(16 * MIN_REGION)
        pool.release(*a)
        pool.release(*b)
    assert f.mapped == [16 * MIN_REGION, 16 * MIN_REGION]
    assert f.released == []
    # Past the peak of what was held at once the old rule holds: least
    # recently given back go first.
    c = pool.acquire(32 * MIN_REGION)
    pool.release(*c)
    assert pool.free_sizes == [32 * MIN_REGION]
    assert f.released == [16 * MIN_REGION, 16 * MIN_REGION]


def test_what_is_kept_has_a_ceiling() -> None:
    """max_keep_bytes bounds what a peak of use keeps pinned."""
    pool, f = _pool(keep=4 * MIN_REGION, max_keep=16 * MIN_REGION)
    for _ in range(2):
        a = pool.acquire(16 * MIN_REGION)
        b = pool.acquire(16 * MIN_REGION)
        pool.release(*a)
        pool.release(*b)
    assert pool.free_sizes == [16 * MIN_REGION]
    assert f.mapped == [16 * MIN_REGION] * 3
    assert f.released == [16 * MIN_REGION] * 2


def test_a_failed_map_holds_nothing() -> None:
    pool, f = _pool(keep=4 * MIN_REGION)

    def refuse(size: int) -> Region:
        raise OSError("no memory")

    f.map_region = refuse  # type: ignore[method-assign]
    with pytest.raises(OSError, match="no memory"):
        pool.acquire(64 * MIN_REGION)
    assert (pool._held, pool._peak) == (0, 0)
