"""The feed client against two real ``gbbridge serve`` processes.

Two simulated ranks on this host (rank 0 says it is NVIDIA, rank 1 AMD) run
discovery through a ``gbdiscover serve`` store, so each is the leader of its
island and a member of the bridge; each gets its own ``gbbridge serve`` and a
FeedClient, driven from two threads as two rank processes would.
"""

from __future__ import annotations

import json
import os
import select
import signal
import socket
import subprocess
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from testenv import scale

from gpubridge._bridge_process import BridgeProcess, start_bridge
from gpubridge._combine import combine
from gpubridge._endpoint import AUTO_SPIN_US, AUTO_TINY_SPIN_US, spin_us, tiny_spin_us
from gpubridge._feed import (
    TINY_CALL_BYTES,
    BridgeError,
    DType,
    FeedClient,
    FeedError,
    FeedTimeout,
    Kind,
    Op,
    RequestError,
    Span,
    Status,
)
from gpubridge._feed_protocol import VERSION

REPO = Path(__file__).resolve().parents[2]
BIN = REPO / "bin"
TOOLS = [BIN / "gbprobe", BIN / "gbdiscover", BIN / "gbbridge"]
TIMEOUT = scale(30.0)

pytestmark = pytest.mark.skipif(
    not all(os.access(t, os.X_OK) for t in TOOLS),
    reason=f"needs bin/gbprobe, bin/gbdiscover and bin/gbbridge: run `make build` in {REPO}",
)
# The feed protocol between the client and gbbridge serve moves bytes; the
# caller's reduction (torch's arithmetic on NaNs, zeros, denormals) and the
# torch dtype names run on every torch.
PROTOCOL = pytest.mark.torch_independent("the feed protocol's bytes between gpubridge and gbbridge serve")


def children() -> list[int]:
    """PIDs of this process's living children, from /proc (no psutil)."""
    me = os.getpid()
    out = []
    for d in os.listdir("/proc"):
        if not d.isdigit():
            continue
        try:
            stat = Path(f"/proc/{d}/stat").read_text()
        except OSError:
            continue
        fields = stat.rsplit(")", 1)[1].split()
        if int(fields[1]) == me and fields[0] != "Z":
            out.append(int(d))
    return out


def read_line(proc: subprocess.Popen[bytes], timeout: float) -> bytes:
    assert proc.stdout is not None
    fd = proc.stdout.fileno()
    line = b""
    deadline = time.monotonic() + timeout
    while b"\n" not in line:
        left = deadline - time.monotonic()
        assert left > 0, "no line in time"
        if select.select([fd], [], [], left)[0]:
            chunk = os.read(fd, 4096)
            assert chunk, f"exited {proc.wait()} without a line"
            line += chunk
    return line


@dataclass
class Pair:
    store: str
    bridges: list[BridgeProcess]
    clients: list[FeedClient]
    procs: list[subprocess.Popen[bytes]] = field(default_factory=list)

    def both(self, fn: Callable[[FeedClient, int], Any]) -> list[Any]:
        """Runs fn(client, member) for both members at once, as two rank
        processes would; re-raises the first failure."""
        with ThreadPoolExecutor(2) as ex:
            futs = [ex.submit(fn, c, c.member) for c in self.clients]
            return [f.result(timeout=TIMEOUT * 2) for f in futs]


