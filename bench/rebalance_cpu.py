"""Rebalancing on the dev box (docs/REBALANCING.md, "Evidence"): the CI
test's mixed job (torchplugin/tests/hetero_worker.py: 4 simulated ranks, the
AMD island twice as slow per sample, global batch 48) run twice under
torchrun — even shares, then rebalanced — and its figures from `gbtrace
stragglers --hetero` (bench/rebalance_figures.py): samples/s with even
shares, n x the slowest rate, the ideal, rebalanced; both jobs in one run,
so each is the other's anchor.

    .venv/bin/python bench/rebalance_cpu.py OUTDIR [ROUNDS]

Writes OUTDIR/rows.jsonl (one row per round, schema
gpubridge.bench-rebalance/v1) and the jobs' traces; about a minute per
round on 2 cores."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from rebalance_figures import figures

REPO = Path(__file__).resolve().parents[1]
WORKER = REPO / "torchplugin" / "tests" / "hetero_worker.py"
GBTRACE = REPO / "bin" / "gbtrace"


def job(out: Path, *args: str) -> None:
    out.mkdir(parents=True, exist_ok=True)
    env = dict(os.environ, GPUBRIDGE_BIN_DIR=str(REPO / "bin"), PYTHONPATH=str(REPO / "torchplugin"))
    env["OMP_NUM_THREADS"] = "1"
    run = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "4"]
    cmd = [*run, str(WORKER), "nvidia,nvidia,amd,amd", str(out), *args]
    subprocess.run(cmd, env=env, check=True, capture_output=True, timeout=600)


def diagnose(trace: Path) -> list[dict[str, object]]:
    cmd = [str(GBTRACE), "stragglers", "--hetero", "--all", str(trace)]
    p = subprocess.run(cmd, capture_output=True, text=True, check=False, timeout=120)
    return [json.loads(line) for line in p.stdout.splitlines() if line.strip()]


def main() -> int:
    out = Path(sys.argv[1])
    rounds = int(sys.argv[2]) if len(sys.argv) > 2 else 1
    git = ["git", "rev-parse", "--short", "HEAD"]
    commit = subprocess.run(git, capture_output=True, text=True, cwd=REPO, check=False).stdout.strip()
    rows = []
    for i in range(rounds):
        load0 = os.getloadavg()[0]
        t0 = time.monotonic()
        job(out / f"even-{i}", "uniform", "200")
        job(out / f"rebalanced-{i}", "rebalanced", "300")
        even, reb = diagnose(out / f"even-{i}" / "trace"), diagnose(out / f"rebalanced-{i}" / "trace")
        f = figures(reb, even=[0], judged=[1, 2], global_batch=48)
        # The uniform job's own samples/s over its steps 100-199.
        uniform_job = figures(even, even=[0], judged=[1], global_batch=48)["rebalanced_per_s"]
        plans = json.loads((out / f"rebalanced-{i}" / "rank0.json").read_text())["plans"]
        degraded = [r["rank"] for r in reb if r["kind"] == "rank" and r["verdict"] == "degraded compute"]
        row = {
            "schema": "gpubridge.bench-rebalance/v1", "kind": "cpu", "host": os.uname().nodename,
            "cpus": os.cpu_count(), "commit": commit, "round": i, "load_before": round(load0, 2),
            "load_after": round(os.getloadavg()[0], 2), "wall_s": round(time.monotonic() - t0, 1),
            "sample_ms": [1.5, 1.5, 3.0, 3.0], "global_batch": 48, "uniform_job_per_s": uniform_job, **f,
            "degraded": degraded, "plans": plans,
        }  # fmt: skip
        rows.append(row)
        print(json.dumps(row), flush=True)
    (out / "rows.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
