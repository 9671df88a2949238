"""A rank lost in the middle of a job: every surviving rank raises the same
clear error within the group's timeout, and nothing is left running.

The ranks are started as plain processes with an env:// rendezvous on a store
this test hosts (as torchrun's agent or a Slurm launch would), not under
torchrun, whose agent would tear the survivors down itself.
"""

from __future__ import annotations

import datetime
import json
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch.distributed as dist
from test_backend import bridge_pids, job_env, needs_tools  # (tests/ is on sys.path under pytest)

HERE = Path(__file__).resolve().parent
TIMEOUT_S = 20


def launch_env(
    tmp_path: Path, vendors: list[str], victim: int, mode: str
) -> tuple[list[dict], float, list[int]]:
    store = dist.TCPStore(
        "127.0.0.1", 0, None, True, timeout=datetime.timedelta(seconds=60), wait_for_workers=False
    )
    procs = []
    for r, v in enumerate(vendors):
        env = dict(
            job_env(tmp_path), RANK=str(r), LOCAL_RANK=str(r), WORLD_SIZE=str(len(vendors)),
            LOCAL_WORLD_SIZE=str(len(vendors)),
            MASTER_ADDR="127.0.0.1", MASTER_PORT=str(store.port), TORCHELASTIC_USE_AGENT_STORE="True",
            GPUBRIDGE_VENDOR=v, GPUBRIDGE_NAMESPACE=f"kill-{tmp_path.name}", KILL_TEST_TIMEOUT=str(TIMEOUT_S),
        )  # fmt: skip
        log = (tmp_path / f"rank{r}.log").open("wb")
        procs.append(
            subprocess.Popen(
                [sys.executable, str(HERE / "kill_worker.py"), str(tmp_path), str(victim), mode],
                env=env,
                stdout=log,
                stderr=subprocess.STDOUT,
                cwd=tmp_path,
            )
        )
    start = time.monotonic()
    try:
        for r, p in enumerate(procs):
            if r == victim:
                continue
            p.wait(timeout=TIMEOUT_S * 3 + 60)
        elapsed = time.monotonic() - start
    finally:
        for p in procs:
            if p.poll() is None:
                p.send_signal(signal.SIGCONT)
                p.kill()
            p.wait()
    results = []
    for r in range(len(vendors)):
        if r == victim:
            results.append({})
            continue
        f = tmp_path / f"rank{r}.json"
        log = (tmp_path / f"rank{r}.log").read_text(errors="replace")
        assert f.exists(), f"rank {r} wrote no result:\n{log[-4000:]}"
        results.append(json.loads(f.read_text()))
    return results, elapsed, [p.pid for p in procs]


@needs_tools
@pytest.mark.parametrize(
    ("vendors", "victim"),
    [
        (["nvidia", "nvidia", "amd", "amd"], 3),  # a member of the second island
        (["nvidia", "nvidia", "amd", "amd"], 0),  # a leader
        (["nvidia", "nvidia", "nvidia", "amd"], 1),
    ],
)
def test_killed_rank(tmp_path: Path, vendors: list[str], victim: int) -> None:
    results, _, pids = launch_env(tmp_path, vendors, victim, "kill")
    t_kill = float((tmp_path / "victim").read_text())
    errors = []
    for r, res in enumerate(results):
        if r == victim:
            continue
        assert "error" in res, f"rank {r} did not fail: {res}"
        assert res["at"] - t_kill < TIMEOUT_S + 10, (
            f"rank {r} failed {res['at'] - t_kill:.1f}s after the kill"
        )
        # the root cause, the same on every rank, comes first
        errors.append(res["error"].split(" (on rank ")[0])
    assert len(set(errors)) == 1, errors
    assert errors[0].startswith("gpubridge: rank "), errors[0]
    assert f"rank {victim} (pid {pids[victim]}) no longer running" in errors[0] or "member" in errors[0], (
        errors[0]
    )
    assert not bridge_pids(str(tmp_path)), "gbbridge serve left running"
    for pid in pids:
        assert not Path(f"/proc/{pid}").exists() or "Z" in Path(f"/proc/{pid}/stat").read_text().split()[2]


@needs_tools
def test_stalled_rank(tmp_path: Path) -> None:
    """A rank stopped with SIGSTOP: its island peer times out after the
    group's timeout, names it, and every other rank follows at once."""
    results, _, pids = launch_env(tmp_path, ["nvidia", "nvidia", "amd", "amd"], 3, "stop")
    t_stop = float((tmp_path / "victim").read_text())
    errors = []
    for r in (0, 1, 2):
        res = results[r]
        assert "error" in res, f"rank {r} did not fail: {res}"
        assert res["at"] - t_stop < TIMEOUT_S + 15, (
            f"rank {r} failed {res['at'] - t_stop:.1f}s after the stop"
        )
        errors.append(res["error"].split(" (on rank ")[0])
    assert len(set(errors)) == 1, errors
    assert f"rank 3 (pid {pids[3]}) stopped" in errors[0], errors[0]
    # While they waited, in_flight() showed each survivor inside the same
    # all_reduce (same sequence number), in a step of its own.
    seen = [results[r]["in_flight"] for r in (0, 1, 2)]
    assert all(len(s) == 1 and s[0]["op"] == "allreduce" for s in seen), seen
    assert len({s[0]["seq"] for s in seen}) == 1, seen
    assert all(s[0]["step"] in ("island reduce", "bridge", "island broadcast") for s in seen), seen
    assert not bridge_pids(str(tmp_path)), "gbbridge serve left running"
    for pid in pids:
        assert not Path(f"/proc/{pid}").exists() or "Z" in Path(f"/proc/{pid}/stat").read_text().split()[2]
