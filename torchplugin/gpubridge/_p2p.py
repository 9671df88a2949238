"""Point-to-point: send and recv inside an island on the native group (tags
as the native group treats them); across islands between any two ranks
through gbbridge's tagged SEND/RECV, which never wait behind collectives.

Two island leaders use the leaders' bridge (bridge 0); any other pair a
2-member bridge of its own, ``pair/<lo>-<hi>`` (gpubridge._endpoints),
JOINed by both ranks on first use, on an endpoint started then if the rank
has none (feed protocol 4). A tensor goes as messages of GPUBRIDGE_P2P_CHUNK
bytes (a setting every rank shares, so both ends cut it alike), or larger
ones for a tensor of more than WINDOW_CHUNKS of them (chunk_bytes), through
a pooled feed region: on GPUs each chunk's copy to the host runs on a copy
stream and its SEND starts once that copy is done, and each received chunk
is copied to the GPU as soon as its RECV is done, so copies overlap the
wire. Sends and receives are apart, so both directions can be in flight at
once (1F1B does that).

Order. Messages of one (peer, tag) keep their order: each transfer takes a
ticket when it is called and issues its requests in ticket order, and
gbbridge matches a (bridge, peer, tag)'s SENDs and RECVs in the order it
read them (feed protocol 5, docs/FEED.md §4; an older gbbridge is refused
by name). So a (peer, tag)'s chunks all go on the tag itself, and tags
across islands are the whole of the wire's u32. Up to WINDOW_CHUNKS chunks
and WINDOW_BYTES bytes of a (peer, tag) are in flight at once (a sliding
window: the next chunk waits for the oldest only when the window is full,
never for a round trip per chunk). The bound is what a sender may push
ahead of a late receiver, which gbbridge queues against its 1 GiB limit,
and keeps a feed's requests in flight under gbbridge's 1024 with up to 64
(peer, tag)s busy at once."""

from __future__ import annotations

import collections
import contextlib
import datetime
import logging
import queue
import threading
import time
from collections.abc import Callable, Hashable
from typing import Any, TypeVar

import torch

from gpubridge import _gpu
from gpubridge import _inflight as fl
from gpubridge._dtypes import as_bytes
from gpubridge._endpoint import BridgeEndpoint
from gpubridge._endpoints import Endpoints, pair_bridge
from gpubridge._failure import Breaker
from gpubridge._feed import Call, FeedClient, Kind, Span
from gpubridge._feed_protocol import P2P_ORDER_VERSION
from gpubridge._island import IslandGroup
from gpubridge._layout import Layout
from gpubridge._worker import Task, Work

log = logging.getLogger("gpubridge")

__all__ = ["PointToPoint", "Route"]

_T = TypeVar("_T")


class Route:
    """Where a cross-island message to or from a peer goes: a bridge (name
    None: bridge 0) and the peer's member index on it."""

    __slots__ = ("member", "members", "name")

    def __init__(self, name: str | None, members: tuple[int, ...], member: int) -> None:
        self.name, self.members, self.member = name, members, member


# Tags across islands: the wire's u32 (feed protocol 5: no lanes).
MAX_TAG = (1 << 32) - 1
# The window of one (direction, bridge, peer, tag): the requests in flight
# at once. 256 MiB bounds what a sender pushes ahead of a late receiver
# (gbbridge queues it against 1 GiB); 16 chunks are the shape measured on
# the H200 (16 lanes of 4 MiB: 1.31x the all_reduce at 64 MiB, 16 of 16 MiB
# 1.47x at 256 MiB) and let 64 busy (peer, tag)s share a feed under
# gbbridge's 1024 requests in flight (more are refused with that limit named).
WINDOW_BYTES = 256 << 20
WINDOW_CHUNKS = 16
MAX_AUTO_CHUNK = 16 << 20  # chunk_bytes grows chunks up to this


