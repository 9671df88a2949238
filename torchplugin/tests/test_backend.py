"""The gpubridge torch.distributed backend, in simulation, under torchrun.

Each test launches a real job (``python -m torch.distributed.run
--standalone``) of tests/backend_worker.py: GPUBRIDGE_VENDOR is set per rank,
every rank all_reduces and broadcasts tensors of every supported dtype and op
through the backend and compares them bit for bit with a flat Gloo world
group of the same job. Afterwards no gbbridge serve may be left.
"""

from __future__ import annotations

import datetime
import json
import os
import sys
from pathlib import Path
from typing import Any

import hung
import pytest
import torch.distributed as dist
from testenv import scale

from gpubridge._discovery import store_address
from gpubridge._tools import find_tool

HERE = Path(__file__).resolve().parent
PKG = HERE.parent
REPO = PKG.parent
BIN = REPO / "bin"
TOOLS = [BIN / "gbprobe", BIN / "gbdiscover", BIN / "gbbridge"]
WORKER = HERE / "backend_worker.py"
TIMEOUT = scale(120)

needs_tools = pytest.mark.skipif(
    not all(os.access(t, os.X_OK) for t in TOOLS),
    reason=f"needs bin/gbprobe, bin/gbdiscover and bin/gbbridge: run `make build` in {REPO}",
)
GBTRACE = BIN / "gbtrace"
needs_gbtrace = pytest.mark.skipif(
    not os.access(GBTRACE, os.X_OK), reason=f"needs bin/gbtrace: run `make build` in {REPO}"
)


def bridge_pids(tag: str | None = None) -> set[int]:
    """Living (non-zombie) gbbridge serve processes on this host; with tag,
    only those started with GPUBRIDGE_TEST_TAG=tag in their environment (the
    tests' own: other jobs on the machine may run gbbridge too)."""
    out = set()
    want = f"GPUBRIDGE_TEST_TAG={tag}".encode() if tag else None
    for d in os.listdir("/proc"):
        if not d.isdigit():
            continue
        try:
            cmd = Path(f"/proc/{d}/cmdline").read_bytes().split(b"\0")
            if not alive(d) or not cmd or not cmd[0].endswith(b"gbbridge") or b"serve" not in cmd:
                continue
            if want is not None and want not in Path(f"/proc/{d}/environ").read_bytes().split(b"\0"):
                continue
        except OSError:
            continue
        out.add(int(d))
    return out


def alive(pid: int | str) -> bool:
    fields = hung.stat(pid)
    return fields is not None and fields[0] != "Z"


def job_env(tmp_path: Path) -> dict[str, str]:
    """The environment of a test job's ranks: the built tools, the package,
    one thread each, a tag on their processes (see bridge_pids), every call
    compared between ranks (GPUBRIDGE_CHECK_CALLS), and none of the caller's
    gpubridge settings."""
    env = dict(
        os.environ, GPUBRIDGE_BIN_DIR=str(BIN), PYTHONPATH=str(PKG), OMP_NUM_THREADS="1",
        GPUBRIDGE_TEST_TAG=str(tmp_path), GPUBRIDGE_CHECK_CALLS="1",
    )  # fmt: skip
    for k in (
        "GPUBRIDGE_VENDOR", "GPUBRIDGE_SIM_ISLAND", "GPUBRIDGE_BRIDGE", "GPUBRIDGE_NAMESPACE",
        "GPUBRIDGE_COMPRESSION", "GPUBRIDGE_POLICY", "GPUBRIDGE_THRESHOLDS",
    ):  # fmt: skip
        env.pop(k, None)
    env.pop("TORCHELASTIC_RUN_ID", None)
    return env