@pytest.fixture
def pair(tmp_path: Path) -> Iterator[Pair]:
    procs: list[subprocess.Popen[bytes]] = []
    bridges: list[BridgeProcess] = []
    clients: list[FeedClient] = []
    try:
        store_proc = subprocess.Popen(
            [BIN / "gbdiscover", "serve", "--listen", "127.0.0.1:0"],
            stdout=subprocess.PIPE,
            stdin=subprocess.DEVNULL,
        )
        procs.append(store_proc)
        ready = json.loads(read_line(store_proc, TIMEOUT))
        assert ready["schema"] == "gpubridge.store-serve/v1"
        store = ready["listen"]

        ns = f"feedtest-{uuid.uuid4().hex[:12]}"
        disc = []
        for rank, vendor in enumerate(["nvidia", "amd"]):
            env = dict(os.environ, GPUBRIDGE_VENDOR=vendor)
            probe = subprocess.Popen([BIN / "gbprobe", "--json"], stdout=subprocess.PIPE, env=env)
            procs.append(probe)
            topo = tmp_path / f"topology{rank}.json"
            with topo.open("wb") as out:
                d = subprocess.Popen(
                    [BIN / "gbdiscover", "--store", store, "--rank", str(rank), "--world-size", "2",
                     "--namespace", ns, "--local-rank", str(rank), "--timeout", f"{TIMEOUT:.0f}s"],
                    stdin=probe.stdout, stdout=out, env=env,
                )  # fmt: skip
            assert probe.stdout is not None
            probe.stdout.close()
            procs.append(d)
            disc.append((d, topo))
        topos = []
        for d, topo in disc:
            assert d.wait(TIMEOUT) == 0, "gbdiscover failed"
            t = json.loads(topo.read_text())
            assert t["bridge"]["members"] == [0, 1], t["bridge"]
            topos.append(topo)

        env = dict(os.environ, GPUBRIDGE_STORE=store)
        for rank, topo in enumerate(topos):
            feed_dir = tmp_path / f"feed{rank}"
            feed_dir.mkdir(mode=0o700)
            bridges.append(
                start_bridge(
                    topo, feed_dir / "feed.sock", gbbridge=BIN / "gbbridge", env=env,
                    args=["--chunk", "64K", "--timeout", f"{scale(20):.0f}s",
                          "--setup-timeout", f"{TIMEOUT:.0f}s"],
                )
            )  # fmt: skip
        for rank, b in enumerate(bridges):
            r = b.wait_ready(TIMEOUT)
            assert (
                r["member"] == rank and r["members"] == 2 and r["feed_version"] == VERSION and r["bridge0"]
            ), r

        def connect(rank: int) -> FeedClient:
            return FeedClient.connect(bridges[rank].feed, timeout=TIMEOUT, request_timeout=TIMEOUT)

        with ThreadPoolExecutor(2) as ex:
            clients = list(ex.map(connect, [0, 1]))
        for rank, c in enumerate(clients):
            assert c.member == rank and c.members == 2
            assert c.welcome is not None and c.welcome.version == VERSION and c.codecs and c.bridges

        yield Pair(store, bridges, clients, procs)

        # A clean close: BYE both ways, gbbridge serve exits 0.
        for c, b in zip(clients, bridges, strict=True):
            if c.error is None:
                c.close()
                assert b.wait(TIMEOUT) == 0, b.stderr()
    finally:
        for c in clients:
            if c.error is None:
                c.abort()
        for b in bridges:
            b.terminate()
        for p in procs:
            if p.poll() is None:
                p.kill()
            p.wait(TIMEOUT)
            if p.stdout is not None:
                p.stdout.close()
    left = children()
    assert not left, f"processes left: {left}"


def bf16_bits(x: torch.Tensor) -> np.ndarray:
    return x.to(torch.bfloat16).view(torch.int16).numpy().view(np.uint16)


def reference(op: Op, dt: DType, x0: np.ndarray, x1: np.ndarray) -> np.ndarray:
    """x0 op x1: member 0's value is the earlier operand; bfloat16 in float32,
    rounded once."""
    if dt == DType.BFLOAT16:
        a = torch.from_numpy(x0.view(np.int16).copy()).view(torch.bfloat16).float()
        b = torch.from_numpy(x1.view(np.int16).copy()).view(torch.bfloat16).float()
        r = a + b if op == Op.SUM else torch.maximum(a, b)
        return bf16_bits(r)
    with np.errstate(over="ignore"):  # -3e38 + -3e38 is -inf, as IEEE says
        return np.asarray(x0 + x1 if op == Op.SUM else np.maximum(x0, x1))


def inputs(dt: DType, n: int, member: int) -> np.ndarray:
    rng = np.random.default_rng(1000 + member * 7 + int(dt))
    if dt == DType.FLOAT32:
        x = np.asarray(rng.standard_normal(n).astype(np.float32) * np.float32(1000))
        x[:4] = np.array([0.0, -0.0, 1e-40, -3.0e38], np.float32)  # zeros, a denormal, near overflow
        return x
    if dt == DType.BFLOAT16:
        return bf16_bits(torch.from_numpy(rng.standard_normal(n).astype(np.float32) * 100))
    x = rng.integers(-(2**62), 2**62, n, dtype=np.int64)
    x[0] = np.iinfo(np.int64).max  # wraps on sum
    return x


