"""A process lost in the middle of a job: every surviving rank raises the
same clear error, naming what died, within the group's timeout; nothing
crashes and nothing is left running.

Faults (at step 5): a rank SIGKILLed, a rank SIGSTOPped, a leader's
``gbbridge serve`` SIGKILLed; each for rank 0 (a leader), the other island's
leader (rank 2) and a non-leader (rank 3, or rank 1 in 3+1), under a loop of
all_reduce calls, DistributedDataParallel and FSDP2. The ranks are started
as plain processes with an env:// rendezvous on a store this test hosts (as
torchrun's agent or a Slurm launch would), not under torchrun, whose agent
would tear the survivors down itself.
"""

from __future__ import annotations

import datetime
import json
import re
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch.distributed as dist
from test_backend import bridge_pids, job_env, needs_tools  # (tests/ is on sys.path under pytest)
from testenv import scale

from gpubridge import _failure, _setup

HERE = Path(__file__).resolve().parent
TIMEOUT_S = round(scale(20))
TWO_TWO = ["nvidia", "nvidia", "amd", "amd"]


@dataclass
class Outcome:
    results: list[dict[str, Any]]  # per rank ({} for the victim unless it survives)
    fault: dict[str, Any]  # when, and the pid of what died
    pids: list[int]
    logs: list[str]


def run_fault(
    tmp_path: Path, vendors: list[str], victim: int, mode: str, workload: str, check_calls: bool = True,
    extra: dict[str, str] | None = None,
) -> Outcome:  # fmt: skip
    """Runs the job with the fault; check_calls=False runs it as users do by
    default, without GPUBRIDGE_CHECK_CALLS (the suite otherwise has it on);
    extra: more environment for every rank."""
    store = dist.TCPStore(
        "127.0.0.1", 0, None, True, timeout=datetime.timedelta(seconds=scale(60)), wait_for_workers=False
    )
    procs = []
    for r, v in enumerate(vendors):
        env = dict(
            job_env(tmp_path), RANK=str(r), LOCAL_RANK=str(r), WORLD_SIZE=str(len(vendors)),
            LOCAL_WORLD_SIZE=str(len(vendors)),
            MASTER_ADDR="127.0.0.1", MASTER_PORT=str(store.port), TORCHELASTIC_USE_AGENT_STORE="True",
            GPUBRIDGE_VENDOR=v, GPUBRIDGE_NAMESPACE=f"fault-{tmp_path.name}",
            KILL_TEST_TIMEOUT=str(TIMEOUT_S), GPUBRIDGE_CHECK_CALLS="1" if check_calls else "0",
            **(extra or {}),
        )  # fmt: skip
        log = (tmp_path / f"rank{r}.log").open("wb")
        cmd = [sys.executable, str(HERE / "fault_worker.py"), str(tmp_path), str(victim), mode, workload]
        procs.append(subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT, cwd=tmp_path))
    survives = mode == "bridge"
    try:
        for r, p in enumerate(procs):
            if r != victim or survives:
                p.wait(timeout=TIMEOUT_S * 3 + scale(60))
    finally:
        for p in procs:
            if p.poll() is None:
                p.send_signal(signal.SIGCONT)
                p.kill()
            p.wait()
    logs = [(tmp_path / f"rank{r}.log").read_text(errors="replace") for r in range(len(vendors))]
    results = []
    for r in range(len(vendors)):
        f = tmp_path / f"rank{r}.json"
        if r == victim and not survives:
            results.append({})
            continue
        assert f.exists(), f"rank {r} wrote no result (exit {procs[r].returncode}):\n{logs[r][-4000:]}"
        results.append(json.loads(f.read_text()))
    fault = json.loads((tmp_path / "victim").read_text())
    return Outcome(results, fault, [p.pid for p in procs], logs)


# "gpubridge: <root cause>" up to " (on rank N: what failed there)", or up to
# the end of the first line: torch prefixes what DDP's reducer raises and
# appends a traceback.
_ROOT = re.compile(r"gpubridge: (.*?)(?: \(on rank \d+: |\n|$)")


