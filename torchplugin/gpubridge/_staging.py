"""The staging region of a bridged rank: a feed region (shared memory that
gbbridge serve maps too) seen as a uint8 tensor, grown as needed, and
page-locked on GPUs so that copies to and from the GPU use it directly."""

from __future__ import annotations

import contextlib
import ctypes
import mmap
import threading
from typing import Any

import torch
from torch.autograd.graph import increment_version

from gpubridge import _gpu
from gpubridge import _inflight as fl
from gpubridge._feed import FeedClient, FeedError, Region

__all__ = ["RegionPool", "Staging"]

MIN_REGION = 1 << 20
# The largest tensor whose copies are a memmove (Staging.raw): torch copies
# bytes on one thread up to its grain size (32768 elements), so nothing
# runs on fewer threads than before.
RAW_MAX = 32 << 10


class Staging:
    """The region and the copies into and out of it. On GPUs the copies in
    run on stream (the worker's) and the copies out on h2d; both are done
    before the region is unpinned."""

    def __init__(self, feed: FeedClient, device: torch.device, stream: Any, h2d: Any, secs: float) -> None:
        self._feed = feed
        self._gpu = device.type == "cuda"
        self._stream = stream
        self._h2d = h2d
        self._secs = secs  # how long a copy may take on the GPU
        self.region: Region | None = None
        self._t: torch.Tensor | None = None
        self._pinned = 0
        self._device = device
        self._scratch: torch.Tensor | None = None
        self._view: torch.Tensor | None = None  # the last tensor() given, kept for the next call of its size

    def tensor(self, nbytes: int) -> torch.Tensor:
        """A uint8 tensor over the first nbytes of the region (grown, and
        page-locked on GPUs, as needed)."""
        v = self._view
        if v is not None and v.numel() == nbytes:
            return v
        r = self.region
        if r is None or r.size < nbytes:
            size = max(MIN_REGION, nbytes, 2 * r.size if r is not None else 0)
            size = -(-size // mmap.PAGESIZE) * mmap.PAGESIZE
            self.drop()
            r = self.region = self._feed.map_region(size)
            t = torch.frombuffer(r.mem, dtype=torch.uint8, count=size)
            if self._gpu:
                _gpu.host_register(t.data_ptr(), size, f"the {size}-byte feed region")
                self._pinned = t.data_ptr()
            self._t = t
        assert self._t is not None
        v = self._view = self._t[:nbytes]
        return v

    def scratch(self, nbytes: int) -> torch.Tensor:
        """A uint8 tensor of nbytes on the device, kept for later calls
        (grown as needed): where the peer's partial lands on the GPU. Every
        use of it is ordered after the last (the streams wait for each other
        at each call's start and end)."""
        if self._scratch is None or self._scratch.numel() < nbytes:
            self._scratch = None
            self._scratch = torch.empty(nbytes, dtype=torch.uint8, device=self._device)
        return self._scratch[:nbytes]

    def drop(self) -> None:
        """Unpins and releases the region (once the copies are done)."""
        r, self.region = self.region, None
        self._t = self._view = None
        if self._pinned:
            if self._stream is not None:
                self.sync(self._stream, "the copies into the feed region")
                self.sync(self._h2d, "the copies out of the feed region")
            _gpu.host_unregister(self._pinned)
            self._pinned = 0
        if r is not None and self._feed.error is None:
            with contextlib.suppress(FeedError):
                self._feed.release(r)

    def sync(self, stream: Any, what: str) -> None:
        _gpu.sync_stream(stream, what, self._secs)

    def raw(self, t: torch.Tensor) -> bool:
        """Whether t's bytes may go to and from the region by memmove
        (copy_in and copy_out with raw) instead of a torch copy of its byte
        view: on CPU, a plain tensor of at most RAW_MAX bytes in one
        dimension of stride 1 (what gpubridge._dtypes.as_bytes views in one
        step), not an inference tensor nor one with the negative bit (whose
        byte view raises). A small call's copies are then no torch op at
        all (each costs more than the copy: microseconds, tens with a cold
        cache); anything else takes the torch copy, and keeps its errors."""
        return (
            not self._gpu and type(t) is torch.Tensor and t.is_cpu and t.dim() == 1 and t.stride(0) == 1
            and t.nbytes <= RAW_MAX and not t.is_inference() and not t.is_neg()
        )  # fmt: skip

    def copy_in(self, e: fl.Entry, host: torch.Tensor, src: torch.Tensor, raw: bool = False) -> None:
        """Copies src into host (a view of the region), done on return.
        raw: src is a tensor raw() took, whose nbytes bytes are copied."""
        e.set_step(fl.COPY)
        if raw:
            ctypes.memmove(host.data_ptr(), src.data_ptr(), src.nbytes)
        elif self._gpu:
            host.copy_(src, non_blocking=True)
            self.sync(self._stream, "the copy into the feed region")
        else:
            host.copy_(src)

    def copy_out(self, e: fl.Entry, dst: torch.Tensor, host: torch.Tensor, raw: bool = False) -> None:
        """Copies host (a view of the region) into dst, queued on the current
        stream on GPUs. raw: dst is a tensor raw() took; its version counter
        moves on as a torch copy's would (autograd sees it changed)."""
        e.set_step(fl.COPY_BACK)
        if raw:
            ctypes.memmove(dst.data_ptr(), host.data_ptr(), dst.nbytes)
            increment_version(dst)
        else:
            dst.copy_(host, non_blocking=self._gpu)


class RegionPool:
    """Feed regions for point-to-point transfers, several in use at once
    (a send and a recv both in flight, each on a region of its own), kept
    for reuse: sizes are powers of two from 1 MiB, page-locked once on
    GPUs (a cudaHostRegister of 64 MiB costs milliseconds). The region
    given back last is always kept, and older free ones are released
    (least recently given back first) while the free regions pass the
    larger of keep_bytes and the most the pool's users ever held at once
    (up to max_keep_bytes): a transfer larger than keep_bytes that repeats
    (a 1 GiB tensor sent every step) reuses its pinned region instead of
    pinning 1 GiB again each time, and so do a send and a recv of 1 GiB
    each in flight together (1F1B's two directions), which need two."""

    def __init__(
        self,
        feed: FeedClient,
        device: torch.device,
        keep_bytes: int = 512 << 20,
        max_keep_bytes: int = 4 << 30,
    ) -> None:
        self._feed = feed
        self._gpu = device.type == "cuda"
        self._keep = keep_bytes
        self._max_keep = max(keep_bytes, max_keep_bytes)
        self._lock = threading.Lock()
        self._free: list[tuple[Region, torch.Tensor]] = []  # least recently given back first
        self._free_bytes = 0
        self._held = 0  # bytes of the regions acquired and not given back
        self._peak = 0  # the most ever held at once
        self._closed = False

    def acquire(self, nbytes: int) -> tuple[Region, torch.Tensor]:
        """A region of at least nbytes and a uint8 tensor over all of it."""
        size = max(MIN_REGION, 1 << max(0, nbytes - 1).bit_length())
        with self._lock:
            if self._closed:
                raise FeedError("gpubridge: the endpoint is closed")
            self._held += size
            for i in range(len(self._free) - 1, -1, -1):  # the most recently given back
                if self._free[i][0].size == size:
                    self._free_bytes -= size
                    self._peak = max(self._peak, self._held)
                    return self._free.pop(i)
        try:
            r = self._feed.map_region(size)
        except BaseException:
            with self._lock:
                self._held -= size
            raise
        t = torch.frombuffer(r.mem, dtype=torch.uint8, count=size)
        if self._gpu:
            try:
                _gpu.host_register(t.data_ptr(), size, f"the {size}-byte point-to-point region")
            except BaseException:
                del t
                with contextlib.suppress(FeedError):
                    self._feed.release(r)
                with self._lock:
                    self._held -= size
                raise
        with self._lock:
            self._peak = max(self._peak, self._held)
        return r, t

    def release(self, region: Region, t: torch.Tensor) -> None:
        """Gives a region back (its copies done): kept, and the least
        recently given back of the others released past keep_bytes."""
        drop: list[tuple[Region, torch.Tensor]] = []
        with self._lock:
            self._held -= region.size
            if self._closed:
                drop.append((region, t))
            else:
                self._free.append((region, t))
                self._free_bytes += region.size
                keep = max(self._keep, min(self._peak, self._max_keep))
                while self._free_bytes > keep and len(self._free) > 1:
                    old = self._free.pop(0)
                    self._free_bytes -= old[0].size
                    drop.append(old)
        for r, rt in drop:
            self._drop(r, rt)

    @property
    def free_sizes(self) -> list[int]:
        """The sizes of the free regions, least recently given back first."""
        with self._lock:
            return [r.size for r, _ in self._free]

    def _drop(self, region: Region, t: torch.Tensor) -> None:
        if self._gpu:
            _gpu.host_unregister(t.data_ptr())
        del t
        if self._feed.error is None:
            with contextlib.suppress(FeedError):
                self._feed.release(region)

    def close(self) -> None:
        """Releases the free regions; those in use go with the feed."""
        with self._lock:
            self._closed = True
            free, self._free = self._free, []
            self._free_bytes = 0
        for r, t in free:
            with contextlib.suppress(Exception):
                self._drop(r, t)
