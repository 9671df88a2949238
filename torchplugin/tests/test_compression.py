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
import json
import mmap
import random
import socket
import struct
import threading
import time
from collections.abc import Callable
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch
from test_backend import check_ok, launch, needs_tools, run_job  # (tests/ is on sys.path under pytest)

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
    monkeypatch.delenv("GPUBRIDGE_P2P_CHUNK", raising=False)
    p = Policy.read()
    assert (p.codec, p.bridge_reduce, p.problems) == (Codec.RAW, "auto", [])
    assert {k: p.settings()[k] for k in ("compression", "bridge_reduce")} == {
        "compression": "raw", "bridge_reduce": "auto",
    }  # fmt: skip
    monkeypatch.setenv("GPUBRIDGE_COMPRESSION", "MXFP8/v1")
    monkeypatch.setenv("GPUBRIDGE_BRIDGE_REDUCE", "caller")
    got = Policy.read().settings()
    assert (got["compression"], got["bridge_reduce"]) == ("fp8", "caller")
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
    """The client offers versions 1..5 and takes a server of version 2 too:
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


# ---- jobs ----

WORKER = Path(__file__).resolve().parent / "compression_worker.py"


def job(tmp_path: Path, vendors: list[str], mode: str) -> list[dict[str, Any]]:
    """Runs compression_worker.py in mode; every rank's result once the
    job passed (and left no gbbridge serve behind)."""
    rc, results, out = run_job(tmp_path, WORKER, len(vendors), [",".join(vendors), str(tmp_path), mode])
    for r, res in enumerate(results):
        assert res.get("ok"), f"rank {r}: {res.get('error')}\n{out[-6000:]}"
    assert rc == 0, out[-6000:]
    for res in results:
        if res["role"] == "leader":
            assert res["bridge_exit"] == 0, "no clean BYE"
    return results


@needs_tools
def test_native_override_and_setup_failures(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """GPUBRIDGE_COMPRESSION differing between ranks, and a value that is
    no compression, fail every rank's set-up with the same message naming
    the rank; the native API's all_reduce(compression=, feedback_key=)
    compresses one call with error feedback (the leaders reduce on the GPU
    path, on CPU tensors: GPUBRIDGE_BRIDGE_REDUCE=caller), bit for bit the
    reference, and the residuals go with the group."""
    monkeypatch.setenv("GPUBRIDGE_BRIDGE_REDUCE", "caller")
    results = job(tmp_path, ["nvidia", "nvidia", "amd", "amd"], "native")
    for case, want in (
        ("mismatch", "setting compression"),
        ("bad", "rank 2 ("),
    ):
        msgs = {res["failures"][case] for res in results}
        assert len(msgs) == 1, (case, msgs)
        msg = msgs.pop()
        assert msg.startswith("gpubridge: discovery failed:") and want in msg, msg
    bad = results[0]["failures"]["bad"]
    assert "GPUBRIDGE_COMPRESSION='fp4' is not a compression (want none, bf16, fp8 or zstd)" in bad, bad
    leaders = [res for res in results if res["role"] == "leader"]
    assert len(leaders) == 2
    assert all(res["residual_bytes"] == 4 * 5000 for res in leaders), leaders
    assert all(res["residual_bytes_after"] == 0 for res in leaders), leaders


@needs_tools
def test_two_islands_host_and_gpu_path(tmp_path: Path) -> None:
    """2+2 under GPUBRIDGE_COMPRESSION=fp8 (compression_worker.py
    "exchange"): keyed fp8 and bf16 all_reduces of float32, bfloat16 and
    float16 with error feedback over several steps, reduced in gbbridge and
    on the leaders' GPU path, each bit for bit the reference made from
    gpubridge._codec (checked on every rank); MAX, MIN, integers, float64,
    broadcast and all_gather exact; zstd exact on both paths. Here: every
    rank ended with the same bits, the records name the codecs and fp8 sent
    fewer bytes, and the GPU path's residuals (4 bytes a value per key) went
    with the group."""
    results = job(tmp_path, ["nvidia", "nvidia", "amd", "amd"], "exchange")
    assert len({json.dumps(res["hashes"], sort_keys=True) for res in results}) == 1, "ranks differ"
    assert all(res["checks"] == results[0]["checks"] > 0 for res in results)
    leaders = [res for res in results if res["role"] == "leader"]
    assert len(leaders) == 2
    for res in leaders:
        # the five keyed cases on the GPU path: 5000 values each
        assert res["residual_bytes"] == 5 * 4 * 5000, res["residual_bytes"]
        assert res["residual_bytes_after"] == 0
        by_call: dict[tuple[str, str], list[int]] = {}
        for call, codec, sent in res["records"]:
            by_call.setdefault((call, codec), []).append(sent)
        assert ("allreduce_compressed", "fp8") in by_call and ("allreduce_compressed", "bf16") in by_call
        assert ("allreduce_compressed", "zstd") in by_call
        assert by_call[("allreduce", "fp8")], "a plain all_reduce of float32 under fp8"
        assert ("allreduce", "raw") in by_call, "MAX, MIN, integers stay raw"
        assert all(c != "fp8" for call, c in by_call if call in ("broadcast", "all_gather_into_tensor"))
        # fp8 of 5000 float32 values: 5157 packed bytes a member, against 20000 raw
        fp8 = [b for b in by_call[("allreduce", "fp8")] if b is not None]
        assert fp8 and max(fp8) < 20000 / 3, fp8


def _ring_bound(codec: str, dtype: str, xs_abs: list[float], members: int) -> list[float]:
    """COMPRESSION.md's bound on |result - exact sum| for a ring of members
    quantizations without feedback, from |x| summed over the members (which
    bounds every partial, grown by the earlier hops' errors), per value:
    members x max(2^-4 |P|, the block's floor 2^(s-137)) + (members-1) x
    2^-24 |P| for fp8 (bf16: 2^-8 |P|), and half a bfloat16 step of the
    result for a bfloat16 tensor."""
    rel = 2.0**-4 if codec == "fp8" else 2.0**-8
    grow = (1 + rel) ** members
    p = [a * grow for a in xs_abs]
    out = []
    for i, pi in enumerate(p):
        blk = max(p[i - i % 32 : i - i % 32 + 32])
        floor = 2 * blk / 448 / 1024 if codec == "fp8" else 0.0  # 2^(s-137) < 2 amax / 448 / 2^10
        b = members * max(rel * pi, floor) + (members - 1) * 2.0**-24 * pi
        if dtype == "torch.bfloat16":
            b += 2.0**-8 * (pi + b)
        out.append(b)
    return out


@needs_tools
@pytest.mark.torch_independent("gbbridge's ring (Go) of 3 islands; the plugin's codec runs in the other jobs")
def test_three_islands_ring(tmp_path: Path) -> None:
    """Three islands (GPUBRIDGE_SIM_ISLAND): gbbridge's low-precision ring.
    Every rank ends with the same bits (with and without error feedback),
    and without it the result is within COMPRESSION.md's bound of the exact
    sum, and not exact (it was compressed)."""
    results = job(tmp_path, ["nvidia", "amd", "amd:b"], "ring")
    assert results[0]["members"] == 3
    assert len({json.dumps(res["hashes"], sort_keys=True) for res in results}) == 1, "ranks differ"
    for case, e in results[0]["errors"].items():
        codec, dtype = case.split(" ")
        bound = _ring_bound(codec, dtype, e["abs"], 3)
        over = [i for i, (err, b) in enumerate(zip(e["err"], bound, strict=True)) if err > b]
        assert not over, (case, [(i, e["err"][i], bound[i]) for i in over[:5]])
        assert max(e["err"]) > 0, f"{case}: exact, so not compressed"


@needs_tools
def test_zstd_is_exact_for_every_collective(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """GPUBRIDGE_COMPRESSION=zstd: test_backend's whole job (every
    collective, dtype and op, bit for bit against a flat Gloo group), with
    every bridged collective's frames zstd-packed, the leaders exchanging
    on the GPU path's way where they can (GPUBRIDGE_BRIDGE_REDUCE=caller)."""
    monkeypatch.setenv("GPUBRIDGE_BRIDGE_REDUCE", "caller")
    rc, results, out = launch(tmp_path, ["nvidia", "nvidia", "amd", "amd"], "zstd")
    check_ok(rc, results, out)
    for res in results:
        if res["role"] == "leader":
            ops = {k.split(" ")[0] for k in res["codecs"]}
            assert ops >= {"all_reduce", "broadcast", "all_gather", "reduce_scatter"}, res["codecs"]
            assert all(k.endswith(" zstd") for k in res["codecs"]), res["codecs"]
            assert res["exchanged"] > 0, "the GPU path's exchange ran with zstd too"


@needs_tools
def test_accuracy_of_fp8_with_and_without_error_feedback(tmp_path: Path) -> None:
    """The issue's accuracy requirement, on CPU simulation (2+2): one model
    trained exactly, with fp8 and error feedback (in gbbridge, and on the
    leaders' GPU path), and with fp8 without it (compression_worker.py
    "accuracy": a linear model whose trainable weights share each 32-value
    block with a frozen entry whose gradient is about 1e6 times theirs, so
    fp8 without feedback flushes their gradients to zero every step). fp8
    with feedback ends within 1% of the exact run's loss; without it,
    measurably worse; the two fp8+EF runs are the same bits (gbbridge's
    residuals and the plugin's); every rank ends with the same weights;
    fp8 sends about a quarter of the bytes. The curves are printed."""
    results = job(tmp_path, ["nvidia", "nvidia", "amd", "amd"], "accuracy")
    runs = results[0]["variants"]
    for v in runs:
        assert len({res["variants"][v]["digest"] for res in results}) == 1, f"{v}: ranks differ"
    print("\nstep " + " ".join(f"{v:>16}" for v in runs))
    for i, (step, _) in enumerate(runs["exact"]["losses"]):
        print(f"{step:4d} " + " ".join(f"{runs[v]['losses'][i][1]:16.6f}" for v in runs))
    final = {v: r["losses"][-1][1] for v, r in runs.items()}
    print({v: round(x, 6) for v, x in final.items()})
    assert runs["fp8-ef"]["losses"] == runs["fp8-ef-gpu-path"]["losses"]
    assert runs["fp8-ef"]["digest"] == runs["fp8-ef-gpu-path"]["digest"], (
        "gbbridge's and the plugin's fp8+EF differ"
    )
    assert abs(final["fp8-ef"] - final["exact"]) <= 0.01 * final["exact"], final
    assert final["fp8"] > 2 * final["exact"], final
    leaders = [res for res in results if res["role"] == "leader"]
    for res in leaders:
        v = res["variants"]
        assert v["exact"]["codecs"] == ["raw"] and v["fp8-ef"]["codecs"] == ["fp8"], v
        assert v["fp8-ef"]["bytes_sent"] * 3.5 < v["exact"]["bytes_sent"], v