def test_refused_call_names_the_root_cause_first() -> None:
    """A rank whose first error is a call refused on the broken group (its
    failed isend's Work surfaced later) words it as fail() does: the root
    cause first, so root_causes reads the same cause from every rank."""
    b = _failure.Breaker(dist.HashStore(), 3, 4, lambda: None, lambda: None)
    b.refuse("recv")  # not broken: nothing to refuse
    b.error = (
        "rank 3: send (collective #0, step p2p): gbbridge serve of rank 3 (pid 1) was killed by SIGKILL "
        "(send to rank 1 (tag 1): gpubridge feed: write: [Errno 32] Broken pipe)"
    )
    with pytest.raises(RuntimeError) as info:
        b.refuse("recv")
    m = _ROOT.search(str(info.value))
    assert m and m.group(1) == b.error, str(info.value)
    assert str(info.value).endswith("(on rank 3: recv refused: the group is broken)")


def root_causes(out: Outcome, survivors: list[int]) -> str:
    """The root cause every survivor names (they must all name the same one)."""
    causes = []
    for r in survivors:
        res = out.results[r]
        assert "error" in res, f"rank {r} did not fail: {res}\n{out.logs[r][-3000:]}"
        assert "Segmentation fault" not in out.logs[r], out.logs[r][-4000:]
        m = _ROOT.search(res["error"])
        assert m, res["error"]
        causes.append(m.group(1))
    assert len(set(causes)) == 1, causes
    return causes[0]


def check_clean(out: Outcome, tmp_path: Path) -> None:
    """Nothing of the job runs any more. A stopped leader's gbbridge serve
    lives until the test kills that rank, then goes with it (PDEATHSIG):
    give it a moment."""
    end = time.monotonic() + scale(10)
    while bridge_pids(str(tmp_path)) and time.monotonic() < end:
        time.sleep(0.1)
    assert not bridge_pids(str(tmp_path)), "gbbridge serve left running"
    for pid in out.pids:
        p = Path(f"/proc/{pid}/stat")
        state = p.read_text().rsplit(")", 1)[1].split()[0] if p.exists() else "gone"
        assert state in ("gone", "Z"), f"rank pid {pid} still runs"


def check_in_time(out: Outcome, survivors: list[int], budget: float) -> None:
    for r in survivors:
        late = out.results[r]["at"] - out.fault["at"]
        assert late < budget, f"rank {r} failed {late:.1f}s after the fault (budget {budget:.0f}s)"


WORKLOADS = ["loop", "ddp", "fsdp"]
# Which rank dies is gpubridge's logic, the same on every torch; how a failed
# call lands in DDP's reducer or FSDP is torch's. So the runs on the other
# torch versions (ci/torch-suite.sh: -m "not victim_matrix and not
# torch_independent") keep a killed rank under DDP and under FSDP, and the
# exited rank under DDP (the reducer's old SIGSEGV); how each other fault is
# found (a timeout, a dead gbbridge serve, a lost point-to-point peer) is
# gpubridge's, and its failed Work reaches DDP and FSDP the same way: those
# run on the project's torch only, as do the further victims.
VICTIM_MATRIX = pytest.mark.victim_matrix
FOUND_BY_GPUBRIDGE = pytest.mark.torch_independent(
    "how the fault is found is gpubridge's; its failed Work reaches DDP and FSDP as test_killed_rank's does"
)
# The loop workload: plain all_reduce calls, whose Work test_backend checks on every torch.
KEPT_WORKLOADS = [
    pytest.param("loop", marks=pytest.mark.torch_independent("plain all_reduce calls: test_backend's Work")),
    "ddp",
    "fsdp",
]
CASES = [  # vendors, victim, what the victim is
    pytest.param(TWO_TWO, 0, "rank 0, a leader", marks=VICTIM_MATRIX),
    pytest.param(TWO_TWO, 2, "the other island's leader", marks=VICTIM_MATRIX),
    (TWO_TWO, 3, "a non-leader"),
]


@needs_tools
@pytest.mark.parametrize("workload", KEPT_WORKLOADS)
@pytest.mark.parametrize(("vendors", "victim", "_what"), CASES)
def test_killed_rank(tmp_path: Path, workload: str, vendors: list[str], victim: int, _what: str) -> None:
    out = run_fault(tmp_path, vendors, victim, "kill", workload)
    survivors = [r for r in range(len(vendors)) if r != victim]
    cause = root_causes(out, survivors)
    assert f"rank {victim} (pid {out.pids[victim]}) no longer running" in cause, cause
    check_in_time(out, survivors, TIMEOUT_S + scale(10))
    check_clean(out, tmp_path)
    # The killed rank's private directory is left behind; the next group
    # this user creates removes it (_setup.remove_stale_dirs runs first).
    # The rank named its directories as it died: any group made since (this
    # machine's other jobs included) may have removed them already.
    left = [Path(d) for d in json.loads((tmp_path / "victim").read_text())["dirs"]]
    assert left, "the killed rank had a private directory"
    _setup.remove_stale_dirs()
    assert not [d for d in left if d.exists()]


