"""A step's verdict from its rows: judge.py STEP ROWS SRUN_RC prints
"RESULT<TAB>reason" (RESULT: PASS, FAIL, ERROR or NOT RUN) for the batch
script's kit_verdict. No torch: it runs on the batch node in any python."""

from __future__ import annotations

import json
import os
import sys
from collections.abc import Callable
from typing import Any

Rows = list[dict[str, Any]]


def load(path: str | os.PathLike[str]) -> Rows:
    """The JSON objects among a step's output lines (logs and torchrun noise
    in between are passed over)."""
    rows = []
    with open(path, errors="replace") as f:
        for raw in f:
            line = raw.strip()
            if not line.startswith("{"):
                continue
            try:
                r = json.loads(line)
            except json.JSONDecodeError:
                continue
            if isinstance(r, dict):
                rows.append(r)
    return rows


def of(rows: Rows, schema: str) -> Rows:
    return [r for r in rows if r.get("schema") == schema]


def layout(rows: Rows) -> dict[str, Any]:
    got = of(rows, "gpubridge.kit-layout/v1")
    return got[0] if got else {"components": [], "simulated": False}


def sim_note(rows: Rows) -> str:
    return " (CPU simulation: vendors simulated per component)" if layout(rows).get("simulated") else ""


def probe(rows: Rows, rc: int) -> tuple[str, str]:
    lay = layout(rows)
    want = {n: c for c in lay["components"] for n in c["nodes"]}
    got = {r["node"]: r for r in of(rows, "gpubridge.kit-probe/v1")}
    missing = sorted(set(want) - set(got))
    bad = [r for r in got.values() if not r.get("ok")]
    if bad:
        r = bad[0]
        first = r["failed"][0] if r.get("failed") else f"gbprobe exit {r.get('rc')}"
        more = f" ({len(bad)} of {len(got)} nodes failed)" if len(bad) > 1 else ""
        return "FAIL", (
            f"component {r['component']} (partition {r['partition']}) node {r['node']}, "
            f"--require {r['require']!r}: {first}{more}"
        )
    if missing:
        return (
            "ERROR",
            f"no gbprobe report from node(s) {', '.join(missing)} (srun exit {rc}; see the job's output)",
        )
    parts = []
    for c in lay["components"]:
        parts.append(
            f"{c['partition']} ({c['vendor']}, {len(c['nodes'])} node(s)): --require {c['require']!r}"
        )
    return "PASS", f"{len(got)} nodes; every requirement held: {'; '.join(parts)}{sim_note(rows)}"


def summary_of(rows: Rows, schema: str, rc: int, what: str) -> tuple[str, str]:  # noqa: PLR0911 - one verdict per case
    """Steps 2-5: the driver's own summary row (ok, reason, not_run), and
    the error rows of ranks that stopped (fail: a check or collective
    failed; else the driver could not run)."""
    s = of(rows, schema)
    errors = of(rows, "gpubridge.kit-error/v1")
    could_not = [e for e in errors if not e.get("fail")]
    failed = [e for e in errors if e.get("fail")]
    if s and s[-1].get("not_run"):
        return "NOT RUN", str(s[-1].get("reason"))
    if could_not:
        e = could_not[0]
        return "ERROR", f"{where(e)}: {e.get('error')}"
    if s:
        r = s[-1]
        if not r.get("ok"):
            return "FAIL", str(r.get("reason"))
        if rc == 0 and not failed:
            return "PASS", str(r.get("reason")) + sim_note(rows)
        if failed:
            return "FAIL", f"{where(failed[0])}: {failed[0].get('error')}"
        return "ERROR", f"{what} reported ok but srun exited {rc}"
    if failed:
        return "FAIL", f"{where(failed[0])}: {failed[0].get('error')}"
    return "ERROR", f"{what} wrote no summary (srun exit {rc}; see the job's output)"


def where(e: dict[str, Any]) -> str:
    if e.get("rank") is not None:
        return f"rank {e['rank']}"
    return f"component {e.get('component')} ({e.get('node')})"


def trace(rows: Rows, rc: int) -> tuple[str, str]:
    """Step 6: gbtrace's rows on step 5's trace (summary, hang, stragglers)."""
    summary = of(rows, "gpubridge.trace-summary/v1")
    hangs = of(rows, "gpubridge.trace-hang/v1")
    strag = [r for r in of(rows, "gpubridge.trace-straggler/v1") if r.get("kind") == "summary"]
    where = next((r.get("trace") for r in of(rows, "gpubridge.kit-trace/v1")), "?")
    if rc != 0 or not summary:
        return "ERROR", f"gbtrace summary of {where} exited {rc} with {len(summary)} rows (see stderr.log)"
    bad = [h for h in hangs if h.get("status") != "ok"]
    if bad:
        return "FAIL", f"{where}: {bad[0].get('verdict')}"
    n = sum(r.get("count", 0) for r in summary)
    ar = [r for r in summary if r.get("op") == "all_reduce" and r.get("count")]
    top = max(ar, key=lambda r: r.get("bucket", 0)) if ar else None
    parts = [f"{n} collectives of {len(summary)} kinds, all complete"]
    if top is not None:
        phase = max(top["phases"].items(), key=lambda kv: kv[1])[0] if top.get("phases") else "?"
        parts.append(
            f"all_reduce <= {top['bucket_label']}B: p50 {top['time_p50_us']:.0f} us, busbw "
            f"{top['busbw_gbps']:.3f} GB/s, most time in {phase}"
        )
    flagged = strag[-1].get("flagged") if strag else None
    if flagged:
        parts.append(f"stragglers: rank(s) {', '.join(str(r) for r in flagged)} (gbtrace stragglers)")
    elif strag:
        parts.append(f"no straggler in {strag[-1].get('windows')} windows")
    return "PASS", "; ".join(parts) + sim_note(rows)


STEPS: dict[str, Callable[[Rows, int], tuple[str, str]]] = {
    "probe": probe,
    "bridge": lambda rows, rc: summary_of(rows, "gpubridge.kit-bridge-summary/v1", rc, "the bridge selftest"),
    "collectives": lambda rows, rc: summary_of(
        rows, "gpubridge.kit-collectives-summary/v1", rc, "the collectives check"
    ),
    "sweep": lambda rows, rc: summary_of(rows, "gpubridge.kit-sweep-summary/v1", rc, "the sweep"),
    "train": lambda rows, rc: summary_of(rows, "gpubridge.kit-train-summary/v1", rc, "the training run"),
    "trace": trace,
}


def main() -> int:
    if len(sys.argv) != 4 or sys.argv[1] not in STEPS:
        print(f"usage: judge.py {'|'.join(STEPS)} ROWS SRUN_RC", file=sys.stderr)
        return 2
    result, reason = STEPS[sys.argv[1]](load(sys.argv[2]), int(sys.argv[3]))
    print(f"{result}\t{' '.join(reason.split())}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
