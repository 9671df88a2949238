"""Training over the gpubridge backend, in simulation, under torchrun.

Each test launches a real job (``python -m torch.distributed.run
--standalone``) of tests/train_worker.py: GPUBRIDGE_VENDOR is set per rank, a
small float64 MLP trains with DistributedDataParallel (as it comes, and with
``gpubridge.ddp_comm_hook``) and with FSDP2's ``fully_shard``, once over the
gpubridge backend and once over a plain Gloo group of the same job, on data
chosen so that every reduction is exact (see train_worker.py). Every rank
must end with parameters identical bit for bit to the Gloo run's and to every
other rank's; since the arithmetic is exact, DDP, DDP with the hook and FSDP
must also agree with each other. Afterwards no gbbridge serve may be left.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from test_backend import needs_tools, run_job  # (tests/ is on sys.path under pytest)
from testenv import scale

HERE = Path(__file__).resolve().parent
WORKER = HERE / "train_worker.py"
TIMEOUT = scale(240)
STEPS = 12


def launch(tmp_path: Path, vendors: list[str], variants: list[str]) -> list[dict[str, Any]]:
    """Runs the worker under torchrun; returns every rank's result after
    checking the job passed and left no gbbridge serve behind."""
    rc, results, output = run_job(
        tmp_path, WORKER, len(vendors), [",".join(vendors), str(tmp_path), ",".join(variants), str(STEPS)],
        timeout=TIMEOUT,
    )  # fmt: skip
    for r, res in enumerate(results):
        assert res.get("ok"), f"rank {r}: {res.get('error')}\n{output[-6000:]}"
    assert rc == 0, output[-6000:]
    for res in results:
        if res.get("bridge_pid"):
            assert res["bridge_exit"] == 0, f"gbbridge serve exited {res['bridge_exit']} (no clean BYE)"
    return results


def check_trained(results: list[dict[str, Any]], variants: list[str]) -> str:
    """Every variant on every rank ended where the Gloo run did, all ranks and
    variants agree, and the loss went down. Returns the common digest."""
    digests: set[str] = set()
    for r, res in enumerate(results):
        assert sorted(res["variants"]) == sorted(variants), res
        for v, got in res["variants"].items():
            assert got["digest"] == got["gloo_digest"], f"rank {r} {v}: {got}"
            assert len(got["losses"]) == STEPS
            first, last = got["losses"][0], sum(got["losses"][-3:]) / 3
            assert last < first, f"rank {r} {v}: the loss did not go down: {got['losses']}"
            digests.add(got["digest"])
    assert len(digests) == 1, f"ranks or variants disagree: {digests}"
    return digests.pop()


@needs_tools
def test_ddp_2_2(tmp_path: Path) -> None:
    variants = ["ddp", "hook"]
    check_trained(launch(tmp_path, ["nvidia", "nvidia", "amd", "amd"], variants), variants)


@needs_tools
def test_fsdp_2_2(tmp_path: Path) -> None:
    variants = ["fsdp"]
    check_trained(launch(tmp_path, ["nvidia", "nvidia", "amd", "amd"], variants), variants)


@needs_tools
def test_ddp_fsdp_3_1(tmp_path: Path) -> None:
    variants = ["ddp", "hook", "fsdp"]
    check_trained(launch(tmp_path, ["nvidia", "nvidia", "nvidia", "amd"], variants), variants)


@needs_tools
def test_ddp_fsdp_1_1(tmp_path: Path) -> None:
    variants = ["ddp", "hook", "fsdp"]
    results = launch(tmp_path, ["amd", "nvidia"], variants)
    check_trained(results, variants)
    assert all(res["bridge_pid"] for res in results), "both ranks lead an island: both run gbbridge serve"


@needs_tools
def test_ddp_fsdp_single_vendor(tmp_path: Path) -> None:
    variants = ["ddp", "fsdp"]
    results = launch(tmp_path, ["nvidia"] * 4, variants)
    check_trained(results, variants)
    assert all(res["bridge_pid"] is None for res in results), "one island: no bridge"


@needs_tools
def test_ddp_fsdp_three_islands_2_1_1(tmp_path: Path) -> None:
    # World size 4 keeps the division by the world size exact (6 would not).
    variants = ["ddp", "hook", "fsdp"]
    check_trained(launch(tmp_path, ["nvidia", "nvidia", "amd", "amd:b"], variants), variants)
