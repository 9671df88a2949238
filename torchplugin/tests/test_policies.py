"""The all_reduce policies (gpubridge._policies) in simulation, under
torchrun (tests/policy_worker.py): flat and sharded bit for bit against a
flat Gloo group and against their documented reference order, the same on
every rank; sharded falling back on unequal islands; auto sending a tiny
all_reduce flat; a policy that differs between ranks failing every rank
alike at discovery; reduce-bridge-broadcast starting no endpoint beyond the
leaders'. Without a job: the choice and the thresholds file."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from test_backend import needs_tools, run_job  # (tests/ is on sys.path under pytest)

from gpubridge._layout import Island, Layout
from gpubridge._policies import choose, flat_bridge, shard_bridge, shard_count
from gpubridge._policy import Policy
from gpubridge._thresholds import BUILTIN, SCHEMA, Thresholds, ThresholdsError
from gpubridge.tune import pick

HERE = Path(__file__).resolve().parent
WORKER = HERE / "policy_worker.py"
pytestmark = pytest.mark.torch_independent(
    "the policies route all_reduce inside gpubridge; test_backend checks its Work on every torch"
)
V22 = ["nvidia", "nvidia", "amd", "amd"]


def launch(
    tmp_path: Path, vendors: list[str], policy: str, mode: str = "check", *extra: str
) -> list[dict[str, Any]]:
    args = [",".join(vendors), str(tmp_path), policy, mode, *extra]
    rc, results, out = run_job(tmp_path, WORKER, len(vendors), args)
    for r, res in enumerate(results):
        assert res.get("ok"), f"rank {r}: {res.get('error')}\n{out[-6000:]}"
    assert rc == 0, out[-6000:]
    assert all(res["checks"] == results[0]["checks"] > 0 for res in results), results
    assert all(res["bridge_exit"] in (None, 0) for res in results), results
    return results


# ---- without a job ----


def layout(sizes: list[int]) -> Layout:
    islands, r = [], 0
    for k, n in enumerate(sizes):
        islands.append(Island(f"i{k}", tuple(range(r, r + n)), r, "gloo"))
        r += n
    members = tuple(i.leader for i in islands)
    return Layout(
        rank=0, size=r, mode="cpu", islands=tuple(islands), island=islands[0], members=members, bridged=True,
        hardware={}, _by_rank={x: i for i in islands for x in i.ranks},
    )  # fmt: skip


def test_choice_and_bridges() -> None:
    th = Thresholds(flat_max_bytes=64, sharded_min_bytes=1 << 20)
    two, uneven = layout([2, 2]), layout([3, 1])
    assert [choose("auto", th, two, n, False).policy for n in (4, 64, 65, 1 << 20)] == [
        "flat", "flat", "reduce-bridge-broadcast", "sharded",
    ]  # fmt: skip
    assert choose("auto", th, uneven, 1 << 20, False).policy == "reduce-bridge-broadcast"
    assert choose("auto", th, two, 4, True).policy == "reduce-bridge-broadcast"  # lossy: the leaders'
    fb = choose("sharded", th, uneven, 4, False)
    assert fb.policy == "reduce-bridge-broadcast" and "3+1" in (fb.fallback or "")
    assert choose("auto", Thresholds(-1, -1), two, 0, False).policy == "reduce-bridge-broadcast"
    assert shard_count(two) == 2 and shard_count(uneven) is None and shard_count(layout([1, 1])) is None
    assert shard_bridge(two, 0) == (None, (0, 2)) and shard_bridge(two, 1) == ("shard/1", (1, 3))
    assert flat_bridge(two) == ("flat", (0, 1, 2, 3)) and flat_bridge(layout([1, 1])) == (None, (0, 1))


def test_thresholds_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    f = tmp_path / "t.json"
    f.write_text(BUILTIN.to_json({"measured": []}))
    t = Thresholds.read(str(f))
    assert (t.flat_max_bytes, t.sharded_min_bytes, t.source) == (
        BUILTIN.flat_max_bytes, BUILTIN.sharded_min_bytes, str(f),
    )  # fmt: skip
    assert t.digest != "builtin" and len(t.digest) == 16
    for bad, why in [
        (b"{", "not JSON"),
        (json.dumps({"schema": "x"}).encode(), "schema 'x'"),
        (json.dumps({"schema": SCHEMA, "flat_max_bytes": "4"}).encode(), "flat_max_bytes must be an integer"),
        (b" " * (2 << 20), "more than"),
    ]:
        with pytest.raises(ThresholdsError, match=why):
            Thresholds.parse(bad, "f")
    monkeypatch.setenv("GPUBRIDGE_THRESHOLDS", str(f))
    monkeypatch.setenv("GPUBRIDGE_POLICY", "Flat")
    p = Policy.read()
    assert p.problems == [] and p.settings()["policy"] == "flat" and p.settings()["thresholds"] == t.digest
    monkeypatch.setenv("GPUBRIDGE_POLICY", "pipelined")
    monkeypatch.setenv("GPUBRIDGE_THRESHOLDS", str(tmp_path / "none.json"))
    problems = Policy.read().problems
    assert len(problems) == 2 and "GPUBRIDGE_POLICY='pipelined'" in problems[0], problems
    assert "GPUBRIDGE_THRESHOLDS" in problems[1], problems


# ---- jobs ----


@needs_tools
@pytest.mark.parametrize(
    ("policy", "vendors", "ran"),
    [
        ("flat", V22, {"flat"}),
        ("sharded", V22, {"sharded"}),
        ("sharded", ["nvidia", "nvidia", "nvidia", "amd"], {"reduce-bridge-broadcast"}),
        ("sharded", ["nvidia", "nvidia", "amd", "amd", "amd:b", "amd:b"], {"sharded"}),
    ],
    ids=["flat-2+2", "sharded-2+2", "sharded-3+1-falls-back", "sharded-2+2+2"],
)
def test_policy_bit_for_bit(tmp_path: Path, policy: str, vendors: list[str], ran: set[str]) -> None:
    results = launch(tmp_path, vendors, policy)
    for r, res in enumerate(results):
        assert set(res["policies"]) == ran, (r, res["policies"])
        if policy == "sharded" and ran == {"reduce-bridge-broadcast"}:  # said once, with why
            assert len(res["fallbacks"]) == 1 and "(3+1 ranks)" in res["fallbacks"][0], (r, res)
        else:
            assert res["fallbacks"] == [], (r, res)
        assert res["endpoint"] == (res["role"] == "leader" or ran != {"reduce-bridge-broadcast"}), (r, res)


@needs_tools
def test_auto_sends_a_tiny_all_reduce_flat(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # With spinning waits (the latency setting for hosts with a core per
    # process): the feed client and every serve's shm streams spin.
    monkeypatch.setenv("GPUBRIDGE_SPIN_US", "200")
    f = tmp_path / "thresholds.json"
    f.write_text(Thresholds(flat_max_bytes=64, sharded_min_bytes=-1).to_json({}))
    results = launch(tmp_path, V22, "auto", "tiny", str(f))
    for r, res in enumerate(results):
        assert res["policies"] == {"flat": 1, "reduce-bridge-broadcast": 1}, (r, res["policies"])
        assert "flat" in res["bridges"], (r, res["bridges"])


@needs_tools
def test_policy_mismatch_fails_every_rank_alike(tmp_path: Path) -> None:
    rc, results, _ = run_job(tmp_path, WORKER, 4, [",".join(V22), str(tmp_path), "rank1:flat"])
    assert rc != 0
    errors = [res.get("error") for res in results]
    assert all(errors) and len(set(errors)) == 1, errors
    assert errors[0].startswith("gpubridge: discovery failed:") and "policy" in errors[0], errors[0]


@needs_tools
def test_reduce_bridge_broadcast_starts_no_extra_serve(tmp_path: Path) -> None:
    for r, res in enumerate(launch(tmp_path, V22, "reduce-bridge-broadcast", "leaders")):
        assert res["policies"] == {"reduce-bridge-broadcast": 3}, (r, res)
        assert res["endpoint"] == (res["role"] == "leader") and not res["lazily_started"], (r, res)
        assert res["bridges"] == [], (r, res)


def test_tune_picks_thresholds_from_measurements() -> None:
    """flat up to the last size of its unbroken lead over
    reduce-bridge-broadcast; sharded from the first size of its unbroken
    lead over both, above flat's range."""
    rbb, flat, sh = "reduce-bridge-broadcast", "flat", "sharded"

    def row(n: int, r: float, f: float, s: float | None = None) -> dict[str, Any]:
        return {"bytes": n, "us": {rbb: r, flat: f, **({sh: s} if s is not None else {})}}

    rows = [row(4, 10, 5, 20), row(64, 10, 6, 20), row(1024, 10, 12, 20), row(1 << 20, 100, 120, 60)]
    rows.append(row(1 << 24, 900, 950, 500))
    assert (pick(rows).flat_max_bytes, pick(rows).sharded_min_bytes) == (64, 1 << 20)
    rows[3] = row(1 << 20, 100, 120, 110)  # lead broken at 1 MiB: from 16 MiB
    assert pick(rows).sharded_min_bytes == 1 << 24
    no_shards = [row(4, 10, 50), row(64, 10, 5)]  # flat behind at the smallest size: never
    assert (pick(no_shards).flat_max_bytes, pick(no_shards).sharded_min_bytes) == (-1, -1)
