"""Client of the feed protocol of ``gbbridge serve`` (docs/FEED.md, version 1).

The plugin puts a tensor's bytes in a shared-memory :class:`Region` (a sealed
memfd that ``gbbridge serve`` maps too) and asks for a collective over the
control socket; gbbridge runs it over the bridge, in place, and answers DONE.
This module mirrors ``lib/feed.Client`` (Go, the reference client); only the
wire format is repeated here. Whether a request makes sense (spans, dtypes,
ops, roots) is the server's to check: it answers DONE with a bad-request
status, raised here as :class:`RequestError`.

Every wait has a deadline. The thread that waits for a reply reads the socket
itself (``poll`` then a non-blocking ``recv``), and hands the replies of other
threads' requests to them, so the client is safe to use from several threads.
"""

from __future__ import annotations

import contextlib
import ctypes
import fcntl
import json
import mmap
import os
import select
import signal
import socket
import struct
import subprocess
import tempfile
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from enum import IntEnum
from typing import IO, Any, Final

import numpy as np
import numpy.typing as npt

__all__ = [
    "BridgeError",
    "BridgeProcess",
    "Call",
    "DType",
    "Done",
    "FeedClient",
    "FeedError",
    "FeedTimeout",
    "Kind",
    "Op",
    "ProtocolError",
    "Region",
    "RequestError",
    "Span",
    "Status",
    "Welcome",
    "spawn_bridge",
    "start_bridge",
]

# ---- wire format (lib/feed/proto.go) ----

VERSION: Final = 1
MIN_VERSION: Final = 1
MAGIC: Final = 0x44464247  # "GBFD" little-endian
HEADER_SIZE: Final = 8
MAX_MESSAGE: Final = 64 << 10
MAX_TEXT: Final = 4 << 10
REQUEST_SIZE: Final = 64
FLAG_STREAMED: Final = 1
EXT_CRITICAL: Final = 0x8000
WRITE_TIMEOUT: Final = 60.0  # seconds, like the server's write deadline
DEFAULT_TIMEOUT: Final = 360.0  # one request: above gbbridge serve's --timeout=5m

_HEADER = struct.Struct("<IHH")
_REQUEST = struct.Struct("<QBBBBIIIQQQQiI")
_DONE = struct.Struct("<QIIQQQQ")
_WELCOME = struct.Struct("<HHIIIIIQ")
_U64X2 = struct.Struct("<QQ")
_U64X3 = struct.Struct("<QQQ")
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


# ---- decoding ----


def _malformed(kind: Kind | int, what: str) -> ProtocolError:
    return ProtocolError(f"gpubridge feed: malformed message from the server: {_kind_name(kind)}: {what}")


def _kind_name(kind: Kind | int) -> str:
    try:
        return str(Kind(kind))
    except ValueError:
        return f"type({int(kind)})"


class _Dec:
    """Reads a message body; every read is bounded by the body."""

    __slots__ = ("b", "kind", "pos")

    def __init__(self, kind: Kind, body: bytes) -> None:
        self.b = body
        self.kind = kind
        self.pos = 0

    def fixed(self, st: struct.Struct) -> tuple[Any, ...]:
        if len(self.b) - self.pos < st.size:
            raise _malformed(self.kind, "body too short")
        v = st.unpack_from(self.b, self.pos)
        self.pos += st.size
        return v

    def text(self) -> str:
        if len(self.b) - self.pos < 2:
            raise _malformed(self.kind, "body too short")
        (n,) = struct.unpack_from("<H", self.b, self.pos)
        if n > MAX_TEXT:
            raise _malformed(self.kind, f"string of {n} bytes is over {MAX_TEXT}")
        self.pos += 2
        if len(self.b) - self.pos < n:
            raise _malformed(self.kind, "body too short")
        s = self.b[self.pos : self.pos + n].decode("utf-8", "replace")
        self.pos += n
        return s

    def exts(self) -> None:
        """Checks and skips the extensions that fill the rest of the body."""
        while self.pos < len(self.b):
            tag, n = self.fixed(struct.Struct("<HH"))
            if len(self.b) - self.pos < n:
                raise _malformed(self.kind, "body too short")
            if tag & EXT_CRITICAL:
                raise _malformed(self.kind, f"unknown critical extension {tag:#06x}")
            self.pos += n

    def end(self) -> None:
        if self.pos != len(self.b):
            raise _malformed(self.kind, f"{len(self.b) - self.pos} trailing bytes")


