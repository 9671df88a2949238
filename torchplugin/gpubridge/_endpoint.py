"""A bridged rank's end of the bridge: its ``gbbridge serve``, the feed to
it, the staging region, the bridges it JOINed besides the leaders' (feed
protocol 4), and the steps of the collectives that cross the bridge. Island
leaders start one with the group (bridge 0 is theirs); any other rank on
its first cross-island need (gpubridge._endpoints), with ``--no-bridge``."""

from __future__ import annotations

import contextlib
import datetime
import itertools
import logging
import os
import threading
import time
from collections.abc import Callable, Hashable
from pathlib import Path
from typing import Any

import torch

from gpubridge import _codec, _gpu, _tools
from gpubridge import _inflight as fl
from gpubridge._bridge_process import BridgeProcess, start_bridge_lasting
from gpubridge._combine import can_combine, combine
from gpubridge._dtypes import DTYPES, as_bytes
from gpubridge._feed import Call, Codec, Done, DType, FeedClient, FeedError, Op, Region
from gpubridge._feed_protocol import BRIDGES_VERSION, CODEC_VERSION
from gpubridge._feedback import ErrorFeedback
from gpubridge._staging import RegionPool, Staging

__all__ = ["BridgeEndpoint"]

log = logging.getLogger("gpubridge")

