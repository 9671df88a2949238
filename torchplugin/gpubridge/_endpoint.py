"""A bridged rank's end of the bridge: its ``gbbridge serve``, the feed to
it, the staging region, and the steps of the collectives that cross the
bridge. Today the island leaders have one."""

from __future__ import annotations

import contextlib
import datetime
import logging
import os
import time
from pathlib import Path
from typing import Any

import torch

from gpubridge import _gpu, _tools
from gpubridge import _inflight as fl
from gpubridge._bridge_process import BridgeProcess, start_bridge
from gpubridge._dtypes import DTYPES, as_bytes
from gpubridge._feed import DType, FeedClient, FeedError, Op, Region
from gpubridge._staging import Staging

__all__ = ["BridgeEndpoint"]

log = logging.getLogger("gpubridge")

# Bytes per chunk of a GPU copy into (or out of) the region: the bridge
# starts on a chunk as soon as its copy is done.
_CHUNK = int(os.environ.get("GPUBRIDGE_COPY_CHUNK", str(8 << 20)))
# GPUBRIDGE_TRACE_COPIES=1 logs the timeline of each large GPU all_reduce on
# a leader (copies queued, input handed to the bridge, results back).
_TRACE_COPIES = os.environ.get("GPUBRIDGE_TRACE_COPIES") == "1"