def _encode(kind: Kind, body: bytes) -> bytes:
    return _HEADER.pack(HEADER_SIZE + len(body), kind, 0) + body


def _text(s: str) -> bytes:
    b = s.encode()
    if len(b) > MAX_TEXT:
        b = b[:MAX_TEXT].decode("utf-8", "ignore").encode()  # cut at a UTF-8 boundary
    return struct.pack("<H", len(b)) + b


# ---- messages and results ----


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


@dataclass(frozen=True)
class Done:
    """A request's DONE."""

    request_id: int
    status: Status
    seq: int
    nbytes: int
    queue_us: int
    total_us: int
    error: str


@dataclass(frozen=True)
class Span:
    """Bytes [offset, offset+nbytes) of a region; region 0 is the empty span."""

    region: int = 0
    offset: int = 0
    nbytes: int = 0


class Region:
    """A shared-memory region: a memfd sealed against shrinking and growing,
    mapped here (``mem``) and by gbbridge.

    ``array`` and ``view`` return views of the mapping: the region's memory
    is valid until :meth:`FeedClient.release` or :meth:`FeedClient.close`,
    which unmap it once no view is left (a view still held keeps the
    client's mapping alive until it is garbage)."""

    def __init__(self, region_id: int, size: int, mem: mmap.mmap) -> None:
        self.id = region_id
        self.size = size
        self.mem = mem

    def span(self, offset: int = 0, nbytes: int | None = None) -> Span:
        """Returns bytes [offset, offset+nbytes) as a request span (default:
        up to the end)."""
        return Span(self.id, offset, self.size - offset if nbytes is None else nbytes)

    def view(self, offset: int = 0, nbytes: int | None = None) -> memoryview:
        end = self.size if nbytes is None else offset + nbytes
        return memoryview(self.mem)[offset:end]

    def array(self, dtype: npt.DTypeLike = np.uint8, offset: int = 0, count: int = -1) -> npt.NDArray[Any]:
        """A numpy array on the region's memory (bfloat16: use uint16 or
        int16 and reinterpret, or ``torch.frombuffer(region.mem, ...)``)."""
        return np.frombuffer(self.mem, dtype=dtype, count=count, offset=offset)

    def _unmap(self) -> None:
        with contextlib.suppress(BufferError):  # a view is still held; the mapping goes with it
            self.mem.close()

    def __repr__(self) -> str:
        return f"Region(id={self.id}, size={self.size})"


