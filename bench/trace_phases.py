"""Median time of each phase of a rank's traced collectives (a gpubridge
trace file, GPUBRIDGE_TRACE), for one op and size, skipping the first calls
(set-up, JOINs): where a small call's time goes. The "serve" row is the
bridge's own wall time inside the "bridge" phase (gbbridge's stats), so
"bridge" minus "serve" is the feed's round trip, split into "to serve"
(the plugin's request until the collective starts in gbbridge: the write,
serve's wake-up and dispatch) and "from serve" (the collective's end until
the plugin has the DONE: the write back, the plugin's wake-up and decode).

    python3 bench/trace_phases.py TRACE.jsonl [--op all_reduce] [--bytes 4] [--skip 100]

Prints one JSON object (schema gpubridge.trace-phases/v1) on stdout."""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from typing import Any


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    p.add_argument("trace")
    p.add_argument("--op", default="all_reduce")
    p.add_argument("--bytes", type=int, default=4)
    p.add_argument("--skip", type=int, default=100, help="first matching calls left out")
    a = p.parse_args()
    calls: list[dict[str, Any]] = []
    with open(a.trace, encoding="utf-8") as f:
        for line in f:
            r = json.loads(line)
            if r.get("kind") == "collective" and r.get("op") == a.op and r.get("bytes") == a.bytes:
                calls.append(r)
    calls = calls[a.skip :]
    if not calls:
        print(f"trace_phases: no {a.op} of {a.bytes} bytes after the first {a.skip}", file=sys.stderr)
        return 1
    phases: dict[str, list[float]] = {"total": [], "serve": []}
    for r in calls:
        phases["total"].append((r["end"] - r["arrived"]) / 1e3)
        for ph in r["phases"]:
            phases.setdefault(ph["name"], []).append((ph["end"] - ph["start"]) / 1e3)
        b = r.get("bridge")
        if b:
            phases["serve"].append((b["end"] - b["start"]) / 1e3)
            # The two legs of the feed (one clock: CLOCK_MONOTONIC on both
            # sides): request sent to the collective's start in gbbridge, and
            # its end to the plugin's return.
            br = next((ph for ph in r["phases"] if ph["name"] == "bridge"), None)
            if br:
                phases.setdefault("to serve", []).append((b["start"] - br["start"]) / 1e3)
                phases.setdefault("from serve", []).append((br["end"] - b["end"]) / 1e3)
    out = {
        "schema": "gpubridge.trace-phases/v1",
        "op": a.op,
        "bytes": a.bytes,
        "calls": len(calls),
        "median_us": {k: round(statistics.median(v), 1) for k, v in phases.items() if v},
    }
    print(json.dumps(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
