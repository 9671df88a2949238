"""The flight recorder, trace files, dumps and observers (docs/TRACING.md).

Every collective that ends goes through :func:`finish` (from the group's
worker). On every rank, tracing on or off, the last GPUBRIDGE_TRACE_BUFFER
(default 2000; 0: none) are kept in a ring, as the entry they ran with:
a deque append, no record built. A dump (:func:`dump`: on a failed or
timed-out collective, on SIGUSR1, on :func:`gpubridge.dump_trace`) writes
them as records, with what is in flight, to GPUBRIDGE_TRACE_DUMP_DIR.

With GPUBRIDGE_TRACE=DIR each collective's record is also written to
DIR/rank-<r>.jsonl (buffered: flushed every 512 records or second, at exit,
and on failure). Observers (:mod:`gpubridge.observe`) get the record of
every collective while any is attached; they must not communicate, and a
failing one is detached.
"""

from __future__ import annotations

import atexit
import collections
import contextlib
import json
import logging
import os
import signal
import socket
import sys
import tempfile
import threading
import time
import warnings
from pathlib import Path
from typing import Any

from gpubridge import _clock
from gpubridge import _inflight as fl
from gpubridge._record import SCHEMA, CollectiveRecord, GroupInfo, StepRecord, ns

__all__ = [
    "GroupInfo",
    "add_observer",
    "attach",
    "dump",
    "dump_dir",
    "finish",
    "in_callback",
    "remove_observer",
    "trace_dir",
]

log = logging.getLogger("gpubridge")

_FLUSH_RECORDS = 512
_FLUSH_S = 1.0
_READY_WAIT_S = 5.0  # at exit, for the device times of the last GPU records


def _buffer_size() -> int:
    try:
        return max(0, int(os.environ.get("GPUBRIDGE_TRACE_BUFFER", "2000")))
    except ValueError:
        return 2000


def trace_dir() -> Path | None:
    d = os.environ.get("GPUBRIDGE_TRACE", "")
    return Path(d) if d else None


_lock = threading.Lock()  # attach, dumps, the writer's file
_ring: collections.deque[fl.Entry] | None = None
_groups: dict[str, GroupInfo] = {}
_rank: int | None = None
_clock_of: _clock.Clock | None = None
_writer: _Writer | None = None
_dumps = 0
_hardware: dict[str, Any] | None = None  # the first group's layout.hardware, for the headers
_steps = 0  # training steps marked (gpubridge.observe.step)

# Observers (gpubridge.observe), and how many threads are inside one's
# callback now (collectives are refused there).
_observers: list[Any] = []
_local = threading.local()
_cb_lock = threading.Lock()
callbacks = 0


def rank() -> int:
    """This process's global rank: RANK, else the first group's rank."""
    if _rank is not None:
        return _rank
    return int(os.environ.get("RANK", "0"))


def _header(kind: str, **extra: Any) -> dict[str, Any]:
    h = {
        "schema": SCHEMA, "kind": kind, "rank": rank(), "host": socket.gethostname(), "pid": os.getpid(),
        "clock": (_clock_of or _clock.unmeasured("no group set up yet")).to_dict(),
        "mono_ns": time.monotonic_ns(), "wall_ns": time.time_ns(), **extra,
    }  # fmt: skip
    if _hardware is not None:
        h["hardware"] = _hardware
    return h


