"""The feed protocol of ``gbbridge serve`` (docs/FEED.md, versions 1 to 5): its
constants, numbering, errors and message codec.

This mirrors ``lib/feed`` (Go), which is the reference; only the wire format
is repeated here. Decoders bound every read by the message body and raise
:class:`ProtocolError` naming the message. The client is
:mod:`gpubridge._feed`.
"""

from __future__ import annotations

import re
import struct
from collections.abc import Sequence
from dataclasses import dataclass
from enum import IntEnum
from typing import Any, Final, NamedTuple

import numpy as np

__all__ = [
    "BRIDGES_VERSION",
    "BRIDGE_STATS_TAG",
    "BRIDGE_STATS_VERSION",
    "BRIDGE_TAG",
    "CALLER_REDUCES_VERSION",
    "CODEC_VERSION",
    "EXT_CRITICAL",
    "FEEDBACK_KEY_TAG",
    "FLAG_CALLER_REDUCES",
    "FLAG_STREAMED",
    "HEADER_SIZE",
    "MAGIC",
    "MAX_BRIDGE_ID",
    "MAX_BRIDGE_MEMBERS",
    "MAX_BRIDGE_NAME",
    "MAX_MESSAGE",
    "MAX_TEXT",
    "MIN_VERSION",
    "P2P_ORDER_VERSION",
    "REQUEST_SIZE",
    "VERSION",
    "BridgeError",
    "BridgePeer",
    "BridgeStats",
    "Codec",
    "DType",
    "Done",
    "FeedError",
    "FeedTimeout",
    "Kind",
    "Op",
    "ProtocolError",
    "RequestError",
    "Span",
    "Status",
    "Welcome",
    "check_bridge",
    "check_bridge_id",
    "decode_bridge_stats",
    "decode_bye",
    "decode_done",
    "decode_error",
    "decode_progress",
    "decode_welcome",
    "encode_bye",
    "encode_hello",
    "encode_join",
    "encode_ready",
    "encode_region",
    "encode_release",
    "encode_request",
    "kind_name",
    "malformed",
    "parse_header",
]

VERSION: Final = 5
MIN_VERSION: Final = 1
# The version that brought FLAG_CALLER_REDUCES.
CALLER_REDUCES_VERSION: Final = 2
# The version that gave the request's codec byte its meaning and brought
# FEEDBACK_KEY (§3a); before it every request says codec 0.
CODEC_VERSION: Final = 3
# The version that brought JOIN and the BRIDGE extension (§3b): more
# bridges on one feed; before it every request runs on bridge 0.
BRIDGES_VERSION: Final = 4
# The version from which gbbridge matches the SENDs and RECVs of a (bridge,
# peer, tag) in request order, many in flight at once (§4); nothing on the
# wire changed.
P2P_ORDER_VERSION: Final = 5
MAGIC: Final = 0x44464247  # "GBFD" little-endian
HEADER_SIZE: Final = 8
MAX_MESSAGE: Final = 64 << 10
MAX_TEXT: Final = 4 << 10
REQUEST_SIZE: Final = 64
FLAG_STREAMED: Final = 1
# ALL_REDUCE, version 2: the bridge exchanges the inputs unreduced into out
# (members x the input, in member order); the caller reduces them.
FLAG_CALLER_REDUCES: Final = 2
EXT_CRITICAL: Final = 0x8000
# DONE's extension tag 1: what the bridge measured of a collective
# (docs/TRACING.md §7; Go: lib/feed/bridgestats.go).
BRIDGE_STATS_TAG: Final = 1
BRIDGE_STATS_VERSION: Final = 1
_MAX_BRIDGE_STREAMS: Final = 64
_BRIDGE_NOT_HEARD: Final = -(1 << 63)
_BRIDGE_PEERS_CUT: Final = 1
# A request's extension tag 2 (version 3, critical): the u64 error-feedback
# key of a lossy all_reduce (gbbridge keeps a residual per key).
FEEDBACK_KEY_TAG: Final = 2
# A request's extension tag 3 (version 4, critical): the u32 id of the
# bridge it runs on, one the feed JOINed (without it: bridge 0).
BRIDGE_TAG: Final = 3
# JOIN's limits (§3b): the bridge's name (its key in the store), its
# members, and the ids a client may give it.
MAX_BRIDGE_NAME: Final = 128
MIN_BRIDGE_MEMBERS: Final = 2
MAX_BRIDGE_MEMBERS: Final = 1024
MAX_BRIDGE_ID: Final = 1 << 31
_BRIDGE_NAME = re.compile(r"[A-Za-z0-9/_-]+")