@PROTOCOL
@pytest.mark.parametrize("op", [Op.SUM, Op.MAX], ids=lambda v: v.name.lower())
@pytest.mark.parametrize("dt", [DType.FLOAT32, DType.BFLOAT16, DType.INT64], ids=lambda v: v.name.lower())
def test_all_reduce(pair: Pair, dt: DType, op: Op) -> None:
    n = 10_000 + 3
    xs = [inputs(dt, n, m) for m in range(2)]
    want = reference(op, dt, xs[0], xs[1])
    off = 64  # not at the start of the region

    def run(c: FeedClient, m: int) -> bytes:
        r = c.map_region(off + xs[m].nbytes + 128)
        r.array(np.uint8, off, xs[m].nbytes)[:] = xs[m].view(np.uint8)
        d = c.all_reduce(r, off, xs[m].nbytes, dt.name.lower(), op.name.lower())
        assert d.status == Status.OK and d.nbytes == xs[m].nbytes and d.seq >= 1
        got = bytes(r.view(off, xs[m].nbytes))
        c.release(r)
        return got

    got = pair.both(run)
    assert got[0] == got[1], "members disagree"
    assert got[0] == want.tobytes(), "result differs from the reference"


def test_all_reduce_torch_dtype_and_small(pair: Pair) -> None:
    def run(c: FeedClient, m: int) -> list[float]:
        r = c.map_region(4096)
        r.array(np.float32, 0, 1)[0] = 1.5 + m
        c.all_reduce(r, 0, 4, str(torch.float32), "sum")
        return [float(r.array(np.float32, 0, 1)[0])]

    assert pair.both(run) == [[4.0], [4.0]]


@PROTOCOL
def test_streamed_all_reduce(pair: Pair) -> None:
    n = 1 << 20  # 4 MiB of float32, 64 KiB chunks
    xs = [np.random.default_rng(m).standard_normal(n).astype(np.float32) for m in range(2)]
    want = (xs[0] + xs[1]).tobytes()
    steps = 8

    def run(c: FeedClient, m: int) -> tuple[bytes, list[tuple[int, int]]]:
        r = c.map_region(xs[m].nbytes)
        src = xs[m].view(np.uint8)
        dst = r.array(np.uint8)
        ranges: list[tuple[int, int]] = []
        lock = threading.Lock()

        def progress(off: int, length: int) -> None:
            with lock:
                ranges.append((off, length))

        call = c.start_all_reduce(r, 0, r.size, DType.FLOAT32, Op.SUM, on_progress=progress)
        step = r.size // steps
        early = 0
        for i in range(steps):  # "D2H copies" completing chunk by chunk
            dst[i * step : (i + 1) * step] = src[i * step : (i + 1) * step]
            call.ready((i + 1) * step)
            if i == steps - 2:
                # Results come back while input still goes in: one must
                # arrive before the last input is ready (waited for, not
                # timed: the peer may be slow to ready its part).
                end = time.monotonic() + TIMEOUT
                while not ranges and time.monotonic() < end:
                    c.pump(0.01)
                early = len(ranges)
        d = call.wait()
        assert early > 0, "no result range came back before the last input"
        assert d.status == Status.OK and d.nbytes == r.size
        return bytes(r.view()), sorted(ranges)

    for got, ranges in pair.both(run):
        assert got == want
        assert len(ranges) > 1, "no streaming"
        pos = 0  # disjoint, covering the buffer exactly once
        for off, length in ranges:
            assert off == pos, ranges
            pos += length
        assert pos == n * 4


