"""Set-up after discovery that fails on one rank only (a leader whose
gbbridge cannot start, or whose /dev/shm is full): every rank, the
non-leaders too, raises the same error naming the cause from
init_process_group, within the group's timeout, and nothing is left running.

The ranks are plain env:// processes on a store this test hosts.
"""

from __future__ import annotations

import datetime
import json
import os
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch.distributed as dist
from test_backend import BIN, bridge_pids, job_env, needs_tools  # (tests/ is on sys.path under pytest)
from testenv import scale

HERE = Path(__file__).resolve().parent
TIMEOUT_S = round(scale(30))
VENDORS = ["nvidia", "nvidia", "amd", "amd"]
# How every rank learns which rank's set-up failed is gpubridge's agreement
# over the store; the case whose store lives in the failing rank 0 (torch's
# env:// rendezvous) and the second job on a port (torch's store refusing
# it) run on every torch, the other failures on the project's torch only.
SET_UP_AGREEMENT = pytest.mark.torch_independent(
    "gpubridge's set-up agreement; the env:// store cases keep torch's part on every torch"
)


def rank_env(tmp_path: Path, r: int, port: int, **extra: str) -> dict[str, str]:
    """Rank r's environment for an env:// launch against the store on port
    (rank 0's own unless TORCHELASTIC_USE_AGENT_STORE is set)."""
    env = dict(
        job_env(tmp_path), RANK=str(r), LOCAL_RANK=str(r), WORLD_SIZE=str(len(VENDORS)),
        LOCAL_WORLD_SIZE=str(len(VENDORS)), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port),
        GPUBRIDGE_VENDOR=VENDORS[r], SETUP_TEST_TIMEOUT=str(TIMEOUT_S), **extra,
    )  # fmt: skip
    env.pop("TORCHELASTIC_USE_AGENT_STORE", None)
    return env


def run(
    tmp_path: Path,
    wrap: dict[int, list[str]],
    env_of: dict[int, dict[str, str]],
    store_on_rank0: bool = False,
) -> list[dict]:
    """Starts one process per rank (rank r's command prefixed with wrap[r],
    its environment extended with env_of[r]); returns every rank's result.
    The store is this test's, or with store_on_rank0 rank 0's own (a plain
    env:// launch: the store lives in a process that may be the failing one)."""
    store = None
    if store_on_rank0:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
    else:
        store = dist.TCPStore(
            "127.0.0.1", 0, None, True, timeout=datetime.timedelta(seconds=scale(60)), wait_for_workers=False
        )
        port = store.port
    procs = []
    for r in range(len(VENDORS)):
        env = rank_env(tmp_path, r, port, GPUBRIDGE_NAMESPACE=f"setup-{tmp_path.name}", **env_of.get(r, {}))
        if not store_on_rank0:
            env["TORCHELASTIC_USE_AGENT_STORE"] = "True"
        log = (tmp_path / f"rank{r}.log").open("wb")
        cmd = [*wrap.get(r, []), sys.executable, str(HERE / "setup_worker.py"), str(tmp_path)]
        procs.append(subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT, cwd=tmp_path))
    try:
        for p in procs:
            p.wait(timeout=TIMEOUT_S * 2 + scale(60))
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
            p.wait()
    results = []
    for r in range(len(VENDORS)):
        f = tmp_path / f"rank{r}.json"
        log = (tmp_path / f"rank{r}.log").read_text(errors="replace")
        assert f.exists(), f"rank {r} wrote no result:\n{log[-4000:]}"
        results.append(json.loads(f.read_text()))
    assert not bridge_pids(str(tmp_path)), "gbbridge serve left running"
    del store
    return results


def same_error(results: list[dict]) -> str:
    """The one error every rank raised. The failing leader's peer stops
    waiting for its gbbridge serve once the failure is published, so no
    rank waits for the group's timeout (they all did before)."""
    errors = [res.get("error") for res in results]
    assert all(errors), results
    assert len(set(errors)) == 1, errors
    assert all(res["elapsed"] < TIMEOUT_S for res in results), results
    return str(errors[0])


def bad_bridge_env(tmp_path: Path) -> dict[str, str]:
    """An environment whose gbbridge fails at once."""
    tools = tmp_path / "tools"
    if not tools.exists():
        tools.mkdir()
        for t in ("gbprobe", "gbdiscover"):
            (tools / t).symlink_to(BIN / t)
        bad = tools / "gbbridge"
        msg = "gbbridge: unknown flag --timeout (an older gbbridge?)"
        bad.write_text(f"#!/bin/sh\necho '{msg}' >&2\nexit 2\n")
        bad.chmod(0o755)
    return {"GPUBRIDGE_BIN_DIR": str(tools), "GPUBRIDGE_BIN_STRICT": "1"}