class _Writer:
    """DIR/rank-<r>.jsonl: one line per record, written in batches. GPU
    records wait (in order) until their device times are ready."""

    def __init__(self, d: Path) -> None:
        d.mkdir(parents=True, exist_ok=True)
        self.path = d / f"rank-{rank()}.jsonl"
        self._f = self.path.open("w", encoding="utf-8")
        self._pending: collections.deque[CollectiveRecord | StepRecord | dict[str, Any]] = collections.deque()
        self._lines: list[str] = []
        self._last = time.monotonic()
        self._lock = threading.Lock()
        self.add(_header("rank", gpubridge_trace_buffer=_buffer_size()))

    def add(self, rec: CollectiveRecord | StepRecord | dict[str, Any]) -> None:
        with self._lock:
            self._pending.append(rec)
            self._drain()
            if len(self._lines) >= _FLUSH_RECORDS or time.monotonic() - self._last >= _FLUSH_S:
                self._write()

    def _drain(self) -> None:
        p = self._pending
        while p:
            rec = p[0]
            if isinstance(rec, (CollectiveRecord, StepRecord)):
                if not rec.ready():
                    return
                rec = rec.to_dict()
            self._lines.append(json.dumps(rec, separators=(",", ":")))
            p.popleft()

    def _write(self) -> None:
        if self._lines:
            self._f.write("\n".join(self._lines) + "\n")
            self._lines.clear()
        self._f.flush()
        self._last = time.monotonic()

    def flush(self, wait_s: float = 0.0) -> None:
        """Writes what is buffered; waits wait_s at most for the device times
        of GPU records, then writes them without."""
        end = time.monotonic() + wait_s
        with self._lock:
            self._drain()
            while self._pending and time.monotonic() < end:
                time.sleep(0.005)
                self._drain()
            for rec in self._pending:
                d = rec.to_dict() if isinstance(rec, (CollectiveRecord, StepRecord)) else rec
                if isinstance(rec, (CollectiveRecord, StepRecord)):
                    d["gpu"] = "not ready at exit"
                self._lines.append(json.dumps(d, separators=(",", ":")))
            self._pending.clear()
            self._write()


def attach(
    name: str,
    group_rank: int,
    size: int,
    layout: Any,
    device: str,
    submitted: Any,
    ranks_of: Any,
    store: Any,
    timeout_s: float,
) -> GroupInfo:
    """Registers a group that was just set up (every rank calls it at the
    same point); the first one also measures the clock (with tracing on),
    opens the trace file and installs the SIGUSR1 handler. layout: the
    group's gpubridge._layout.Layout; ranks_of: its global ranks, once torch
    knows them."""
    global _ring, _rank, _clock_of, _writer, _hardware  # noqa: PLW0603 - the process's recorder
    peers = [r for r in layout.island.ranks if r != group_rank]
    if layout.bridged and layout.is_leader:
        peers += [m for m in layout.members if m != group_rank]
    info = GroupInfo(
        name=name, rank=group_rank, size=size, island=layout.island.label, leader=layout.is_leader,
        local_peers=peers, policy="hierarchical" if layout.bridged else "native", device=device,
        submitted=submitted, ranks_of=ranks_of,
    )  # fmt: skip
    first = _rank is None
    with _lock:
        if first:
            env_rank = os.environ.get("RANK", "")
            _rank = int(env_rank) if env_rank.isdigit() else group_rank
            n = _buffer_size()
            _ring = collections.deque(maxlen=n) if n > 0 else None
            _hardware = getattr(layout, "hardware", None)
        _groups[name] = info
    d = trace_dir()
    if first:
        if d is not None:
            secs = min(30.0, max(1.0, timeout_s))
            _clock_of = _clock.measure(store, group_rank, size, secs)
        else:
            _clock_of = _clock.unmeasured("tracing is off (GPUBRIDGE_TRACE)")
        _install_signal()
        if d is not None:
            try:
                _writer = _Writer(d)
            except OSError as e:  # this rank only: no reason to fail the group on every rank
                log.warning("gpubridge: rank %d: tracing off: cannot write %s: %s", rank(), d, e)
    return info


def tracing() -> bool:
    """Whether records are built for every collective (a trace file or an
    observer wants them), and GPU collectives record CUDA events at their
    steps."""
    return _writer is not None or bool(_observers)


def finish(e: fl.Entry, exc: BaseException | None) -> None:
    """A collective ended (its entry's last step closed): into the ring,
    the trace file and the observers; on failure, a dump, named in the
    error. Tracing off, this is the flight recorder's whole cost."""
    g = _groups.get(e.group)
    if g is None:
        return
    if exc is None:
        g.completed = max(g.completed, e.seq)
    else:
        e.error = str(exc)
    if _ring is not None:
        _ring.append(e)
    if _writer is not None or _observers:
        rec = CollectiveRecord(e, g, rank(), e.error)
        if _writer is not None:
            if not g.written:
                g.written = True
                _writer.add(g.to_dict())
            _writer.add(rec)
        if _observers:
            _notify(rec)
    if exc is not None:
        failed(e, exc)