@PROTOCOL
def test_broadcast_gather_scatter_barrier_p2p(pair: Pair) -> None:
    def run(c: FeedClient, m: int) -> None:
        r = c.map_region(1 << 16)
        a = r.array(np.int32, 0, 256)
        # broadcast from member 1
        a[:] = np.arange(256, dtype=np.int32) * (10 if m == 1 else -1)
        c.broadcast(r, 0, a.nbytes, root=1)
        assert (a == np.arange(256, dtype=np.int32) * 10).all()
        # all_gather: in place at this member's slot
        g = r.array(np.int32, 4096, 2 * 16)
        g[m * 16 : (m + 1) * 16] = m + 1
        c.all_gather(r.span(4096, g.nbytes), r.span(4096 + m * 64, 64), "int32")
        assert (g == np.repeat(np.array([1, 2], np.int32), 16)).all()
        # reduce_scatter: member m gets its half of the sum
        inp = r.array(np.float32, 8192, 32)
        inp[:] = np.arange(32, dtype=np.float32) + m
        c.reduce_scatter(r.span(16384, 64), r.span(8192, 128), "float32", "sum")
        want = (2 * np.arange(32, dtype=np.float32) + 1)[m * 16 : (m + 1) * 16]
        assert (r.array(np.float32, 16384, 16) == want).all()
        c.barrier()
        # send/recv: 0 → 1
        if m == 0:
            r.array(np.uint8, 32768, 5)[:] = np.frombuffer(b"hello", np.uint8)
            c.send(r, 32768, 5, peer=1, tag=7)
        else:
            got = c.recv(r, 32768, 100, peer=0, tag=7)
            assert got == 5 and bytes(r.view(32768, 5)) == b"hello"

    pair.both(run)


@PROTOCOL
def test_done_carries_bridge_stats(pair: Pair) -> None:
    """gbbridge's measure of each collective (DONE tag 1, docs/TRACING.md
    §7) on the trace clock: all_reduce and broadcast carry it, barrier and
    send do not."""
    n = 1 << 20

    def run(c: FeedClient, m: int) -> None:
        r = c.map_region(n)
        before = time.monotonic_ns()
        d = c.all_reduce(r, 0, n, "float32", "sum")
        after = time.monotonic_ns()
        b = d.bridge
        assert b is not None
        assert before <= b.start_ns <= b.all_arrived_ns <= b.end_ns <= after, (before, b, after)
        # Two members send each other their buffers.
        assert n <= b.bytes_sent < n + 1024 and n <= b.bytes_received < n + 1024, b
        assert b.reduce_ns > 0 and b.codec_ns == 0 and not b.peers_cut
        (p,) = b.peers
        assert p.member == 1 - m and p.arrival_skew_ns is not None and len(p.blocked_ns) >= 1
        assert all(0 <= w <= b.end_ns - b.start_ns for w in p.blocked_ns), b
        d = c.broadcast(r, 0, 4096, root=0)
        assert d.bridge is not None
        heard = d.bridge.peers[0].arrival_skew_ns is not None
        assert heard == (m == 1), "only the non-root hears from a peer"
        assert c.barrier().bridge is None
        c.release(r)

    pair.both(run)


@PROTOCOL
def test_threads_share_a_client(pair: Pair) -> None:
    """A RECV waits on one thread while collectives and the SEND it waits
    for run on another: each thread's DONE reaches it, whoever reads."""

    def run(c: FeedClient, m: int) -> None:
        r = c.map_region(1 << 16)
        peer = 1 - m
        got: list[int] = []
        t = threading.Thread(target=lambda: got.append(c.recv(r, 8192, 64, peer=peer, tag=1)))
        t.start()
        a = r.array(np.float32, 0, 1024)
        for i in range(20):
            a[:] = i + m
            c.all_reduce(r, 0, a.nbytes, "float32", "sum")
            assert (a == 2 * i + 1).all()
        r.array(np.uint8, 4096, 3)[:] = m + 1
        c.send(r, 4096, 3, peer=peer, tag=1)
        t.join(TIMEOUT)
        assert got == [3] and bytes(r.view(8192, 3)) == bytes([peer + 1] * 3)

    pair.both(run)


@PROTOCOL
def test_bad_request_then_ok(pair: Pair) -> None:
    def run(c: FeedClient, m: int) -> str:
        r = c.map_region(4096)
        with pytest.raises(FeedError) as ei:
            c.all_reduce(r, 8192, 4, "float32", "sum")  # offset beyond the region
        e = ei.value
        assert isinstance(e, RequestError) and not isinstance(e, BridgeError)
        assert e.status == Status.BAD_REQUEST and e.message
        r.array(np.float32, 0, 1)[0] = 2.0
        c.all_reduce(r, 0, 4, "float32", "sum")
        assert r.array(np.float32, 0, 1)[0] == 4.0
        return e.message

    msgs = pair.both(run)
    assert all(msgs)


