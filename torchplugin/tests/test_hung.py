"""hung.stop: a job past its deadline leaves its stacks and no process."""

from __future__ import annotations

import os
import subprocess
import sys
import time

import hung
from test_backend import BIN, needs_tools
from testenv import scale

# A parent that starts a child and both wait forever, in a named function
# each, so their stacks can be recognised.
TREE = """
import subprocess, sys, time
def child_waits():
    time.sleep(600)
if len(sys.argv) > 1:
    child_waits()
def parent_waits(c):
    c.wait()
parent_waits(subprocess.Popen([sys.executable, __file__, "child"]))
"""


def test_stop_dumps_every_python_process_and_leaves_none(tmp_path) -> None:  # type: ignore[no-untyped-def]
    script = tmp_path / "tree.py"
    script.write_text(TREE)
    p = subprocess.Popen(
        [sys.executable, str(script)],
        env=dict(os.environ, PYTHONFAULTHANDLER="1"),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
    )
    deadline = time.monotonic() + scale(60)
    while len(hung.tree(p.pid)) < 2:  # the child has started
        assert time.monotonic() < deadline, "the child never started"
        time.sleep(0.05)
    time.sleep(0.5)  # and reached its sleep
    pids = hung.tree(p.pid)
    out, dumps = hung.stop(p)
    assert "child_waits" in out, out  # the child's stack (the job's own process is not asked)
    assert dumps == ""
    assert [pid for pid in pids if os.path.exists(f"/proc/{pid}")] == []
    assert p.returncode is not None


# A rank's bridge: gbbridge blocked on a store that never answers, its
# stderr an unlinked file as the plugin gives it.
BRIDGE = """
import socket, subprocess, sys, tempfile
srv = socket.socket()
srv.bind(("127.0.0.1", 0))
srv.listen()
store = f"127.0.0.1:{srv.getsockname()[1]}"
err = tempfile.TemporaryFile()
args = ["selftest", "--store", store, "--rank", "0", "--world-size", "2"]
subprocess.Popen([sys.argv[1], *args], stderr=err).wait()
"""


@needs_tools
def test_stop_dumps_a_bridges_goroutines(tmp_path) -> None:  # type: ignore[no-untyped-def]
    script = tmp_path / "bridge.py"
    script.write_text(BRIDGE)
    p = subprocess.Popen(
        [sys.executable, str(script), str(BIN / "gbbridge")], stdout=subprocess.PIPE, stderr=subprocess.STDOUT
    )
    deadline = time.monotonic() + scale(60)
    while len(hung.tree(p.pid)) < 2:
        assert time.monotonic() < deadline, "gbbridge never started"
        time.sleep(0.05)
    time.sleep(1)  # it reached the store
    pids = hung.tree(p.pid)
    _, dumps = hung.stop(p)
    assert f"--- gbbridge {pids[1]}, its stderr's end:" in dumps, dumps
    assert "goroutine " in dumps, dumps  # the Go runtime's dump on SIGQUIT
    assert [pid for pid in pids if os.path.exists(f"/proc/{pid}")] == []