def run_job(
    tmp_path: Path, worker: Path, ranks: int, args: list[str], timeout: float = TIMEOUT
) -> tuple[int, list[dict[str, Any]], str]:
    """Runs worker under torchrun with ranks ranks (argv: args); every rank
    writes tmp_path/rank<R>.json. Returns the exit status, every rank's
    result and the output, after checking that no gbbridge serve of the job
    is left running."""
    cmd = [
        sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(ranks),
        str(worker), *args,
    ]  # fmt: skip
    env = job_env(tmp_path)

    def wrote() -> str:
        return f"ranks with a result: {[r for r in range(ranks) if (tmp_path / f'rank{r}.json').exists()]}"

    p = hung.run(cmd, timeout=timeout, note=wrote, env=env, cwd=tmp_path)
    output = (p.stdout + p.stderr).decode("utf-8", "replace")
    results = []
    for r in range(ranks):
        f = tmp_path / f"rank{r}.json"
        assert f.exists(), f"rank {r} wrote no result (exit {p.returncode}):\n{output[-6000:]}"
        results.append(json.loads(f.read_text()))
    left = bridge_pids(str(tmp_path))
    assert not left, f"gbbridge serve left running: {left}"
    for res in results:
        if res.get("bridge_pid"):
            assert not alive(res["bridge_pid"]), f"gbbridge serve {res['bridge_pid']} still runs"
    return p.returncode, results, output


def launch(tmp_path: Path, vendors: list[str], mode: str = "") -> tuple[int, list[dict[str, Any]], str]:
    """Runs backend_worker.py under torchrun, one rank per vendor."""
    return run_job(
        tmp_path, WORKER, len(vendors), [",".join(vendors), str(tmp_path), *([mode] if mode else [])]
    )


def check_ok(rc: int, results: list[dict[str, Any]], output: str) -> None:
    for r, res in enumerate(results):
        assert res.get("ok"), f"rank {r}: {res.get('error')}\n{output[-6000:]}"
    assert rc == 0, output[-6000:]
    assert len({json.dumps(res["refused"]) for res in results}) == 1, "refusals differ between ranks"
    assert all(res["checks"] == results[0]["checks"] > 0 for res in results)


@needs_tools
def test_two_islands_2_2(tmp_path: Path) -> None:
    rc, results, out = launch(tmp_path, ["nvidia", "nvidia", "amd", "amd"])
    check_ok(rc, results, out)
    assert results[0]["islands"] in ([[0, 1], [2, 3]], [[2, 3], [0, 1]])
    assert all(res["transport"] != "none" for res in results)
    leaders = [r for r, res in enumerate(results) if res["role"] == "leader"]
    assert len(leaders) == 2
    assert all(results[r]["bridge_pid"] for r in leaders)
    assert all(results[r]["bridge_exit"] == 0 for r in leaders), results  # a clean BYE
    assert all(results[r]["exchanged"] == 0 for r in leaders), "a CPU job reduces in gbbridge"
    refused = results[0]["refused"]
    for what in ("PRODUCT", "all_to_all", "reduce", "any-source recv", "non-contiguous", "dtype"):
        assert any(x.startswith(what + ":") and "gpubridge" in x for x in refused), (what, refused)