def ring_files() -> set[str]:
    """The shm ring files and share sockets in /dev/shm (gbbridge's)."""
    return {p.name for p in Path("/dev/shm").glob("gpubridge-*")}


@needs_tools
@SET_UP_AGREEMENT
def test_bridge_cannot_start_on_one_leader(tmp_path: Path) -> None:
    """Rank 2 (the AMD island's leader) has a gbbridge that fails at once.
    Rank 0's gbbridge, in set-up, is stopped so that it removes its shm
    ring file: SIGKILL left ~100 MiB of /dev/shm behind every time."""
    before = ring_files()
    err = same_error(run(tmp_path, {}, {2: bad_bridge_env(tmp_path)}))
    assert err.startswith("gpubridge: set-up failed: rank 2: starting gbbridge serve:"), err
    assert "unknown flag --timeout" in err, err
    assert ring_files() <= before, "a gbbridge stopped in set-up left its ring file"


@needs_tools
def test_bridge_cannot_start_on_rank_0_hosting_the_store(tmp_path: Path) -> None:
    """Rank 0 fails, and the store lives in its process (plain env://): it
    must wait until every rank has read the outcome before it raises, or
    the others would see a connection error instead of the reason."""
    err = same_error(run(tmp_path, {}, {0: bad_bridge_env(tmp_path)}, store_on_rank0=True))
    assert err.startswith("gpubridge: set-up failed: rank 0: starting gbbridge serve:"), err


@needs_tools
@SET_UP_AGREEMENT
def test_bridge_cannot_start_on_both_leaders(tmp_path: Path) -> None:
    """Both leaders fail (the issue's /dev/shm case hits every leader of a
    host): the first cause recorded wins, and every rank raises that one."""
    env = bad_bridge_env(tmp_path)
    err = same_error(run(tmp_path, {}, {0: env, 2: env}, store_on_rank0=True))
    assert err.startswith(("gpubridge: set-up failed: rank 0: ", "gpubridge: set-up failed: rank 2: ")), err
    assert "unknown flag --timeout" in err, err


@needs_tools
@SET_UP_AGREEMENT
@pytest.mark.skipif(os.geteuid() != 0, reason="needs root: a mount namespace with a tiny /dev/shm")
def test_dev_shm_full_on_one_leader(tmp_path: Path) -> None:
    """Rank 2 runs in a mount namespace whose /dev/shm is a 64 KiB tmpfs: its
    gbbridge cannot allocate its ring file (the issue's case)."""
    unshare = shutil.which("unshare")
    assert unshare, "unshare (util-linux) is missing"
    wrap = [unshare, "--mount", "--propagation", "private", "sh", "-c",
            'mount -t tmpfs -o size=64k gbtest /dev/shm && exec "$@"', "sh"]  # fmt: skip
    err = same_error(run(tmp_path, {2: wrap}, {}))
    assert err.startswith("gpubridge: set-up failed: rank 2:"), err
    assert "/dev/shm" in err, err


def start_job(outdir: Path, port: int, hold: Path | None = None) -> list[subprocess.Popen[bytes]]:
    """A 2+2 env:// job whose rank 0 hosts the store on port (as a plain
    env:// launch does), with no run id: the default namespace."""
    outdir.mkdir()
    procs = []
    for r in range(len(VENDORS)):
        env = rank_env(outdir, r, port)
        cmd = [sys.executable, str(HERE / "setup_worker.py"), str(outdir), *([str(hold)] if hold else [])]
        log = (outdir / f"rank{r}.log").open("wb")
        procs.append(subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT, cwd=outdir))
    return procs


def finish(procs: list[subprocess.Popen[bytes]], outdir: Path) -> list[dict]:
    try:
        for p in procs:
            p.wait(timeout=TIMEOUT_S * 4 + scale(60))
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
            p.wait()
    out = []
    for r in range(len(procs)):
        f = outdir / f"rank{r}.json"
        log = (outdir / f"rank{r}.log").read_text(errors="replace")
        assert f.exists(), f"{outdir.name} rank {r} wrote no result:\n{log[-4000:]}"
        out.append(json.loads(f.read_text()))
    return out


