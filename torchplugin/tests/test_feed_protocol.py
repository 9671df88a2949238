"""The feed's message codec (gpubridge._feed_protocol) against the layouts
of docs/FEED.md, without a server: what the Python side writes, and what it
refuses to read."""

from __future__ import annotations

import ast
import json
import struct
from pathlib import Path

import pytest

from gpubridge._feed_protocol import (
    BRIDGE_STATS_TAG,
    CALLER_REDUCES_VERSION,
    CODEC_VERSION,
    FEEDBACK_KEY_TAG,
    FLAG_CALLER_REDUCES,
    FLAG_STREAMED,
    VERSION,
    Codec,
    DType,
    Kind,
    Op,
    ProtocolError,
    Span,
    Status,
    _decode_done_slow,
    decode_bridge_stats,
    decode_done,
    decode_error,
    decode_progress,
    decode_welcome,
    encode_hello,
    encode_ready,
    encode_region,
    encode_release,
    encode_request,
    parse_header,
)


def header(kind: Kind, body: bytes) -> bytes:
    return struct.pack("<IHH", 8 + len(body), kind, 0) + body


def text(s: str) -> bytes:
    return struct.pack("<H", len(s.encode())) + s.encode()


def test_request_layout() -> None:
    """The 64-byte request body, field by field (docs/FEED.md §3)."""
    msg = encode_request(
        Kind.ALL_REDUCE, 7, DType.BFLOAT16, Op.MAX, 1, Span(2, 16, 4096), Span(3, 32, 8192), -1, 9
    )
    assert parse_header(msg) == (8 + 64, Kind.ALL_REDUCE)
    body = msg[8:]
    assert len(body) == 64
    assert struct.unpack_from("<Q", body, 0) == (7,)
    assert body[8:12] == bytes([DType.BFLOAT16, Op.MAX, 0, 0])
    assert struct.unpack_from("<IIIQQQQiI", body, 12) == (1, 2, 3, 16, 4096, 32, 8192, -1, 9)


def test_caller_reduces_flag() -> None:
    """Version 2's "exchange, reduce on the caller" all_reduce is flag bit 1
    of the request (docs/FEED.md §3), beside STREAMED."""
    assert (CALLER_REDUCES_VERSION, FLAG_STREAMED, FLAG_CALLER_REDUCES) == (2, 1, 2)
    msg = encode_request(
        Kind.ALL_REDUCE, 8, DType.FLOAT32, Op.SUM, FLAG_STREAMED | FLAG_CALLER_REDUCES,
        Span(1, 4096, 4096), Span(1, 0, 8192), -1, 0,
    )  # fmt: skip
    assert struct.unpack_from("<I", msg, 8 + 12) == (3,)


def test_codec_byte_and_feedback_key() -> None:
    """Version 3 (docs/FEED.md §3a): the codec is byte 10 of the request
    body, lib/codec's id; FEEDBACK_KEY is extension tag 2 with the critical
    bit (0x8002), 8 bytes, the u64 key little-endian, after the 64-byte
    body. Without a key nothing follows the body."""
    assert (CODEC_VERSION, FEEDBACK_KEY_TAG) == (3, 2) and VERSION >= CODEC_VERSION
    assert [(c.name, int(c), c.versioned, c.lossy) for c in Codec] == [
        ("RAW", 0, "raw", False), ("BF16", 1, "bf16/v1", True),
        ("FP8", 2, "fp8/v1", True), ("ZSTD", 3, "zstd/v1", False),
    ]  # fmt: skip
    key = 0x0102030405060708
    msg = encode_request(
        Kind.ALL_REDUCE, 9, DType.FLOAT32, Op.SUM, FLAG_STREAMED, Span(1, 0, 4096), Span(), -1, 0,
        Codec.FP8, key,
    )  # fmt: skip
    assert parse_header(msg) == (8 + 64 + 12, Kind.ALL_REDUCE)
    body = msg[8:]
    assert body[8:12] == bytes([DType.FLOAT32, Op.SUM, 2, 0])
    assert body[64:] == bytes.fromhex("028008000807060504030201")
    plain = encode_request(
        Kind.BROADCAST, 10, DType.BFLOAT16, Op.NONE, 0, Span(1, 0, 8), Span(), 1, 0, Codec.ZSTD
    )
    assert len(plain) == 8 + 64 and plain[8 + 10] == 3
    assert encode_request(Kind.BARRIER, 11, DType.NONE, Op.NONE, 0, Span(), Span(), -1, 0)[8 + 10] == 0