def _new_memfd(name: str, size: int) -> tuple[int, mmap.mmap]:
    fd = os.memfd_create(name, os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
    try:
        os.ftruncate(fd, size)
        fcntl.fcntl(fd, fcntl.F_ADD_SEALS, fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW | fcntl.F_SEAL_SEAL)
        return fd, mmap.mmap(fd, size, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ | mmap.PROT_WRITE)
    except BaseException:
        os.close(fd)
        raise


ProgressFn = Callable[[int, int], None]


class Call:
    """A request in flight. ``wait`` returns its DONE."""

    def __init__(self, client: FeedClient, kind: Kind, on_progress: ProgressFn | None) -> None:
        self.client = client
        self.kind = kind
        self.id = 0
        self.on_progress = on_progress
        self.done: Done | None = None
        self.error: FeedError | None = None

    @property
    def finished(self) -> bool:
        return self.done is not None or self.error is not None

    def ready(self, end: int) -> None:
        """Says that input bytes [0, end) of this streamed request are in the
        region (end never goes back; a smaller one is ignored by the server)."""
        self.client._write(_encode(Kind.READY, _U64X2.pack(self.id, end)))

    def wait(self, timeout: float | None = None) -> Done:
        """Waits for DONE (``timeout`` seconds, default: the client's);
        raises :class:`RequestError`/:class:`BridgeError` for a status other
        than OK, :class:`FeedTimeout` at the deadline."""
        self.client._await(lambda: self.finished, self.client._deadline(timeout))
        if self.error is not None:
            raise self.error
        assert self.done is not None
        d = self.done
        if d.status != Status.OK:
            cls = RequestError if d.status == Status.BAD_REQUEST else BridgeError
            raise cls(self.kind, self.id, d.status, d.error)
        return d


# ---- the client ----


class FeedClient:
    """A connection to one ``gbbridge serve``; mirrors lib/feed.Client.

    Create it with :meth:`connect`. Every method that waits takes a
    ``timeout`` in seconds (default: the client's ``timeout``)."""

    def __init__(self, sock: socket.socket, timeout: float, spin: float) -> None:
        self._sock = sock
        self.timeout = timeout
        self.spin = spin
        self.welcome: Welcome | None = None
        self._wlock = threading.Lock()  # writes and request ids
        self._next_id = 0
        self._lock = threading.Lock()
        self._cond = threading.Condition(self._lock)
        self._calls: dict[int, Call] = {}
        self._regions: dict[int, Region] = {}
        self._next_region = 0
        self._err: FeedError | None = None
        self._got_bye = False
        self._reading = False  # a thread reads the socket
        self._rbuf = bytearray()
        self._poll = select.poll()
        self._poll.register(sock.fileno(), select.POLLIN)

    # -- setup --

    @classmethod
    def connect(
        cls,
        path: str | os.PathLike[str],
        timeout: float = 10.0,
        *,
        name: str = "gpubridge",
        request_timeout: float = DEFAULT_TIMEOUT,
        spin: float = 0.0,
    ) -> FeedClient:
        """Connects to the feed socket at path and says HELLO; ``timeout``
        bounds the connection and the handshake. ``request_timeout`` becomes
        the client's default deadline of one wait; ``spin`` (seconds, e.g.
        100e-6) polls the socket without blocking that long before a
        blocking wait (docs/FEED.md §7-8)."""
        deadline = time.monotonic() + timeout
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM | socket.SOCK_CLOEXEC)
        try:
            sock.settimeout(timeout)
            try:
                sock.connect(os.fspath(path))
            except OSError as e:
                raise FeedError(f"gpubridge feed: connect to {os.fspath(path)}: {e}") from e
            sock.setblocking(True)
            sec = int(WRITE_TIMEOUT)
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDTIMEO, struct.pack("@ll", sec, 0))
            c = cls(sock, request_timeout, spin)
            c.hello(deadline, name)
        except BaseException:
            sock.close()
            raise
        return c

    def hello(self, deadline: float, name: str = "gpubridge") -> Welcome:
        """Sends HELLO and reads WELCOME (or ERROR) by ``deadline``
        (time.monotonic()); :meth:`connect` does this."""
        body = struct.pack("<IHHI", MAGIC, MIN_VERSION, VERSION, os.getpid()) + _text(name)
        self._write(_encode(Kind.HELLO, body))
        kind, body = self._read_one(deadline)
        if kind == Kind.ERROR:
            d = _Dec(Kind.ERROR, body)
            (code,) = d.fixed(struct.Struct("<I"))
            raise ProtocolError(f"gpubridge feed: the server refused the feed: {d.text()}", code)
        if kind != Kind.WELCOME:
            raise ProtocolError(f"gpubridge feed: the server answered hello with {_kind_name(kind)}")
        d = _Dec(Kind.WELCOME, body)
        version, zero, member, members, max_msg, max_regions, max_inflight, max_bytes = d.fixed(_WELCOME)
        if zero != 0:
            raise _malformed(Kind.WELCOME, "reserved field is not zero")
        transport = d.text()
        d.exts()
        d.end()
        if not MIN_VERSION <= version <= VERSION:
            raise ProtocolError(
                f"gpubridge feed: server chose protocol version {version}, outside {MIN_VERSION}..{VERSION}"
            )
        self.welcome = Welcome(
            version, member, members, max_msg, max_regions, max_inflight, max_bytes, transport
        )
        return self.welcome

    def _read_one(self, deadline: float) -> tuple[int, bytes]:
        """Reads exactly one message (the handshake: nothing else is in
        flight)."""
        while True:
            if len(self._rbuf) >= HEADER_SIZE:
                size, kind = self._parse_header()
                if len(self._rbuf) >= size:
                    body = bytes(self._rbuf[HEADER_SIZE:size])
                    del self._rbuf[:size]
                    return kind, body
            self._recv(deadline)

    @property
    def member(self) -> int:
        assert self.welcome is not None
        return self.welcome.member

    @property
    def members(self) -> int:
        assert self.welcome is not None
        return self.welcome.members

    # -- socket --

    def _deadline(self, timeout: float | None) -> float:
        return time.monotonic() + (self.timeout if timeout is None else timeout)

    def _write(self, msg: bytes, fds: Sequence[int] = ()) -> None:
        with self._wlock:
            self._write_locked(msg, fds)

    def _write_locked(self, msg: bytes, fds: Sequence[int] = ()) -> None:
        err = self._err
        if err is not None:
            raise err
        try:
            if fds:
                n = socket.send_fds(self._sock, [msg], list(fds))
                if n < len(msg):
                    self._sock.sendall(msg[n:])
            else:
                self._sock.sendall(msg)
        except BlockingIOError as e:  # SO_SNDTIMEO: the server stopped reading
            raise self._fail(FeedError(f"gpubridge feed: write timed out after {WRITE_TIMEOUT:g}s")) from e
        except OSError as e:
            raise self._fail(FeedError(f"gpubridge feed: write: {e}")) from e

    def _recv(self, deadline: float) -> None:
        """Reads what the socket has into the buffer, waiting until deadline;
        raises FeedTimeout, or FeedError at EOF or on a read error."""
        spin_until = time.monotonic() + self.spin if self.spin > 0 else 0.0
        while True:
            try:
                data = self._sock.recv(2 * MAX_MESSAGE, socket.MSG_DONTWAIT)
            except BlockingIOError:
                now = time.monotonic()
                if now < spin_until:
                    continue
                if now >= deadline:
                    raise FeedTimeout("gpubridge feed: timed out waiting for the server") from None
                self._poll.poll(max(1, int((deadline - now) * 1000) + 1))
                continue
            except OSError as e:
                raise FeedError(f"gpubridge feed: read: {e}") from e
            if not data:
                if self._got_bye:
                    raise FeedError("gpubridge feed: client closed")
                raise FeedError("gpubridge feed: the server closed the feed")
            self._rbuf += data
            return

    def _parse_header(self) -> tuple[int, int]:
        size, kind, flags = _HEADER.unpack_from(self._rbuf)
        if flags != 0:
            raise _malformed(kind, f"header flags {flags:#x} are not zero")
        if not HEADER_SIZE <= size <= MAX_MESSAGE:
            raise _malformed(kind, f"size {size} is outside {HEADER_SIZE}..{MAX_MESSAGE}")
        return size, kind

    def _fail(self, err: FeedError) -> FeedError:
        """Makes the feed unusable with err (the first error wins) and
        finishes every call in flight with it; returns the error in force."""
        with self._cond:
            if self._err is None:
                self._err = err
                for k in self._calls.values():
                    k.error = err
                self._calls.clear()
                self._cond.notify_all()
            return self._err

    def _pump(self, deadline: float) -> None:
        """Reads once and handles every whole message. The caller is the
        reading thread."""
        try:
            self._recv(deadline)
        except FeedTimeout:
            raise
        except FeedError as e:
            self._fail(e)
            return
        while len(self._rbuf) >= HEADER_SIZE:
            try:
                size, kind = self._parse_header()
                if len(self._rbuf) < size:
                    return
                body = bytes(self._rbuf[HEADER_SIZE:size])
                del self._rbuf[:size]
                self._handle(kind, body)
            except FeedError as e:
                self._fail(e)
                return

    def _handle(self, kind: int, body: bytes) -> None:
        if kind == Kind.DONE:
            d = _Dec(Kind.DONE, body)
            rid, status, zero, seq, nbytes, queue_us, total_us = d.fixed(_DONE)
            if zero != 0:
                raise _malformed(Kind.DONE, "reserved field is not zero")
            text = d.text()
            d.exts()
            d.end()
            try:
                st = Status(status)
            except ValueError:
                raise _malformed(Kind.DONE, f"unknown status {status}") from None
            with self._cond:
                k = self._calls.pop(rid, None)
                if k is None:
                    raise ProtocolError(
                        f"gpubridge feed: the server finished request {rid}, which is not in flight"
                    )
                k.done = Done(rid, st, seq, nbytes, queue_us, total_us, text)
                self._cond.notify_all()
        elif kind == Kind.PROGRESS:
            d = _Dec(Kind.PROGRESS, body)
            rid, off, n = d.fixed(_U64X3)
            d.end()
            with self._lock:
                k = self._calls.get(rid)
            if k is not None and k.on_progress is not None:
                k.on_progress(off, n)
        elif kind == Kind.ERROR:
            d = _Dec(Kind.ERROR, body)
            (code,) = d.fixed(struct.Struct("<I"))
            text = d.text()
            d.end()
            raise ProtocolError(f"gpubridge feed: the server closed the feed: {text}", code)
        elif kind == Kind.BYE:
            _Dec(Kind.BYE, body).end()
            with self._lock:
                self._got_bye = True
        else:
            raise ProtocolError(f"gpubridge feed: unexpected {_kind_name(kind)} message from the server")

    def _await(self, cond: Callable[[], bool], deadline: float) -> None:
        """Returns once cond() holds (checked under the lock) or the feed
        failed; reads the socket meanwhile whenever no other thread does."""
        with self._cond:
            while True:
                if cond() or self._err is not None:
                    return
                if not self._reading:
                    self._reading = True
                    break
                left = deadline - time.monotonic()
                if left <= 0:
                    raise FeedTimeout("gpubridge feed: timed out waiting for the server")
                self._cond.wait(left)
        try:
            while True:
                with self._lock:
                    if cond() or self._err is not None:
                        return
                self._pump(deadline)
        finally:
            with self._cond:
                self._reading = False
                self._cond.notify_all()

    def pump(self, timeout: float) -> None:
        """Handles the messages that arrive within timeout seconds (so that
        PROGRESS callbacks run while the caller is busy feeding a streamed
        request), unless another thread is reading the socket. Never raises
        FeedTimeout; a broken feed shows in :attr:`error` and in the next
        wait."""
        with self._cond:
            if self._reading or self._err is not None:
                return
            self._reading = True
        try:
            with contextlib.suppress(FeedTimeout):
                self._pump(time.monotonic() + timeout)
        finally:
            with self._cond:
                self._reading = False
                self._cond.notify_all()

    # -- requests --

    def _send(self, call: Call | None, msg: Callable[[int], bytes], fds: Sequence[int] = ()) -> int:
        """Writes a message carrying the next request id; registers call first
        so that its DONE finds it."""
        with self._wlock:
            self._next_id += 1
            rid = self._next_id
            if call is not None:
                call.id = rid
                with self._lock:
                    if self._err is not None:
                        raise self._err
                    self._calls[rid] = call
            try:
                self._write_locked(msg(rid), fds)
            except FeedError:
                if call is not None:
                    with self._lock:
                        self._calls.pop(rid, None)
                raise
            return rid

    def start(
        self,
        kind: Kind,
        buf: Span = Span(),
        out: Span = Span(),
        *,
        dtype: DType | int | str | None = None,
        op: Op | int | str = Op.NONE,
        peer: int = -1,
        tag: int = 0,
        streamed: bool = False,
        on_progress: ProgressFn | None = None,
    ) -> Call:
        """Sends a request and returns its :class:`Call`. With ``streamed``,
        send :meth:`Call.ready` as input becomes ready; ``on_progress(off, n)``
        gets each PROGRESS range on the thread that reads the socket (it must
        not block)."""
        if kind < Kind.ALL_REDUCE:
            raise ValueError(f"gpubridge feed: {kind} is not a request")
        dt, o = DType.of(dtype), Op.of(op)
        flags = FLAG_STREAMED if streamed else 0

        def enc(rid: int) -> bytes:
            return _encode(
                kind,
                _REQUEST.pack(
                    rid, dt, o, 0, 0, flags, buf.region, out.region,
                    buf.offset, buf.nbytes, out.offset, out.nbytes, peer, tag,
                ),
            )  # fmt: skip

        k = Call(self, kind, on_progress)
        self._send(k, enc)
        return k

    def request(self, kind: Kind, timeout: float | None = None, **kw: Any) -> Done:
        """Sends a request and waits for its DONE."""
        return self.start(kind, **kw).wait(timeout)

    def map_region(self, size: int, timeout: float | None = None) -> Region:
        """Creates a region of ``size`` bytes (a sealed memfd mapped here),
        sends it to the server and waits until the server has mapped it."""
        if size <= 0:
            raise ValueError("gpubridge feed: a region needs at least one byte")
        with self._lock:
            self._next_region += 1
            rid = self._next_region
        fd, mem = _new_memfd(f"gpubridge-feed-{rid}", size)
        try:
            k = Call(self, Kind.REGION, None)
            self._send(k, lambda i: _encode(Kind.REGION, struct.pack("<QIIQ", i, rid, 0, size)), [fd])
            k.wait(timeout)
        except BaseException:
            mem.close()
            raise
        finally:
            os.close(fd)  # the server holds its own mapping now
        r = Region(rid, size, mem)
        with self._lock:
            self._regions[rid] = r
        return r

    def release(self, region: Region, timeout: float | None = None) -> None:
        """Asks the server to unmap region once no request uses it, waits,
        and unmaps the client's view."""
        k = Call(self, Kind.RELEASE, None)
        self._send(k, lambda i: _encode(Kind.RELEASE, struct.pack("<QI", i, region.id)))
        k.wait(timeout)
        with self._lock:
            self._regions.pop(region.id, None)
        region._unmap()

    def all_reduce(
        self,
        region: Region,
        offset: int,
        nbytes: int,
        dtype: DType | int | str,
        op: Op | int | str,
        *,
        timeout: float | None = None,
    ) -> Done:
        """Reduces bytes [offset, offset+nbytes) of region in place across the
        bridge members; the input must be in place."""
        return self.request(Kind.ALL_REDUCE, timeout, buf=region.span(offset, nbytes), dtype=dtype, op=op)

    def start_all_reduce(
        self,
        region: Region,
        offset: int,
        nbytes: int,
        dtype: DType | int | str,
        op: Op | int | str,
        on_progress: ProgressFn | None = None,
    ) -> Call:
        """Starts a streamed all_reduce: call ``ready(end)`` as input bytes
        [offset, offset+end) come in; ``on_progress(off, n)`` says which
        result bytes (relative to offset) are final; ``wait()`` ends it."""
        return self.start(
            Kind.ALL_REDUCE, region.span(offset, nbytes), dtype=dtype, op=op,
            streamed=True, on_progress=on_progress,
        )  # fmt: skip

    def broadcast(
        self,
        region: Region,
        offset: int,
        nbytes: int,
        root: int,
        *,
        timeout: float | None = None,
    ) -> Done:
        """Copies member root's bytes into every member's, in place."""
        return self.request(Kind.BROADCAST, timeout, buf=region.span(offset, nbytes), peer=root)

    def all_gather(
        self, out: Span, inp: Span, dtype: DType | int | str | None = None, *, timeout: float | None = None
    ) -> Done:
        """Concatenates every member's inp into out (members x inp.nbytes), in
        member order."""
        return self.request(Kind.ALL_GATHER, timeout, buf=inp, out=out, dtype=dtype)

    def reduce_scatter(
        self,
        out: Span,
        inp: Span,
        dtype: DType | int | str,
        op: Op | int | str,
        *,
        timeout: float | None = None,
    ) -> Done:
        """Reduces inp (members x out.nbytes) across members and leaves this
        member's share in out."""
        return self.request(Kind.REDUCE_SCATTER, timeout, buf=inp, out=out, dtype=dtype, op=op)

    def barrier(self, timeout: float | None = None) -> Done:
        return self.request(Kind.BARRIER, timeout)

    def send(
        self, region: Region, offset: int, nbytes: int, peer: int, tag: int = 0,
        *, timeout: float | None = None,
    ) -> Done:  # fmt: skip
        """Sends the bytes to member peer with tag."""
        return self.request(Kind.SEND, timeout, buf=region.span(offset, nbytes), peer=peer, tag=tag)

    def recv(
        self, region: Region, offset: int, nbytes: int, peer: int, tag: int = 0,
        *, timeout: float | None = None,
    ) -> int:  # fmt: skip
        """Receives the next message from member peer with tag into the
        bytes; returns its length."""
        return self.request(Kind.RECV, timeout, buf=region.span(offset, nbytes), peer=peer, tag=tag).nbytes

    # -- closing --

    @property
    def error(self) -> FeedError | None:
        """Why the feed is unusable, or None."""
        return self._err

    def close(self, timeout: float = 10.0) -> None:
        """Says BYE, waits (up to timeout) for the server's BYE, which comes
        once every request in flight is DONE, then closes the socket and
        unmaps the regions. Raises FeedError if the server did not say BYE."""
        deadline = time.monotonic() + timeout
        err: FeedError | None = None
        try:
            self._write(_encode(Kind.BYE, b""))
            self._sock.shutdown(socket.SHUT_WR)
            self._await(lambda: False, deadline)
        except FeedError as e:
            err = e
        except OSError as e:
            err = FeedError(f"gpubridge feed: close: {e}")
        with self._lock:
            bye = self._got_bye
        self._fail(FeedError("gpubridge feed: client closed"))
        self._shutdown()
        if not bye:
            if err is None:
                err = self._err
            raise FeedError(f"gpubridge feed: the server closed the feed without bye ({err})")

    def abort(self) -> None:
        """Closes the feed at once, without BYE, as a crashing client would;
        the server aborts the bridge. Calls in flight fail."""
        self._fail(FeedError("gpubridge feed: client aborted"))
        self._shutdown()

    def _shutdown(self) -> None:
        with contextlib.suppress(OSError):
            self._sock.shutdown(socket.SHUT_RDWR)  # wakes a thread in poll
        deadline = time.monotonic() + 5
        with self._cond:
            while self._reading and time.monotonic() < deadline:
                self._cond.wait(0.05)
            regions = list(self._regions.values())
            self._regions.clear()
        self._sock.close()
        for r in regions:
            r._unmap()

    def __enter__(self) -> FeedClient:
        return self

    def __exit__(self, *exc: object) -> None:
        if exc[0] is None:
            self.close()
        else:
            self.abort()


