"""Rows of bench/codec.sh's run: OUTDIR/bench.txt (go test -bench of
lib/codec) and OUTDIR/stat.jsonl (gbcompress stat on the gradient dumps),
as JSON lines on stdout (schema gpubridge.codec-bench/v1 for the
benchmarks; the stat lines as they are, with the commit).

    python bench/codec_rows.py OUTDIR COMMIT"""

from __future__ import annotations

import json
import os
import platform
import re
import sys
from pathlib import Path

LINE = re.compile(r"^Benchmark(\w+)/(\S+?)-\d+\s+(\d+)\s+(\d+(?:\.\d+)?) ns/op\s+(.*)$")


def cpu_model() -> str:
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("model name"):
            return line.split(":", 1)[1].strip()
    return platform.processor()


def main() -> int:
    out, commit = Path(sys.argv[1]), sys.argv[2]
    host = {
        "commit": commit,
        "cpu": cpu_model(),
        "cpus": os.cpu_count(),
        "load_before": (out / "load-before").read_text().split()[:3],
        "load_after": (out / "load-after").read_text().split()[:3],
    }
    for line in (out / "bench.txt").read_text().splitlines():
        m = LINE.match(line)
        if not m:
            continue
        bench, sub, iters, ns, rest = m.groups()
        metrics = {unit: float(v) for v, unit in re.findall(r"(\d+(?:\.\d+)?) (\S+)", rest)}
        row = {
            "schema": "gpubridge.codec-bench/v1",
            "bench": bench,
            "case": sub,
            "iterations": int(iters),
            "ns_per_op": float(ns),
            "wall_mbps": metrics.get("MB/s"),
            "cpu_mbps": metrics.get("cpu-MB/s"),
        }
        if "ratio" in metrics:
            row["ratio"] = metrics["ratio"]
        print(json.dumps({**row, **host}))
    for line in (out / "stat.jsonl").read_text().splitlines():
        if line.strip():
            row = json.loads(line)
            row["input"] = Path(row["input"]).name
            print(json.dumps({**row, **host}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