@needs_tools
def test_second_job_on_the_same_port(tmp_path: Path) -> None:
    """Two env:// jobs with the same MASTER_PORT and no run id: job B's rank 0
    cannot listen, its ranks 1-3 reach job A's store. They must fail naming
    the processes that hold their ranks, in bounded time, and job A must not
    notice (they used to adopt A's outcome and fail three ways or hang)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    hold = tmp_path / "hold"
    a = start_job(tmp_path / "a", port, hold)
    try:
        end = time.monotonic() + scale(120)
        while not all((tmp_path / "a" / f"rank{r}.ready").exists() for r in range(4)):
            assert time.monotonic() < end, "job A did not start"
            assert all(p.poll() is None for p in a), "a rank of job A ended early"
            time.sleep(0.1)
        b_res = finish(start_job(tmp_path / "b", port), tmp_path / "b")
    finally:
        hold.touch()
    a_res = finish(a, tmp_path / "a")
    assert all(res.get("ok") and res["sum"] == [4.0] * 4 for res in a_res), a_res
    assert "EADDRINUSE" in b_res[0].get("error", "") or "in use" in b_res[0].get("error", ""), b_res[0]
    for r in (1, 2, 3):
        err = b_res[r].get("error", "")
        assert f"rank {r} is already claimed" in err and "another job" in err, (r, err)
        assert f"pid {a[r].pid}" in err, (r, a[r].pid, err)
        assert b_res[r]["elapsed"] < TIMEOUT_S + scale(30), b_res[r]
    assert not bridge_pids(str(tmp_path / "a")) and not bridge_pids(str(tmp_path / "b"))


def test_stale_private_dirs_are_removed(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A killed rank leaves its gpubridge-<pid>-* directory; the next group
    created by this user removes it, and keeps the live ones: those whose
    lock a living process holds, even when their pid means nothing here (a
    process in another pid namespace sharing /tmp)."""
    import fcntl  # noqa: PLC0415
    import tempfile  # noqa: PLC0415

    from gpubridge import _setup  # noqa: PLC0415

    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    p = subprocess.Popen(["true"])  # a pid that is gone
    p.wait()
    old_style = tmp_path / f"gpubridge-{p.pid}-abc"  # no lock: judged by its pid
    (old_style / "x").mkdir(parents=True)
    unlocked = tmp_path / "gpubridge-1-def"  # a lock nobody holds: its process is gone
    unlocked.mkdir()
    (unlocked / ".lock").touch()
    foreign = tmp_path / f"gpubridge-{p.pid}-ghi"  # a dead pid here, but its lock is held
    foreign.mkdir()
    (foreign / ".lock").touch()
    holder = subprocess.Popen(
        [sys.executable, "-c", "import fcntl,sys,time; f=open(sys.argv[1]); fcntl.flock(f, fcntl.LOCK_EX); "
         "print('held', flush=True); time.sleep(60)", str(foreign / ".lock")],
        stdout=subprocess.PIPE,
    )  # fmt: skip
    try:
        assert holder.stdout is not None and holder.stdout.readline() == b"held\n"
        other = tmp_path / "gpubridge-notapid-x"
        other.mkdir()
        mine = _setup.private_dir()
        assert not old_style.exists() and not unlocked.exists()
        assert foreign.exists() and other.exists() and mine.exists()
        # This process's own directory is locked while it lives, and goes
        # with its lock.
        with open(mine / ".lock") as f, pytest.raises(BlockingIOError):
            fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
        _setup.remove_stale_dirs()
        assert mine.exists() and foreign.exists()
        _setup.remove_private_dir(mine)
        assert not mine.exists()
    finally:
        holder.kill()
        holder.wait()
    _setup.remove_stale_dirs()
    assert not foreign.exists(), "its holder is gone"


def test_a_directory_being_made_is_not_stale(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Another process's remove_stale_dirs at the worst moment of
    private_dir (the lock file made, not yet locked) keeps the directory:
    in CI a rank's directory vanished that way while it ran discovery
    ("No such file or directory: .../topology.json")."""
    import fcntl  # noqa: PLC0415
    import tempfile  # noqa: PLC0415

    from gpubridge import _setup  # noqa: PLC0415

    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    real = fcntl.flock
    raced = []

    def flock(fd: int, op: int) -> None:
        if op == fcntl.LOCK_EX and not raced:  # private_dir's blocking lock
            # A stranger's sweep, as from another process: a new open file
            # description, so its LOCK_NB would win over an unlocked file.
            raced.append(True)
            _setup.remove_stale_dirs()
        real(fd, op)

    monkeypatch.setattr(fcntl, "flock", flock)
    d = _setup.private_dir()
    try:
        assert raced and d.exists() and (d / ".lock").exists(), "the sweep took a live directory"
        (d / "topology.json").write_text("{}")
    finally:
        _setup.remove_private_dir(d)
