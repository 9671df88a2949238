"""Point-to-point's ordering rules without a job (gpubridge._p2p): a (peer,
tag)'s chunks go on the tag itself within a window of requests in flight,
transfers issue in the order they were called, a channel goes when no
transfer holds it; and GPUBRIDGE_P2P_CHUNK as a setting."""

from __future__ import annotations

import datetime
import gc
import threading
import time
import weakref
from typing import Any

import pytest
import torch
from testenv import scale

from gpubridge import _inflight as fl
from gpubridge._endpoints import pair_bridge
from gpubridge._p2p import (
    MAX_AUTO_CHUNK,
    MAX_TAG,
    WINDOW_BYTES,
    WINDOW_CHUNKS,
    PointToPoint,
    Route,
    _Channel,
    _Runner,
    _Transfer,
    chunk_bytes,
)
from gpubridge._policy import DEFAULT_P2P_CHUNK, Policy, parse_bytes
from gpubridge._worker import Task


class _FakeCall:
    """A request in flight: finished when the test says so."""

    def __init__(self, i: int, log: list[str]) -> None:
        self.i = i
        self.log = log
        self.event = threading.Event()

    @property
    def finished(self) -> bool:
        return self.event.is_set()

    def join(self, timeout: float | None = None) -> None:
        self.log.append(f"join {self.i}")
        assert self.event.wait(timeout)


def _starter(log: list[str], calls: list[_FakeCall]) -> Any:
    def start() -> _FakeCall:
        log.append(f"start {len(calls)}")
        calls.append(_FakeCall(len(calls), log))
        return calls[-1]

    return start