_HEADER = struct.Struct("<IHH")
_REQUEST = struct.Struct("<QBBBBIIIQQQQiI")
_DONE = struct.Struct("<QIIQQQQ")
_WELCOME = struct.Struct("<HHIIIIIQ")
_U32 = struct.Struct("<I")
_EXT = struct.Struct("<HH")
_U64 = struct.Struct("<Q")
_U64X2 = struct.Struct("<QQ")
_U64X3 = struct.Struct("<QQQ")
_BRIDGE = struct.Struct("<HHHH7Q")
_BRIDGE_PEER = struct.Struct("<IIq")
assert _REQUEST.size == REQUEST_SIZE


class Kind(IntEnum):
    """Message types."""

    HELLO = 1
    WELCOME = 2
    ERROR = 3
    BYE = 4
    REGION = 5
    RELEASE = 6
    READY = 7
    PROGRESS = 8
    DONE = 9
    JOIN = 10
    ALL_REDUCE = 16
    BROADCAST = 17
    ALL_GATHER = 18
    REDUCE_SCATTER = 19
    BARRIER = 20
    SEND = 21
    RECV = 22

    def __str__(self) -> str:
        return self.name.lower()


class DType(IntEnum):
    """Element types, numbered as lib/reduce numbers them (stable)."""

    NONE = 0
    FLOAT16 = 1
    BFLOAT16 = 2
    FLOAT32 = 3
    FLOAT64 = 4
    INT8 = 5
    UINT8 = 6
    INT32 = 7
    INT64 = 8

    @classmethod
    def of(cls, v: DType | int | str | np.dtype[Any] | type[Any] | None) -> DType:
        """Returns the dtype named by v: a DType, its number, a name (torch and
        short spellings too: "bf16", "torch.float32", "long"), a numpy dtype or
        a ``torch.dtype`` (through its name)."""
        if type(v) is cls:  # the hot path: no Enum lookup
            return v
        if v is None:
            return cls.NONE
        if isinstance(v, int):
            return cls(v)
        if isinstance(v, (np.dtype, type)):
            return cls.of(np.dtype(v).name)
        name = str(v).lower().removeprefix("torch.")
        try:
            return _DTYPE_NAMES[name]
        except KeyError:
            raise ValueError(f"gpubridge feed: unknown dtype {v!r}") from None

    @property
    def itemsize(self) -> int:
        return _DTYPE_SIZES[self]


_DTYPE_NAMES: Final[dict[str, DType]] = {
    "none": DType.NONE, "bytes": DType.NONE,
    "float16": DType.FLOAT16, "half": DType.FLOAT16, "fp16": DType.FLOAT16, "f16": DType.FLOAT16,
    "bfloat16": DType.BFLOAT16, "bf16": DType.BFLOAT16,
    "float32": DType.FLOAT32, "float": DType.FLOAT32, "fp32": DType.FLOAT32, "f32": DType.FLOAT32,
    "float64": DType.FLOAT64, "double": DType.FLOAT64, "fp64": DType.FLOAT64, "f64": DType.FLOAT64,
    "int8": DType.INT8, "uint8": DType.UINT8,
    "int32": DType.INT32, "int": DType.INT32,
    "int64": DType.INT64, "long": DType.INT64,
}  # fmt: skip
_DTYPE_SIZES: Final[dict[DType, int]] = {
    DType.NONE: 1, DType.FLOAT16: 2, DType.BFLOAT16: 2, DType.FLOAT32: 4, DType.FLOAT64: 8,
    DType.INT8: 1, DType.UINT8: 1, DType.INT32: 4, DType.INT64: 8,
}  # fmt: skip


