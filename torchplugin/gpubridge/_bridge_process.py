"""``gbbridge serve``, the child process a bridged rank runs: starting it,
reading its ready line, and stopping it (docs/FEED.md §6).

The feed itself (the socket and the regions) is :mod:`gpubridge._feed`.
"""

from __future__ import annotations

import contextlib
import json
import os
import queue
import select
import signal
import subprocess
import tempfile
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import IO, Any

from gpubridge._feed_protocol import MAX_MESSAGE, FeedError, FeedTimeout

__all__ = ["BridgeProcess", "start_bridge", "start_bridge_lasting"]

_GIVE_UP_POLL_S = 0.25  # how often wait_ready asks its give_up
_SETUP_EXIT_S = 5.0  # how long a serve stopped in set-up gets to clean up


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

    def wait_ready(
        self, timeout: float = 90.0, give_up: Callable[[], str | None] | None = None
    ) -> dict[str, Any]:
        """Reads the ready line (printed once the bridge is up) by the
        deadline. give_up, asked every _GIVE_UP_POLL_S while no line has come,
        returns why to stop waiting before the deadline (the bridge's other
        members will not come: another rank's set-up failed). On failure the
        child is stopped and FeedError carries its stderr."""
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
                r, _, _ = select.select([fd], [], [], left if give_up is None else min(left, _GIVE_UP_POLL_S))
                if not r:
                    why = give_up() if give_up is not None else None
                    if why:
                        raise FeedError(f"gpubridge: stopped waiting for gbbridge serve's ready line: {why}")
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
            # SIGTERM first: a serve still in set-up aborts it and removes
            # what it made (an shm ring file holds ~100 MiB of /dev/shm
            # until someone does); SIGKILL only if it does not go.
            self.terminate(_SETUP_EXIT_S)
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

    def exit_reason(self) -> str | None:
        """How the process ended ("was killed by SIGKILL", "exited with
        status 1: <its last line on stderr>"), or None while it runs."""
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.proc.wait(0.2)  # a killed child may not be reaped yet
        rc = self.proc.poll()
        if rc is None:
            return None
        if rc < 0:
            try:
                return f"was killed by {signal.Signals(-rc).name}"
            except ValueError:
                return f"was killed by signal {-rc}"
        last = self.stderr().strip().rsplit("\n", 1)[-1][-300:]
        return f"exited with status {rc}" + (f": {last}" if last else "")

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
    :meth:`BridgeProcess.wait_ready` next. The ready line comes once the
    bridge is up, so with several members on one host start them all before
    waiting for any. The child gets SIGTERM when the thread that called this
    dies (serve's own ``--die-with-parent``, PR_SET_PDEATHSIG, which follows
    the thread that forked): call it from a thread that lives as long as the
    job. ``--parent-pid`` makes serve exit at start if this process died
    before it got there. No ``preexec_fn``: forking a threaded interpreter
    to run Python in the child can deadlock; subprocess spawns without it."""
    cmd = [os.fspath(gbbridge), "serve", "--topology", os.fspath(topology), "--feed", os.fspath(feed)]
    cmd += ["--parent-pid", str(os.getpid()), *args]
    errf = tempfile.TemporaryFile()  # noqa: SIM115 (the BridgeProcess owns it)
    try:
        proc = subprocess.Popen(
            cmd,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=errf,
            env=None if env is None else dict(env),
            close_fds=True,
        )
    except BaseException:
        errf.close()
        raise
    return BridgeProcess(proc, {}, os.fspath(feed), errf)


class _Spawner:
    """One thread of the process that lives as long as it does and forks
    the gbbridge serve processes started after set-up (a rank's endpoint
    made on first need, from whatever thread needed it): PR_SET_PDEATHSIG
    follows the thread that forked, and a caller's thread may end long
    before the job."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._jobs: queue.SimpleQueue[tuple[Callable[[], Any], queue.SimpleQueue[Any]]] = queue.SimpleQueue()
        self._thread: threading.Thread | None = None

    def run(self, fn: Callable[[], Any]) -> Any:
        """fn() on the spawner's thread; its result, or its exception."""
        with self._lock:
            if self._thread is None or not self._thread.is_alive():
                self._thread = threading.Thread(target=self._loop, name="gpubridge-spawner", daemon=True)
                self._thread.start()
        reply: queue.SimpleQueue[Any] = queue.SimpleQueue()
        self._jobs.put((fn, reply))
        ok, value = reply.get()
        if not ok:
            raise value
        return value

    def _loop(self) -> None:
        while True:
            fn, reply = self._jobs.get()
            try:
                reply.put((True, fn()))
            except BaseException as e:  # handed to the caller
                reply.put((False, e))


_SPAWNER = _Spawner()


def start_bridge_lasting(
    topology: str | os.PathLike[str],
    feed: str | os.PathLike[str],
    *,
    gbbridge: str | os.PathLike[str] = "gbbridge",
    args: Sequence[str] = (),
    env: Mapping[str, str] | None = None,
) -> BridgeProcess:
    """:func:`start_bridge` from a thread that lasts as long as the process,
    so that the child gets SIGTERM only when the process dies, whichever
    thread asks."""
    if threading.current_thread() is threading.main_thread():
        return start_bridge(topology, feed, gbbridge=gbbridge, args=args, env=env)
    return _SPAWNER.run(lambda: start_bridge(topology, feed, gbbridge=gbbridge, args=args, env=env))  # type: ignore[no-any-return]
