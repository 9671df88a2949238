"""Client of the feed protocol of ``gbbridge serve`` (docs/FEED.md, versions 1
to 4).

The plugin puts a tensor's bytes in a shared-memory :class:`Region` (a sealed
memfd that ``gbbridge serve`` maps too) and asks for a collective over the
control socket; gbbridge runs it over the bridge, in place, and answers DONE.
This module mirrors ``lib/feed/feedtest.Client`` (Go, the reference client); the wire
format is :mod:`gpubridge._feed_protocol`, whose names a caller needs are
exported here too. Whether a request makes sense (spans, dtypes, ops, roots)
is the server's to check: it answers DONE with a bad-request status, raised
here as :class:`RequestError`.

Every wait has a deadline. The thread that waits for a reply reads the socket
itself (``poll`` then a non-blocking ``recv``), and hands the replies of other
threads' requests to them, so the client is safe to use from several threads.
"""

from __future__ import annotations

import contextlib
import fcntl
import mmap
import os
import select
import socket
import struct
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any, Final

import numpy as np
import numpy.typing as npt

from gpubridge._feed_protocol import (
    BRIDGES_VERSION,
    CALLER_REDUCES_VERSION,
    CODEC_VERSION,
    FLAG_CALLER_REDUCES,
    FLAG_STREAMED,
    HEADER_SIZE,
    MAX_MESSAGE,
    MIN_VERSION,
    VERSION,
    BridgeError,
    Codec,
    Done,
    DType,
    FeedError,
    FeedTimeout,
    Kind,
    Op,
    ProtocolError,
    RequestError,
    Span,
    Status,
    Welcome,
    decode_bye,
    decode_done,
    decode_error,
    decode_progress,
    decode_welcome,
    encode_bye,
    encode_hello,
    encode_join,
    encode_ready,
    encode_region,
    encode_release,
    encode_request,
    kind_name,
    parse_header,
)

# With the protocol's names that the client's callers pass and catch.
__all__ = [
    "BridgeError",
    "Call",
    "Codec",
    "DType",
    "Done",
    "FeedClient",
    "FeedError",
    "FeedTimeout",
    "Kind",
    "Op",
    "ProgressFn",
    "ProtocolError",
    "Region",
    "RequestError",
    "Span",
    "Status",
    "Welcome",
]

WRITE_TIMEOUT: Final = 60.0  # seconds, like the server's write deadline
DEFAULT_TIMEOUT: Final = 360.0  # one request: above gbbridge serve's --timeout=5m
# The collectives whose waits spin FeedClient.tiny_spin: those that move at
# most this many bytes (gbbridge serve's feedserver.TinyCallBytes).
TINY_CALL_BYTES: Final = 64 << 10


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
DTypeArg = DType | int | str  # what DType.of takes
OpArg = Op | int | str  # what Op.of takes