class Codec(IntEnum):
    """How a request's bridged transfers are packed: lib/codec's ids
    (docs/COMPRESSION.md; an id names one format version forever)."""

    RAW = 0
    BF16 = 1  # bf16/v1
    FP8 = 2  # fp8/v1 (MXFP8)
    ZSTD = 3  # zstd/v1, lossless

    def __str__(self) -> str:
        return self.name.lower()

    @property
    def versioned(self) -> str:
        """The name with the format's version ("fp8/v1"), as gbbridge's
        messages say it."""
        return "raw" if self == Codec.RAW else f"{self}/v1"

    @property
    def lossy(self) -> bool:
        return self in (Codec.BF16, Codec.FP8)


class Op(IntEnum):
    """Reduction ops, numbered as lib/reduce numbers them (stable)."""

    NONE = 0
    SUM = 1
    PROD = 2
    MAX = 3
    MIN = 4
    AVG = 5

    @classmethod
    def of(cls, v: Op | int | str) -> Op:
        if type(v) is cls:
            return v
        if isinstance(v, int):
            return cls(v)
        try:
            return cls[str(v).upper().rsplit(".", 1)[-1]]
        except KeyError:
            raise ValueError(f"gpubridge feed: unknown op {v!r}") from None


class Status(IntEnum):
    """DONE statuses."""

    OK = 0
    BAD_REQUEST = 1  # refused before anything ran; the bridge is fine
    BRIDGE_ERROR = 2  # the bridge failed during this request; broken from now on
    BROKEN = 3  # refused at once: the bridge broke earlier
    ABORTED = 4  # the server is stopping

    def __str__(self) -> str:
        return self.name.lower().replace("_", " ")


# ---- errors ----


class FeedError(Exception):
    """The feed failed or the server refused something; ``str(e)`` carries the
    server's message when there is one."""


class ProtocolError(FeedError):
    """A message from the server does not follow the protocol, or the server
    sent ERROR (``code``: 1 protocol, 2 version, 3 internal)."""

    def __init__(self, msg: str, code: int = 0) -> None:
        super().__init__(msg)
        self.code = code


class FeedTimeout(FeedError, TimeoutError):
    """A wait passed its deadline. The request stays in flight on the server;
    waiting for it again is allowed."""


class RequestError(FeedError):
    """A request finished with a status other than OK. A bad request
    (``Status.BAD_REQUEST``) left the bridge fine."""

    def __init__(self, kind: Kind, request_id: int, status: Status, message: str) -> None:
        super().__init__(f"gpubridge feed: {kind} {request_id}: {status}: {message}")
        self.kind = kind
        self.request_id = request_id
        self.status = status
        self.message = message


class BridgeError(RequestError):
    """The bridge failed (DONE status 2, 3 or 4): ``message`` is the
    collective's error, naming the operation and the peer. Every later
    collective on this feed fails too."""


# ---- messages ----


@dataclass(frozen=True)
class Welcome:
    """The server's WELCOME: version, this leader's member index, limits."""

    version: int
    member: int
    members: int
    max_message: int
    max_regions: int
    max_inflight: int
    max_region_bytes: int
    transport: str


class BridgePeer(NamedTuple):
    """One peer's part of BridgeStats: its member index, when its first
    frame came relative to start (ns; None: none came, as a ring member
    hears only from its predecessor), and per stream the ns waited on it."""

    member: int
    arrival_skew_ns: int | None
    blocked_ns: tuple[int, ...]


class BridgeStats(NamedTuple):
    """DONE's tag 1 (layout version 1): one collective as gbbridge saw it.
    Times are CLOCK_MONOTONIC ns of the bridge's host, the trace clock."""

    start_ns: int
    all_arrived_ns: int
    end_ns: int
    bytes_sent: int
    bytes_received: int
    codec_ns: int
    reduce_ns: int
    peers: tuple[BridgePeer, ...]
    peers_cut: bool  # the value held fewer peers than the bridge has


class Done(NamedTuple):
    """A request's DONE; bridge: what gbbridge measured of a collective.
    (DONE, its stats and Span are named tuples, not dataclasses: one of
    each is made per request, and a tuple is made several times faster.)"""

    request_id: int
    status: Status
    seq: int
    nbytes: int
    queue_us: int
    total_us: int
    error: str
    bridge: BridgeStats | None = None


class Span(NamedTuple):
    """Bytes [offset, offset+nbytes) of a region; region 0 is the empty span."""

    region: int = 0
    offset: int = 0
    nbytes: int = 0


