"""Compression on the bridge from torch (docs/COMPRESSION.md, "Compression
on the bridge"; docs/FEED.md §3a).

Without a job: the settings (gpubridge._policy), what each call compresses,
the feed client against a server of an older protocol, and the GPU path's
compressed exchange (gpubridge._endpoint._Exchange) on CPU tensors between
two in-process leaders joined by a fake bridge that hands each one the
other's slot in ranges of any order, against a reference computed here from
gpubridge._codec: dec(q0) + dec(q1), then the dtype.

With jobs (tests/compression_worker.py under torchrun, simulated vendors):
see the second half of this file.
"""

from __future__ import annotations

import datetime
import mmap
import random
import socket
import struct
import threading
import time
from collections.abc import Callable
from types import SimpleNamespace
from typing import Any

import pytest
import torch

from gpubridge import _codec
from gpubridge import _endpoint as endpoint_mod
from gpubridge import _inflight as fl
from gpubridge._endpoint import BridgeEndpoint
from gpubridge._feed import Codec, Done, FeedClient, FeedError, Kind, Op, Region, Span, Status
from gpubridge._feed_protocol import HEADER_SIZE, REQUEST_SIZE
from gpubridge._feedback import ErrorFeedback
from gpubridge._policy import Policy, for_all_reduce, for_transfer, parse_codec
from gpubridge._staging import Staging

# ---- settings ----


@pytest.mark.parametrize(
    ("name", "want"),
    [
        ("none", Codec.RAW), ("raw", Codec.RAW), ("NONE", Codec.RAW), ("bf16", Codec.BF16),
        ("BF16/v1", Codec.BF16), ("fp8", Codec.FP8), ("mxfp8", Codec.FP8), ("fp8/V1", Codec.FP8),
        (" fp8 ", Codec.FP8), ("zstd", Codec.ZSTD), ("lossless/v1", Codec.ZSTD), ("Lossless", Codec.ZSTD),
    ],
)  # fmt: skip
def test_codec_names(name: str, want: Codec) -> None:
    """The names lib/codec's Parse takes."""
    assert parse_codec(name) == want


@pytest.mark.parametrize("name", ["fp16", "", "fp8/v2", "gzip", "zstd/v1/v1"])
def test_bad_codec_names(name: str) -> None:
    with pytest.raises(ValueError, match="want none, bf16, fp8 or zstd"):
        parse_codec(name)


