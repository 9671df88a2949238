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
from gpubridge._combine import can_combine, combine
from gpubridge._dtypes import DTYPES, as_bytes
from gpubridge._feed import Done, DType, FeedClient, FeedError, Op, Region
from gpubridge._staging import Staging

__all__ = ["BridgeEndpoint"]

log = logging.getLogger("gpubridge")

# Bytes per chunk of a GPU copy into (or out of) the region: the bridge
# starts on a chunk as soon as its copy is done.
_CHUNK = int(os.environ.get("GPUBRIDGE_COPY_CHUNK", str(8 << 20)))
# GPUBRIDGE_TRACE_COPIES=1 logs the timeline of each large GPU all_reduce on
# a leader (copies queued, input handed to the bridge, results back).
_TRACE_COPIES = os.environ.get("GPUBRIDGE_TRACE_COPIES") == "1"
# Where the leaders of a two-island group reduce (every rank must say the
# same): "auto": on the GPU, for GPU tensors of at least _CALLER_MIN bytes
# whose dtype and op gpubridge._combine does, when gbbridge speaks feed
# protocol 2 (gbbridge only exchanges the partials); else in gbbridge.
# "host": always in gbbridge. "caller": every all_reduce _combine can do,
# CPU tensors and small ones too (the simulation tests of the GPU path's
# arithmetic and order).
_REDUCE = os.environ.get("GPUBRIDGE_BRIDGE_REDUCE", "auto")
_REDUCE_MODES = ("auto", "host", "caller")
_CALLER_MIN = 1 << 20
# The caller reduces the peer's partial in spans of this many bytes, as
# they arrive: fewer, larger kernels (the tests make it small).
_SPAN = int(os.environ.get("GPUBRIDGE_REDUCE_SPAN", str(32 << 20)))


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
        self._add: Any = _gpu.new_stream(device) if device.type == "cuda" else None  # the caller's reduction
        self._timeout = timeout
        self._feed: FeedClient | None = None
        self._staging: Staging | None = None
        if _REDUCE not in _REDUCE_MODES:
            modes = ", ".join(_REDUCE_MODES)
            raise RuntimeError(f"gpubridge: GPUBRIDGE_BRIDGE_REDUCE={_REDUCE!r}: want one of {modes}")
        # GPUBRIDGE_BRIDGE_REDUCE; a benchmark may switch it between calls,
        # on every leader alike.
        self.reduce_mode = _REDUCE
        # A list: every all_reduce the caller reduced appends where its time
        # went (bench/gpu/exchange_bench.py sets it).
        self.profile: list[dict[str, float]] | None = None
        self.exchanged = 0  # all_reduces this leader reduced itself

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
            if self._caller_reduces(t, op):
                self._all_reduce_exchanged(e, t, op)
                return
            if self._device.type == "cuda":
                self._all_reduce_streamed(e, src, host, region, dt, op)
                return
            e.set_step(fl.COPY)
            host.copy_(src)
            e.set_step(fl.BRIDGE)
            self._measured(e, self.feed.all_reduce(region, 0, n, dt, op))
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
        self._measured(e, call.wait())
        e.set_step(fl.COPY_BACK)
        self._stream.wait_stream(self._h2d)
        if trace is not None:
            staging.sync(self._h2d, "the copies out of the feed region")
            trace.append(("copied back", time.perf_counter() - t0))
            log.warning(
                "gpubridge: rank %d: %d-byte all_reduce (chunks of %d): %s", self._rank, n, chunk,
                ", ".join(f"{w} {t * 1e3:.3f}" for w, t in trace),
            )  # fmt: skip

    def _measured(self, e: fl.Entry, d: Done) -> None:
        """Keeps what gbbridge measured of the step for e's trace record."""
        e.bridge, e.bridge_ranks = d.bridge, self._members

    def _caller_reduces(self, t: torch.Tensor, op: Op) -> bool:
        """Whether this all_reduce exchanges the partials and reduces them
        here (the same answer on every leader: every input is)."""
        mode = self.reduce_mode
        if mode == "host" or len(self._members) != 2 or not self.feed.caller_reduces:
            return False
        if not can_combine(t.dtype, op):
            return False
        if mode == "caller":
            return True
        return self._device.type == "cuda" and t.numel() * t.element_size() >= _CALLER_MIN

    def _all_reduce_exchanged(self, e: fl.Entry, t: torch.Tensor, op: Op) -> None:
        """Two islands: the partials are exchanged through the region (slot
        m holds member m's), and each leader reduces them itself, member 0's
        value first (gpubridge._combine: lib/reduce's bits), so both end with
        what gbbridge's all_reduce would have left: chunked copies in, the
        peer's partial copied to the device as it arrives and reduced there
        span by span, overlapping on a GPU (in order, on CPU tensors)."""
        n = t.numel() * t.element_size()
        host = self.staging.tensor(2 * n)
        region = self.staging.region
        assert region is not None
        self.exchanged += 1
        _Exchange(self, e, t, op, self._members.index(self._rank), host, region).run()

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
            self._measured(e, self.feed.broadcast(staging.region, 0, src.numel(), root))
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
            d = self.feed.all_gather(staging.region.span(0, m * slot), staging.region.span(me * slot, slot))
            self._measured(e, d)
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