# Bytes per chunk of a GPU copy into (or out of) the region: the bridge
# starts on a chunk as soon as its copy is done.
_CHUNK = int(os.environ.get("GPUBRIDGE_COPY_CHUNK", str(8 << 20)))
# GPUBRIDGE_TRACE_COPIES=1 logs the timeline of each large GPU all_reduce on
# a leader (copies queued, input handed to the bridge, results back).
_TRACE_COPIES = os.environ.get("GPUBRIDGE_TRACE_COPIES") == "1"
# Where the leaders of a two-island group reduce (GPUBRIDGE_BRIDGE_REDUCE,
# gpubridge._policy; every rank says the same): "auto": on the GPU, for GPU
# tensors of at least _CALLER_MIN bytes whose dtype and op gpubridge._combine
# does, when gbbridge speaks feed protocol 2 (gbbridge only exchanges the
# partials); else in gbbridge. "host": always in gbbridge. "caller": every
# all_reduce _combine can do, CPU tensors and small ones too (the simulation
# tests of the GPU path's arithmetic and order).
_CALLER_MIN = 1 << 20
# The caller reduces the peer's partial in spans of this many bytes, as
# they arrive: fewer, larger kernels (the tests make it small).
_SPAN = int(os.environ.get("GPUBRIDGE_REDUCE_SPAN", str(32 << 20)))
# A lossy codec quantizes a partial in at most _PIECES pieces of at least
# _PIECE_BYTES of the tensor (one codec call each) before its packed bytes
# go to the region.
_PIECES = 4
_PIECE_BYTES = 128 << 20


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
        reduce_mode: str = "auto",
        codec: Codec = Codec.RAW,
        bridge0: bool = True,
        spins: tuple[int | None, int | None] = (None, None),
    ) -> None:
        self.process = process
        self.bridge0 = bridge0  # a leader's: serve joined the leaders' bridge at start
        self._rank = rank
        self._members = members  # the bridge's, in member order
        self._device = device
        self._stream = stream  # the worker's, where the copies in are queued
        self._h2d: Any = _gpu.new_stream(device) if device.type == "cuda" else None
        self._add: Any = _gpu.new_stream(device) if device.type == "cuda" else None  # the caller's reduction
        self._timeout = timeout
        self._feed: FeedClient | None = None
        self._staging: Staging | None = None
        self._pool: RegionPool | None = None
        self._codec = codec  # the group's (GPUBRIDGE_COMPRESSION)
        # GPUBRIDGE_BRIDGE_REDUCE; a benchmark or a test may switch it
        # between calls, on every leader alike.
        self.reduce_mode = reduce_mode
        # Error feedback of the calls this leader quantizes itself (the GPU
        # path), per codec; gbbridge keeps those of the host path, by the
        # number _wire_keys gives each key.
        self.feedback: dict[Codec, ErrorFeedback] = {}
        self._wire_keys: dict[Hashable, int] = {}
        self._next_key = itertools.count(1)
        # A list: every all_reduce the caller reduced appends where its time
        # went (bench/gpu/exchange_bench.py sets it).
        self.profile: list[dict[str, float]] | None = None
        self.exchanged = 0  # all_reduces this leader reduced itself
        self._spins = spins  # spin_us() and tiny_spin_us() as start() resolved them (None: no spin)
        # The bridges JOINed on this feed (§3b), by name: their ids, or the
        # JOIN in flight; one JOIN per name, whichever thread needs it first.
        self._join_lock = threading.Lock()
        self._joins: dict[str, tuple[int, Call | None, tuple[int, ...]]] = {}
        self._next_bridge = itertools.count(1)

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
        reduce_mode: str = "auto",
        codec: Codec = Codec.RAW,
        bridge0: bool = True,
    ) -> BridgeEndpoint:
        """Starts gbbridge serve with the topology in workdir; the job's
        store (host, port) and namespace are where it meets the other
        members. Without bridge0 (a rank that leads no island) it joins no
        bridge at start (``--no-bridge``: the bridges come by JOIN)."""
        host, port = store
        env = dict(os.environ, GPUBRIDGE_STORE=f"{host}:{port}", GPUBRIDGE_NAMESPACE=namespace)
        isecs = int(max(1.0, timeout.total_seconds()))
        args = ["--timeout", f"{isecs}s", *([] if bridge0 else ["--no-bridge"])]
        spin, tiny = spin_us(), tiny_spin_us()
        if spin is not None:
            args += ["--spin-us", str(spin)]
        if tiny is not None:
            args += ["--tiny-spin-us", str(tiny)]
        for k in ("GPUBRIDGE_SPIN_US", "GPUBRIDGE_TINY_SPIN_US"):
            env.pop(k, None)  # the flags say them, "auto" resolved
        process = start_bridge_lasting(
            workdir / "topology.json", workdir / "feed.sock", gbbridge=_tools.find_tool("gbbridge"),
            env=env, args=args,
        )  # fmt: skip
        return cls(process, rank, members, device, stream, timeout, reduce_mode, codec, bridge0, (spin, tiny))

    def connect(self, give_up: Callable[[], str | None] | None = None) -> None:
        """Waits for gbbridge serve's ready line (give_up: see
        BridgeProcess.wait_ready) and connects the feed. A group that
        compresses needs a gbbridge of feed protocol 3."""
        isecs = int(max(1.0, self._timeout.total_seconds()))
        spin, tiny = ((us or 0) / 1e6 for us in self._spins)
        try:
            self.process.wait_ready(float(min(isecs, 120)), give_up)
            self._feed = FeedClient.connect(
                self.process.feed, timeout=60.0, name=f"gpubridge rank {self._rank}",
                request_timeout=isecs + 60.0, spin=spin, tiny_spin=tiny,
            )  # fmt: skip
        except FeedError as e:
            raise RuntimeError(f"gpubridge: rank {self._rank}: starting gbbridge serve: {e}") from e
        if not self.bridge0 and not self._feed.bridges:
            raise RuntimeError(
                f"gpubridge: rank {self._rank}: an endpoint outside the leaders' bridge needs a gbbridge "
                f"serve that speaks feed protocol {BRIDGES_VERSION}; gbbridge serve (pid "
                f"{self.process.proc.pid}) speaks version {self._feed.version}: use the gbbridge of "
                "this gpubridge"
            )
        if self._codec != Codec.RAW and not self._feed.codecs:
            raise RuntimeError(
                f"gpubridge: rank {self._rank}: GPUBRIDGE_COMPRESSION={self._codec} needs a gbbridge serve "
                f"that speaks feed protocol {CODEC_VERSION}; gbbridge serve (pid {self.process.proc.pid}) "
                f"speaks version {self._feed.version}: use the gbbridge of this gpubridge"
            )
        self._staging = Staging(self._feed, self._device, self._stream, self._h2d, self._secs)
        self._pool = RegionPool(self._feed, self._device)

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

    @property
    def regions(self) -> RegionPool:
        """The regions of point-to-point transfers."""
        assert self._pool is not None
        return self._pool

    # ---- more bridges (feed protocol 4) ----

    def join(self, name: str, members: tuple[int, ...]) -> int:
        """The id of the bridge called name (members: the topology's ranks
        in member order, this rank among them) on this feed, JOINed on
        first use; every member must ask for the same name and members. A
        failed JOIN raises RuntimeError naming the bridge, and so does every
        later use of it."""
        # Every call of a bridge after its JOIN: its entry no longer changes,
        # so it is read without the lock.
        got = self._joins.get(name)
        if got is not None and got[1] is None and got[2] == members:
            return got[0]
        call: Call | None
        with self._join_lock:
            got = self._joins.get(name)
            if got is None:
                bid = next(self._next_bridge)
                try:
                    call = self.feed.start_join(bid, name, members)
                except FeedError as exc:
                    raise self._join_error(name, members, exc) from exc
                self._joins[name] = (bid, call, members)
            else:
                bid, call, had = got
                if had != members:
                    raise RuntimeError(
                        f"gpubridge: rank {self._rank}: bridge {name} was joined with ranks "
                        f"{list(had)}, now asked for with {list(members)}"
                    )
        if call is not None:
            try:
                call.wait()
            except FeedError as exc:
                raise self._join_error(name, members, exc) from exc
            with self._join_lock:
                self._joins[name] = (bid, None, members)
        return bid

    def _join_error(self, name: str, members: tuple[int, ...], exc: FeedError) -> RuntimeError:
        ranks = ", ".join(str(m) for m in members)
        return RuntimeError(f"rank {self._rank}: joining bridge {name} (ranks {ranks}): {exc}")

    @property
    def bridges(self) -> list[str]:
        """The names of the bridges this feed JOINed (or is joining)."""
        with self._join_lock:
            return sorted(self._joins)

    # ---- the bridged steps ----

    def all_reduce(
        self, e: fl.Entry, t: torch.Tensor, op: Op, codec: Codec = Codec.RAW, key: Hashable | None = None
    ) -> None:
        """All-reduces t in place over the bridge, through the region. codec
        packs the bridged transfers (gpubridge._policy chose it for t and
        op); key names the error-feedback residual of a lossy one (None:
        none is kept)."""
        staging = self.staging
        raw = staging.raw(t)
        src = t if raw else as_bytes(t)
        n = src.nbytes
        try:
            if self._caller_reduces(t, op):
                self._all_reduce_exchanged(e, t, op, codec, key if codec.lossy else None)
                return
            host = staging.tensor(n)
            region = staging.region
            assert region is not None
            dt = DTYPES[t.dtype]
            wire_key = self._wire_key(key) if codec.lossy and key is not None else None
            if self._device.type == "cuda":
                self._all_reduce_streamed(e, src, host, region, dt, op, codec, wire_key)
                return
            staging.copy_in(e, host, src, raw)
            e.set_step(fl.BRIDGE)
            self._measured(e, self.feed.all_reduce(region, 0, n, dt, op, codec=codec, feedback_key=wire_key))
            staging.copy_out(e, src, host, raw)
        except FeedError as exc:
            raise RuntimeError(f"bridge all_reduce: {exc}") from exc

    def _wire_key(self, key: Hashable) -> int:
        """The FEEDBACK_KEY gbbridge knows key's residual by: a number of
        its own for each key this leader has used."""
        k = self._wire_keys.get(key)
        if k is None:
            k = self._wire_keys[key] = next(self._next_key)
        return k

    def error_feedback(self, codec: Codec) -> ErrorFeedback:
        """The residuals this leader keeps for codec (the GPU path's)."""
        ef = self.feedback.get(codec)
        if ef is None:
            ef = self.feedback[codec] = ErrorFeedback(str(codec))
        return ef

    @property
    def residual_bytes(self) -> int:
        """The memory the GPU path's residuals hold here (4 bytes a value)."""
        return sum(ef.nbytes for ef in self.feedback.values())

    def _all_reduce_streamed(
        self, e: fl.Entry, src: torch.Tensor, host: torch.Tensor, region: Region, dt: DType, op: Op,
        codec: Codec, wire_key: int | None,
    ) -> None:  # fmt: skip
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

        call = feed.start_all_reduce(
            region, 0, n, dt, op, on_progress=back, codec=codec, feedback_key=wire_key
        )
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

    def _all_reduce_exchanged(
        self, e: fl.Entry, t: torch.Tensor, op: Op, codec: Codec, key: Hashable | None
    ) -> None:
        """Two islands: the partials are exchanged through the region (slot
        m holds member m's), and each leader reduces them itself, member 0's
        value first (gpubridge._combine: lib/reduce's bits), so both end with
        what gbbridge's all_reduce would have left: chunked copies in, the
        peer's partial copied to the device as it arrives and reduced there
        span by span, overlapping on a GPU (in order, on CPU tensors). With
        a lossy codec the slots hold the partials' packings, quantized here
        (with key's residual), and the reduction decodes and sums them."""
        ef = self.error_feedback(codec) if key is not None else None
        self.exchanged += 1
        _Exchange(self, e, t, op, self._members.index(self._rank), codec, ef, key).run()

    def broadcast(
        self, e: fl.Entry, t: torch.Tensor, root: int, mine: bool, codec: Codec = Codec.RAW
    ) -> None:
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
            d = self.feed.broadcast(staging.region, 0, src.numel(), root, dtype=DTYPES[t.dtype], codec=codec)
            self._measured(e, d)
        except FeedError as exc:
            raise RuntimeError(f"bridge broadcast: {exc}") from exc
        if not mine:
            staging.copy_out(e, src, host)

    def all_gather(
        self, e: fl.Entry, block: torch.Tensor, slot: int, dtype: torch.dtype, codec: Codec = Codec.RAW
    ) -> torch.Tensor:
        """Every member's block (bytes of dtype, at most slot of them) in a
        slot of its own, in member order: returns the region's members x
        slot bytes, valid until the next step."""
        staging = self.staging
        me, m = self._members.index(self._rank), len(self._members)
        host = staging.tensor(m * slot)
        assert staging.region is not None
        staging.copy_in(e, host[me * slot : me * slot + block.numel()], block)
        e.set_step(fl.BRIDGE)
        try:
            d = self.feed.all_gather(
                staging.region.span(0, m * slot),
                staging.region.span(me * slot, slot),
                DTYPES[dtype],
                codec=codec,
            )
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
        serve's exit; returns its exit status (-1: killed at the deadline).
        The residuals go with it: this leader's now, gbbridge's as its feed
        closes."""
        for ef in self.feedback.values():
            ef.clear()
        if self._staging is not None:
            with contextlib.suppress(Exception):
                self._staging.drop()
        if self._pool is not None:
            self._pool.close()
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


# A lossy codec on the GPU path: (encode, encode with feedback, decode,
# decode-add) of gpubridge._codec, the bytes lib/codec writes.
_Encode = Callable[[torch.Tensor], torch.Tensor]
_EncodeFeedback = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
_Decode = _codec.Decoder
_DecodeAdd = Callable[[torch.Tensor, torch.Tensor], None]
_LOSSY: dict[Codec, tuple[_Encode, _EncodeFeedback, _Decode, _DecodeAdd]] = {
    Codec.FP8: (
        _codec.mxfp8_encode, _codec.mxfp8_encode_feedback, _codec.mxfp8_decode, _codec.mxfp8_decode_add,
    ),
    Codec.BF16: (_codec.bf16_encode, _codec.bf16_encode_feedback, _codec.bf16_decode, _codec.bf16_decode_add),
}  # fmt: skip


class _Packing:
    """Where the values of a tensor of n values lie in its packing by a lossy
    codec: fp8 in groups of 1024 values (1056 bytes each, the last shorter),
    bf16 in 2 bytes a value. Cuts fall on whole groups, so the packing of
    values [v, w) (v a multiple of 1024) is bytes [at(v), at(w)) of the whole
    packing."""

    def __init__(self, codec: Codec, n: int) -> None:
        self.codec, self.n = codec, n
        fp8 = codec == Codec.FP8
        self.nbytes = _codec.mxfp8_len(n) if fp8 else 2 * n
        self.unit = _codec.GROUP_BYTES if fp8 else 2  # bytes of a whole group (or value)
        self.per_unit = _codec.GROUP if fp8 else 1  # its values

    def at(self, v: int) -> int:
        """The byte where value v's group starts (v: a group's first value, or n)."""
        return self.nbytes if v == self.n else v // self.per_unit * self.unit

    def value(self, b: int) -> int:
        """The first value of the group at byte b (a multiple of unit, or the end)."""
        return self.n if b == self.nbytes else b // self.unit * self.per_unit


class _Exchange:
    """One all_reduce whose partials the bridge exchanges and this leader
    reduces (BridgeEndpoint._all_reduce_exchanged). On a GPU the copies in
    run on the worker's stream, the peer's partial goes to the GPU on h2d,
    the reduction runs on add; each span is reduced once its peer bytes are
    on the GPU and the copy in of its own bytes is done (the reduction
    overwrites them). On CPU tensors every copy is done when it returns:
    the same steps, in order, without streams or events.

    With a lossy codec (fp8, bf16) the slots hold packings: each chunk of
    the partial is quantized on the device (with the residual of ef's key,
    when there is one) just before its packed bytes are copied in, and a
    span of the result (whole groups) is dec(slot 0) + dec(slot 1) in
    float32, member 0's decoding first, then the tensor's dtype: the bits
    gbbridge's compressed exchange gives (docs/COMPRESSION.md).
    """

    def __init__(
        self, ep: BridgeEndpoint, e: fl.Entry, t: torch.Tensor, op: Op, me: int,
        codec: Codec = Codec.RAW, ef: ErrorFeedback | None = None, key: Hashable | None = None,
    ) -> None:  # fmt: skip
        self.ep, self.e, self.t, self.op, self.me = ep, e, t, op, me
        self.codec = codec
        self.src = as_bytes(t)
        self.es = t.element_size()
        self.packing = _Packing(codec, t.numel()) if codec.lossy else None
        # The bytes a slot holds: the partial's, or its packing's.
        self.n = self.packing.nbytes if self.packing is not None else self.src.numel()
        self.unit = self.packing.unit if self.packing is not None else self.es  # spans are cut at these
        self.host = ep.staging.tensor(2 * self.n)
        self.region = ep.staging.region
        assert self.region is not None
        self.ef, self.key = ef, key
        self.own: torch.Tensor | None = None  # this member's packing, on the device
        self.peer = ep.staging.scratch(self.n)  # the peer's partial (or packing), on the GPU
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
        tbytes = self.src.numel()
        chunk = min(_CHUNK, max(1 << 20, -(-tbytes // 8)))
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
        if self.packing is not None:
            self._pack_in(mine, chunk)
        else:
            for off in range(0, n, chunk):
                end = min(n, off + chunk)
                mine[off:end].copy_(self.src[off:end], non_blocking=self.gpu)
                self.d2h.append((end, self._event(stream)))
        assert self.region is not None
        call = feed.start_exchange(
            self.region.span(me * n, n), self.region.span(0, 2 * n), DTYPES[self.t.dtype], self.op,
            on_progress=self._arrived, codec=self.codec,
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

    def _pack_in(self, mine: torch.Tensor, chunk: int) -> None:
        """Quantizes the partial into own on the device, in at most
        _PIECES pieces of whole groups, none under _PIECE_BYTES of the
        tensor unless it is smaller (each one call of the codec: a call
        costs a fixed fraction of a millisecond of host time, which chunk
        by chunk added up to more than the copies it saved), and copies
        each piece's packed bytes into this member's slot in chunks of
        about chunk bytes, an event after each (the bridge starts on a
        chunk once its copy is done)."""
        p, ep = self.packing, self.ep
        assert p is not None
        enc, enc_fb, _, _ = _LOSSY[self.codec]
        x = self.t.reshape(-1)
        r = self.ef.residual(self.key, x) if self.ef is not None else None
        own = self.own = torch.empty(p.nbytes, dtype=torch.uint8, device=x.device)
        if self.gpu:
            own.record_stream(ep._add)  # read by the reduction on add
        pieces = max(1, min(_PIECES, self.src.numel() // _PIECE_BYTES))
        step = -(-p.n // pieces)
        step = max(_codec.GROUP, -(-step // _codec.GROUP) * _codec.GROUP)
        for v in range(0, p.n, step):
            w = min(p.n, v + step)
            lo, hi = p.at(v), p.at(w)
            own[lo:hi] = enc_fb(x[v:w], r[v:w]) if r is not None else enc(x[v:w])
            for b in range(lo, hi, chunk):
                e = min(hi, b + chunk)
                mine[b:e].copy_(own[b:e], non_blocking=self.gpu)
                self.d2h.append((e, self._event(ep._stream)))

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
        at least _SPAN bytes (when final, whatever is there), cut at whole
        elements (packings: whole groups)."""
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
            cut = end if end == self.n else end - end % self.unit
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
            if self.packing is not None:
                self._decode_sum(lo, hi)
            else:
                own = self.src[lo:hi].view(self.t.dtype)
                other = self.peer[lo:hi].view(self.t.dtype)
                a, b = (own, other) if self.me == 0 else (other, own)
                combine(self.op, a, b, own)
            if ev0 is not None:
                self.add_ev.append((ev0, self._event(ep._add)))

    def _decode_sum(self, lo: int, hi: int) -> None:
        """The result's values in packed bytes [lo, hi) (whole groups):
        dec(member 0's) + dec(member 1's) in float32, then t's dtype (the
        op is a sum: an average is divided after the bridge)."""
        p, own = self.packing, self.own
        assert p is not None and own is not None
        _, _, dec, dec_add = _LOSSY[self.codec]
        v, w = p.value(lo), p.value(hi)
        q_own, q_peer = own[lo:hi], self.peer[lo:hi]
        q0, q1 = (q_own, q_peer) if self.me == 0 else (q_peer, q_own)
        acc = dec(q0, w - v)
        dec_add(acc, q1)
        self.t.reshape(-1)[v:w].copy_(_codec.to_dtype(acc, self.t.dtype))

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