# ---- spawning gbbridge serve ----

_PR_SET_PDEATHSIG: Final = 1


def _die_with_parent(parent: int) -> Callable[[], None]:
    """A preexec_fn: SIGTERM when the parent dies. PR_SET_PDEATHSIG follows
    the thread that forked: spawn from a thread that lives as long as the
    job (the main thread)."""

    def pre() -> None:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(_PR_SET_PDEATHSIG, signal.SIGTERM, 0, 0, 0)
        if os.getppid() != parent:  # the parent died before prctl
            os._exit(1)

    return pre


@dataclass
class BridgeProcess:
    """A running ``gbbridge serve`` and its ready line."""

    proc: subprocess.Popen[bytes]
    ready: dict[str, Any]
    feed: str
    stderr_file: IO[bytes] = field(repr=False)

    @property
    def member(self) -> int:
        return int(self.ready["member"])

    def wait_ready(self, timeout: float = 90.0) -> dict[str, Any]:
        """Reads the ready line (printed once the bridge is up) by the
        deadline. On failure the child is killed and FeedError carries its
        stderr."""
        proc = self.proc
        assert proc.stdout is not None
        deadline = time.monotonic() + timeout
        line = b""
        try:
            fd = proc.stdout.fileno()
            while b"\n" not in line:
                left = deadline - time.monotonic()
                if left <= 0:
                    raise FeedTimeout(f"gpubridge: gbbridge serve printed no ready line within {timeout:g}s")
                r, _, _ = select.select([fd], [], [], left)
                if not r:
                    continue
                chunk = os.read(fd, 4096)
                if not chunk:
                    rc = proc.wait(5)
                    raise FeedError(f"gpubridge: gbbridge serve exited {rc}: {self.stderr().strip()}")
                line += chunk
                if len(line) > MAX_MESSAGE:
                    raise FeedError("gpubridge: gbbridge serve's ready line is too long")
            ready = json.loads(line.split(b"\n", 1)[0])
            if not isinstance(ready, dict) or ready.get("schema") != "gpubridge.bridge-serve/v1":
                raise FeedError(f"gpubridge: unexpected ready line from gbbridge serve: {line!r}")
        except BaseException as e:
            msg = self.stderr().strip()
            self.kill()
            if isinstance(e, FeedError) or not msg:
                raise
            raise FeedError(f"gpubridge: gbbridge serve failed: {e}: {msg}") from e
        # Nothing else is ever printed; the pipe stays open so that the
        # child never gets SIGPIPE.
        self.ready = ready
        return ready

    def stderr(self) -> str:
        """What the process wrote on stderr so far."""
        self.stderr_file.seek(0)
        return self.stderr_file.read().decode("utf-8", "replace")

    def wait(self, timeout: float = 10.0) -> int:
        """Waits for the exit (after the client's close); kills it at the
        deadline and raises FeedTimeout."""
        try:
            rc = self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.kill()
            raise FeedTimeout(f"gpubridge: gbbridge serve (pid {self.proc.pid}) did not exit") from None
        self._close_pipe()
        return rc

    def terminate(self, timeout: float = 5.0) -> int:
        """SIGTERM, then SIGKILL after timeout; returns the exit status."""
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.kill()
        self._close_pipe()
        return self.proc.wait()

    def kill(self) -> None:
        """SIGKILL (if it still runs) and reap."""
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait()
        self._close_pipe()

    def _close_pipe(self) -> None:
        if self.proc.stdout is not None:
            self.proc.stdout.close()