# ---- encoding ----


def _encode(kind: Kind, body: bytes) -> bytes:
    return _HEADER.pack(HEADER_SIZE + len(body), kind, 0) + body


def _text(s: str) -> bytes:
    b = s.encode()
    if len(b) > MAX_TEXT:
        b = b[:MAX_TEXT].decode("utf-8", "ignore").encode()  # cut at a UTF-8 boundary
    return struct.pack("<H", len(b)) + b


def encode_hello(pid: int, name: str) -> bytes:
    return _encode(Kind.HELLO, struct.pack("<IHHI", MAGIC, MIN_VERSION, VERSION, pid) + _text(name))


def encode_request(
    kind: Kind, request_id: int, dtype: DType, op: Op, flags: int, buf: Span, out: Span, peer: int, tag: int,
    codec: Codec = Codec.RAW, feedback_key: int | None = None, bridge: int | None = None,
) -> bytes:  # fmt: skip
    """A request (§3); codec is the body's byte 10, feedback_key the
    FEEDBACK_KEY extension (version 3, §3a) and bridge the BRIDGE extension
    (version 4, §3b: the id of a JOINed bridge; None: bridge 0)."""
    body = _REQUEST.pack(
        request_id, dtype, op, codec, 0, flags, buf.region, out.region,
        buf.offset, buf.nbytes, out.offset, out.nbytes, peer, tag,
    )  # fmt: skip
    if feedback_key is not None:
        body += _EXT.pack(FEEDBACK_KEY_TAG | EXT_CRITICAL, _U64.size) + _U64.pack(feedback_key)
    if bridge is not None:
        check_bridge_id(bridge)
        body += _EXT.pack(BRIDGE_TAG | EXT_CRITICAL, _U32.size) + _U32.pack(bridge)
    return _encode(kind, body)


def check_bridge_id(bridge: int) -> None:
    """ValueError unless bridge is an id a client may JOIN (1 … 2^31)."""
    if not 1 <= bridge <= MAX_BRIDGE_ID:
        raise ValueError(f"gpubridge feed: bridge id {bridge} is outside 1..{MAX_BRIDGE_ID}")


def check_bridge(name: str, members: Sequence[int]) -> None:
    """ValueError unless name and members make a JOIN gbbridge takes
    (§3b): a name of letters, digits, '/', '-', '_' of at most 128 bytes,
    2 … 1024 distinct members, none negative."""
    if not _BRIDGE_NAME.fullmatch(name) or len(name) > MAX_BRIDGE_NAME:
        raise ValueError(
            f"gpubridge feed: bridge name {name!r} is not 1..{MAX_BRIDGE_NAME} letters, digits, '/', '-', '_'"
        )
    if not MIN_BRIDGE_MEMBERS <= len(members) <= MAX_BRIDGE_MEMBERS:
        raise ValueError(
            f"gpubridge feed: bridge {name}: {len(members)} members, "
            f"{MIN_BRIDGE_MEMBERS}..{MAX_BRIDGE_MEMBERS} allowed"
        )
    if len(set(members)) != len(members) or any(not 0 <= m < 1 << 32 for m in members):
        raise ValueError(f"gpubridge feed: bridge {name}: members {list(members)} are not distinct ranks")


def encode_join(request_id: int, bridge: int, name: str, members: Sequence[int]) -> bytes:
    """JOIN (version 4, §3b): join the bridge called name, whose members are
    these ranks of the topology in member order, as bridge id bridge of
    this feed."""
    check_bridge_id(bridge)
    check_bridge(name, members)
    body = struct.pack("<QII", request_id, bridge, 0) + _text(name) + struct.pack("<H", len(members))
    body += struct.pack(f"<{len(members)}I", *members)
    return _encode(Kind.JOIN, body)


def encode_region(request_id: int, region_id: int, size: int) -> bytes:
    return _encode(Kind.REGION, struct.pack("<QIIQ", request_id, region_id, 0, size))


def encode_release(request_id: int, region_id: int) -> bytes:
    return _encode(Kind.RELEASE, struct.pack("<QI", request_id, region_id))


def encode_ready(request_id: int, end: int) -> bytes:
    return _encode(Kind.READY, _U64X2.pack(request_id, end))