def chunk_bytes(n: int, chunk: int) -> int:
    """The chunk of an n-byte transfer: GPUBRIDGE_P2P_CHUNK, or larger (up
    to MAX_AUTO_CHUNK, 4 KiB multiples) so that the transfer is at most
    WINDOW_CHUNKS chunks: each request costs a feed round of its own (on
    the 2-core simulation 1 MiB chunks ran a 64 MiB send at half the speed
    of 4 MiB ones), and up to 256 MiB every chunk is then in flight at
    once; larger transfers slide the window (16 chunks of 16 MiB in
    flight). Both ends know n (a RECV's tensor has the SEND's size), so
    they cut alike."""
    per_window = -(-n // WINDOW_CHUNKS)
    return max(chunk, min(-(-per_window // 4096) * 4096, MAX_AUTO_CHUNK))


class _Channel:
    """The messages of one direction, bridge, peer and tag: transfers issue
    their requests in the order they were called (tickets), at most one
    window of them in flight. users counts the transfers holding it (from
    their ticket to their end), under PointToPoint's lock: the channel is
    dropped when none does."""

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._next = 0  # the next ticket handed out
        self._turn = 0  # the ticket whose turn it is
        self._inflight: collections.deque[tuple[Call, int]] = collections.deque()  # in turn only
        self._bytes = 0  # of the requests in _inflight
        self.users = 0

    def full(self, nbytes: int) -> bool:
        """In turn: whether a request of nbytes must wait for room (the
        requests that finished leave the window first)."""
        q = self._inflight
        while q and q[0][0].finished:
            self._bytes -= q.popleft()[1]
        return bool(q) and (len(q) >= WINDOW_CHUNKS or self._bytes + nbytes > WINDOW_BYTES)

    def issue(self, start: Callable[[], Call], nbytes: int, secs: float) -> Call:
        """In turn: starts the next chunk's request (start()), of nbytes,
        once the window has room for it (waiting for the oldest first)."""
        while self.full(nbytes):
            self._inflight[0][0].join(secs)
        call = start()
        self._inflight.append((call, nbytes))
        self._bytes += nbytes
        return call

    def ticket(self) -> int:
        with self._cond:
            t = self._next
            self._next += 1
            return t

    def wait_turn(self, ticket: int, secs: float, what: str) -> None:
        """Waits for ticket's turn. The deadline is per turn: it starts
        again each time an earlier transfer passes the turn on, so a
        transfer queued behind several long ones fails only when one of
        them is stuck, not when they are many."""
        with self._cond:
            while self._turn != ticket:

                def moved(seen: int = self._turn) -> bool:
                    return self._turn != seen

                if not self._cond.wait_for(moved, secs):
                    raise RuntimeError(
                        f"{what}: the transfer called before it with the same peer and tag was not issued "
                        f"within {secs:g} s"
                    )

    def done(self, ticket: int) -> None:
        with self._cond:
            self._turn = ticket + 1
            self._cond.notify_all()


class PointToPoint:
    def __init__(
        self,
        group: str,
        layout: Layout,
        island: IslandGroup,
        endpoints: Endpoints,
        breaker: Breaker,
        device: torch.device,
        timeout: datetime.timedelta,
        chunk: int,
    ) -> None:
        self._group = group
        self._layout = layout
        self._island = island
        self._endpoints = endpoints
        self._breaker = breaker
        self._device = device
        self._timeout = timeout
        self._chunk = chunk
        self._runner = _Runner(f"gpubridge-{group}-p2p")
        self._lock = threading.Lock()
        self._channels: dict[Hashable, _Channel] = {}
        self._d2h: Any = None  # GPU: the copy streams of the transfers, made on first use
        self._h2d: Any = None

    def route(self, peer: int) -> Route:
        """The bridge of messages to or from peer (a rank of another
        island)."""
        lay = self._layout
        if lay.is_leader and lay.island_of(peer).leader == peer:
            return Route(None, lay.members, lay.members.index(peer))
        name, members = pair_bridge(lay.rank, peer)
        return Route(name, members, members.index(peer))

    def start(self, op: str, t: torch.Tensor, peer: int, tag: int) -> Any:
        """A send (op "send") or recv of t to or from rank peer; returns its
        Work."""
        lay = self._layout
        if not 0 <= peer < lay.size or peer == lay.rank:
            raise RuntimeError(f"gpubridge: {op}: peer {peer} is not another rank of the group")
        peer_island = lay.island_of(peer)
        if peer_island.label == lay.island.label:
            local = lay.island.ranks.index(peer)
            return self._island.send(t, local, tag) if op == "send" else self._island.recv(t, local, tag)
        return self._bridged(op, t, peer, tag)

    def _take(self, key: Hashable) -> tuple[_Channel, int]:
        """The channel of key and a ticket on it, held until release."""
        with self._lock:
            ch = self._channels.get(key)
            if ch is None:
                ch = self._channels[key] = _Channel()
            ch.users += 1
            return ch, ch.ticket()

    def _release(self, key: Hashable, ch: _Channel) -> None:
        """A transfer is over with its channel: the channel goes once no
        transfer holds it (a job of many tags keeps none idle). The next
        transfer of key then starts a new one: the last one's requests were
        all issued (its turns are over), so order is kept."""
        with self._lock:
            ch.users -= 1
            if ch.users == 0 and self._channels.get(key) is ch:
                del self._channels[key]

    def channels(self) -> int:
        """The channels held now (tests)."""
        with self._lock:
            return len(self._channels)

    def _streams(self) -> tuple[Any, Any]:
        with self._lock:
            if self._d2h is None:
                self._d2h = _gpu.new_stream(self._device)
                self._h2d = _gpu.new_stream(self._device)
            return self._d2h, self._h2d

    def _bridged(self, op: str, t: torch.Tensor, peer: int, tag: int) -> Work:
        """A send or recv across islands, completed by a thread of its own
        (SEND and RECV run concurrently in gbbridge, so an isend/irecv pair
        never waits on the other)."""
        self._breaker.refuse(op)
        if not 0 <= tag <= MAX_TAG:
            raise RuntimeError(
                f"gpubridge: {op} with tag {tag}: tags of point-to-point across islands are 0..{MAX_TAG}"
            )
        route = self.route(peer)
        key = (op, route.name, route.member, tag)
        ch, ticket = self._take(key)
        gpu = self._device.type == "cuda"
        fut: Any = torch.futures.Future(devices=[self._device]) if gpu else torch.futures.Future()
        nb = t.numel() * t.element_size()
        entry = fl.Entry(self._group, 0, op, nb, fl.P2P, threading.current_thread().name)
        task = Task(entry, lambda e: None, fut, [t])
        after: Any = None  # GPU: the caller's stream up to this call
        if gpu:
            d2h, h2d = self._streams()
            after = _gpu.new_event()
            after.record(torch.cuda.current_stream(self._device))
            t.record_stream(d2h if op == "send" else h2d)
        xfer = _Transfer(self, op, t, peer, tag, route, key, ch, ticket, task, after)
        try:
            self._runner.submit(xfer.run)
        except BaseException:
            xfer.abandon()
            raise
        return Work(task, self._device, self._timeout)

    def join(self, secs: float) -> None:
        """Waits (secs at most) for the bridged sends and recvs in flight,
        then lets the runner's threads go."""
        self._runner.close(secs)


class _Runner:
    """The threads that run transfers, kept for the next one (starting a
    thread costs about 0.1 ms, a good part of a small message's time). A
    transfer never waits for a thread: when none is idle, one more starts
    (transfers wait on their peers, and a bounded pool could wait on a peer
    whose own pool waits on this one). At most _KEEP idle threads stay."""

    _KEEP = 16

    def __init__(self, name: str) -> None:
        self._name = name
        self._q: queue.SimpleQueue[Callable[[], None] | None] = queue.SimpleQueue()
        self._cond = threading.Condition()
        self._idle = 0  # threads waiting for work that no submit has claimed
        self._threads = 0
        self._busy = 0  # transfers submitted and not finished
        self._started: list[threading.Thread] = []  # joined by close

    def submit(self, fn: Callable[[], None]) -> None:
        with self._cond:
            self._busy += 1
            if self._idle > 0:
                self._idle -= 1
            else:
                self._threads += 1
                th = threading.Thread(target=self._loop, name=self._name, daemon=True)
                self._started = [t for t in self._started if t.is_alive()]
                self._started.append(th)
                th.start()
        self._q.put(fn)

    def _loop(self) -> None:
        while True:
            fn = self._q.get()
            if fn is None:
                return
            returned = False
            try:
                fn()
                returned = True
            finally:
                # An idle thread must not keep its last transfer (its
                # tensors, future and events) alive until the process ends.
                fn = None
                with self._cond:
                    self._busy -= 1
                    self._cond.notify_all()
                    # A thread that a raise is about to end is not idle: a
                    # submit that counted on it would never run.
                    keep = returned and self._idle < self._KEEP
                    if keep:
                        self._idle += 1
                    else:
                        self._threads -= 1
            if not keep:
                return

    def close(self, secs: float) -> None:
        """Waits (secs at most) until no transfer runs, stops the idle
        threads and joins them, so none is left running torch code while
        the process exits."""
        deadline = time.monotonic() + secs
        with self._cond:
            self._cond.wait_for(lambda: self._busy == 0, secs)
            n, self._idle = self._idle, 0
            self._threads -= n
            started, self._started = self._started, []
        for _ in range(n):
            self._q.put(None)
        for th in started:
            th.join(max(0.0, deadline - time.monotonic()))
        left = sum(th.is_alive() for th in started)
        if left:
            log.warning(
                "gpubridge: %d point-to-point transfer thread(s) of %s still running after %g s",
                left, self._name, secs,
            )  # fmt: skip


class _Transfer:
    """One cross-island send or recv, run on its own thread."""

    def __init__(
        self, p2p: PointToPoint, op: str, t: torch.Tensor, peer: int, tag: int, route: Route, key: Hashable,
        ch: _Channel, ticket: int, task: Task, after: Any,
    ) -> None:  # fmt: skip
        self.p, self.op, self.t, self.peer, self.tag = p2p, op, t, peer, tag
        self.route, self.key, self.ch, self.ticket = route, key, ch, ticket
        self.task, self.after = task, after
        self.gpu = p2p._device.type == "cuda"
        self.secs = p2p._timeout.total_seconds()
        self.what = f"{op} {'to' if op == 'send' else 'from'} rank {peer} (tag {tag})"
        self.passed = False  # this transfer's turn on its channel is over

    def run(self) -> None:
        p, task = self.p, self.task
        fl.enter(task.entry)
        ep: BridgeEndpoint | None = None
        held: tuple[Any, torch.Tensor] | None = None
        try:
            ep = p._endpoints.get()
            if ep.feed.version < P2P_ORDER_VERSION:
                raise RuntimeError(
                    f"point-to-point across islands needs a gbbridge serve that speaks feed protocol "
                    f"{P2P_ORDER_VERSION} (SEND and RECV matched in request order); this one speaks version "
                    f"{ep.feed.version}: use the gbbridge of this gpubridge"
                )
            bridge = None if self.route.name is None else ep.join(self.route.name, self.route.members)
            src = as_bytes(self.t)
            n = src.numel()
            held = ep.regions.acquire(max(n, 1))
            region, host = held
            step = chunk_bytes(n, p._chunk)
            spans = [(a, min(n, a + step)) for a in range(0, n, step)] or [(0, 0)]
            sync: Any = None
            if self.op == "send":
                self._send(ep, bridge, src, host, region, spans)
            else:
                sync = self._recv(ep, bridge, src, host, region, spans)
            task.event = sync
            task.done.set()
            if sync is not None:  # the region is reused once its copies are out
                _gpu.wait_event(sync, f"the copies of a {self.what} to the GPU", self.secs)
            task.fut.set_result([self.t])
        except BaseException as exc:
            self._pass_turn()
            held = None  # the group breaks: its regions go with the feed
            task.exc = p._breaker.fail(task.entry, RuntimeError(f"{self.what}: {exc}"))
            task.done.set()
            task.fut.set_exception(task.exc)
        finally:
            fl.leave()
            if ep is not None and held is not None:
                with contextlib.suppress(Exception):
                    ep.regions.release(*held)
            self.p._release(self.key, self.ch)

    def abandon(self) -> None:
        """The transfer never ran (it could not be submitted): its turn
        passes on and its hold on the channel ends."""
        self._pass_turn()
        self.p._release(self.key, self.ch)

    def _issue(self, fn: Callable[[], _T]) -> _T:
        """Runs fn (which issues this transfer's requests) in its turn."""
        self.ch.wait_turn(self.ticket, self.secs + 60.0, self.what)
        try:
            return fn()
        finally:
            self.passed = True
            self.ch.done(self.ticket)

    def _start(self, feed: FeedClient, kind: Kind, span: Span, bridge: int | None) -> Call:
        """The request of one chunk, once the window has room (in this
        transfer's turn)."""
        peer, tag = self.route.member, self.tag
        return self.ch.issue(
            lambda: feed.start(kind, span, peer=peer, tag=tag, bridge=bridge), span.nbytes, self.secs + 60.0
        )

    def _pass_turn(self) -> None:
        """A transfer that failed before its turn still passes it on in
        order, so those after it run (and fail on their own: the group is
        broken now)."""
        if not self.passed:
            self.passed = True
            with contextlib.suppress(Exception):
                self.ch.wait_turn(self.ticket, self.secs + 60.0, self.what)
            self.ch.done(self.ticket)

    def _send(
        self, ep: BridgeEndpoint, bridge: int | None, src: torch.Tensor, host: torch.Tensor, region: Any,
        spans: list[tuple[int, int]],
    ) -> None:  # fmt: skip
        feed, p = ep.feed, self.p
        ready: list[Any] = []
        if self.gpu:
            # Every chunk's copy to the host is queued at once on the copy
            # stream, after the caller's work on the tensor; each SEND
            # starts when its chunk's copy is done.
            with _gpu.on_stream(p._device, p._d2h):
                p._d2h.wait_event(self.after)
                for a, b in spans:
                    host[a:b].copy_(src[a:b], non_blocking=True)
                    ev = _gpu.new_event()
                    ev.record(p._d2h)
                    ready.append(ev)

        def issue() -> list[Call]:
            calls = []
            for k, (a, b) in enumerate(spans):
                if self.gpu:
                    _gpu.wait_event(ready[k], f"the copy of a {self.what} to the host", self.secs)
                else:
                    host[a:b].copy_(src[a:b])
                calls.append(self._start(feed, Kind.SEND, region.span(a, b - a), bridge))
            return calls

        for c in self._issue(issue):
            c.wait()

    def _recv(
        self, ep: BridgeEndpoint, bridge: int | None, dst: torch.Tensor, host: torch.Tensor, region: Any,
        spans: list[tuple[int, int]],
    ) -> Any:  # fmt: skip
        """Returns the event after the copies to the GPU (None on CPU).
        A chunk's copy out is queued as soon as it has arrived, while later
        chunks are still on the wire: before each RECV is issued, the
        chunks that arrived are copied out, and when the window is full
        this transfer's oldest chunk is waited for and copied out first."""
        feed, p = ep.feed, self.p
        if self.gpu:
            p._h2d.wait_event(self.after)
        done = 0

        def copy_out(k: int, c: Call) -> None:
            a, b = spans[k]
            got = c.wait().nbytes
            if got != b - a:
                raise RuntimeError(
                    f"bytes [{a}, {b}) of the tensor ({dst.numel()} bytes): got a message of {got} bytes "
                    f"(the sender's tensor has another size, or GPUBRIDGE_P2P_CHUNK differs)"
                )
            if self.gpu:
                with _gpu.on_stream(p._device, p._h2d):
                    dst[a:b].copy_(host[a:b], non_blocking=True)
            else:
                dst[a:b].copy_(host[a:b])

        def issue() -> list[Call]:
            nonlocal done
            calls: list[Call] = []
            for a, b in spans:
                while done < len(calls) and (calls[done].finished or self.ch.full(b - a)):
                    calls[done].join(self.secs + 60.0)
                    copy_out(done, calls[done])
                    done += 1
                calls.append(self._start(feed, Kind.RECV, region.span(a, b - a), bridge))
            return calls

        calls = self._issue(issue)
        for k in range(done, len(calls)):
            copy_out(k, calls[k])
        if not self.gpu:
            return None
        ev = _gpu.new_event()
        ev.record(p._h2d)
        return ev
