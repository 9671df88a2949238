"""Collectives run one at a time, in submission order, and their Works.

A collective is submitted with a sequence number (equal on every rank,
since every rank submits the same collectives in the same order) and runs
on the group's worker thread; a synchronous call with nothing queued ahead
runs on the calling thread instead (two thread switches fewer), and on the
CPU makes no Event and no Future (its Work makes one if asked). On GPUs the
work is queued on the worker's stream, which first waits for the caller's
current stream, and a completer thread completes each Work once its GPU
work is done."""

from __future__ import annotations

import datetime
import queue
import threading
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from gpubridge import _check_calls, _gpu, _trace, _trace_gpu
from gpubridge import _inflight as fl
from gpubridge._failure import Breaker

__all__ = ["Run", "Task", "Work", "Worker"]


Run = Callable[[fl.Entry], None]


# The done event of every collective that ran inline (on the caller's
# thread, over before its Work exists): set once, never cleared, so such a
# call makes no Event (a Condition and a lock) and sets none.
_FINISHED = threading.Event()
_FINISHED.set()


class Task:
    __slots__ = ("done", "entry", "event", "exc", "fn", "fut", "result", "sig")

    def __init__(
        self,
        entry: fl.Entry,
        fn: Run,
        fut: Any,
        result: list[torch.Tensor],
        sig: bytes = b"",
        done: threading.Event | None = None,
    ) -> None:
        self.entry = entry
        self.fn = fn
        # The Work's future, completed with result; None for a CPU call
        # that ran inline, whose Work makes one on demand (get_future).
        self.fut = fut
        self.result = result
        self.sig = sig  # set when calls are checked
        self.event: Any = None  # GPU: the caller's stream, then the work's end
        self.exc: BaseException | None = None
        # The host's part is over (GPU work may still run).
        self.done = threading.Event() if done is None else done


def _value(fut: Any) -> Any:
    return fut.value()  # raises the collective's error


class Work(dist.Work):
    """What a collective returns. wait() raises the collective's error; on
    GPUs it returns once the work is queued on the group's stream and makes
    the caller's current stream wait for it (NCCL's semantics); on CPU it
    returns when the collective is over. is_completed() is true only when
    the work is done, on the GPU too. get_future() completes then. wait()
    gives up after the group's timeout and two minutes more."""

    def __init__(self, task: Task, device: torch.device, timeout: datetime.timedelta) -> None:
        super().__init__()
        self._task = task
        self._device = device
        self._deadline_s = timeout.total_seconds() + 120.0
        self._fut: Any = None

    def wait(self, timeout: Any = None) -> bool:
        t = self._task
        secs = self._deadline_s
        if isinstance(timeout, datetime.timedelta) and timeout.total_seconds() > 0:
            secs = timeout.total_seconds()
        done = t.done
        if not done.is_set() and not done.wait(secs):
            _trace.dump(f"{t.entry.op} (collective #{t.entry.seq}) not done after {secs:g} s")
            raise RuntimeError(
                f"gpubridge: {t.entry.op} (collective #{t.entry.seq}) is not done after {secs:g} s "
                f"(step {t.entry.step})"
            )
        if t.exc is not None:
            raise t.exc
        if self._device.type == "cuda" and t.event is not None:
            torch.cuda.current_stream(self._device).wait_event(t.event)
        return True

    def is_completed(self) -> bool:
        t = self._task
        if not t.done.is_set():
            return False
        return t.exc is not None or t.event is None or bool(t.event.query())

    def is_success(self) -> bool:
        return self._task.done.is_set() and self._task.exc is None and self.is_completed()

    def exception(self) -> Any:
        return self._task.exc

    def get_future(self) -> Any:
        # A Python Future's set_exception completes it *successfully* with
        # the exception object as its value (only Python's wait() raises
        # it): C++ callers such as DDP's reducer would take that value for
        # the result and crash. The chained future holds a real error,
        # which every caller sees (made on first use: nothing per call).
        if self._fut is None:
            t = self._task
            fut = t.fut
            if fut is None:  # ran inline on the CPU: over already
                fut = torch.futures.Future()
                if t.exc is not None:
                    fut.set_exception(t.exc)
                else:
                    fut.set_result(t.result)
            self._fut = fut.then(_value)
        return self._fut

    def synchronize(self) -> None:
        self.wait()