def test_session_messages() -> None:
    hello = encode_hello(1234, "rank 0")
    assert hello == header(Kind.HELLO, struct.pack("<IHHI", 0x44464247, 1, 5, 1234) + text("rank 0"))
    assert encode_region(5, 2, 1 << 20) == header(Kind.REGION, struct.pack("<QIIQ", 5, 2, 0, 1 << 20))
    assert encode_release(6, 2) == header(Kind.RELEASE, struct.pack("<QI", 6, 2))
    assert encode_ready(7, 4096) == header(Kind.READY, struct.pack("<QQ", 7, 4096))


def test_long_text_is_cut_at_a_character() -> None:
    name = "é" * 3000  # 6000 bytes: cut to 4096, which ends inside no character
    body = encode_hello(1, name)[8 + 12 :]
    (n,) = struct.unpack_from("<H", body)
    assert n == 4096 and body[2:].decode() == "é" * 2048


def test_replies_decode() -> None:
    welcome = struct.pack("<HHIIIIIQ", 1, 0, 1, 2, 65536, 256, 1024, 1 << 36) + text("tcp x2")
    w = decode_welcome(welcome + struct.pack("<HH", 7, 2) + b"ab")  # an extension, skipped
    assert (w.version, w.member, w.members, w.max_region_bytes, w.transport) == (1, 1, 2, 1 << 36, "tcp x2")
    done = decode_done(struct.pack("<QIIQQQQ", 9, 2, 0, 3, 64, 5, 6) + text("peer 1 gone"))
    assert (done.request_id, done.status, done.seq, done.nbytes, done.error) == (
        9, Status.BRIDGE_ERROR, 3, 64, "peer 1 gone",
    )  # fmt: skip
    assert decode_progress(struct.pack("<QQQ", 9, 0, 4096)) == (9, 0, 4096)
    err = struct.pack("<I", 2) + text("version")
    assert decode_error(err) == (2, "version")
    assert decode_error(err + b"x", whole=False) == (2, "version")


@pytest.mark.parametrize(
    ("decode", "body", "want"),
    [
        (decode_done, struct.pack("<QIIQQQQ", 1, 9, 0, 0, 0, 0, 0) + text(""), "done: unknown status 9"),
        (decode_done, struct.pack("<QIIQQQQ", 1, 0, 1, 0, 0, 0, 0) + text(""), "reserved field is not zero"),
        (decode_done, struct.pack("<QII", 1, 0, 0), "done: body too short"),
        (decode_progress, struct.pack("<QQQ", 1, 0, 0) + b"x", "progress: 1 trailing bytes"),
        (decode_error, struct.pack("<IH", 1, 5000) + b"x" * 5000, "string of 5000 bytes is over 4096"),
        (decode_error, struct.pack("<I", 1) + text("a") + b"x", "error: 1 trailing bytes"),
        (
            decode_welcome,
            struct.pack("<HHIIIIIQ", 1, 0, 0, 2, 1, 1, 1, 1) + text("") + struct.pack("<HH", 0x8001, 0),
            "unknown critical extension 0x8001",
        ),
    ],
    ids=["status", "reserved", "short", "trailing", "long-string", "error-trailing", "critical-ext"],
)
def test_malformed_replies_are_refused(decode: object, body: bytes, want: str) -> None:
    with pytest.raises(ProtocolError, match="malformed message from the server") as e:
        decode(body)  # type: ignore[operator]
    assert want in str(e.value), e.value


