"""A group's set-up on one rank, around building its parts: discovery, the
rank's private directory and device, its pid in the store, and the set-up
agreement that makes every rank return or fail together."""

from __future__ import annotations

import contextlib
import datetime
import fcntl
import os
import shutil
import socket
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from gpubridge import _discovery
from gpubridge._failure import pid_key, publish_first

__all__ = [
    "agree",
    "discover",
    "failure_elsewhere",
    "private_dir",
    "publish_pid",
    "remove_private_dir",
    "remove_stale_dirs",
    "use_gpu",
]

_SETUP_FAILURE_KEY = "gpubridge/setup/failure"


# A live process holds an exclusive flock on <dir>/.lock for as long as it
# runs (the lock goes with the process, in any pid namespace), so a
# directory whose lock can be taken was left by a process that is gone.
_LOCK = ".lock"
_held_locks: dict[Path, int] = {}  # this process's directories and their locks' fds


def _abandoned(d: Path) -> bool:
    try:
        fd = os.open(d / _LOCK, os.O_RDONLY | os.O_CLOEXEC | os.O_NOFOLLOW)
    except FileNotFoundError:
        # Made before locks existed, or killed between mkdtemp and the
        # lock: the pid is all there is to go by.
        pid = d.name.split("-")[1]
        return pid.isdigit() and not Path(f"/proc/{pid}").exists()
    except OSError:
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        return False  # held: its process lives (perhaps in another pid namespace)
    finally:
        os.close(fd)
    return True


def remove_stale_dirs() -> None:
    """Removes the private directories (gpubridge-<pid>-*) that processes of
    this user left behind when they were killed."""
    tmp = Path(tempfile.gettempdir())
    uid = os.getuid()
    for d in tmp.glob("gpubridge-*-*"):
        with contextlib.suppress(OSError):
            if d.is_dir() and not d.is_symlink() and d.lstat().st_uid == uid and _abandoned(d):
                shutil.rmtree(d, ignore_errors=True)


def private_dir() -> Path:
    """A new directory of this process for a group's files (the topology,
    the feed socket), locked for as long as the process lives; the ones
    killed processes left are removed first."""
    remove_stale_dirs()
    d = Path(tempfile.mkdtemp(prefix=f"gpubridge-{os.getpid()}-"))
    # The lock file appears only once it is locked (made under another
    # name, locked, renamed): a .lock another process could find unlocked
    # in between would let its remove_stale_dirs take this live directory.
    # Until the rename, _abandoned goes by the pid, which is alive.
    tmp = d / (_LOCK + ".new")
    fd = os.open(tmp, os.O_RDONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
    fcntl.flock(fd, fcntl.LOCK_EX)
    os.rename(tmp, d / _LOCK)
    _held_locks[d] = fd
    return d


def remove_private_dir(d: Path) -> None:
    """Removes a directory private_dir made, and lets its lock go."""
    shutil.rmtree(d, ignore_errors=True)
    fd = _held_locks.pop(d, None)
    if fd is not None:
        os.close(fd)


def discover(
    store: Any,
    rank: int,
    size: int,
    timeout: datetime.timedelta,
    group: str,
    workdir: Path,
    problems: list[str],
    settings: dict[str, str] | None = None,
) -> dict[str, Any]:
    """gbprobe | gbdiscover: the topology (also in workdir), or the same
    error on every rank; settings must be equal on every rank."""
    host, port = _discovery.store_address(store)
    secs = max(1.0, timeout.total_seconds())
    return _discovery.discover(
        host, port, rank, size, _discovery.namespace(group), workdir / "topology.json",
        timeout=min(secs, float(os.environ.get("GPUBRIDGE_DISCOVER_TIMEOUT_S", "300"))),
        problems=problems or None, settings=settings,
    )  # fmt: skip


def publish_pid(store: Any, rank: int) -> None:
    """Says where this rank's process is, for the failure messages of its
    peers. Only after discovery: it made sure this process holds its rank
    (a second job on the same store fails there, before it writes here)."""
    store.set(pid_key(rank), f"{socket.gethostname()} {os.getpid()}")


def use_gpu(rank: int) -> torch.device:
    """Makes cuda:LOCAL_RANK this process's device (only once discovery
    chose GPU mode)."""
    local = int(os.environ.get("LOCAL_RANK", "0"))
    if not torch.cuda.is_available():
        raise RuntimeError(
            f"gpubridge: rank {rank}: discovery chose GPU mode but this torch sees no GPU "
            "(a CPU-only torch? set GPUBRIDGE_CPU_ONLY=1 on every rank to run on CPU)"
        )
    device = torch.device("cuda", local)
    torch.cuda.set_device(device)
    return device


def _has(store: Any, key: str) -> bool:
    try:
        return bool(store.check([key]))
    except Exception:
        return False


def _published_failure(store: Any) -> str | None:
    """The first set-up failure a rank published (agree), if one did."""
    if not _has(store, _SETUP_FAILURE_KEY):
        return None
    return str(store.get(_SETUP_FAILURE_KEY).decode("utf-8", "replace"))


def failure_elsewhere(store: Any) -> str | None:
    """The set-up failure a rank published, worded as agree raises it: one
    look at the store; None when there is none or it cannot be read."""
    try:
        root = _published_failure(store)
    except Exception:
        return None
    return f"set-up failed: {root}" if root else None


def agree(
    store: Any, rank: int, size: int, timeout: datetime.timedelta, failed: BaseException | None
) -> None:
    """Set-up after discovery (island groups, gbbridge serve, regions) can
    fail on one rank only, say a leader whose /dev/shm is full: no rank
    returns before every rank is set up, and a failure anywhere raises the
    same error everywhere (the first one published). A rank that does not
    finish within the group's timeout is named."""
    secs = max(1.0, timeout.total_seconds())
    key = "gpubridge/setup/{}".format
    root = ""
    if failed is not None:
        mine = str(failed).removeprefix("gpubridge: ")
        if not mine.startswith(f"rank {rank}: "):
            mine = f"rank {rank}: {mine}"
        root = publish_first(store, _SETUP_FAILURE_KEY, mine)
    store.set(key(rank), "failed" if failed is not None else "ok")
    try:
        store.wait([key(r) for r in range(size)], datetime.timedelta(seconds=secs))
    except Exception:
        slow = [r for r in range(size) if not _has(store, key(r))]
        if slow:
            names = ", ".join(str(r) for r in slow)
            root = publish_first(
                store, _SETUP_FAILURE_KEY, f"rank(s) {names} did not finish setting up within {secs:g}s"
            )
    if not root:
        root = _published_failure(store) or ""
    if not root:
        return
    # The store may live in one of the failing processes (rank 0 under
    # env://): everyone reads the outcome before anyone leaves.
    with contextlib.suppress(Exception):
        store.add("gpubridge/setup/read", 1)
        end = time.monotonic() + min(secs, 30.0)
        while store.add("gpubridge/setup/read", 0) < size and time.monotonic() < end:
            time.sleep(0.02)
    err = RuntimeError(f"gpubridge: set-up failed: {root}")
    raise err from failed