@needs_tools
@pytest.mark.torch_independent("which call turns a lost peer into the error is gpubridge's (the call check)")
@pytest.mark.parametrize("workload", ["ddp", "fsdp"])
@pytest.mark.parametrize("victim", [pytest.param(0, marks=VICTIM_MATRIX), 3])
def test_killed_rank_without_call_checks(tmp_path: Path, workload: str, victim: int) -> None:
    """As test_killed_rank, with GPUBRIDGE_CHECK_CALLS off (the default): the
    call check's extra all_gather must not be what turns a lost peer into a
    clean error."""
    out = run_fault(tmp_path, TWO_TWO, victim, "kill", workload, check_calls=False)
    survivors = [r for r in range(4) if r != victim]
    cause = root_causes(out, survivors)
    assert f"rank {victim} (pid {out.pids[victim]}) no longer running" in cause, cause
    check_in_time(out, survivors, TIMEOUT_S + scale(10))
    check_clean(out, tmp_path)


@needs_tools
@FOUND_BY_GPUBRIDGE
def test_killed_non_leader_with_an_endpoint(tmp_path: Path) -> None:
    """2+2, every rank exchanging with its counterpart in the other island,
    so non-leaders 1 and 3 run gbbridge serve of their own (pair/1-3): rank 3
    SIGKILLed fails every survivor with one root cause naming it, and no
    gbbridge serve is left (rank 3's goes with it: PDEATHSIG, though it was
    started from a thread that is not the main one)."""
    out = run_fault(tmp_path, TWO_TWO, 3, "kill", "p2p")
    cause = root_causes(out, [0, 1, 2])
    assert f"rank 3 (pid {out.pids[3]}) no longer running" in cause, cause
    check_in_time(out, [0, 1, 2], TIMEOUT_S + scale(10))
    check_clean(out, tmp_path)


@needs_tools
@FOUND_BY_GPUBRIDGE
def test_killed_endpoint_of_a_non_leader(tmp_path: Path) -> None:
    """As test_killed_bridge for the gbbridge serve rank 3 (no leader)
    started on its first exchange: every rank, rank 3 too, fails naming
    that process."""
    out = run_fault(tmp_path, TWO_TWO, 3, "bridge", "p2p")
    cause = root_causes(out, [0, 1, 2, 3])
    assert f"gbbridge serve of rank 3 (pid {out.fault['pid']})" in cause, cause
    check_in_time(out, [0, 1, 2, 3], TIMEOUT_S + scale(10))
    check_clean(out, tmp_path)


@needs_tools
@pytest.mark.torch_independent("a 3+1 layout under plain all_reduce calls: gpubridge's islands")
def test_killed_rank_3_1_non_leader(tmp_path: Path) -> None:
    out = run_fault(tmp_path, ["nvidia", "nvidia", "nvidia", "amd"], 1, "kill", "loop")
    cause = root_causes(out, [0, 2, 3])
    assert f"rank 1 (pid {out.pids[1]}) no longer running" in cause, cause
    check_clean(out, tmp_path)


@needs_tools
@pytest.mark.parametrize(
    "check_calls",
    [pytest.param(True, marks=pytest.mark.torch_independent("the call check is gpubridge's")), False],
)
def test_exited_rank_ddp(tmp_path: Path, check_calls: bool) -> None:
    """The issue's reproduction: a rank leaves with os._exit under DDP (the
    survivors used to die with SIGSEGV in DDP's reducer); also without call
    checks, the default a user runs with."""
    out = run_fault(tmp_path, TWO_TWO, 3, "exit", "ddp", check_calls=check_calls)
    cause = root_causes(out, [0, 1, 2])
    assert f"rank 3 (pid {out.pids[3]}) no longer running" in cause, cause
    check_clean(out, tmp_path)