class BridgeEndpoint:
    """Made by :meth:`start` (gbbridge serve is running), usable after
    :meth:`connect` (the feed is up)."""

    def __init__(
        self,
        process: BridgeProcess,
        rank: int,
        members: tuple[int, ...],
        device: torch.device,
        stream: Any,
        timeout: datetime.timedelta,
    ) -> None:
        self.process = process
        self._rank = rank
        self._members = members  # the bridge's, in member order
        self._device = device
        self._stream = stream  # the worker's, where the copies in are queued
        self._h2d: Any = _gpu.new_stream(device) if device.type == "cuda" else None
        self._timeout = timeout
        self._feed: FeedClient | None = None
        self._staging: Staging | None = None

    @classmethod
    def start(
        cls,
        workdir: Path,
        store: tuple[str, int],
        namespace: str,
        rank: int,
        members: tuple[int, ...],
        device: torch.device,
        stream: Any,
        timeout: datetime.timedelta,
    ) -> BridgeEndpoint:
        """Starts gbbridge serve with the topology in workdir; the job's
        store (host, port) and namespace are where it meets the other
        members."""
        host, port = store
        env = dict(os.environ, GPUBRIDGE_STORE=f"{host}:{port}", GPUBRIDGE_NAMESPACE=namespace)
        isecs = int(max(1.0, timeout.total_seconds()))
        process = start_bridge(
            workdir / "topology.json", workdir / "feed.sock", gbbridge=_tools.find_tool("gbbridge"),
            env=env, args=["--timeout", f"{isecs}s"],
        )  # fmt: skip
        return cls(process, rank, members, device, stream, timeout)

    def connect(self) -> None:
        """Waits for gbbridge serve's ready line and connects the feed."""
        isecs = int(max(1.0, self._timeout.total_seconds()))
        try:
            self.process.wait_ready(float(min(isecs, 120)))
            self._feed = FeedClient.connect(
                self.process.feed, timeout=60.0, name=f"gpubridge rank {self._rank}",
                request_timeout=isecs + 60.0,
            )  # fmt: skip
        except FeedError as e:
            raise RuntimeError(f"gpubridge: rank {self._rank}: starting gbbridge serve: {e}") from e
        self._staging = Staging(self._feed, self._device, self._stream, self._h2d, self._secs)

    @property
    def _secs(self) -> float:
        return self._timeout.total_seconds()

    @property
    def feed(self) -> FeedClient:
        assert self._feed is not None
        return self._feed

    @property
    def staging(self) -> Staging:
        assert self._staging is not None
        return self._staging

    # ---- the bridged steps ----

    def all_reduce(self, e: fl.Entry, t: torch.Tensor, op: Op) -> None:
        """All-reduces t in place over the bridge, through the region."""
        src = as_bytes(t)
        n = src.numel()
        host = self.staging.tensor(n)
        region = self.staging.region
        assert region is not None
        dt = DTYPES[t.dtype]
        try:
            if self._device.type == "cuda":
                self._all_reduce_streamed(e, src, host, region, dt, op)
                return
            e.set_step(fl.COPY)
            host.copy_(src)
            e.set_step(fl.BRIDGE)
            self.feed.all_reduce(region, 0, n, dt, op)
            e.set_step(fl.COPY_BACK)
            src.copy_(host)
        except FeedError as exc:
            raise RuntimeError(f"bridge all_reduce: {exc}") from exc

    def _all_reduce_streamed(
        self, e: fl.Entry, src: torch.Tensor, host: torch.Tensor, region: Region, dt: DType, op: Op
    ) -> None:
        """The GPU all_reduce of src (its bytes) through host (the region's
        view): chunked copies on the worker's stream; the bridge starts on
        each chunk once its copy is done and hands results back as it
        finishes them, copied back on a second stream meanwhile. While a
        chunk's copy runs, this thread reads the feed, so results are copied
        back while input still goes in. Chunks: an eighth of the tensor, 1
        to 8 MiB (GPUBRIDGE_COPY_CHUNK caps them)."""
        feed, staging = self.feed, self.staging
        n = src.numel()
        e.set_step(fl.COPY)
        chunk = min(_CHUNK, max(1 << 20, -(-n // 8)))
        chunk = -(-chunk // 4096) * 4096
        # The copies back wait for the island reduce (queued before), not
        # for the copies in: a result range comes only after the bridge
        # read its input, whose copy was done by then.
        self._h2d.wait_stream(self._stream)
        trace: list[tuple[str, float]] | None = [] if _TRACE_COPIES and n >= (16 << 20) else None
        t0 = time.perf_counter()
        ends = []
        for off in range(0, n, chunk):
            end = min(n, off + chunk)
            host[off:end].copy_(src[off:end], non_blocking=True)
            ev = _gpu.new_event()
            ev.record(self._stream)
            ends.append((end, ev))
        dev = self._device
        if trace is not None:
            trace.append(("copies queued", time.perf_counter() - t0))

        def back(off: int, k: int) -> None:
            if trace is not None:
                trace.append((f"result {off >> 20}+{k >> 10}K", time.perf_counter() - t0))
            with torch.cuda.device(dev), torch.cuda.stream(self._h2d):
                src[off : off + k].copy_(host[off : off + k], non_blocking=True)

        call = feed.start_all_reduce(region, 0, n, dt, op, on_progress=back)
        e.set_step(fl.BRIDGE)
        for end, ev in ends:
            _gpu.wait_event(
                ev, f"the copy of bytes [0, {end}) into the feed region", self._secs,
                pump=lambda: feed.pump(0.0),  # what has arrived, without blocking
            )  # fmt: skip
            call.ready(end)
            if trace is not None:
                trace.append((f"ready {end >> 20}M", time.perf_counter() - t0))
        call.wait()
        e.set_step(fl.COPY_BACK)
        self._stream.wait_stream(self._h2d)
        if trace is not None:
            staging.sync(self._h2d, "the copies out of the feed region")
            trace.append(("copied back", time.perf_counter() - t0))
            log.warning(
                "gpubridge: rank %d: %d-byte all_reduce (chunks of %d): %s", self._rank, n, chunk,
                ", ".join(f"{w} {t * 1e3:.3f}" for w, t in trace),
            )  # fmt: skip

    def broadcast(self, e: fl.Entry, t: torch.Tensor, root: int, mine: bool) -> None:
        """Copies member root's t into every member's; mine: this member
        holds the data."""
        staging = self.staging
        src = as_bytes(t)
        host = staging.tensor(src.numel())
        assert staging.region is not None
        if mine:
            staging.copy_in(e, host, src)
        e.set_step(fl.BRIDGE)
        try:
            self.feed.broadcast(staging.region, 0, src.numel(), root)
        except FeedError as exc:
            raise RuntimeError(f"bridge broadcast: {exc}") from exc
        if not mine:
            staging.copy_out(e, src, host)

    def all_gather(self, e: fl.Entry, block: torch.Tensor, slot: int) -> torch.Tensor:
        """Every member's block (bytes, at most slot of them) in a slot of
        its own, in member order: returns the region's members x slot bytes,
        valid until the next step."""
        staging = self.staging
        me, m = self._members.index(self._rank), len(self._members)
        host = staging.tensor(m * slot)
        assert staging.region is not None
        staging.copy_in(e, host[me * slot : me * slot + block.numel()], block)
        e.set_step(fl.BRIDGE)
        try:
            self.feed.all_gather(staging.region.span(0, m * slot), staging.region.span(me * slot, slot))
        except FeedError as exc:
            raise RuntimeError(f"bridge all_gather: {exc}") from exc
        return host

    # ---- failure and closing ----

    def exit_reason(self) -> str | None:
        """How this rank's gbbridge serve ended, if it did (a feed error such
        as a broken pipe is only the symptom)."""
        how = self.process.exit_reason()
        if how is None:
            return None
        return f"gbbridge serve of rank {self._rank} (pid {self.process.proc.pid}) {how}"

    def abort(self) -> None:
        """Closes the feed at once: gbbridge serve aborts the bridge, which
        sends abort frames to the other members."""
        if self._feed is not None:
            self._feed.abort()

    def close(self, abort: bool) -> int:
        """Releases the region, says BYE (or aborts), and waits for gbbridge
        serve's exit; returns its exit status (-1: killed at the deadline)."""
        if self._staging is not None:
            with contextlib.suppress(Exception):
                self._staging.drop()
        feed, self._feed = self._feed, None
        if feed is not None:
            if abort or feed.error is not None:
                feed.abort()
            else:
                with contextlib.suppress(FeedError, OSError):
                    feed.close()
        try:
            return self.process.wait(10.0)
        except FeedError:
            return -1
        finally:
            self.process.kill()
            self.process.stderr_file.close()
