"""Point-to-point between any two ranks, in simulation, under torchrun
(tests/p2p_worker.py): every pair of ranks in both directions at once, with
tags (past 2^24 too), bit for bit, across islands over each pair's own bridge (between
leaders: bridge 0) on endpoints started on first need; and a job that only
needs the leaders starts no endpoint anywhere else. Afterwards no gbbridge
serve may be left (run_job checks)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from test_backend import needs_tools, run_job  # (tests/ is on sys.path under pytest)
from testenv import scale

from gpubridge._endpoints import pair_bridge

HERE = Path(__file__).resolve().parent
WORKER = HERE / "p2p_worker.py"
# 2+2 runs isend/irecv, batch_isend_irecv and send/recv on every torch; the
# other layouts change only gpubridge's routing between the same calls.
OTHER_LAYOUT = pytest.mark.torch_independent("another layout: gpubridge's routing of the calls 2+2 runs")


def launch(tmp_path: Path, vendors: list[str], mode: str) -> list[dict[str, Any]]:
    # The job's deadline leaves room for the workers' group timeout (60 s
    # scaled) after a slow start: a stalled call is reported by the ranks.
    args = [",".join(vendors), str(tmp_path), mode]
    rc, results, out = run_job(tmp_path, WORKER, len(vendors), args, timeout=scale(180))
    for r, res in enumerate(results):
        assert res.get("ok"), f"rank {r}: {res.get('error')}\n{out[-6000:]}"
    assert rc == 0, out[-6000:]
    assert all(res["checks"] > 0 for res in results), results
    return results


def expected_bridges(islands: list[list[int]], rank: int) -> list[str]:
    """The pair bridges rank joins when it talks to every rank: one per
    peer of another island, but none between two leaders (bridge 0)."""
    leaders = {i[0] for i in islands}
    mine = next(i for i in islands if rank in i)
    return sorted(
        pair_bridge(rank, p)[0]
        for i in islands
        if i is not mine
        for p in i
        if not (rank in leaders and p in leaders)
    )


@needs_tools
@pytest.mark.parametrize(
    "vendors",
    [
        ["nvidia", "nvidia", "amd", "amd"],
        pytest.param(["nvidia", "nvidia", "nvidia", "amd"], marks=OTHER_LAYOUT),
        pytest.param(["nvidia", "amd"], marks=OTHER_LAYOUT),
        pytest.param(["nvidia", "nvidia", "amd", "amd", "amd:b", "amd:b"], marks=OTHER_LAYOUT),
    ],
    ids=["2+2", "3+1", "1+1", "2+2+2"],
)
def test_every_pair(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, vendors: list[str]) -> None:
    monkeypatch.setenv("GPUBRIDGE_P2P_CHUNK", "4096")  # several chunks per message
    results = launch(tmp_path, vendors, "pairs")
    n = len(vendors)
    assert all(res["checks"] == 13 * (n - 1) for res in results), [res["checks"] for res in results]
    islands = results[0]["islands"]
    for r, res in enumerate(results):
        assert res["endpoint"], f"rank {r} has no endpoint"
        assert res["lazily_started"] == (res["role"] != "leader"), (r, res)
        assert res["bridges"] == expected_bridges(islands, r), (r, res["bridges"])
        assert res["bridge_exit"] == 0, (r, res)  # a clean BYE, every bridge fine
        assert res["channels_left"] == 0, (r, res)  # idle channels are dropped


@needs_tools
@pytest.mark.torch_independent("which ranks start an endpoint is gpubridge's")
def test_leaders_only_job_starts_no_endpoint(tmp_path: Path) -> None:
    """Collectives, P2P inside islands and between leaders: only the
    leaders run gbbridge serve, and they join no other bridge."""
    results = launch(tmp_path, ["nvidia", "nvidia", "amd", "amd"], "leaders")
    for r, res in enumerate(results):
        leader = res["role"] == "leader"
        assert res["endpoint"] == leader and not res["lazily_started"], (r, res)
        assert res["bridges"] == [], (r, res)
