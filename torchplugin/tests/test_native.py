"""gpubridge's native API (gpubridge.init() and friends) under torchrun: the
same collectives on the same topology, without torch.distributed's default
group, and refusing to share a process with init_process_group."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from test_backend import bridge_pids, job_env, needs_tools  # (tests/ is on sys.path under pytest)

WORKER = Path(__file__).resolve().parent / "native_worker.py"


@needs_tools
def test_native_api_2_2(tmp_path: Path) -> None:
    vendors = ["nvidia", "nvidia", "amd", "amd"]
    env = job_env(tmp_path)
    cmd = [
        sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(len(vendors)),
        str(WORKER), ",".join(vendors), str(tmp_path),
    ]  # fmt: skip
    p = subprocess.run(cmd, env=env, capture_output=True, timeout=180, check=False, cwd=tmp_path)
    out = (p.stdout + p.stderr).decode("utf-8", "replace")
    results = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(len(vendors))]
    for r, res in enumerate(results):
        assert res.get("ok"), f"rank {r}: {res.get('error')}\n{out[-4000:]}"
    assert p.returncode == 0, out[-4000:]
    assert results[0]["islands"] == [[0, 1], [2, 3]]
    assert all("use one or the other" in res["refused"] for res in results), results[0]["refused"]
    assert all("already initialized" in res["twice"] for res in results)
    assert not bridge_pids(str(tmp_path)), "gbbridge serve left running"