def test_policy_settings_and_problems(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("GPUBRIDGE_COMPRESSION", raising=False)
    monkeypatch.delenv("GPUBRIDGE_BRIDGE_REDUCE", raising=False)
    p = Policy.read()
    assert (p.codec, p.bridge_reduce, p.problems) == (Codec.RAW, "auto", [])
    assert p.settings() == {"compression": "raw", "bridge_reduce": "auto"}
    monkeypatch.setenv("GPUBRIDGE_COMPRESSION", "MXFP8/v1")
    monkeypatch.setenv("GPUBRIDGE_BRIDGE_REDUCE", "caller")
    assert Policy.read().settings() == {"compression": "fp8", "bridge_reduce": "caller"}
    monkeypatch.setenv("GPUBRIDGE_COMPRESSION", "fp4")
    monkeypatch.setenv("GPUBRIDGE_BRIDGE_REDUCE", "gpu")
    assert Policy.read().problems == [
        "GPUBRIDGE_COMPRESSION='fp4' is not a compression (want none, bf16, fp8 or zstd)",
        "GPUBRIDGE_BRIDGE_REDUCE='gpu' is not one of auto, host, caller",
    ]


F32, BF16, F16, F64, I32 = torch.float32, torch.bfloat16, torch.float16, torch.float64, torch.int32


@pytest.mark.parametrize(
    ("codec", "dtype", "op", "want"),
    [
        (Codec.FP8, F32, Op.SUM, Codec.FP8), (Codec.FP8, BF16, Op.AVG, Codec.FP8),
        (Codec.FP8, F16, Op.SUM, Codec.FP8), (Codec.FP8, F64, Op.SUM, Codec.RAW),
        (Codec.FP8, F32, Op.MAX, Codec.RAW), (Codec.FP8, F32, Op.MIN, Codec.RAW),
        (Codec.FP8, I32, Op.SUM, Codec.RAW), (Codec.BF16, F32, Op.SUM, Codec.BF16),
        (Codec.BF16, BF16, Op.AVG, Codec.BF16), (Codec.BF16, F16, Op.SUM, Codec.RAW),
        (Codec.ZSTD, I32, Op.MAX, Codec.ZSTD), (Codec.ZSTD, F32, Op.SUM, Codec.ZSTD),
        (Codec.RAW, F32, Op.SUM, Codec.RAW),
    ],
)  # fmt: skip
def test_what_is_compressed(codec: Codec, dtype: torch.dtype, op: Op, want: Codec) -> None:
    """COMPRESSION.md "What is compressed": lossy codecs only on floating
    sums and averages of the dtypes they pack, zstd on everything."""
    assert for_all_reduce(codec, dtype, op) == want


def test_transfers_take_zstd_only() -> None:
    assert [for_transfer(c) for c in Codec] == [Codec.RAW, Codec.RAW, Codec.RAW, Codec.ZSTD]


# ---- the feed client and the server's version ----


class _OldServer:
    """A feed server that speaks version `version` and answers every
    request ok, keeping the raw request messages it got."""

    def __init__(self, version: int) -> None:
        self.client_sock, self.sock = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        self.version = version
        self.requests: list[bytes] = []
        self.thread = threading.Thread(target=self._serve, daemon=True)
        self.thread.start()

    def _read(self) -> tuple[int, bytes] | None:
        head = self._exactly(HEADER_SIZE)
        if head is None:
            return None
        size, kind, _ = struct.unpack("<IHH", head)
        body = self._exactly(size - HEADER_SIZE)
        return None if body is None else (kind, head + body)

    def _exactly(self, n: int) -> bytes | None:
        b = b""
        while len(b) < n:
            got = self.sock.recv(n - len(b))
            if not got:
                return None
            b += got
        return b

    def _send(self, kind: int, body: bytes) -> None:
        self.sock.sendall(struct.pack("<IHH", HEADER_SIZE + len(body), kind, 0) + body)

    def _serve(self) -> None:
        hello = self._read()
        assert hello is not None and hello[0] == Kind.HELLO
        transport = b"fake"
        welcome = struct.pack("<HHIIIIIQ", self.version, 0, 0, 2, 65536, 16, 16, 1 << 30)
        self._send(Kind.WELCOME, welcome + struct.pack("<H", len(transport)) + transport)
        while (msg := self._read()) is not None:
            kind, raw = msg
            if kind == Kind.BYE:
                self._send(Kind.BYE, b"")
                self.sock.close()
                return
            self.requests.append(raw)
            rid = struct.unpack_from("<Q", raw, HEADER_SIZE)[0]
            self._send(Kind.DONE, struct.pack("<QIIQQQQH", rid, 0, 0, 1, 0, 0, 0, 0))


@pytest.mark.parametrize("version", [2, 3])
def test_feed_client_and_server_versions(version: int) -> None:
    """The client offers versions 1..3 and takes a server of version 2 too:
    raw requests say codec 0 and carry no extension; a codec or an
    error-feedback key is refused before anything is sent unless the
    server speaks version 3."""
    srv = _OldServer(version)
    c = FeedClient(srv.client_sock, 10.0, 0.0)
    c.hello(time.monotonic() + 10.0)
    assert c.version == version and c.caller_reduces and c.codecs == (version >= 3)
    c.request(Kind.BARRIER)
    assert len(srv.requests[-1]) == HEADER_SIZE + REQUEST_SIZE and srv.requests[-1][HEADER_SIZE + 10] == 0
    if version < 3:
        for kw in ({"codec": Codec.FP8}, {"codec": Codec.ZSTD}, {"feedback_key": 5}):
            with pytest.raises(
                FeedError, match="needs feed protocol 3; this gbbridge serve speaks version 2"
            ):
                c.request(Kind.ALL_REDUCE, dtype="float32", op="sum", **kw)
        assert len(srv.requests) == 1, "nothing was sent"
    else:
        c.request(Kind.ALL_REDUCE, dtype="float32", op="sum", codec=Codec.FP8, feedback_key=5)
        raw = srv.requests[-1]
        assert raw[HEADER_SIZE + 10] == 2 and raw[HEADER_SIZE + REQUEST_SIZE :] == bytes.fromhex(
            "02800800"
        ) + (5).to_bytes(8, "little")
    c.close()
    srv.thread.join(5)


# ---- the GPU path's exchange, on CPU tensors ----


class _FakeBridge:
    """Two members' CALLER_REDUCES exchange: once both members' slots are
    ready, each gets the other's slot copied into its out span in ranges
    of random sizes and order (its own slot's ranges too), each announced
    as PROGRESS; neither starts its next call before both copied."""

    def __init__(self, seed: int) -> None:
        self.barrier = threading.Barrier(2, timeout=30)
        self.slots: dict[int, tuple[Region, Span]] = {}
        self.codecs: list[Codec] = []
        self.seed = seed

    def feed(self, member: int) -> _FakeFeed:
        return _FakeFeed(self, member)


class _FakeCall:
    def __init__(
        self, feed: _FakeFeed, inp: Span, out: Span, on_progress: Callable[[int, int], None]
    ) -> None:
        self.feed, self.inp, self.out, self.on_progress = feed, inp, out, on_progress
        self.end = 0

    def ready(self, end: int) -> None:
        assert self.end <= end <= self.inp.nbytes
        self.end = end

    def wait(self) -> Done:
        f, b, n = self.feed, self.feed.bridge, self.inp.nbytes
        assert self.end == n, "the slot was not all ready"
        region = f.regions[self.inp.region]
        b.slots[f.member] = (region, self.inp)
        b.barrier.wait()
        peer_region, peer_inp = b.slots[1 - f.member]
        assert peer_inp.nbytes == n, "the members' slots differ in size"
        f.calls += 1
        rng = random.Random(b.seed * 1000 + f.calls * 2 + f.member)
        cuts = sorted(rng.sample(range(1, n), min(n - 1, 7))) if n > 1 else []
        ranges = [(slot, lo, hi) for slot in (0, 1) for lo, hi in zip([0, *cuts], [*cuts, n], strict=True)]
        rng.shuffle(ranges)
        for slot, lo, hi in ranges:
            src_region, src = (region, self.inp) if slot == f.member else (peer_region, peer_inp)
            off = self.out.offset + slot * n + lo
            region.mem[off : off + hi - lo] = src_region.mem[src.offset + lo : src.offset + hi]
            self.on_progress(slot * n + lo, hi - lo)
        b.barrier.wait()
        return Done(0, Status.OK, 1, 2 * n, 0, 0, "")


class _FakeFeed:
    caller_reduces = True
    codecs = True
    error = None

    def __init__(self, bridge: _FakeBridge, member: int) -> None:
        self.bridge, self.member = bridge, member
        self.regions: dict[int, Region] = {}
        self.calls = 0

    def map_region(self, size: int) -> Region:
        r = Region(len(self.regions) + 1, size, mmap.mmap(-1, size))
        self.regions[r.id] = r
        return r

    def release(self, region: Region) -> None:
        self.regions.pop(region.id, None)

    def pump(self, timeout: float) -> None:
        pass

    def start_exchange(self, inp: Span, out: Span, dtype: Any, op: Any, **kw: Any) -> _FakeCall:
        assert op == Op.SUM and inp.offset == out.offset + self.member * inp.nbytes
        self.bridge.codecs.append(kw["codec"])
        return _FakeCall(self, inp, out, kw["on_progress"])


def _leader(bridge: _FakeBridge, member: int) -> BridgeEndpoint:
    ep = BridgeEndpoint(
        None, member, (0, 1), torch.device("cpu"), None,  # type: ignore[arg-type]  # no process
        datetime.timedelta(seconds=30), "caller",
    )  # fmt: skip
    feed = bridge.feed(member)
    ep._feed = feed  # type: ignore[assignment]
    ep._staging = Staging(feed, torch.device("cpu"), None, None, 30.0)  # type: ignore[arg-type]
    return ep


def _exchange_both(
    eps: list[BridgeEndpoint], xs: list[torch.Tensor], codec: Codec, key: object
) -> list[torch.Tensor]:
    """Both leaders all-reduce their x at once (one thread each)."""
    outs = [x.clone() for x in xs]
    errors: list[BaseException] = []

    def run(m: int) -> None:
        try:
            e = fl.Entry("g", 1, "allreduce", outs[m].nbytes, fl.RUNNING, "test")
            eps[m].all_reduce(e, outs[m], Op.SUM, codec, key)
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=run, args=(m,)) for m in (0, 1)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert not errors, errors
    return outs