def encode_bye() -> bytes:
    return _encode(Kind.BYE, b"")


# ---- decoding ----


def kind_name(kind: Kind | int) -> str:
    try:
        return str(Kind(kind))
    except ValueError:
        return f"type({int(kind)})"


def malformed(kind: Kind | int, what: str) -> ProtocolError:
    return ProtocolError(f"gpubridge feed: malformed message from the server: {kind_name(kind)}: {what}")


def parse_header(buf: bytes | bytearray) -> tuple[int, int]:
    """The size and type of the message at the start of buf (which holds at
    least HEADER_SIZE bytes)."""
    size, kind, flags = _HEADER.unpack_from(buf)
    if flags != 0:
        raise malformed(kind, f"header flags {flags:#x} are not zero")
    if not HEADER_SIZE <= size <= MAX_MESSAGE:
        raise malformed(kind, f"size {size} is outside {HEADER_SIZE}..{MAX_MESSAGE}")
    return size, kind


class _Dec:
    """Reads a message body; every read is bounded by the body."""

    __slots__ = ("b", "kind", "pos")

    def __init__(self, kind: Kind, body: bytes) -> None:
        self.b = body
        self.kind = kind
        self.pos = 0

    def fixed(self, st: struct.Struct) -> tuple[Any, ...]:
        if len(self.b) - self.pos < st.size:
            raise malformed(self.kind, "body too short")
        v = st.unpack_from(self.b, self.pos)
        self.pos += st.size
        return v

    def text(self) -> str:
        (n,) = self.fixed(struct.Struct("<H"))
        if n > MAX_TEXT:
            raise malformed(self.kind, f"string of {n} bytes is over {MAX_TEXT}")
        if len(self.b) - self.pos < n:
            raise malformed(self.kind, "body too short")
        s = self.b[self.pos : self.pos + n].decode("utf-8", "replace")
        self.pos += n
        return s

    def exts(self, want: int = 0) -> bytes | None:
        """Checks the extensions that fill the rest of the body and returns
        the value of the last with tag want (0: none is wanted)."""
        got = None
        while self.pos < len(self.b):
            tag, n = self.fixed(_EXT)
            if len(self.b) - self.pos < n:
                raise malformed(self.kind, "body too short")
            if tag & EXT_CRITICAL:
                raise malformed(self.kind, f"unknown critical extension {tag:#06x}")
            if want and tag == want:
                got = bytes(self.b[self.pos : self.pos + n])
            self.pos += n
        return got

    def end(self) -> None:
        if self.pos != len(self.b):
            raise malformed(self.kind, f"{len(self.b) - self.pos} trailing bytes")


def decode_welcome(body: bytes) -> Welcome:
    d = _Dec(Kind.WELCOME, body)
    version, zero, member, members, max_msg, max_regions, max_inflight, max_bytes = d.fixed(_WELCOME)
    if zero != 0:
        raise malformed(Kind.WELCOME, "reserved field is not zero")
    transport = d.text()
    d.exts()
    d.end()
    return Welcome(version, member, members, max_msg, max_regions, max_inflight, max_bytes, transport)


def decode_error(body: bytes, *, whole: bool = True) -> tuple[int, str]:
    """ERROR's code and text; with whole, nothing may follow them (the
    answer to HELLO is read without that check)."""
    d = _Dec(Kind.ERROR, body)
    (code,) = d.fixed(_U32)
    text = d.text()
    if whole:
        d.end()
    return code, text


_STATUSES: Final = tuple(Status)
_TEXT_LEN = struct.Struct("<H")


def decode_done(body: bytes) -> Done:
    # The hot path of every request: one DONE per call, so the common
    # shapes (no text, or a text, then BRIDGE_STATS or nothing) are read
    # without the general decoder; anything else goes through _Dec.
    if len(body) < _DONE.size + 2:
        return _decode_done_slow(body)
    rid, status, zero, seq, nbytes, queue_us, total_us = _DONE.unpack_from(body)
    (n,) = _TEXT_LEN.unpack_from(body, _DONE.size)
    pos = _DONE.size + 2 + n
    if zero != 0 or n > MAX_TEXT or pos > len(body) or not 0 <= status < len(_STATUSES):
        return _decode_done_slow(body)
    text = body[pos - n : pos].decode("utf-8", "replace") if n else ""
    bridge = None
    if pos != len(body):
        tag, size = _EXT.unpack_from(body, pos) if len(body) - pos >= _EXT.size else (-1, 0)
        if tag != BRIDGE_STATS_TAG or pos + _EXT.size + size != len(body):
            return _decode_done_slow(body)
        bridge = decode_bridge_stats(body[pos + _EXT.size :])
    return Done(rid, _STATUSES[status], seq, nbytes, queue_us, total_us, text, bridge)


