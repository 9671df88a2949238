"""Failures of a group: the first one breaks it on every rank, with one
root cause.

The first cause is written to the group's store with compare-and-set
(``gpubridge/failure``), so every rank's error begins with the same root
cause; a rank that can see a peer's process (pids are published at set-up)
names a dead or stopped rank."""

from __future__ import annotations

import contextlib
import datetime
import socket
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

from gpubridge import _inflight as fl

__all__ = ["FAILURE_KEY", "Breaker", "gone_ranks", "pid_key", "publish_first", "read_pids"]

FAILURE_KEY = "gpubridge/failure"


def pid_key(rank: int) -> str:
    """Where a rank's "<host> <pid>" is in the group's store."""
    return f"gpubridge/pid/{rank}"


def publish_first(store: Any, key: str, msg: str) -> str:
    """Stores msg under key unless a message is there already; returns the
    stored one (the first cause wins on every rank), or msg when the store
    is unreachable."""
    try:
        got = store.compare_set(key, "", msg)
    except Exception:
        return msg
    return str(got.decode("utf-8", "replace")) or msg


def read_pids(store: Any, size: int) -> dict[int, tuple[str, str]]:
    """Every rank's (host, pid) as published at set-up, read once every rank
    is set up (each publishes before the set-up agreement), so that naming a
    dead rank later needs no store: under env:// the store lives in rank 0,
    which may be the rank that died."""
    pids: dict[int, tuple[str, str]] = {}
    for r in range(size):
        with contextlib.suppress(Exception):
            h, pid = store.get(pid_key(r)).decode().rsplit(" ", 1)
            pids[r] = (h, pid)
    return pids


# PF_EXITING in /proc/PID/stat's flags: the process is dying. A killed
# process closes its sockets (so its peers see a reset) before it becomes a
# zombie; under load that takes long enough for a peer to look in between.
_PF_EXITING = 0x4


def _proc_stat(pid: str) -> str:
    return Path(f"/proc/{pid}/stat").read_text()


def gone_ranks(pids: dict[int, tuple[str, str]], rank: int) -> list[str]:
    """Ranks of the group on this host, other than rank, whose process has
    exited, is exiting or is stopped (pids: read_pids's), to name a dead or
    stalled peer."""
    gone: list[str] = []
    host = socket.gethostname()
    for r, (h, pid) in sorted(pids.items()):
        if r == rank or h != host:
            continue
        try:
            fields = _proc_stat(pid).rsplit(")", 1)[1].split()
            state, flags = fields[0], int(fields[6])
        except (OSError, IndexError, ValueError):
            state, flags = "gone", 0
        if state in ("gone", "Z", "X") or flags & _PF_EXITING:
            gone.append(f"rank {r} (pid {pid}) no longer running")
        elif state in ("T", "t"):
            gone.append(f"rank {r} (pid {pid}) stopped")
    return gone


class Breaker:
    """Whether the group takes collectives: not once closed, nor once broken
    by a failure. on_break aborts what would keep the peers waiting (the
    feed, the island group) so that their calls fail at once instead of at
    their timeout; why_dead says how this rank's gbbridge serve ended, if it
    did (a feed error is only the symptom)."""

    def __init__(
        self,
        store: Any,
        rank: int,
        size: int,
        on_break: Callable[[], None],
        why_dead: Callable[[], str | None],
    ) -> None:
        self._store = store
        self._rank = rank
        self._size = size
        self._on_break = on_break
        self._why_dead = why_dead
        self.closed = False
        self.error: str | None = None  # the root cause, once broken
        self.pids: dict[int, tuple[str, str]] = {}  # every rank's (host, pid), once set up

    def refuse(self, op: str) -> None:
        if self.closed:
            raise RuntimeError(f"gpubridge: {op}: the group was destroyed")
        if self.error is not None:
            # The root cause first, as fail() words it: a rank whose first
            # error is a refused call names the cause the others name.
            here = f"on rank {self._rank}: {op} refused: the group is broken"
            raise RuntimeError(f"gpubridge: {self.error} ({here})")

    def abort(self) -> None:
        """Breaks the group, unless it is broken already, because it is
        being aborted."""
        if self.error is None:
            self.error = f"rank {self._rank}: the group was aborted"

    def fail(self, e: fl.Entry, exc: BaseException) -> RuntimeError:
        """Breaks the group after a failure of collective e: publishes the
        first cause in the store and aborts the links; returns the error
        naming the root cause and what happened here."""
        # The frames of the failed steps hold the island group and its Work:
        # let them go, so that dropping the group closes its connections and
        # wakes the island peers at once.
        traceback.clear_frames(exc.__traceback__)
        dead = self._why_dead()
        what = f"{dead} ({exc})" if dead else str(exc)
        here = f"rank {self._rank}: {e.op} (collective #{e.seq}, step {e.step}): {what}"
        if self.error is None:
            gone = gone_ranks(self.pids or read_pids(self._store, self._size), self._rank)
            if gone:
                here += f" [{'; '.join(gone)}]"
            self.error = here
            with contextlib.suppress(Exception):  # the store may be gone with a dead rank
                self._store.set_timeout(datetime.timedelta(seconds=10))
            self.error = publish_first(self._store, FAILURE_KEY, here)
            self._on_break()
        msg = f"gpubridge: {self.error}"
        if self.error != here:
            msg += f" (on rank {self._rank}: {e.op} #{e.seq} failed in step {e.step}: {exc})"
        err = RuntimeError(msg)
        err.__cause__ = exc
        return err