def reference_exchange(
    xs: list[torch.Tensor], codec: str, residuals: list[torch.Tensor] | None
) -> torch.Tensor:
    """What every member ends with (COMPRESSION.md, two members): each
    member's partial quantized (with its residual), dec(q0) + dec(q1) in
    float32, member 0's first, then the dtype."""
    if codec == "fp8":
        enc, enc_fb, dec, dec_add = (
            _codec.mxfp8_encode, _codec.mxfp8_encode_feedback, _codec.mxfp8_decode, _codec.mxfp8_decode_add,
        )  # fmt: skip
    else:
        enc, enc_fb, dec, dec_add = (
            _codec.bf16_encode, _codec.bf16_encode_feedback, _codec.bf16_decode, _codec.bf16_decode_add,
        )  # fmt: skip
    rs = residuals if residuals is not None else [None, None]
    qs = [enc(x) if r is None else enc_fb(x, r) for x, r in zip(xs, rs, strict=True)]
    n = xs[0].numel()
    acc = dec(qs[0], n)
    dec_add(acc, qs[1])
    return _codec.to_dtype(acc, xs[0].dtype).view(xs[0].shape)


def grads(n: int, seed: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Gradient-like values: magnitudes over 8 decades in each 32-block,
    with zeros, a NaN-free mix of signs."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, generator=g) * torch.logspace(-6, 2, 32).repeat(-(-n // 32))[:n]
    x[::97] = 0.0
    return x.to(dtype)


def set_nan(x: torch.Tensor, i: int, negative: bool) -> None:
    """x[i] = a quiet NaN with that sign, set in bits (a conversion to a
    16-bit dtype may drop a NaN's sign)."""
    bits = {torch.float32: (torch.int32, 0x7FC00000), torch.bfloat16: (torch.int16, 0x7FC0)}
    bits[torch.float16] = (torch.int16, 0x7E00)
    ibits, q = bits[x.dtype]
    sign = 1 << (8 * x.element_size() - 1)
    x.view(ibits)[i] = (q | sign) - (sign << 1) if negative else q


def negative(x: torch.Tensor, i: int) -> bool:
    """The sign bit of x[i] (torch.signbit drops a float16 NaN's)."""
    ibits = torch.int32 if x.element_size() == 4 else torch.int16
    return bool(x.view(ibits)[i] < 0)


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    return torch.equal(a.reshape(-1).view(torch.uint8), b.reshape(-1).view(torch.uint8))


@pytest.mark.parametrize(
    ("codec", "dtype", "n"),
    [
        ("fp8", torch.float32, 5000), ("fp8", torch.float32, 4096), ("fp8", torch.bfloat16, 3333),
        ("fp8", torch.float16, 2050), ("fp8", torch.float32, 7), ("bf16", torch.float32, 3001),
        ("bf16", torch.bfloat16, 2000),
    ],
)  # fmt: skip
def test_exchange_decodes_in_member_order(
    monkeypatch: pytest.MonkeyPatch, codec: str, dtype: torch.dtype, n: int
) -> None:
    """The GPU path's compressed exchange on CPU tensors, with small copy
    chunks and reduction spans (many of each, ranges in any order): both
    leaders end with the same bits, equal to the reference, over several
    steps with error feedback; the residuals are the reference's."""
    monkeypatch.setattr(endpoint_mod, "_CHUNK", 4096)
    monkeypatch.setattr(endpoint_mod, "_SPAN", 5000)
    bridge = _FakeBridge(seed=n)
    eps = [_leader(bridge, 0), _leader(bridge, 1)]
    c = parse_codec(codec)
    ref_r = [torch.zeros(n), torch.zeros(n)]
    for step in range(3):
        xs = [grads(n, 100 * step + m, dtype) for m in (0, 1)]
        # NaNs of both signs where both members have one: the result's is
        # member 0's (lib/reduce's rule: the first operand's NaN wins).
        for i, neg in ((n // 2, False), (n - 1, True)):
            set_nan(xs[0], i, neg)
            set_nan(xs[1], i, not neg)
        outs = _exchange_both(eps, xs, c, ("bucket", 0))
        want = reference_exchange(xs, codec, ref_r)
        assert same_bits(outs[0], want) and same_bits(outs[1], want), (codec, dtype, n, step)
        assert negative(outs[0], n - 1) and not negative(outs[0], n // 2), "member 0's NaN"
        for m in (0, 1):
            assert torch.equal(eps[m].feedback[c].residual(("bucket", 0), xs[m]), ref_r[m])
    assert bridge.codecs == [c] * 6
    assert all(ep.residual_bytes == 4 * n for ep in eps)
    # Without a key nothing is kept: the plain encoding's result.
    xs = [grads(n, 7 + m, dtype) for m in (0, 1)]
    outs = _exchange_both(eps, xs, c, None)
    assert same_bits(outs[0], reference_exchange(xs, codec, None)) and same_bits(outs[0], outs[1])
    assert all(len(ep.feedback[c]) == 1 for ep in eps)


@pytest.mark.parametrize("codec", [Codec.RAW, Codec.ZSTD])
def test_exchange_raw_and_zstd_sum_exactly(monkeypatch: pytest.MonkeyPatch, codec: Codec) -> None:
    """zstd (and raw) on the GPU path exchange the raw partials (the codec
    goes on the request) and sum them as lib/reduce does."""
    monkeypatch.setattr(endpoint_mod, "_CHUNK", 4096)
    monkeypatch.setattr(endpoint_mod, "_SPAN", 5000)
    bridge = _FakeBridge(seed=3)
    eps = [_leader(bridge, 0), _leader(bridge, 1)]
    xs = [grads(3000, m) for m in (0, 1)]
    outs = _exchange_both(eps, xs, codec, ("k",))
    assert same_bits(outs[0], xs[0] + xs[1]) and same_bits(outs[1], xs[0] + xs[1])
    assert bridge.codecs == [codec, codec]
    assert all(ep.residual_bytes == 0 for ep in eps), "nothing to feed back"


def test_feedback_drops_on_another_dtype() -> None:
    """gbbridge drops a key's residual when the key comes with another
    dtype or length; the plugin's do too."""
    ef = ErrorFeedback("fp8")
    r = ef.residual("k", torch.zeros(64))
    assert ef.residual("k", torch.zeros(64, dtype=torch.bfloat16)) is not r and ef.dropped == 1
    assert ef.residual("k", torch.zeros(64, dtype=torch.bfloat16)) is ef.residual(
        "k", torch.ones(64).bfloat16()
    )


def test_endpoint_close_frees_the_residuals() -> None:
    bridge = _FakeBridge(seed=5)
    ep = _leader(bridge, 0)
    ep.error_feedback(Codec.FP8).residual("k", torch.zeros(1000))
    assert ep.residual_bytes == 4000
    ep._staging = None
    ep._feed = None
    ep.process = SimpleNamespace(  # type: ignore[assignment]  # no gbbridge serve: it "exits 0"
        wait=lambda t: 0, kill=lambda: None, stderr_file=SimpleNamespace(close=lambda: None)
    )
    assert ep.close(abort=False) == 0
    assert ep.residual_bytes == 0