def _decode_done_slow(body: bytes) -> Done:
    d = _Dec(Kind.DONE, body)
    rid, status, zero, seq, nbytes, queue_us, total_us = d.fixed(_DONE)
    if zero != 0:
        raise malformed(Kind.DONE, "reserved field is not zero")
    text = d.text()
    value = d.exts(BRIDGE_STATS_TAG)
    d.end()
    try:
        st = Status(status)
    except ValueError:
        raise malformed(Kind.DONE, f"unknown status {status}") from None
    bridge = None if value is None else decode_bridge_stats(value)
    return Done(rid, st, seq, nbytes, queue_us, total_us, text, bridge)


# One struct per (peers, streams) layout of BRIDGE_STATS: the whole value
# in one unpack (a DONE per call carries one).
_BRIDGE_LAYOUTS: dict[tuple[int, int], struct.Struct] = {}


def _bridge_layout(p: int, s: int) -> struct.Struct:
    st = _BRIDGE_LAYOUTS.get((p, s))
    if st is None:
        st = struct.Struct("<HHHH7Q" + f"IIq{s}Q" * p)
        if len(_BRIDGE_LAYOUTS) < 256:
            _BRIDGE_LAYOUTS[(p, s)] = st
    return st


def decode_bridge_stats(v: bytes) -> BridgeStats | None:
    """DONE's tag-1 value; None for another layout version (a newer
    gbbridge: skipped). A version-1 value must be exactly as long as its
    peer and stream counts say, with 1 .. 64 streams, known flags and zero
    reserved words, else ProtocolError."""
    if len(v) < 2:
        raise malformed(Kind.DONE, f"bridge stats: {len(v)} bytes, need {_BRIDGE.size}")
    if int.from_bytes(v[:2], "little") != BRIDGE_STATS_VERSION:
        return None
    if len(v) < _BRIDGE.size:
        raise malformed(Kind.DONE, f"bridge stats: {len(v)} bytes, need {_BRIDGE.size}")
    _, p, s, flags, start, arrived, end, sent, received, codec, red = _BRIDGE.unpack_from(v)
    if not 1 <= s <= _MAX_BRIDGE_STREAMS:
        raise malformed(Kind.DONE, f"bridge stats: {s} streams per peer, 1..{_MAX_BRIDGE_STREAMS} allowed")
    if flags & ~_BRIDGE_PEERS_CUT:
        raise malformed(Kind.DONE, f"bridge stats: unknown flags {flags:#x}")
    size = _BRIDGE_PEER.size + 8 * s
    if len(v) != (want := _BRIDGE.size + p * size):
        raise malformed(Kind.DONE, f"bridge stats: {len(v)} bytes, {p} peers of {s} streams take {want}")
    f = _bridge_layout(p, s).unpack_from(v)
    peers = []
    k = 11  # the fields before the first peer
    for i in range(p):
        member, zero, skew = f[k], f[k + 1], f[k + 2]
        if zero:
            raise malformed(Kind.DONE, f"bridge stats: peer {i}: reserved word is not zero")
        skew_ns = None if skew == _BRIDGE_NOT_HEARD else skew
        peers.append(BridgePeer(member, skew_ns, f[k + 3 : k + 3 + s]))
        k += 3 + s
    cut = bool(flags & _BRIDGE_PEERS_CUT)
    return BridgeStats(start, arrived, end, sent, received, codec, red, tuple(peers), cut)


def decode_progress(body: bytes) -> tuple[int, int, int]:
    """PROGRESS's request id, offset and length."""
    d = _Dec(Kind.PROGRESS, body)
    rid, off, n = d.fixed(_U64X3)
    d.end()
    return rid, off, n


def decode_bye(body: bytes) -> None:
    _Dec(Kind.BYE, body).end()