class _Exchange:
    """One all_reduce whose partials the bridge exchanges and this leader
    reduces (BridgeEndpoint._all_reduce_exchanged). On a GPU the copies in
    run on the worker's stream, the peer's partial goes to the GPU on h2d,
    the reduction runs on add; each span is reduced once its peer bytes are
    on the GPU and the copy in of its own bytes is done (the reduction
    overwrites them). On CPU tensors every copy is done when it returns:
    the same steps, in order, without streams or events.
    """

    def __init__(
        self, ep: BridgeEndpoint, e: fl.Entry, t: torch.Tensor, op: Op, me: int,
        host: torch.Tensor, region: Region,
    ) -> None:  # fmt: skip
        self.ep, self.e, self.t, self.op, self.me = ep, e, t, op, me
        self.src = as_bytes(t)
        self.n = self.src.numel()
        self.host, self.region = host, region
        self.es = t.element_size()
        self.peer = ep.staging.scratch(self.n)  # the peer's partial, on the GPU
        # The peer bytes on the GPU and not reduced yet: off -> (end, the
        # number of the last copy that brought them, its event). Copies run
        # in order on h2d, so that event covers every earlier copy.
        self.arrived: dict[int, tuple[int, int, Any]] = {}
        self.copies = 0
        self.done_to = 0  # the peer partial's bytes [0, done_to) are reduced
        self.d2h: list[tuple[int, Any]] = []  # copy-in chunks: (end, event)
        self.gpu = ep._device.type == "cuda"
        self.prof = ep.profile is not None and self.gpu
        self.h2d_ev: list[tuple[Any, Any]] = []
        self.add_ev: list[tuple[Any, Any]] = []
        self.t_last = 0.0

    def run(self) -> None:
        ep, n, me = self.ep, self.n, self.me
        feed, stream = ep.feed, ep._stream
        self.e.set_step(fl.COPY)
        chunk = min(_CHUNK, max(1 << 20, -(-n // 8)))
        chunk = -(-chunk // 4096) * 4096
        if self.gpu:
            # The bridge writes the peer's partial into the region without
            # waiting for this member: copies out of it still queued from an
            # earlier call must be done first.
            _gpu.sync_stream(ep._h2d, "the copies out of the feed region", ep._secs)
            # The copies out and the reduction wait for the island reduce
            # (queued before); the reduction also for each span's copy in.
            ep._h2d.wait_stream(stream)
            ep._add.wait_stream(stream)
        mine = self.host[me * n : (me + 1) * n]
        t0 = time.perf_counter()
        ev0 = self._event(stream) if self.prof else None
        for off in range(0, n, chunk):
            end = min(n, off + chunk)
            mine[off:end].copy_(self.src[off:end], non_blocking=self.gpu)
            self.d2h.append((end, self._event(stream)))
        call = feed.start_exchange(
            self.region.span(me * n, n), self.region.span(0, 2 * n), DTYPES[self.t.dtype], self.op,
            on_progress=self._arrived,
        )  # fmt: skip
        t_start = time.perf_counter()
        self.e.set_step(fl.BRIDGE)
        for end, ev in self.d2h:
            if ev is not None:
                what = f"the copy of bytes [0, {end}) into the feed region"
                _gpu.wait_event(ev, what, ep._secs, pump=lambda: feed.pump(0.0))
            call.ready(end)
        d = call.wait()
        ep._measured(self.e, d)
        self.e.set_step(fl.COPY_BACK)
        self._reduce(final=True)
        if self.done_to != n:
            raise FeedError(f"the peer's partial came only up to byte {self.done_to} of {n}")
        if self.gpu:
            stream.wait_stream(ep._add)
        if ev0 is not None:
            self._record(ev0, t0, t_start, d.total_us)

    def _event(self, stream: Any) -> Any:
        """An event recorded on stream (None on CPU tensors)."""
        if not self.gpu:
            return None
        ev = _gpu.new_event(timing=self.prof)
        ev.record(stream)
        return ev

    def _on(self, stream: Any) -> Any:
        """The context that queues work on stream (nothing on CPU tensors)."""
        if not self.gpu:
            return contextlib.nullcontext()
        return _gpu.on_stream(self.ep._device, stream)

    def _arrived(self, off: int, k: int) -> None:
        """A PROGRESS range of the output: the peer's bytes go to the GPU."""
        lo = (1 - self.me) * self.n
        if off < lo or off >= lo + self.n:
            return  # this member's own slot
        rel = off - lo
        ep = self.ep
        with self._on(ep._h2d):
            ev0 = self._event(ep._h2d) if self.prof else None
            self.peer[rel : rel + k].copy_(self.host[off : off + k], non_blocking=self.gpu)
            ev = self._event(ep._h2d)
        if ev0 is not None:
            self.h2d_ev.append((ev0, ev))
        self.copies += 1
        self.arrived[rel] = (rel + k, self.copies, ev)
        self.t_last = time.perf_counter()
        self._reduce(final=False)

    def _reduce(self, final: bool) -> None:
        """Reduces the peer bytes that arrived from done_to on, in spans of
        at least _SPAN bytes (when final, whatever is there)."""
        while self.done_to in self.arrived:
            lo = end = self.done_to
            seq, ev = 0, None
            while end in self.arrived:
                end, s, e = self.arrived.pop(end)
                if s > seq:
                    seq, ev = s, e
            if end - lo < _SPAN and not final:
                self.arrived[lo] = (end, seq, ev)  # not enough yet
                return
            cut = end if end == self.n else end - end % self.es
            if cut <= lo:
                self.arrived[lo] = (end, seq, ev)
                return
            if cut < end:
                self.arrived[cut] = (end, seq, ev)
            self._launch(lo, cut, ev)
            self.done_to = cut

    def _launch(self, lo: int, hi: int, h2d_ev: Any) -> None:
        """Reduces bytes [lo, hi) on the add stream, member 0's value first."""
        ep = self.ep
        d2h = next(ev for end, ev in self.d2h if end >= hi)
        with self._on(ep._add):
            if self.gpu:
                ep._add.wait_event(h2d_ev)
                ep._add.wait_event(d2h)
            ev0 = self._event(ep._add) if self.prof else None
            own = self.src[lo:hi].view(self.t.dtype)
            other = self.peer[lo:hi].view(self.t.dtype)
            a, b = (own, other) if self.me == 0 else (other, own)
            combine(self.op, a, b, own)
            if ev0 is not None:
                self.add_ev.append((ev0, self._event(ep._add)))

    def _record(self, ev0: Any, t0: float, t_start: float, server_us: int) -> None:
        """Appends where the call's time went (GPU busy times from events)."""
        ep = self.ep
        ep._stream.synchronize()

        def ms(a: Any, b: Any) -> float:
            return float(a.elapsed_time(b))

        def parts(name: str, evs: list[tuple[Any, Any]]) -> dict[str, float]:
            """Busy time, and first start and last end after the call began."""
            if not evs:
                return {f"{name}_ms": 0.0, f"{name}_first_ms": 0.0, f"{name}_last_ms": 0.0}
            return {
                f"{name}_ms": sum(ms(a, b) for a, b in evs),
                f"{name}_first_ms": ms(ev0, evs[0][0]), f"{name}_last_ms": ms(ev0, evs[-1][1]),
            }  # fmt: skip

        assert ep.profile is not None
        ep.profile.append({
            "bytes": float(self.n), "d2h_ms": ms(ev0, self.d2h[-1][1]),
            **parts("h2d", self.h2d_ev), **parts("add", self.add_ev), "adds": float(len(self.add_ev)),
            "wire_ms": (self.t_last - t_start) * 1e3, "server_ms": server_us / 1e3,
            "host_ms": (time.perf_counter() - t0) * 1e3,
        })  # fmt: skip