@PROTOCOL
def test_peer_killed(pair: Pair) -> None:
    c0, c1 = pair.clients
    r0 = c0.map_region(4096)
    c1.map_region(4096)
    pair.bridges[1].proc.send_signal(signal.SIGKILL)
    pair.bridges[1].proc.wait(TIMEOUT)
    t0 = time.monotonic()
    with pytest.raises(BridgeError) as ei:
        c0.all_reduce(r0, 0, 4096, "float32", "sum", timeout=TIMEOUT)
    took = time.monotonic() - t0
    assert took < 10, f"the failure took {took:.1f}s"
    msg = ei.value.message
    assert "member 1" in msg, msg
    # The killed member's client sees its feed gone.
    with pytest.raises(FeedError):
        c1.barrier(timeout=5)
    assert c1.error is not None
    # Every later collective fails at once with the original cause.
    with pytest.raises(BridgeError) as ei2:
        c0.barrier(timeout=5)
    assert ei2.value.status == Status.BROKEN and "member 1" in ei2.value.message
    c0.abort()
    assert pair.bridges[0].wait(TIMEOUT) == 1


# Raw bit patterns of the floating dtypes the caller's reduction must treat
# as lib/reduce does: zeros, denormals, the largest finite, infinities, quiet
# and signalling NaNs with payloads and either sign.
SPECIALS = {
    torch.float16: [0x0000, 0x8000, 0x0001, 0x83FF, 0x7BFF, 0x7C00, 0xFC00, 0x7E00, 0xFE01, 0x7D00, 0x7C01],
    torch.bfloat16: [0x0000, 0x8000, 0x0001, 0x807F, 0x7F7F, 0x7F80, 0xFF80, 0x7FC0, 0xFFC1, 0x7F81, 0x7FA5],
    torch.float32: [0, 0x80000000, 1, 0x807FFFFF, 0x7F7FFFFF, 0x7F800000, 0xFF800000, 0x7FC00000, 0xFFC00001,
                    0x7F800001, 0x7FA5A5A5],
    torch.float64: [0, 1 << 63, 1, 0x7FEFFFFFFFFFFFFF, 0x7FF0000000000000, 0xFFF0000000000000,
                    0x7FF8000000000000, 0xFFF8000000000001, 0x7FF0000000000001, 0x7FF4A5A5A5A5A5A5],
}  # fmt: skip
BITS = {torch.float16: torch.int16, torch.bfloat16: torch.int16, torch.float32: torch.int32}
BITS[torch.float64] = torch.int64


