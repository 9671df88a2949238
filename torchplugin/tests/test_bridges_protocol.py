"""Feed protocol 4 (docs/FEED.md §3b) on the Python side, without gbbridge:
JOIN and the BRIDGE extension against bytes written out from the spec, the
refusals of what gbbridge would refuse, and the client against a fake
server of version 3 (bridge 0 keeps working; JOIN is refused before
anything is sent) and of version 4 (JOIN's DONE statuses become errors
that carry the server's words)."""

from __future__ import annotations

import socket
import struct
import threading
import time

import pytest

from gpubridge._feed import BridgeError, FeedClient, FeedError, RequestError
from gpubridge._feed_protocol import (
    BRIDGE_TAG,
    BRIDGES_VERSION,
    HEADER_SIZE,
    P2P_ORDER_VERSION,
    REQUEST_SIZE,
    VERSION,
    DType,
    Kind,
    Op,
    Span,
    encode_hello,
    encode_join,
    encode_request,
    parse_header,
)


def test_version_constants() -> None:
    assert (VERSION, BRIDGES_VERSION, P2P_ORDER_VERSION, BRIDGE_TAG, int(Kind.JOIN)) == (5, 4, 5, 3, 10)
    # HELLO offers versions 1 to 5
    assert struct.unpack_from("<HH", encode_hello(1, "x"), HEADER_SIZE + 4) == (1, 5)


def test_join_layout() -> None:
    """u64 request id, u32 bridge id, u32 flags (0), string name, u16 member
    count, then the members' ranks as u32, in member order."""
    msg = encode_join(12, 5, "pair/1-3", [1, 3])
    want = (
        (12).to_bytes(8, "little") + (5).to_bytes(4, "little") + bytes(4)
        + (8).to_bytes(2, "little") + b"pair/1-3"
        + (2).to_bytes(2, "little") + (1).to_bytes(4, "little") + (3).to_bytes(4, "little")
    )  # fmt: skip
    assert msg == struct.pack("<IHH", HEADER_SIZE + len(want), 10, 0) + want
    assert parse_header(msg) == (HEADER_SIZE + len(want), Kind.JOIN)
    # member order is kept as given (it is the bridge's member order)
    assert encode_join(1, 1, "b", [7, 0, 3])[-12:] == struct.pack("<3I", 7, 0, 3)


@pytest.mark.parametrize(
    ("bridge", "name", "members", "want"),
    [
        (0, "pair/0-1", [0, 1], "bridge id 0 is outside"),
        ((1 << 31) + 1, "pair/0-1", [0, 1], "is outside 1..2147483648"),
        (1, "pair 0-1", [0, 1], "is not 1..128 letters"),
        (1, "", [0, 1], "is not 1..128 letters"),
        (1, "a" * 129, [0, 1], "is not 1..128 letters"),
        (1, "pair/0-1", [0], "1 members, 2..1024 allowed"),
        (1, "x", list(range(1025)), "1025 members"),
        (1, "x", [2, 2], "not distinct"),
        (1, "x", [-1, 2], "not distinct"),
    ],
)
def test_join_refusals(bridge: int, name: str, members: list[int], want: str) -> None:
    with pytest.raises(ValueError, match=want):
        encode_join(1, bridge, name, members)


def test_join_limits_taken() -> None:
    encode_join(1, 1 << 31, "A-z_9/" + "a" * 122, list(range(1024)))


def test_bridge_extension() -> None:
    """Tag 3 with the critical bit (0x8003), length 4, the u32 id; after a
    FEEDBACK_KEY when both are given; without it, no extension (bridge 0,
    the bytes of version 3)."""
    plain = encode_request(Kind.SEND, 3, DType.NONE, Op.NONE, 0, Span(1, 0, 64), Span(), 1, 9)
    on = encode_request(Kind.SEND, 3, DType.NONE, Op.NONE, 0, Span(1, 0, 64), Span(), 1, 9, bridge=7)
    assert len(plain) == HEADER_SIZE + REQUEST_SIZE
    assert on[HEADER_SIZE : HEADER_SIZE + REQUEST_SIZE] == plain[HEADER_SIZE:]
    assert on[HEADER_SIZE + REQUEST_SIZE :] == bytes.fromhex("03800400") + (7).to_bytes(4, "little")
    assert parse_header(on) == (HEADER_SIZE + REQUEST_SIZE + 8, Kind.SEND)
    both = encode_request(
        Kind.ALL_REDUCE, 4, DType.FLOAT32, Op.SUM, 0, Span(1, 0, 64), Span(), -1, 0, feedback_key=5, bridge=2
    )
    assert both[HEADER_SIZE + REQUEST_SIZE :] == (
        bytes.fromhex("02800800")
        + (5).to_bytes(8, "little")
        + bytes.fromhex("03800400")
        + (2).to_bytes(4, "little")
    )
    with pytest.raises(ValueError, match="bridge id 0"):
        encode_request(Kind.SEND, 3, DType.NONE, Op.NONE, 0, Span(), Span(), 1, 0, bridge=0)


