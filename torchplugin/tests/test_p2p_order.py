"""Point-to-point's ordering rules without a job (gpubridge._p2p): a (peer,
tag)'s chunks go round-robin over the wire-tag lanes, a lane's next request
waits for its previous one, and transfers issue in the order they were
called; and GPUBRIDGE_P2P_CHUNK as a setting."""

from __future__ import annotations

import gc
import threading
import time
import weakref

import pytest
from testenv import scale

from gpubridge._endpoints import pair_bridge
from gpubridge._p2p import LANES, MAX_AUTO_CHUNK, MAX_TAG, _Channel, _Runner, chunk_bytes
from gpubridge._policy import DEFAULT_P2P_CHUNK, Policy, parse_bytes


class _FakeCall:
    """A request in flight: finished when the test says so."""

    def __init__(self, wire: int, log: list[str]) -> None:
        self.wire = wire
        self.log = log
        self.finished = threading.Event()

    def join(self, timeout: float | None = None) -> None:
        self.log.append(f"join {self.wire:#x}")
        assert self.finished.wait(timeout)


def test_chunks_go_round_robin_over_lanes() -> None:
    log: list[str] = []
    calls: list[_FakeCall] = []
    ch = _Channel(tag=5)

    def start(wire: int) -> _FakeCall:
        log.append(f"start {wire:#x}")
        calls.append(_FakeCall(wire, log))
        return calls[-1]

    for _ in range(LANES):
        ch.issue(start, 5.0)  # type: ignore[arg-type]
    assert [c.wire for c in calls] == [lane << 24 | 5 for lane in range(LANES)]
    assert not any(x.startswith("join") for x in log), "a free lane waits for nothing"
    # The next chunk is on lane 0 again: it starts only once lane 0's
    # previous request finished.
    t = threading.Thread(target=ch.issue, args=(start, 5.0))
    t.start()
    time.sleep(0.05)
    assert log[-1] == "join 0x5" and len(calls) == LANES, log
    calls[0].finished.set()
    t.join(5)
    assert log[-1] == "start 0x5" and len(calls) == LANES + 1, log


def test_transfers_issue_in_call_order() -> None:
    ch = _Channel(tag=0)
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
    ch = _Channel(tag=0)
    ch.ticket()
    late = ch.ticket()
    with pytest.raises(RuntimeError, match="the transfer called before it with the same peer and tag"):
        ch.wait_turn(late, 0.05, "send to rank 3 (tag 0)")


def test_the_turn_deadline_restarts_when_the_turn_moves() -> None:
    """Three transfers ahead, each holding the turn for 0.6 of the deadline:
    the fourth waits 1.8 deadlines in all and still gets its turn."""
    ch = _Channel(tag=0)
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
    assert MAX_TAG == (1 << 24) - 1


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


@pytest.mark.parametrize(
    ("n", "want"),
    [
        (0, 4 << 20),
        (1, 4 << 20),
        (64 << 20, 4 << 20),  # 16 chunks of GPUBRIDGE_P2P_CHUNK: all in flight
        ((64 << 20) + 1, (4 << 20) + 4096),  # 4 KiB multiples
        (256 << 20, 16 << 20),
        ((256 << 20) + 1, 16 << 20),  # capped: at most 256 MiB pushed ahead of a late receiver
        ((1 << 30) + 5, 16 << 20),
    ],
)
def test_chunks_grow_so_every_chunk_is_in_flight(n: int, want: int) -> None:
    c = chunk_bytes(n, 4 << 20)
    assert c == want
    assert -(-n // c) <= LANES or c == MAX_AUTO_CHUNK
    assert chunk_bytes(n, 32 << 20) == max(32 << 20, want)  # a larger GPUBRIDGE_P2P_CHUNK is kept
