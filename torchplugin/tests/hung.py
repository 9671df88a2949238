"""What a test does with a job that outlived its deadline: a hang is only
worth a failure if the failure says where everyone stood. Every process of
the job's process tree is asked for its stacks (Python ranks: SIGABRT, dumped by
faulthandler, which run turns on; gbbridge serve: SIGQUIT, the Go
runtime's goroutine dump, read from its stderr file through /proc since the
rank holds that file), then every one of them is killed so that nothing
is left behind."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import IO, Any

import pytest

# How long the stack dumps get before everything is killed.
DUMP_GRACE_S = 5.0
# A goroutine dump of a hung serve is a few hundred lines; keep the end.
BRIDGE_DUMP_CHARS = 20000


def stat(pid: int | str) -> list[str] | None:
    """The fields of /proc/PID/stat after the command's name (state first,
    then the parent's pid), or None when there is no such process."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return None


def tree(root: int) -> list[int]:
    """root and its living descendants (by parent links: torchrun starts
    each rank in a session of its own)."""
    children: dict[int, list[int]] = {}
    for d in os.listdir("/proc"):
        fields = stat(d) if d.isdigit() else None
        if fields is not None and fields[0] != "Z":
            children.setdefault(int(fields[1]), []).append(int(d))
    out, todo = [], [root]
    while todo:
        pid = todo.pop()
        out.append(pid)
        todo.extend(children.get(pid, []))
    return out


def _cmdline(pid: int) -> list[bytes]:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
    except OSError:
        return []


def _text(b: bytes | str | None) -> str:
    if b is None:
        return ""
    return b if isinstance(b, str) else b.decode("utf-8", "replace")


def stop(p: subprocess.Popen[Any]) -> tuple[str, str]:
    """Dumps every process of p's tree, kills them all and returns (what p
    wrote on its pipes, stdout then stderr; the bridges' dumps)."""
    bridges: dict[int, IO[bytes]] = {}
    first = tree(p.pid)
    for pid in first:
        cmd = _cmdline(pid)
        if cmd and cmd[0].endswith(b"gbbridge"):
            try:  # its stderr is an unlinked file: keep a handle before it exits
                bridges[pid] = open(f"/proc/{pid}/fd/2", "rb")  # noqa: SIM115
            except OSError:
                continue
            sig = signal.SIGQUIT
        elif pid != p.pid and cmd and b"python" in os.path.basename(cmd[0]):
            sig = signal.SIGABRT
        else:
            continue
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, sig)
    time.sleep(DUMP_GRACE_S)
    # Those whose parent died meanwhile are no longer in the tree: the
    # first look still has them.
    for pid in {*first, *tree(p.pid)}:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    out, err = p.communicate()
    dumps = []
    for pid, f in bridges.items():
        with f:
            text = f.read().decode("utf-8", "replace")
        dumps.append(f"--- gbbridge {pid}, its stderr's end:\n{text[-BRIDGE_DUMP_CHARS:]}")
    return _text(out) + _text(err), "\n".join(dumps)


def run(
    cmd: Sequence[str], *, timeout: float, note: Callable[[], str] | None = None, **kw: Any
) -> subprocess.CompletedProcess[Any]:
    """subprocess.run(cmd, capture_output=True, check=False, **kw) for a
    job: one still running after timeout fails the test with every
    process's stacks (stop), and none is left; note() adds what the test
    knows of the job, read before the stacks are asked for."""
    kw.setdefault("stdout", subprocess.PIPE)
    kw.setdefault("stderr", subprocess.PIPE)
    kw["env"] = {**(kw.get("env") or os.environ), "PYTHONFAULTHANDLER": "1"}
    with subprocess.Popen(cmd, **kw) as p:
        try:
            out, err = p.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            known = f" ({note()})" if note else ""
            text, dumps = stop(p)
            pytest.fail(
                f"{' '.join(cmd[:4])} ... still ran after {timeout:.0f} s{known}; every process's "
                f"stacks follow\n{text[-30000:]}\n{dumps}",
                pytrace=False,
            )
    return subprocess.CompletedProcess(list(cmd), p.returncode, out, err)