def special_inputs(dtype: torch.dtype, n: int, member: int) -> torch.Tensor:
    """n values of dtype, mostly ordinary, one in eight a special pattern,
    and every pair of specials somewhere."""
    g = torch.Generator().manual_seed(17 + member)
    x = (torch.randn(n, generator=g, dtype=torch.float64) * 4).to(dtype)
    sp = torch.tensor([v - (1 << 8 * dtype.itemsize) if v >= 1 << (8 * dtype.itemsize - 1) else v
                       for v in SPECIALS[dtype]], dtype=BITS[dtype])  # fmt: skip
    bits = x.view(BITS[dtype])
    k = len(sp)
    pick = torch.randint(0, 8 * k, (n,), generator=g)
    mask = pick < k
    bits[mask] = sp[pick[mask]]
    # Every (member 0, member 1) pair of specials at the start.
    grid = torch.arange(k * k)
    bits[: k * k] = sp[grid // k] if member == 0 else sp[grid % k]
    return x


@pytest.mark.parametrize("op", [Op.SUM, Op.PROD, Op.MAX, Op.MIN], ids=lambda v: v.name.lower())
@pytest.mark.parametrize("dtype", list(SPECIALS), ids=str)
def test_caller_reduces_like_the_bridge(pair: Pair, dtype: torch.dtype, op: Op) -> None:
    """The exchange (feed protocol 2) hands every member both inputs in
    member order, and the caller's reduction of them (gpubridge._combine, on
    CPU tensors here) gives the bits of the bridge's own all_reduce (lib/reduce
    in Go), NaN payloads, signed zeros and denormals included; over shm the
    large size runs the direct exchange, the small one the rings."""
    assert all(c.caller_reduces for c in pair.clients)
    for n in (1000, 600_001):
        xs = [special_inputs(dtype, n, m) for m in range(2)]
        nb = xs[0].numel() * dtype.itemsize

        def run(c: FeedClient, m: int, xs: list[torch.Tensor] = xs, nb: int = nb) -> tuple[bytes, bytes]:
            r = c.map_region(3 * nb)
            region = torch.frombuffer(r.mem, dtype=torch.uint8, count=3 * nb)
            mine = xs[m].view(torch.uint8)
            # The bridge's all_reduce, in place at [2nb, 3nb).
            region[2 * nb :] = mine
            c.all_reduce(r, 2 * nb, nb, DType.of(dtype), op)
            want = bytes(region[2 * nb :].numpy())
            # The exchange: this member's input in its own slot of [0, 2nb).
            region[m * nb : (m + 1) * nb] = mine
            d = c.start_exchange(r.span(m * nb, nb), r.span(0, 2 * nb), DType.of(dtype), op, streamed=False)
            d = d.wait()
            assert d.nbytes == 2 * nb
            slots = [region[k * nb : (k + 1) * nb].view(dtype) for k in range(2)]
            for k in range(2):
                assert torch.equal(slots[k].view(torch.uint8), xs[k].view(torch.uint8)), f"slot {k}"
            out = torch.empty_like(slots[0])
            combine(op, slots[0], slots[1], out)
            got = bytes(out.view(torch.uint8).numpy())
            del region, slots, out, mine
            c.release(r)
            return want, got

        for m, (want, got) in enumerate(pair.both(run)):
            w = np.frombuffer(want, dtype=np.uint8).view(f"<i{dtype.itemsize}")
            g = np.frombuffer(got, dtype=np.uint8).view(w.dtype)
            bad = np.flatnonzero(w != g)
            assert bad.size == 0, (
                f"member {m}, {n} elements: {bad.size} differ; first at {bad[0]}: "
                f"x0={xs[0].view(BITS[dtype])[bad[0]]:#x} x1={xs[1].view(BITS[dtype])[bad[0]]:#x} "
                f"want {w[bad[0]]:#x} got {g[bad[0]]:#x}"
            )


@PROTOCOL
def test_peer_killed_mid_exchange(pair: Pair) -> None:
    """A member killed in the middle of a streamed exchange (feed protocol 2,
    the GPU path's all_reduce; both members in it, half their input ready):
    the other's call fails naming the dead gbbridge, and every later one at
    once."""
    c0, c1 = pair.clients
    n = 4 << 20
    r0, r1 = c0.map_region(2 * n), c1.map_region(2 * n)
    k0 = c0.start_exchange(r0.span(0, n), r0.span(0, 2 * n), DType.FLOAT32, Op.SUM)
    k1 = c1.start_exchange(r1.span(n, n), r1.span(0, 2 * n), DType.FLOAT32, Op.SUM)
    k0.ready(n // 2)
    k1.ready(n // 2)
    time.sleep(0.2)  # both are in the exchange, waiting for the second half
    pid = pair.bridges[1].proc.pid
    pair.bridges[1].proc.send_signal(signal.SIGKILL)
    pair.bridges[1].proc.wait(TIMEOUT)
    with pytest.raises(BridgeError) as ei:
        k0.wait(TIMEOUT)
    msg = ei.value.message
    assert "member 1" in msg and f"pid {pid}) died" in msg, msg
    with pytest.raises(BridgeError) as ei2:
        c0.barrier(timeout=5)
    assert ei2.value.status == Status.BROKEN
    c0.abort()
    c1.abort()
    assert pair.bridges[0].wait(TIMEOUT) == 1


@pytest.mark.parametrize(
    ("raw", "want"),
    [("0", 0), ("150", 150), (" 10000 ", 10000), ("10001", None), ("-1", None), ("1.5", None), ("x", None)],
)
def test_spin_setting(monkeypatch: pytest.MonkeyPatch, raw: str, want: int | None) -> None:
    """GPUBRIDGE_SPIN_US: whole microseconds within gbbridge serve's --spin-us range, else a clear error."""
    monkeypatch.setenv("GPUBRIDGE_SPIN_US", raw)
    if want is None:
        with pytest.raises(ValueError, match=r"GPUBRIDGE_SPIN_US=.*auto, or whole microseconds 0\.\.10000"):
            spin_us()
    else:
        assert spin_us() == want


def _spin_env(monkeypatch: pytest.MonkeyPatch, cpus: int, **env: str | None) -> None:
    """This process has cpus CPUs, no SLURM_NTASKS_PER_NODE, and env's variables (None: unset)."""
    monkeypatch.delenv("SLURM_NTASKS_PER_NODE", raising=False)
    for k, v in env.items():
        if v is None:
            monkeypatch.delenv(k, raising=False)
        else:
            monkeypatch.setenv(k, v)
    monkeypatch.setattr(os, "sched_getaffinity", lambda _pid: set(range(cpus)))


@pytest.mark.parametrize(("raw", "local", "cpus", "want"), [
    (None, "4", 16, AUTO_SPIN_US), ("auto", "4", 8, AUTO_SPIN_US), ("auto", "4", 7, None),
    (None, None, 2, AUTO_SPIN_US), (None, "4", 2, None), (None, "junk", 1, None),
])  # fmt: skip
def test_spin_auto(
    monkeypatch: pytest.MonkeyPatch, raw: str | None, local: str | None, cpus: int, want: int | None
) -> None:
    """auto spins only when every local rank and its serve have a core."""
    _spin_env(monkeypatch, cpus, GPUBRIDGE_SPIN_US=raw, LOCAL_WORLD_SIZE=local)
    assert spin_us() == want
    if local is None:  # under srun without torchrun: the tasks per node count
        monkeypatch.setenv("SLURM_NTASKS_PER_NODE", str(cpus))
        assert spin_us() is None


@pytest.mark.parametrize(("spin", "tiny", "cpus", "want"), [
    (None, None, 16, AUTO_TINY_SPIN_US), ("auto", "auto", 16, AUTO_TINY_SPIN_US), (None, None, 7, None),
    ("150", None, 16, 150), ("150", "auto", 2, 150), ("0", None, 16, 0),
    (None, "1000", 16, 1000), ("200", "1000", 2, 1000), ("1000", "0", 16, 0),
])  # fmt: skip
def test_tiny_spin(
    monkeypatch: pytest.MonkeyPatch, spin: str | None, tiny: str | None, cpus: int, want: int | None
) -> None:
    """The tiny calls' spin: its own setting, else GPUBRIDGE_SPIN_US's number, else its auto; the other
    calls' is GPUBRIDGE_SPIN_US's alone."""
    _spin_env(monkeypatch, cpus, GPUBRIDGE_SPIN_US=spin, GPUBRIDGE_TINY_SPIN_US=tiny, LOCAL_WORLD_SIZE="4")
    assert tiny_spin_us() == want
    auto = AUTO_SPIN_US if cpus >= 8 else None
    assert spin_us() == (auto if spin in (None, "auto") else int(spin))


@pytest.mark.parametrize("raw", ["10001", "-1", "x"])
def test_tiny_spin_refused(monkeypatch: pytest.MonkeyPatch, raw: str) -> None:
    monkeypatch.setenv("GPUBRIDGE_TINY_SPIN_US", raw)
    with pytest.raises(ValueError, match=r"GPUBRIDGE_TINY_SPIN_US=.*auto, or whole microseconds 0\.\.10000"):
        tiny_spin_us()


def test_tiny_calls_spin_their_own(monkeypatch: pytest.MonkeyPatch) -> None:
    """A collective of at most TINY_CALL_BYTES (its larger span) waits spinning the tiny spin, any other
    request the client's spin; the wait hands its call's spin to the read."""
    a, b = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        c = FeedClient(a, 10.0, 200e-6, 1e-3)
        f32 = {"dtype": "float32", "op": "sum"}
        tiny = c.start(Kind.ALL_REDUCE, Span(1, 0, TINY_CALL_BYTES), **f32)
        big = c.start(Kind.ALL_REDUCE, Span(1, 0, TINY_CALL_BYTES + 4), **f32)
        gather = c.start(Kind.ALL_GATHER, Span(1, 0, 4), Span(1, 8, TINY_CALL_BYTES + 8))
        barrier = c.start(Kind.BARRIER)
        assert (tiny.spin, big.spin, gather.spin, barrier.spin) == (1e-3, 200e-6, 200e-6, 1e-3)
        spins: list[float] = []

        def recv(deadline: float, spin: float) -> None:
            spins.append(spin)
            raise FeedTimeout("test")

        monkeypatch.setattr(c, "_recv", recv)
        for k in (tiny, big):
            with pytest.raises(FeedTimeout):
                k.wait(1.0)
        assert spins == [1e-3, 200e-6]
    finally:
        a.close()
        b.close()