def failed(e: fl.Entry, exc: BaseException) -> None:
    """A collective failed (on the host or, later, on the device): the first
    failure of each group dumps the flight recorder and flushes the trace;
    the error names the dump in a note (shown under it in a traceback; its
    text, the same on every rank, is unchanged), and stderr in a warning."""
    g = _groups.get(e.group)
    if g is None or g.failed_dumped:
        return
    g.failed_dumped = True
    path = dump(f"{e.op} (collective #{e.seq} of group {e.group}) failed")
    if _writer is not None:
        _writer.flush()
    if path is not None and hasattr(exc, "add_note"):  # Python 3.11 and later
        exc.add_note(f"gpubridge: flight recorder of rank {rank()}: {path}")


# ---- dumps ----


def dump_dir() -> Path:
    """GPUBRIDGE_TRACE_DUMP_DIR, else a directory per job under the temp
    directory (the same for every rank of a job on one host)."""
    d = os.environ.get("GPUBRIDGE_TRACE_DUMP_DIR")
    if d:
        return Path(d)
    job = os.environ.get("TORCHELASTIC_RUN_ID") or os.environ.get("SLURM_JOB_ID")
    if not job:
        port = os.environ.get("MASTER_PORT")
        job = f"port-{port}" if port else f"pid-{os.getpid()}"
    return Path(tempfile.gettempdir()) / f"gpubridge-trace-{os.getuid()}" / job.replace("/", "_")


def dump(reason: str) -> Path | None:
    """Writes the flight recorder (the last records, then what is in
    flight) to a new file of the dump directory; returns its path (None
    when it could not be written: said on stderr)."""
    global _dumps  # noqa: PLW0603
    with _lock:
        _dumps += 1
        n = _dumps
        ring = list(_ring) if _ring is not None else []
        groups = list(_groups.values())
    by_name = {g.name: g for g in groups}
    status = [
        {"name": g.name, "rank": g.rank, "size": g.size, "submitted": g.submitted(), "completed": g.completed}
        for g in groups
    ]
    lines = [
        _header("dump", reason=reason, buffer=_buffer_size(), records=len(ring), groups=status),
        *(g.to_dict() for g in groups),
    ]
    r = rank()
    for e in ring:
        g = by_name.get(e.group)
        if g is not None:
            lines.append(CollectiveRecord(e, g, r, e.error).to_dict())
    for e in fl.entries():
        g = by_name.get(e.group)
        if g is not None and e.seq > 0:
            rec = CollectiveRecord(e, g, r, None, in_flight=True).to_dict()
            rec["step_ns"] = ns(time.monotonic() - e.step_started)
            lines.append(rec)
    try:
        where = dump_dir()
        where.mkdir(parents=True, exist_ok=True)
        path = where / f"rank-{r}.{os.getpid()}.{n}.dump.jsonl"
        tmp = where / f".{path.name}.tmp"  # hidden: readers of the directory pass it over
        tmp.write_text("".join(json.dumps(x, separators=(",", ":")) + "\n" for x in lines))
        tmp.replace(path)
    except OSError as e:
        log.warning("gpubridge: rank %d: flight recorder dump (%s) failed: %s", r, reason, e)
        return None
    log.warning("gpubridge: flight recorder of rank %d (%s): %s", r, reason, path)
    return path


_last_signal = 0.0


def _on_signal() -> None:
    """SIGUSR1: a dump from a thread of its own (the main thread may be stuck
    in a collective), at most one per second."""
    global _last_signal  # noqa: PLW0603
    now = time.monotonic()
    if now - _last_signal < 1.0:
        return
    _last_signal = now
    threading.Thread(target=dump, args=("SIGUSR1",), name="gpubridge-dump", daemon=True).start()