@pytest.mark.parametrize(
    ("head", "want"),
    [
        (struct.pack("<IHH", 16, Kind.DONE, 1), "done: header flags 0x1 are not zero"),
        (struct.pack("<IHH", 4, Kind.DONE, 0), "done: size 4 is outside 8..65536"),
        (struct.pack("<IHH", 1 << 17, 99, 0), "type(99): size 131072 is outside 8..65536"),
    ],
)
def test_bad_headers_are_refused(head: bytes, want: str) -> None:
    with pytest.raises(ProtocolError) as e:
        parse_header(head)
    assert want in str(e.value), e.value


# Tag-1 values lib/feed wrote, with the Go fields they hold
# (lib/feed/bridgestats_test.go, TestBridgeStatsVectors).
BRIDGE_VECTORS = Path(__file__).resolve().parents[2] / "lib" / "feed" / "testdata" / "bridgestats"


def ok_done(tag: int, value: bytes) -> bytes:
    """An ok DONE's body with one extension."""
    fixed = struct.pack("<QIIQQQQ", 7, 0, 0, 3, 64, 1, 2) + text("")
    return fixed + struct.pack("<HH", tag, len(value)) + value


@pytest.mark.parametrize("name", ["two-peers", "not-heard", "cut"])
def test_bridge_stats_vectors(name: str) -> None:
    v = (BRIDGE_VECTORS / f"{name}.bin").read_bytes()
    want = json.loads((BRIDGE_VECTORS / f"{name}.json").read_text())
    b = decode_done(ok_done(BRIDGE_STATS_TAG, v)).bridge
    assert b is not None
    assert b == decode_bridge_stats(v)
    assert (b.start_ns, b.all_arrived_ns, b.end_ns) == (want["StartNS"], want["AllArrivedNS"], want["EndNS"])
    assert (b.bytes_sent, b.bytes_received) == (want["BytesSent"], want["BytesReceived"])
    assert (b.codec_ns, b.reduce_ns) == (want["CodecNS"], want["ReduceNS"])
    assert b.peers_cut == bool(want["Flags"] & 1)
    assert len(b.peers) == len(want["Peers"] or [])
    for p, w in zip(b.peers, want["Peers"] or [], strict=True):
        skew = None if w["ArrivalSkewNS"] == -(1 << 63) else w["ArrivalSkewNS"]
        assert (p.member, p.arrival_skew_ns, list(p.blocked_ns)) == (w["Member"], skew, w["BlockedNS"])


def test_done_without_bridge_stats() -> None:
    assert decode_done(ok_done(9, b"ab")).bridge is None


def _bridge_value() -> bytes:
    return (BRIDGE_VECTORS / "two-peers.bin").read_bytes()


def _patched(off: int, v: int) -> bytes:
    b = bytearray(_bridge_value())
    struct.pack_into("<H", b, off, v)
    return bytes(b)


def test_bridge_stats_of_another_version_are_skipped() -> None:
    assert decode_bridge_stats(_patched(0, 2)) is None
    assert decode_bridge_stats(b"\x02\x00") is None  # a newer layout may be of any length


_BAD_BRIDGE_IDS = [
    "empty", "truncated", "short-peer", "oversized", "peers", "no-streams", "streams", "flags", "reserved",
]  # fmt: skip