class Worker:
    """The group's worker (and, on GPUs, completer) thread; a failure fails
    its Work and breaks the group (breaker), never the thread. With
    compare_calls, each collective first compares the call's signature
    with every rank's (gpubridge._check_calls)."""

    def __init__(
        self,
        group: str,
        device: torch.device,
        stream: Any,
        timeout: datetime.timedelta,
        breaker: Breaker,
        compare_calls: Callable[[fl.Entry, bytes], None] | None,
    ) -> None:
        self._group = group
        self._compare_calls = compare_calls
        self._device = device
        self._gpu = device.type == "cuda"
        self._stream = stream
        self._timeout = timeout
        self._breaker = breaker
        self.seq = 0  # collectives submitted
        self._submit_lock = threading.Lock()
        self._exec_lock = threading.Lock()  # held while a collective runs
        self._pending = 0  # collectives queued or running
        self._stats: dict[str, dict[str, Any]] = {}
        self._queue: queue.SimpleQueue[Task | None] = queue.SimpleQueue()
        self._done_q: queue.SimpleQueue[Task | None] = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._run, name=f"gpubridge-{group}", daemon=True)
        self._completer: threading.Thread | None = None
        if device.type == "cuda":
            self._completer = threading.Thread(
                target=self._complete, name=f"gpubridge-{group}-done", daemon=True
            )
        self._thread.start()
        if self._completer is not None:
            self._completer.start()

    def submit(
        self,
        op: str,
        nbytes: int,
        fn: Run,
        result: list[torch.Tensor],
        uses: list[torch.Tensor] | None = None,
        opts: Any = None,
        detail: str = "",
        codec: str = "",
    ) -> Work:
        """Runs fn after every collective submitted before it; returns the
        Work the caller gets (its future's value is result). A synchronous
        call (opts.asyncOp false) with nothing ahead of it runs at once on
        the calling thread, saving two thread switches; anything else is
        queued to the worker. On GPUs the tensors in result and uses are
        marked as used on the worker's stream, so the caching allocator does
        not hand their memory out before the collective is done. detail: the
        call's options, for its signature; codec: the compression the call
        asks for, when it names one (part of its signature too)."""
        if _trace.callbacks and _trace.in_callback():
            _trace.refuse_in_callback(op)
        gpu = self._gpu
        sync = opts is not None and getattr(opts, "asyncOp", True) is False
        inline = False
        with self._submit_lock:
            self._breaker.refuse(op)
            self.seq += 1
            entry = fl.Entry(self._group, self.seq, op, nbytes, fl.QUEUED, threading.current_thread().name)
            entry.dtype = result[0].dtype if result else None
            entry.detail, entry.asynchronous = detail, not sync
            task = Task(entry, fn, None, result, done=_FINISHED)
            if self._compare_calls is not None:
                sig_detail = f"{detail}, {codec}" if codec else detail
                task.sig = _check_calls.signature(op, [*result, *(uses or [])], sig_detail)
            if gpu:
                task.fut = torch.futures.Future(devices=[self._device])
                if _trace.tracing():  # the steps' CUDA events (none with tracing off)
                    entry.mark = _trace_gpu.Marker(self._device, self._stream)
                cur = torch.cuda.current_stream(self._device)
                task.event = _gpu.new_event()
                task.event.record(cur)
                for t in [*result, *(uses or [])]:
                    t.record_stream(self._stream)
            # _pending counts collectives queued or running; with none, the
            # worker is idle and cannot start a later one before this one
            # (it takes _exec_lock first).
            if sync and self._pending == 0:
                inline = self._exec_lock.acquire(blocking=False)
            self._pending += 1
            if not inline:
                # Waited for from another thread: an event and a future of
                # its own (an inline CPU call's Work makes its future).
                task.done = threading.Event()
                if task.fut is None:
                    task.fut = torch.futures.Future()
                self._queue.put(task)
        if inline:
            try:
                self._execute(task)
            finally:
                self._exec_lock.release()
        return Work(task, self._device, self._timeout)

    def _run(self) -> None:
        while True:
            task = self._queue.get()
            if task is None:
                return
            with self._exec_lock:
                self._execute(task)

    def _execute(self, task: Task) -> None:
        e = task.entry
        e.set_step(fl.RUNNING)
        fl.enter(e)
        cuda = self._gpu
        try:
            if self._breaker.error is not None:
                raise RuntimeError(f"not started: the group is broken: {self._breaker.error}")
            if cuda:
                with torch.cuda.device(self._device), torch.cuda.stream(self._stream):
                    self._stream.wait_event(task.event)
                    self._run_task(task)
                    done = _gpu.new_event()
                    done.record(self._stream)
                    task.event = done
            else:
                self._run_task(task)
        except BaseException as exc:  # every failure fails the Work, never the thread
            task.exc = self._breaker.fail(e, exc)
            task.event = None
        finally:
            # The entry is closed, counted and its record delivered before
            # the Work completes: a caller back from wait() finds the
            # collective in stats() and in its observers' records.
            try:
                fl.leave()
                e.set_step(fl.DONE)
                self._count(e)
                _trace.finish(e, task.exc)
                with self._submit_lock:
                    self._pending -= 1
            finally:
                done, fut = task.done, task.fut
                if done is not _FINISHED:
                    done.set()
                if task.exc is not None:
                    if fut is not None:
                        fut.set_exception(task.exc)
                elif cuda:
                    self._done_q.put(task)
                elif fut is not None:
                    fut.set_result(task.result)

    def _run_task(self, task: Task) -> None:
        if task.sig and self._compare_calls is not None:
            self._compare_calls(task.entry, task.sig)
        task.fn(task.entry)

    def _count(self, e: fl.Entry) -> None:
        st = self._stats.get(e.op)
        if st is None:
            st = self._stats[e.op] = {"calls": 0, "bytes": 0, "seconds": 0.0, "steps": {}}
        st["calls"] += 1
        st["bytes"] += e.nbytes
        st["seconds"] += e.step_started - e.started
        steps = st["steps"]
        for k, v in e.steps.items():
            steps[k] = steps.get(k, 0.0) + v

    def _complete(self) -> None:
        """Completes GPU Works once their work is done on the device."""
        while True:
            task = self._done_q.get()
            if task is None:
                return
            try:
                _gpu.wait_event(
                    task.event,
                    f"{task.entry.op} (collective #{task.entry.seq})",
                    self._timeout.total_seconds(),
                )
                with torch.cuda.device(self._device), torch.cuda.stream(self._stream):
                    task.fut.set_result(task.result)
            except BaseException as exc:
                task.exc = self._breaker.fail(task.entry, exc)
                _trace.failed(task.entry, task.exc)
                task.fut.set_exception(task.exc)

    def stats(self) -> dict[str, Any]:
        """Per op: calls, bytes, seconds and seconds per step, rounded."""
        return {
            op: {
                **v,
                "seconds": round(v["seconds"], 6),
                "steps": {k: round(x, 6) for k, x in v["steps"].items()},
            }
            for op, v in self._stats.copy().items()
        }

    def on_worker_thread(self) -> bool:
        return threading.current_thread() is self._thread

    def close(self, join_s: float) -> None:
        """Runs what is queued, then ends the threads (waiting join_s for
        each at most)."""
        if not self.on_worker_thread():
            self._queue.put(None)
            self._thread.join(join_s)
        if self._completer is not None:
            self._done_q.put(None)
            self._completer.join(join_s)