def _install_signal() -> None:
    """SIGUSR1 dumps the flight recorder, unless something else handles it
    or GPUBRIDGE_TRACE_SIGNAL=0. A Python handler runs only when the main
    thread gets back to Python, which a main thread stuck inside a native
    collective never does: a wakeup fd, read by a thread of ours, sees the
    signal at once (when no one else uses the wakeup fd)."""
    if os.environ.get("GPUBRIDGE_TRACE_SIGNAL", "1") == "0":
        return
    if threading.current_thread() is not threading.main_thread():
        return
    if signal.getsignal(signal.SIGUSR1) not in (signal.SIG_DFL, None):
        return
    signal.signal(signal.SIGUSR1, lambda s, f: _on_signal())
    r, w = os.pipe()
    os.set_blocking(w, False)
    try:
        old = signal.set_wakeup_fd(w, warn_on_full_buffer=False)
    except ValueError:
        old = -2
    if old != -1:  # someone else's wakeup fd (asyncio): give it back, keep the handler
        if old >= 0:
            signal.set_wakeup_fd(old)
        os.close(r)
        os.close(w)
        return

    def read() -> None:
        while True:
            try:
                b = os.read(r, 64)
            except OSError:
                return
            if not b:
                return
            if signal.SIGUSR1 in b:
                _on_signal()

    threading.Thread(target=read, name="gpubridge-signals", daemon=True).start()


# ---- observers ----


def add_observer(obj: Any) -> None:
    if not callable(getattr(obj, "on_collective", None)):
        raise TypeError("gpubridge.add_observer: the observer needs an on_collective(record) method")
    with _lock:
        if obj not in _observers:
            _observers.append(obj)


def remove_observer(obj: Any) -> None:
    with _lock, contextlib.suppress(ValueError):
        _observers.remove(obj)


def in_callback() -> bool:
    return bool(getattr(_local, "inside", False))


def _notify(rec: CollectiveRecord) -> None:
    for obj in list(_observers):
        _notify_one(obj, obj.on_collective, rec, "on_collective")


def _notify_one(obj: Any, method: Any, arg: Any, name: str) -> None:
    """Calls one observer's method; one that raises is detached."""
    global callbacks  # noqa: PLW0603
    _local.inside = True
    with _cb_lock:
        callbacks += 1
    try:
        method(arg)
    except Exception as exc:
        remove_observer(obj)
        warnings.warn(
            f"gpubridge: rank {rank()}: observer {obj!r} raised {exc!r} in {name} and was "
            "detached (collectives carry on)",
            RuntimeWarning,
            stacklevel=3,
        )
        with contextlib.suppress(Exception):
            if callable(getattr(obj, "on_detach", None)):
                obj.on_detach(exc)
    finally:
        with _cb_lock:
            callbacks -= 1
        _local.inside = False


def refuse_in_callback(op: str) -> None:
    """Observers never communicate: a gpubridge collective called from
    inside an on_collective callback is refused."""
    if callbacks and in_callback():
        raise RuntimeError(
            f"gpubridge: {op} called from an observer's on_collective: observers must not "
            "communicate (exchange data outside the callback)"
        )


def add_phase(name: str, start: float, end: float) -> None:
    """A step marked with gpubridge.observe.phase outside any collective:
    a record of its own in the trace file."""
    if _writer is None:
        return
    _writer.add({
        "schema": SCHEMA, "kind": "phase", "rank": rank(), "name": name,
        "thread": threading.current_thread().name, "start": ns(start), "end": ns(end),
    })  # fmt: skip


def step_marker() -> Any:
    """For a step being marked on a GPU (CUDA in use, records wanted):
    a marker that records CUDA events on the current stream (call it at the
    step's start and end); else None."""
    torch = sys.modules.get("torch")
    if torch is None or not tracing() or not torch.cuda.is_initialized():
        return None
    from gpubridge._trace_gpu import Marker  # noqa: PLC0415  (torch is there)

    dev = torch.device("cuda", torch.cuda.current_device())
    return Marker(dev, torch.cuda.current_stream(dev))


def add_step(samples: int, start: float, end: float, marker: Any = None) -> None:
    """A training step marked with gpubridge.observe.step: a record of its
    own in the trace file (its index counts the steps marked on this rank,
    so the same step has the same index on every rank), and to the
    observers that have on_step. marker: step_marker()'s, with its start
    and end events recorded."""
    global _steps  # noqa: PLW0603
    rec = StepRecord(rank(), _steps, samples, ns(start), ns(end), marker)
    _steps += 1
    if _writer is not None:
        _writer.add(rec)
    for obj in list(_observers):
        on_step = getattr(obj, "on_step", None)
        if callable(on_step):
            _notify_one(obj, on_step, rec, "on_step")


@atexit.register
def _flush_at_exit() -> None:
    if _writer is not None:
        with contextlib.suppress(Exception):
            _writer.flush(_READY_WAIT_S)