class Call:
    """A request in flight. ``wait`` returns its DONE."""

    def __init__(self, client: FeedClient, kind: Kind, on_progress: ProgressFn | None, spin: float) -> None:
        self.client = client
        self.kind = kind
        self.spin = spin  # how long a wait for its answer spins (seconds)
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
        self.client._write(encode_ready(self.id, end))

    def join(self, timeout: float | None = None) -> None:
        """Waits until the request finished, whatever its outcome (which
        :meth:`wait` raises); :class:`FeedTimeout` at the deadline."""
        self.client._await(lambda: self.finished, self.client._deadline(timeout), self.spin)

    def wait(self, timeout: float | None = None) -> Done:
        """Waits for DONE (``timeout`` seconds, default: the client's);
        raises :class:`RequestError`/:class:`BridgeError` for a status other
        than OK, :class:`FeedTimeout` at the deadline."""
        self.client._await(lambda: self.finished, self.client._deadline(timeout), self.spin)
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
    """A connection to one ``gbbridge serve``; mirrors lib/feed/feedtest.Client.

    Create it with :meth:`connect`. Every method that waits takes a
    ``timeout`` in seconds (default: the client's ``timeout``)."""

    def __init__(
        self, sock: socket.socket, timeout: float, spin: float, tiny_spin: float | None = None
    ) -> None:
        self._sock = sock
        self.timeout = timeout
        self.spin = spin
        self.tiny_spin = spin if tiny_spin is None else tiny_spin
        self.welcome: Welcome | None = None
        self._wlock = threading.Lock()  # writes and request ids
        self._next_id = 0
        self._lock = threading.Lock()
        # Waiters take _cond's lock as `with self._lock` (the same lock):
        # a Condition's own __enter__ is a Python call on every request.
        self._cond = threading.Condition(self._lock)
        self._waiting = 0  # threads in _cond.wait (notify only when some are)
        self._calls: dict[int, Call] = {}
        self._regions: dict[int, Region] = {}
        self._next_region = 0
        self._err: FeedError | None = None
        self._got_bye = False
        self._reading = False  # a thread reads the socket
        self._rbuf = bytearray()
        # What one read takes: a buffer kept, not a new bytes object of
        # 128 KiB per read.
        self._rscratch = bytearray(2 * MAX_MESSAGE)
        self._rview = memoryview(self._rscratch)
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
        tiny_spin: float | None = None,
    ) -> FeedClient:
        """Connects to the feed socket at path and says HELLO; ``timeout``
        bounds the connection and the handshake. ``request_timeout`` becomes
        the client's default deadline of one wait; ``spin`` (seconds, e.g.
        100e-6) polls the socket without blocking that long before a
        blocking wait (docs/FEED.md §7-8), ``tiny_spin`` (default: spin)
        instead in the waits for collectives of at most TINY_CALL_BYTES."""
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
            c = cls(sock, request_timeout, spin, tiny_spin)
            c.hello(deadline, name)
        except BaseException:
            sock.close()
            raise
        return c

    def hello(self, deadline: float, name: str = "gpubridge") -> Welcome:
        """Sends HELLO and reads WELCOME (or ERROR) by ``deadline``
        (time.monotonic()); :meth:`connect` does this."""
        self._write(encode_hello(os.getpid(), name))
        kind, body = self._read_one(deadline)
        if kind == Kind.ERROR:
            code, text = decode_error(body, whole=False)
            raise ProtocolError(f"gpubridge feed: the server refused the feed: {text}", code)
        if kind != Kind.WELCOME:
            raise ProtocolError(f"gpubridge feed: the server answered hello with {kind_name(kind)}")
        w = decode_welcome(body)
        if not MIN_VERSION <= w.version <= VERSION:
            raise ProtocolError(
                f"gpubridge feed: server chose protocol version {w.version}, outside {MIN_VERSION}..{VERSION}"
            )
        self.welcome = w
        return w

    def _read_one(self, deadline: float) -> tuple[int, bytes]:
        """Reads exactly one message (the handshake: nothing else is in
        flight)."""
        while True:
            if len(self._rbuf) >= HEADER_SIZE:
                size, kind = parse_header(self._rbuf)
                if len(self._rbuf) >= size:
                    body = bytes(self._rbuf[HEADER_SIZE:size])
                    del self._rbuf[:size]
                    return kind, body
            self._recv(deadline, self.spin)

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

    def _recv(self, deadline: float, spin: float) -> None:
        """Reads what the socket has into the buffer, waiting until deadline
        (spinning first for spin seconds); raises FeedTimeout, or FeedError
        at EOF or on a read error."""
        spin_until = time.monotonic() + spin if spin > 0 else 0.0
        while True:
            try:
                n = self._sock.recv_into(self._rscratch, 0, socket.MSG_DONTWAIT)
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
            if not n:
                if self._got_bye:
                    raise FeedError("gpubridge feed: client closed")
                raise FeedError("gpubridge feed: the server closed the feed")
            self._rbuf += self._rview[:n]
            return

    def _fail(self, err: FeedError) -> FeedError:
        """Makes the feed unusable with err (the first error wins) and
        finishes every call in flight with it; returns the error in force."""
        with self._lock:
            if self._err is None:
                self._err = err
                for k in self._calls.values():
                    k.error = err
                self._calls.clear()
                self._wake()
            return self._err

    def _pump(self, deadline: float, spin: float) -> None:
        """Reads once and handles every whole message. The caller is the
        reading thread."""
        try:
            self._recv(deadline, spin)
        except FeedTimeout:
            raise
        except FeedError as e:
            self._fail(e)
            return
        while len(self._rbuf) >= HEADER_SIZE:
            try:
                size, kind = parse_header(self._rbuf)
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
            done = decode_done(body)
            with self._lock:
                k = self._calls.pop(done.request_id, None)
                if k is None:
                    raise ProtocolError(
                        f"gpubridge feed: the server finished request {done.request_id}, "
                        "which is not in flight"
                    )
                k.done = done
                self._wake()
        elif kind == Kind.PROGRESS:
            rid, off, n = decode_progress(body)
            with self._lock:
                k = self._calls.get(rid)
            if k is not None and k.on_progress is not None:
                k.on_progress(off, n)
        elif kind == Kind.ERROR:
            code, text = decode_error(body)
            raise ProtocolError(f"gpubridge feed: the server closed the feed: {text}", code)
        elif kind == Kind.BYE:
            decode_bye(body)
            with self._lock:
                self._got_bye = True
        else:
            raise ProtocolError(f"gpubridge feed: unexpected {kind_name(kind)} message from the server")

    def _wait(self, timeout: float) -> None:
        """_cond.wait, counted; the caller holds the lock."""
        self._waiting += 1
        try:
            self._cond.wait(timeout)
        finally:
            self._waiting -= 1

    def _wake(self) -> None:
        """_cond.notify_all when a thread waits (a Condition's notify costs
        microseconds even with none, on every request); the caller holds
        the lock."""
        if self._waiting:
            self._cond.notify_all()

    def _await(self, cond: Callable[[], bool], deadline: float, spin: float | None = None) -> None:
        """Returns once cond() holds (checked under the lock) or the feed
        failed; reads the socket meanwhile whenever no other thread does,
        spinning spin seconds (default: the client's) before each sleep."""
        spin = self.spin if spin is None else spin
        with self._lock:
            while True:
                if cond() or self._err is not None:
                    return
                if not self._reading:
                    self._reading = True
                    break
                left = deadline - time.monotonic()
                if left <= 0:
                    raise FeedTimeout("gpubridge feed: timed out waiting for the server")
                self._wait(left)
        try:
            while True:
                with self._lock:
                    if cond() or self._err is not None:
                        return
                self._pump(deadline, spin)
        finally:
            with self._lock:
                self._reading = False
                self._wake()

    def pump(self, timeout: float) -> None:
        """Handles the messages that arrive within timeout seconds (so that
        PROGRESS callbacks run while the caller is busy feeding a streamed
        request), unless another thread is reading the socket. Never raises
        FeedTimeout; a broken feed shows in :attr:`error` and in the next
        wait."""
        with self._lock:
            if self._reading or self._err is not None:
                return
            self._reading = True
        try:
            with contextlib.suppress(FeedTimeout):
                self._pump(time.monotonic() + timeout, self.spin)
        finally:
            with self._lock:
                self._reading = False
                self._wake()

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
        dtype: DTypeArg | None = None,
        op: OpArg = Op.NONE,
        peer: int = -1,
        tag: int = 0,
        streamed: bool = False,
        caller_reduces: bool = False,
        codec: Codec = Codec.RAW,
        feedback_key: int | None = None,
        bridge: int | None = None,
        on_progress: ProgressFn | None = None,
    ) -> Call:
        """Sends a request and returns its :class:`Call`. With ``streamed``,
        send :meth:`Call.ready` as input becomes ready; ``on_progress(off, n)``
        gets each PROGRESS range on the thread that reads the socket (it must
        not block). ``caller_reduces`` (all_reduce, version 2) asks for the
        inputs unreduced (see :meth:`start_exchange`). ``codec`` packs the
        bridged transfers and ``feedback_key`` names the residual of a lossy
        all_reduce (version 3, docs/FEED.md §3a); ``bridge`` runs it on a
        bridge this feed JOINed (version 4, §3b; None: bridge 0). What a
        server of an older version does not speak is refused here, before
        anything is sent."""
        if kind < Kind.ALL_REDUCE:
            raise ValueError(f"gpubridge feed: {kind} is not a request")
        dt, o = DType.of(dtype), Op.of(op)
        c = codec if type(codec) is Codec else Codec(codec)
        if (c != Codec.RAW or feedback_key is not None) and not self.codecs:
            what = f"codec {c.versioned}" if c != Codec.RAW else "an error-feedback key"
            raise FeedError(
                f"gpubridge feed: {what} needs feed protocol {CODEC_VERSION}; this gbbridge serve speaks "
                f"version {self.version} (compression needs a gbbridge that speaks {CODEC_VERSION})"
            )
        if bridge is not None and not self.bridges:
            raise FeedError(self._needs_bridges(f"bridge {bridge}"))
        flags = (FLAG_STREAMED if streamed else 0) | (FLAG_CALLER_REDUCES if caller_reduces else 0)

        tiny = max(buf.nbytes, out.nbytes) <= TINY_CALL_BYTES
        k = Call(self, kind, on_progress, self.tiny_spin if tiny else self.spin)
        self._send(
            k,
            lambda rid: encode_request(kind, rid, dt, o, flags, buf, out, peer, tag, c, feedback_key, bridge),
        )
        return k

    def _needs_bridges(self, what: str) -> str:
        return (
            f"gpubridge feed: {what} needs feed protocol {BRIDGES_VERSION} (more bridges on one feed); "
            f"this gbbridge serve speaks version {self.version}: use the gbbridge of this gpubridge"
        )

    def start_join(self, bridge: int, name: str, members: Sequence[int]) -> Call:
        """Sends JOIN (version 4, docs/FEED.md §3b): this feed's gbbridge
        joins the bridge called name, whose members are these ranks of the
        topology in member order, as bridge id bridge (ids are the
        client's: 1 … 2^31, one per bridge). Its DONE comes once every
        member joined and the mesh is up; wait() raises
        :class:`RequestError` for a JOIN refused before anything (status
        1) and :class:`BridgeError` for a set-up that failed (status 2:
        the message names the member and the step)."""
        if not self.bridges:
            raise FeedError(self._needs_bridges(f"joining bridge {name}"))
        k = Call(self, Kind.JOIN, None, self.spin)
        self._send(k, lambda rid: encode_join(rid, bridge, name, members))
        return k

    def join(self, bridge: int, name: str, members: Sequence[int], timeout: float | None = None) -> Done:
        """JOIN and wait for its DONE (see :meth:`start_join`)."""
        return self.start_join(bridge, name, members).wait(timeout)

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
            k = Call(self, Kind.REGION, None, self.spin)
            self._send(k, lambda i: encode_region(i, rid, size), [fd])
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
        k = Call(self, Kind.RELEASE, None, self.spin)
        self._send(k, lambda i: encode_release(i, region.id))
        k.wait(timeout)
        with self._lock:
            self._regions.pop(region.id, None)
        region._unmap()

    def all_reduce(
        self, region: Region, offset: int, nbytes: int, dtype: DTypeArg, op: OpArg,
        *, timeout: float | None = None, codec: Codec = Codec.RAW, feedback_key: int | None = None,
    ) -> Done:  # fmt: skip
        """Reduces bytes [offset, offset+nbytes) of region in place across the
        bridge members; the input must be in place. codec, feedback_key:
        see :meth:`start`."""
        return self.request(
            Kind.ALL_REDUCE, timeout, buf=region.span(offset, nbytes), dtype=dtype, op=op,
            codec=codec, feedback_key=feedback_key,
        )  # fmt: skip

    def start_all_reduce(
        self, region: Region, offset: int, nbytes: int, dtype: DTypeArg, op: OpArg,
        on_progress: ProgressFn | None = None, *, codec: Codec = Codec.RAW, feedback_key: int | None = None,
    ) -> Call:  # fmt: skip
        """Starts a streamed all_reduce: call ``ready(end)`` as input bytes
        [offset, offset+end) come in; ``on_progress(off, n)`` says which
        result bytes (relative to offset) are final; ``wait()`` ends it."""
        return self.start(
            Kind.ALL_REDUCE, region.span(offset, nbytes), dtype=dtype, op=op,
            streamed=True, on_progress=on_progress, codec=codec, feedback_key=feedback_key,
        )  # fmt: skip

    @property
    def version(self) -> int:
        """The feed protocol version the server chose (0 before WELCOME)."""
        return self.welcome.version if self.welcome is not None else 0

    @property
    def caller_reduces(self) -> bool:
        """Whether the server speaks the "exchange, reduce on the caller"
        all_reduce (feed protocol 2)."""
        return self.version >= CALLER_REDUCES_VERSION

    @property
    def bridges(self) -> bool:
        """Whether the server joins more bridges (JOIN, the BRIDGE
        extension: feed protocol 4)."""
        return self.version >= BRIDGES_VERSION

    @property
    def codecs(self) -> bool:
        """Whether the server takes codecs other than raw and error-feedback
        keys (feed protocol 3)."""
        return self.version >= CODEC_VERSION

    def start_exchange(
        self, inp: Span, out: Span, dtype: DTypeArg, op: OpArg, *,
        streamed: bool = True, on_progress: ProgressFn | None = None, codec: Codec = Codec.RAW,
    ) -> Call:  # fmt: skip
        """Starts an all_reduce whose reduction is the caller's (feed
        protocol 2): the bridge exchanges every member's inp unreduced into
        out (members x inp.nbytes, member m's in slot m; inp may be this
        member's own slot) and the caller combines the slots in the
        documented order. Streamed: ``ready(end)`` as bytes [0, end) of inp
        come in; ``on_progress(off, n)`` names bytes of out that arrived.
        codec (version 3): zstd packs the frames; with bf16 or fp8, inp holds
        this member's packed values, which the caller decodes and sums."""
        return self.start(
            Kind.ALL_REDUCE, inp, out, dtype=dtype, op=op, streamed=streamed,
            caller_reduces=True, on_progress=on_progress, codec=codec,
        )  # fmt: skip

    def broadcast(
        self, region: Region, offset: int, nbytes: int, root: int, *,
        timeout: float | None = None, dtype: DTypeArg | None = None, codec: Codec = Codec.RAW,
    ) -> Done:  # fmt: skip
        """Copies member root's bytes (of dtype, optional) into every
        member's, in place."""
        return self.request(
            Kind.BROADCAST, timeout, buf=region.span(offset, nbytes), peer=root, dtype=dtype, codec=codec
        )

    def all_gather(
        self, out: Span, inp: Span, dtype: DTypeArg | None = None, *,
        timeout: float | None = None, codec: Codec = Codec.RAW,
    ) -> Done:  # fmt: skip
        """Concatenates every member's inp into out (members x inp.nbytes), in
        member order."""
        return self.request(Kind.ALL_GATHER, timeout, buf=inp, out=out, dtype=dtype, codec=codec)

    def reduce_scatter(
        self, out: Span, inp: Span, dtype: DTypeArg, op: OpArg, *,
        timeout: float | None = None, codec: Codec = Codec.RAW,
    ) -> Done:  # fmt: skip
        """Reduces inp (members x out.nbytes) across members and leaves this
        member's share in out."""
        return self.request(Kind.REDUCE_SCATTER, timeout, buf=inp, out=out, dtype=dtype, op=op, codec=codec)

    def barrier(self, timeout: float | None = None) -> Done:
        return self.request(Kind.BARRIER, timeout)

    def send(
        self, region: Region, offset: int, nbytes: int, peer: int, tag: int = 0,
        *, timeout: float | None = None, bridge: int | None = None,
    ) -> Done:  # fmt: skip
        """Sends the bytes to member peer (of bridge; None: bridge 0) with
        tag."""
        return self.request(
            Kind.SEND, timeout, buf=region.span(offset, nbytes), peer=peer, tag=tag, bridge=bridge
        )

    def recv(
        self, region: Region, offset: int, nbytes: int, peer: int, tag: int = 0,
        *, timeout: float | None = None, bridge: int | None = None,
    ) -> int:  # fmt: skip
        """Receives the next message from member peer (of bridge; None:
        bridge 0) with tag into the bytes; returns its length."""
        d = self.request(
            Kind.RECV, timeout, buf=region.span(offset, nbytes), peer=peer, tag=tag, bridge=bridge
        )
        return d.nbytes

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
            self._write(encode_bye())
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
        with self._lock:
            while self._reading and time.monotonic() < deadline:
                self._wait(0.05)
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
