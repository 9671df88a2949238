"""gpubridge's native API (gpubridge.init() and friends) under torchrun: the
same collectives on the same topology, without torch.distributed's default
group, and refusing to share a process with init_process_group."""

from __future__ import annotations

from pathlib import Path

from test_backend import needs_tools, run_job  # (tests/ is on sys.path under pytest)
from testenv import scale

WORKER = Path(__file__).resolve().parent / "native_worker.py"


@needs_tools
def test_native_api_2_2(tmp_path: Path) -> None:
    vendors = ["nvidia", "nvidia", "amd", "amd"]
    rc, results, out = run_job(
        tmp_path, WORKER, len(vendors), [",".join(vendors), str(tmp_path)], timeout=scale(180)
    )
    for r, res in enumerate(results):
        assert res.get("ok"), f"rank {r}: {res.get('error')}\n{out[-4000:]}"
    assert rc == 0, out[-4000:]
    assert results[0]["islands"] == [[0, 1], [2, 3]]
    assert all("use one or the other" in res["refused"] for res in results), results[0]["refused"]
    assert all("already initialized" in res["twice"] for res in results)