@pytest.mark.parametrize(
    ("value", "want"),
    [
        (b"", "0 bytes, need 64"),
        (_bridge_value()[:40], "40 bytes, need 64"),
        (_bridge_value()[:-1], "127 bytes, 2 peers of 2 streams take 128"),
        (_bridge_value() + b"\x00", "129 bytes, 2 peers of 2 streams take 128"),
        (_patched(2, 3), "3 peers of 2 streams"),
        (_patched(4, 0), "0 streams per peer"),
        (_patched(4, 65), "65 streams per peer"),
        (_patched(6, 2), "unknown flags 0x2"),
        (_patched(64 + 4, 1), "peer 0: reserved word is not zero"),
    ],
    ids=_BAD_BRIDGE_IDS,
)
def test_malformed_bridge_stats_are_refused(value: bytes, want: str) -> None:
    with pytest.raises(ProtocolError, match="malformed message from the server: done: bridge stats") as e:
        decode_bridge_stats(value)
    assert want in str(e.value), e.value
    with pytest.raises(ProtocolError, match=want):
        decode_done(ok_done(BRIDGE_STATS_TAG, value))


def _decoded(body: bytes, decode: object) -> object:
    try:
        return decode(body)  # type: ignore[operator]
    except ProtocolError as e:
        return ("refused", str(e))


def test_done_fast_path_is_the_general_decoder() -> None:
    """decode_done reads the usual DONEs without the general decoder; on
    every body (valid ones, and each byte of them changed, and every
    truncation) it returns or refuses exactly as the general decoder does."""
    stats = _bridge_value()
    bodies = [
        ok_done(BRIDGE_STATS_TAG, stats),
        ok_done(BRIDGE_STATS_TAG, _patched(0, 2)),  # another layout: skipped
        ok_done(5, b"xyz"),  # an unknown extension
        ok_done(BRIDGE_STATS_TAG, stats) + struct.pack("<HH", 6, 1) + b"z",  # stats, then another
        struct.pack("<QIIQQQQ", 9, 2, 0, 3, 64, 5, 6) + text("peer 1 gone é"),
        struct.pack("<QIIQQQQ", 9, 0, 0, 3, 64, 5, 6) + text(""),
    ]
    seen = 0
    for b in bodies:
        cases = [b[:k] for k in range(len(b) + 1)]
        for i in range(len(b)):
            for x in (0x00, 0x01, 0x80, 0xFF):
                m = bytearray(b)
                m[i] ^= x
                cases.append(bytes(m))
        for c in cases:
            assert _decoded(c, decode_done) == _decoded(c, _decode_done_slow), c.hex()
            seen += 1
    assert seen > 1000


# Go's fuzz seeds of the feed decoder (lib/feed/testdata/fuzz/FuzzFeedDecode):
# whole messages, which Go's decoder takes and re-encodes to the same bytes.
FUZZ_SEEDS = Path(__file__).resolve().parents[2] / "lib" / "feed" / "testdata" / "fuzz" / "FuzzFeedDecode"


def go_seed(name: str) -> bytes:
    """The []byte of a `go test fuzz v1` file."""
    lines = (FUZZ_SEEDS / name).read_text().splitlines()
    assert lines[0] == "go test fuzz v1" and lines[1].startswith("[]byte(") and lines[1].endswith(")")
    lit = ast.literal_eval("b" + lines[1][len("[]byte(") : -1])
    assert isinstance(lit, bytes)
    return lit


def test_version_3_requests_are_gos() -> None:
    """The requests of Go's version-3 seeds, made here from their fields:
    an fp8 all_reduce with a FEEDBACK_KEY, and a streamed zstd
    caller-reduces all_reduce."""
    fp8 = encode_request(
        Kind.ALL_REDUCE, 7, DType.FLOAT32, Op.SUM, 0, Span(1, 0, 4096), Span(), -1, 0, Codec.FP8, 77
    )
    assert fp8 == go_seed("v3-fp8-feedback-key")
    zstd = encode_request(
        Kind.ALL_REDUCE, 9, DType.INT32, Op.MAX, FLAG_STREAMED | FLAG_CALLER_REDUCES,
        Span(1, 0, 8), Span(1, 0, 16), -1, 0, Codec.ZSTD,
    )  # fmt: skip
    assert zstd == go_seed("v3-zstd-caller-reduces")