@pytest.mark.parametrize(
    ("nbytes", "room"),
    [(4096, WINDOW_CHUNKS), (WINDOW_BYTES // 4, 4)],
    ids=["chunks", "bytes"],
)
def test_the_window_bounds_requests_in_flight(nbytes: int, room: int) -> None:
    """WINDOW_CHUNKS requests (or WINDOW_BYTES) start without waiting; the
    next waits for the oldest only, and finished ones leave the window
    without a wait."""
    log: list[str] = []
    calls: list[_FakeCall] = []
    ch = _Channel()
    start = _starter(log, calls)
    for _ in range(room):
        ch.issue(start, nbytes, 5.0)  # type: ignore[arg-type]
    assert len(calls) == room and not any(x.startswith("join") for x in log), log
    t = threading.Thread(target=ch.issue, args=(start, nbytes, 5.0))
    t.start()
    time.sleep(0.05)
    assert log[-1] == "join 0" and len(calls) == room, log
    calls[0].event.set()
    t.join(5)
    assert log[-1] == f"start {room}" and len(calls) == room + 1, log
    for c in calls[1:3]:
        c.event.set()
    ch.issue(start, nbytes, 5.0)  # type: ignore[arg-type]
    ch.issue(start, nbytes, 5.0)  # type: ignore[arg-type]
    assert log[-1] == f"start {room + 2}" and "join 1" not in log, log


def test_transfers_issue_in_call_order() -> None:
    ch = _Channel()
    tickets = [ch.ticket() for _ in range(3)]
    order: list[int] = []

    def run(t: int) -> None:
        ch.wait_turn(t, 5.0, "test")
        order.append(t)
        ch.done(t)

    threads = [threading.Thread(target=run, args=(t,)) for t in reversed(tickets)]
    for th in threads:
        th.start()
        time.sleep(0.02)  # the later tickets are waiting first
    for th in threads:
        th.join(5)
    assert order == tickets


def test_a_turn_not_passed_is_named() -> None:
    ch = _Channel()
    ch.ticket()
    late = ch.ticket()
    with pytest.raises(RuntimeError, match="the transfer called before it with the same peer and tag"):
        ch.wait_turn(late, 0.05, "send to rank 3 (tag 0)")


def test_the_turn_deadline_restarts_when_the_turn_moves() -> None:
    """Three transfers ahead, each holding the turn for 0.6 of the deadline:
    the fourth waits 1.8 deadlines in all and still gets its turn."""
    ch = _Channel()
    tickets = [ch.ticket() for _ in range(4)]
    secs = scale(1.0)  # ahead holds 0.6 s a turn: 0.4 s of slack for a loaded box
    got: list[int] = []

    def ahead() -> None:
        for t in tickets[:3]:
            time.sleep(0.6 * secs)
            ch.done(t)

    th = threading.Thread(target=ahead)
    th.start()
    ch.wait_turn(tickets[3], secs, "test")
    got.append(tickets[3])
    th.join(10 * secs)
    assert got == [tickets[3]]


def test_pair_bridge_names() -> None:
    assert pair_bridge(3, 1) == pair_bridge(1, 3) == ("pair/1-3", (1, 3))
    assert MAX_TAG == (1 << 32) - 1  # the wire's u32: no lanes in it


def _p2p(endpoints: Any = None, breaker: Any = None) -> PointToPoint:
    """A PointToPoint with nothing behind it but what is given."""
    none: Any = None
    return PointToPoint(
        "g", none, none, endpoints, breaker, torch.device("cpu"), datetime.timedelta(seconds=5), 4096
    )  # fmt: skip


def test_a_gbbridge_without_request_order_is_refused_by_name() -> None:
    """A gbbridge of feed protocol 4 may match a (peer, tag)'s requests in
    any order: the transfer fails saying which version it needs, passes
    its turn on and lets its channel go."""

    class Old:
        class feed:  # stands for BridgeEndpoint.feed
            version = 4

    class Endpoints:
        def get(self) -> Any:
            return Old()

    class Breaker:
        def fail(self, e: fl.Entry, exc: BaseException) -> RuntimeError:
            return RuntimeError(str(exc))

    p = _p2p(Endpoints(), Breaker())
    key = ("send", None, 1, 3)
    ch, ticket = p._take(key)
    fut: Any = torch.futures.Future()
    t = torch.zeros(4)
    task = Task(fl.Entry("g", 0, "send", 16, fl.P2P, "test"), lambda e: None, fut, [t])
    _Transfer(p, "send", t, 1, 3, Route(None, (0, 1), 1), key, ch, ticket, task, None).run()
    assert task.exc is not None
    assert "needs a gbbridge serve that speaks feed protocol 5" in str(task.exc)
    assert "this one speaks version 4" in str(task.exc)
    assert p.channels() == 0


def test_channels_go_when_idle() -> None:
    """A channel lives while a transfer holds it (ticket to end); the last
    to let go drops it, and the next transfer of the key gets a new one
    whose first ticket runs at once."""
    p = _p2p()
    a, ta = p._take(("send", None, 1, 7))
    b, tb = p._take(("send", None, 1, 7))
    c, _ = p._take(("recv", None, 1, 7))
    assert a is b and (ta, tb) == (0, 1) and c is not a and p.channels() == 2
    p._release(("send", None, 1, 7), a)
    assert p.channels() == 2, "b still holds it"
    p._release(("send", None, 1, 7), b)
    p._release(("recv", None, 1, 7), c)
    assert p.channels() == 0
    d, td = p._take(("send", None, 1, 7))
    assert d is not a and td == 0
    d.wait_turn(td, 0.01, "test")
    p._release(("send", None, 1, 7), d)
    assert p.channels() == 0


def test_channels_under_concurrent_takers() -> None:
    """Threads taking and letting go of a few keys at once: each key's
    tickets on one channel are handed out once each, the turn passes in
    order, and nothing is left."""
    p = _p2p()
    keys = [("send", None, 0, t) for t in range(3)]
    errors: list[BaseException] = []

    def worker(k: int) -> None:
        try:
            for i in range(300):
                key = keys[(k + i) % len(keys)]
                ch, t = p._take(key)
                ch.wait_turn(t, scale(10.0), "test")
                ch.done(t)
                p._release(key, ch)
        except BaseException as e:  # reported below
            errors.append(e)

    threads = [threading.Thread(target=worker, args=(k,)) for k in range(4)]
    for th in threads:
        th.start()
    for th in threads:
        th.join(scale(60.0))
    assert not errors and p.channels() == 0


@pytest.mark.parametrize(
    ("value", "want"),
    [("4M", 4 << 20), ("512k", 512 << 10), ("1GiB", 1 << 30), ("4096", 4096), ("2KB", 2048)],
)
def test_parse_bytes(value: str, want: int) -> None:
    assert parse_bytes(value) == want


def test_p2p_chunk_setting(monkeypatch: pytest.MonkeyPatch) -> None:
    """A discovery setting (both ends must cut a tensor alike); a bad value
    is a problem of the rank, named."""
    monkeypatch.delenv("GPUBRIDGE_P2P_CHUNK", raising=False)
    p = Policy.read()
    assert p.p2p_chunk == DEFAULT_P2P_CHUNK and p.settings()["p2p_chunk"] == str(4 << 20)
    monkeypatch.setenv("GPUBRIDGE_P2P_CHUNK", "1M")
    assert Policy.read().p2p_chunk == 1 << 20
    for bad in ("0", "lots", "-4M"):
        monkeypatch.setenv("GPUBRIDGE_P2P_CHUNK", bad)
        p = Policy.read()
        assert p.problems == [f"GPUBRIDGE_P2P_CHUNK={bad!r} is not a byte count of at least 1 (e.g. 4M)"]


def test_runner_close_joins_its_threads_and_drops_their_transfers() -> None:
    """A transfer's thread is kept for the next one, but it must not keep
    the last transfer (its tensors and future) alive, and close joins every
    thread, so none runs torch code while the process exits."""

    class Transfer:
        def run(self) -> None:
            time.sleep(0.01)

    runner = _Runner("test-p2p")
    held = [Transfer() for _ in range(3)]
    refs = [weakref.ref(t) for t in held]
    for t in held:
        runner.submit(t.run)
    threads = [th for th in threading.enumerate() if th.name == "test-p2p"]
    assert threads
    del held, t
    runner.close(30.0)
    assert not any(th.is_alive() for th in threads)
    gc.collect()
    assert all(r() is None for r in refs)


def test_runner_runs_the_next_transfer_after_one_raised() -> None:
    """A transfer that raises ends its thread (threading's excepthook reports
    it); the thread must not count as idle, or the next transfer would wait
    for it forever."""

    def fails() -> None:
        raise RuntimeError("a transfer's bug")

    runner = _Runner("test-p2p-raise")
    hooked: list[BaseException | None] = []
    old, threading.excepthook = threading.excepthook, lambda a: hooked.append(a.exc_value)
    try:
        runner.submit(fails)
        deadline = time.monotonic() + scale(30)
        while not hooked:
            assert time.monotonic() < deadline, "the failing transfer never ran"
            time.sleep(0.01)
        ran = threading.Event()
        runner.submit(ran.set)
        assert ran.wait(scale(30)), "the transfer after a raise never ran"
    finally:
        threading.excepthook = old
        runner.close(scale(30))
    assert [str(e) for e in hooked] == ["a transfer's bug"]


@pytest.mark.parametrize(
    ("n", "want"),
    [
        (0, 4 << 20),
        (1, 4 << 20),
        (64 << 20, 4 << 20),  # 16 chunks of GPUBRIDGE_P2P_CHUNK: one window
        ((64 << 20) + 1, (4 << 20) + 4096),  # 4 KiB multiples
        (256 << 20, 16 << 20),
        (512 << 20, 16 << 20),
        ((1 << 30) + 5, 16 << 20),  # capped: the window slides (16 of 16 MiB in flight)
        (160000, 12288),  # p2p_worker's long message at GPUBRIDGE_P2P_CHUNK=4096: 14 chunks
    ],
)
def test_chunks_grow_to_stay_within_a_window(n: int, want: int) -> None:
    c = chunk_bytes(n, 4 << 20 if n != 160000 else 4096)
    assert c == want
    assert -(-n // c) <= WINDOW_CHUNKS or c == MAX_AUTO_CHUNK
    if n != 160000:
        assert chunk_bytes(n, 32 << 20) == max(32 << 20, want)  # a larger GPUBRIDGE_P2P_CHUNK is kept