# ---- the client against a fake server ----


class _Server:
    """A feed server of `version` that answers each JOIN with the next of
    join_answers (status, text) and every other request ok; keeps the raw
    messages it got."""

    def __init__(self, version: int, join_answers: list[tuple[int, str]] | None = None) -> None:
        self.client_sock, self.sock = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        self.version = version
        self.answers = list(join_answers or [])
        self.got: list[tuple[int, bytes]] = []
        self.thread = threading.Thread(target=self._serve, daemon=True)
        self.thread.start()

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
        head = self._exactly(HEADER_SIZE)
        assert head is not None
        self._exactly(struct.unpack("<I", head[:4])[0] - HEADER_SIZE)
        welcome = struct.pack("<HHIIIIIQ", self.version, 0, 0, 1, 65536, 16, 16, 1 << 30) + b"\x04\x00fake"
        self._send(Kind.WELCOME, welcome)
        while (head := self._exactly(HEADER_SIZE)) is not None:
            size, kind, _ = struct.unpack("<IHH", head)
            body = self._exactly(size - HEADER_SIZE)
            assert body is not None
            if kind == Kind.BYE:
                self._send(Kind.BYE, b"")
                self.sock.close()
                return
            self.got.append((kind, body))
            rid = struct.unpack_from("<Q", body)[0]
            status, text = self.answers.pop(0) if kind == Kind.JOIN and self.answers else (0, "")
            t = text.encode()
            self._send(Kind.DONE, struct.pack("<QIIQQQQH", rid, status, 0, 0, 0, 0, 0, len(t)) + t)


def _client(srv: _Server) -> FeedClient:
    c = FeedClient(srv.client_sock, 10.0, 0.0)
    c.hello(time.monotonic() + 10.0)
    return c


def test_version_3_server_keeps_bridge_0() -> None:
    """A gbbridge of feed protocol 3: requests on bridge 0 go as before
    (no extension); JOIN and the BRIDGE extension are refused before
    anything is sent, saying which version is needed."""
    srv = _Server(3)
    c = _client(srv)
    assert c.version == 3 and not c.bridges
    c.request(Kind.BARRIER)
    with pytest.raises(FeedError, match=r"joining bridge pair/0-1 needs feed protocol 4.*speaks version 3"):
        c.join(1, "pair/0-1", [0, 1])
    with pytest.raises(FeedError, match="bridge 1 needs feed protocol 4"):
        c.request(Kind.SEND, peer=1, bridge=1)
    assert [k for k, _ in srv.got] == [Kind.BARRIER]
    assert len(srv.got[0][1]) == REQUEST_SIZE
    c.close()
    srv.thread.join(5)


def test_join_statuses() -> None:
    """JOIN's DONE: ok; status 1 (refused) a RequestError, status 2 (the
    set-up failed) a BridgeError, each with the server's text; the
    requests that follow carry the bridge's id."""
    srv = _Server(
        4,
        [
            (0, ""),
            (1, "bridge id 1 is already used on this feed"),
            (2, "set up the shm bridge: member 1 (rank 3): timed out"),
        ],
    )
    c = _client(srv)
    assert c.bridges
    c.join(1, "pair/1-3", [1, 3])
    c.request(Kind.SEND, peer=1, tag=4, bridge=1)
    with pytest.raises(RequestError, match="already used") as e1:
        c.join(1, "pair/1-3", [1, 3])
    assert not isinstance(e1.value, BridgeError)
    with pytest.raises(BridgeError, match=r"member 1 \(rank 3\): timed out"):
        c.join(2, "pair/0-3", [0, 3])
    kinds = [k for k, _ in srv.got]
    assert kinds == [Kind.JOIN, Kind.SEND, Kind.JOIN, Kind.JOIN]
    send = srv.got[1][1]
    assert send[REQUEST_SIZE:] == bytes.fromhex("03800400") + (1).to_bytes(4, "little")
    c.close()
    srv.thread.join(5)


def test_version_4_messages_are_gos() -> None:
    """Go's version-4 seeds (lib/feed/testdata/fuzz/FuzzFeedDecode), made
    here from their fields: a JOIN of bridge 2 "shard/1" with members 1, 4,
    9, and a RECV of 8 int8 bytes from member 0 with tag 2 on bridge 2."""
    from test_feed_protocol import go_seed  # noqa: PLC0415  (tests/ is on sys.path under pytest)

    join, recv = go_seed("join-v4"), go_seed("request-bridge-v4")
    assert encode_join(12, 2, "shard/1", [1, 4, 9]) == join
    assert (
        encode_request(Kind.RECV, 13, DType.INT8, Op.NONE, 0, Span(1, 0, 8), Span(), 0, 2, bridge=2) == recv
    )