@needs_tools
@FOUND_BY_GPUBRIDGE
@pytest.mark.parametrize("workload", WORKLOADS)
@pytest.mark.parametrize(("vendors", "victim", "_what"), CASES)
def test_stalled_rank(tmp_path: Path, workload: str, vendors: list[str], victim: int, _what: str) -> None:
    """A rank stopped with SIGSTOP: a peer times out after the group's
    timeout, names it, and every other rank follows at once."""
    out = run_fault(tmp_path, vendors, victim, "stop", workload)
    survivors = [r for r in range(len(vendors)) if r != victim]
    cause = root_causes(out, survivors)
    assert f"rank {victim} (pid {out.pids[victim]}) stopped" in cause, cause
    check_in_time(out, survivors, TIMEOUT_S + scale(15))
    if workload == "loop":
        # While they waited, in_flight() showed each survivor inside the same
        # all_reduce (same sequence number), in a step of its own.
        seen = [out.results[r]["in_flight"] for r in survivors]
        assert all(len(s) == 1 and s[0]["op"] == "allreduce" for s in seen), seen
        assert len({s[0]["seq"] for s in seen}) == 1, seen
        # (the suite compares calls first, GPUBRIDGE_CHECK_CALLS: its all_gather's steps count too)
        steps = ("island reduce", "bridge", "island broadcast", "check calls", "island allgather")
        assert all(s[0]["step"] in steps for s in seen), seen
    check_clean(out, tmp_path)


@needs_tools
@FOUND_BY_GPUBRIDGE
@pytest.mark.parametrize("workload", WORKLOADS)
@pytest.mark.parametrize("victim", [pytest.param(0, marks=VICTIM_MATRIX), 2])
def test_killed_bridge(tmp_path: Path, workload: str, victim: int) -> None:
    """A leader's gbbridge serve SIGKILLed: every rank, its own rank too,
    fails naming that process."""
    out = run_fault(tmp_path, TWO_TWO, victim, "bridge", workload)
    survivors = [0, 1, 2, 3]
    cause = root_causes(out, survivors)
    assert f"gbbridge serve of rank {victim} (pid {out.fault['pid']})" in cause, cause
    check_in_time(out, survivors, TIMEOUT_S + scale(10))
    check_clean(out, tmp_path)


@needs_tools
@FOUND_BY_GPUBRIDGE
def test_killed_non_leader_bridge_under_flat(tmp_path: Path) -> None:
    """GPUBRIDGE_POLICY=flat: DDP's all_reduces put every rank on the flat
    bridge, so non-leader 3 runs a gbbridge serve of its own; SIGKILLed,
    every rank, its own too, fails naming it, and nothing is left."""
    out = run_fault(tmp_path, TWO_TWO, 3, "bridge", "ddp", extra={"GPUBRIDGE_POLICY": "flat"})
    cause = root_causes(out, [0, 1, 2, 3])
    assert f"gbbridge serve of rank 3 (pid {out.fault['pid']})" in cause, cause
    check_in_time(out, [0, 1, 2, 3], TIMEOUT_S + scale(10))
    check_clean(out, tmp_path)


def test_gone_ranks_sees_a_process_on_its_way_out(monkeypatch: pytest.MonkeyPatch) -> None:
    """A SIGKILLed rank closes its sockets before it is a zombie: a peer that
    looks in between sees state R with PF_EXITING, and must name it (under
    load that window made a survivor publish Gloo's "connection reset" as
    the root cause). The window cannot be held open on purpose, so the stat
    lines are given."""
    import socket  # noqa: PLC0415

    host = socket.gethostname()
    stat = {
        "11": "11 (python) R 1 11 11 0 -1 4194560 0 0 0 0",  # running
        "12": "12 (python) R 1 12 12 0 -1 4194564 0 0 0 0",  # running, PF_EXITING
        "13": "13 (py (x)) Z 1 13 13 0 -1 4194564 0 0 0 0",  # zombie; ')' in the name
        "14": "14 (python) T 1 14 14 0 -1 4194560 0 0 0 0",  # stopped
    }

    def fake(pid: str) -> str:
        if pid not in stat:
            raise FileNotFoundError(pid)
        return stat[pid]

    monkeypatch.setattr(_failure, "_proc_stat", fake)
    pids = {r: (host, str(10 + r)) for r in range(1, 6)} | {6: ("elsewhere", "12"), 0: (host, "99")}
    assert _failure.gone_ranks(pids, 0) == [
        "rank 2 (pid 12) no longer running",
        "rank 3 (pid 13) no longer running",
        "rank 4 (pid 14) stopped",
        "rank 5 (pid 15) no longer running",
    ]