MAX_SPIN_US = 10_000  # gbbridge serve's --spin-us limit
# What auto spins: a 4-byte flat all_reduce of 4 ranks on 16 cores took 2.0x
# Gloo's time unspun, 1.0x at 200 us; 1000 us shortened its p99 (1.10x to
# 0.88x Gloo's) but cost 4 members' shm all_reduce 1.3-2.7x (docs/BENCHMARKS.md).
AUTO_SPIN_US = 200
# So the tiny calls (_feed.TINY_CALL_BYTES, 64 KiB, at most) spin 1000 us
# on their own, in serve and in the client.
AUTO_TINY_SPIN_US = 1000


def spin_us() -> int | None:
    """GPUBRIDGE_SPIN_US: how long (microseconds) gbbridge serve's shm
    waiters check their ring before sleeping on their futex (--spin-us),
    and the feed client for its answers, in calls of more than 64 KiB.
    ``auto`` (or unset): AUTO_SPIN_US when this rank's CPUs (its affinity)
    give every local rank and its gbbridge serve a core of their own (local
    ranks: LOCAL_WORLD_SIZE, else SLURM_NTASKS_PER_NODE, else 1), else None
    (no spinning in the client, serve's default). Waking a sleeper costs
    tens of microseconds on a VM; spinning where cores are shared steals
    them."""
    return _spin_setting("GPUBRIDGE_SPIN_US", AUTO_SPIN_US)