def start_bridge(
    topology: str | os.PathLike[str],
    feed: str | os.PathLike[str],
    *,
    gbbridge: str | os.PathLike[str] = "gbbridge",
    args: Sequence[str] = (),
    env: Mapping[str, str] | None = None,
) -> BridgeProcess:
    """Starts ``gbbridge serve --topology TOPOLOGY --feed FEED ARGS``; call
    :meth:`BridgeProcess.wait_ready` next. The child gets SIGTERM when the
    thread that called this dies (PR_SET_PDEATHSIG follows the thread that
    forked): call it from a thread that lives as long as the job."""
    cmd = [os.fspath(gbbridge), "serve", "--topology", os.fspath(topology), "--feed", os.fspath(feed)]
    cmd += list(args)
    errf = tempfile.TemporaryFile()  # noqa: SIM115 (the BridgeProcess owns it)
    try:
        proc = subprocess.Popen(
            cmd,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=errf,
            env=None if env is None else dict(env),
            preexec_fn=_die_with_parent(os.getpid()),  # noqa: PLW1509 (the point of it)
            close_fds=True,
        )
    except BaseException:
        errf.close()
        raise
    return BridgeProcess(proc, {}, os.fspath(feed), errf)


def spawn_bridge(
    topology: str | os.PathLike[str],
    feed: str | os.PathLike[str],
    *,
    gbbridge: str | os.PathLike[str] = "gbbridge",
    args: Sequence[str] = (),
    env: Mapping[str, str] | None = None,
    timeout: float = 90.0,
) -> BridgeProcess:
    """:func:`start_bridge`, then :meth:`BridgeProcess.wait_ready`. The ready
    line comes once the bridge is up, so with several members on one host
    start them all before waiting for any."""
    bp = start_bridge(topology, feed, gbbridge=gbbridge, args=args, env=env)
    bp.wait_ready(timeout)
    return bp