@needs_tools
def test_caller_reduces(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The GPU path's "exchange, reduce on the caller" all_reduce, on CPU
    tensors (GPUBRIDGE_BRIDGE_REDUCE=caller): every check of the job passes
    with the leaders reducing the exchanged partials themselves (small copy
    chunks and reduction spans: many of each per call, the peer's ranges in
    any order); without the setting a CPU job leaves the reduction to
    gbbridge."""
    monkeypatch.setenv("GPUBRIDGE_BRIDGE_REDUCE", "caller")
    monkeypatch.setenv("GPUBRIDGE_COPY_CHUNK", "4096")
    monkeypatch.setenv("GPUBRIDGE_REDUCE_SPAN", "12288")
    rc, results, out = launch(tmp_path, ["nvidia", "nvidia", "amd", "amd"])
    check_ok(rc, results, out)
    leaders = [res for res in results if res["role"] == "leader"]
    assert len(leaders) == 2 and all(res["exchanged"] > 0 for res in leaders), leaders
    assert len({res["exchanged"] for res in leaders}) == 1, "the leaders disagree on where to reduce"


@needs_tools
def test_two_islands_3_1(tmp_path: Path) -> None:
    rc, results, out = launch(tmp_path, ["nvidia", "nvidia", "nvidia", "amd"])
    check_ok(rc, results, out)
    assert sorted(results[0]["islands"]) == [[0, 1, 2], [3]]


@needs_tools
def test_three_islands_2_2_2(tmp_path: Path) -> None:
    rc, results, out = launch(tmp_path, ["nvidia", "nvidia", "amd", "amd", "amd:b", "amd:b"])
    check_ok(rc, results, out)
    assert sorted(results[0]["islands"]) == [[0, 1], [2, 3], [4, 5]]
    leaders = [r for r, res in enumerate(results) if res["role"] == "leader"]
    assert leaders == [0, 2, 4]
    assert all(results[r]["bridge_exit"] == 0 for r in leaders), results


@needs_tools
def test_single_rank(tmp_path: Path) -> None:
    rc, results, out = launch(tmp_path, ["nvidia"])
    check_ok(rc, results, out)
    assert results[0]["transport"] == "none" and results[0]["islands"] == [[0]]


@needs_tools
def test_two_islands_1_1(tmp_path: Path) -> None:
    rc, results, out = launch(tmp_path, ["nvidia", "amd"])
    check_ok(rc, results, out)
    assert all(res["transport"] != "none" and res["role"] == "leader" for res in results)
    assert all(res["bridge_exit"] == 0 for res in results), results


@needs_tools
def test_single_vendor_no_bridge(tmp_path: Path) -> None:
    rc, results, out = launch(tmp_path, ["amd"] * 4)
    check_ok(rc, results, out)
    assert all(res["transport"] == "none" and res["bridge_pid"] is None for res in results)
    assert results[0]["islands"] == [[0, 1, 2, 3]]


@needs_tools
def test_mismatched_setting_fails_everywhere(tmp_path: Path) -> None:
    rc, results, _ = launch(tmp_path, ["nvidia", "nvidia", "amd", "amd"], mode="badbridge")
    assert rc != 0
    errors = [res.get("error") for res in results]
    assert all(errors), results
    assert len(set(errors)) == 1, errors
    assert errors[0].startswith("gpubridge: discovery failed:"), errors[0]
    assert "bridge" in errors[0], errors[0]


@needs_tools
@pytest.mark.parametrize(
    ("mode", "want"),
    [
        ("mismatch-op", "allreduce(float32[4], SUM) on ranks 0, 2, 3; allreduce(float32[4], MAX) on rank 1"),
        (
            "mismatch-size",
            "allreduce(float32[4], SUM) on ranks 0, 2, 3; allreduce(float32[5], SUM) on rank 1",
        ),
    ],
)
def test_mismatched_calls_in_an_island(tmp_path: Path, mode: str, want: str) -> None:
    """Rank 1 calls all_reduce differently from its island's leader: with
    GPUBRIDGE_CHECK_CALLS every rank raises the same error naming both calls
    and their ranks (without it, the result was a silent mix of both, or a
    crash inside Gloo)."""
    rc, results, out = launch(tmp_path, ["nvidia", "nvidia", "amd", "amd"], mode=mode)
    assert rc != 0
    roots = []
    for r, res in enumerate(results):
        err = res.get("error", "")
        assert f"mismatched calls: {want}" in err, f"rank {r}: {err}\n{out[-3000:]}"
        roots.append(err.split(" (on rank ")[0])
    assert len(set(roots)) == 1, roots


def test_missing_tool_is_named(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("GPUBRIDGE_BIN_DIR", str(tmp_path))
    with pytest.raises(RuntimeError, match="gbnosuchtool was not found"):
        find_tool("gbnosuchtool")


@needs_tools
def test_tool_found_in_bin_dir(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("GPUBRIDGE_BIN_DIR", str(BIN))
    assert find_tool("gbdiscover") == str(BIN / "gbdiscover")


def test_store_address_walks_prefix_stores() -> None:
    tcp = dist.TCPStore("127.0.0.1", 0, 1, True, timeout=datetime.timedelta(seconds=10))
    s = dist.PrefixStore("a/", dist.PrefixStore("b/", tcp))
    assert store_address(s) == ("127.0.0.1", tcp.port)
    with pytest.raises(RuntimeError, match="not a TCPStore"):
        store_address(dist.HashStore())