def tiny_spin_us() -> int | None:
    """GPUBRIDGE_TINY_SPIN_US: the same spin in the calls of at most 64 KiB
    (--tiny-spin-us), whose time is mostly wake-ups.
    ``auto`` (or unset): GPUBRIDGE_SPIN_US's number when it gives one, else
    AUTO_TINY_SPIN_US under auto's rule of a core each, else None."""
    if _is_auto("GPUBRIDGE_TINY_SPIN_US") and not _is_auto("GPUBRIDGE_SPIN_US"):
        return spin_us()
    return _spin_setting("GPUBRIDGE_TINY_SPIN_US", AUTO_TINY_SPIN_US)


def _is_auto(name: str) -> bool:
    return os.environ.get(name, "").strip() in ("", "auto")


def _spin_setting(name: str, auto: int) -> int | None:
    if _is_auto(name):
        local = _int_env("LOCAL_WORLD_SIZE", _int_env("SLURM_NTASKS_PER_NODE", 1))
        return auto if len(os.sched_getaffinity(0)) >= 2 * local else None
    raw = os.environ[name].strip()
    try:
        us = int(raw)
    except ValueError:
        us = -1
    if not 0 <= us <= MAX_SPIN_US:
        raise ValueError(f"{name}={raw!r}: auto, or whole microseconds 0..{MAX_SPIN_US}")
    return us


def _int_env(name: str, default: int) -> int:
    try:
        return max(1, int(os.environ.get(name, "")))
    except ValueError:
        return default
