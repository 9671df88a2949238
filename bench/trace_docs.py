"""The generated blocks about tracing (bench/docs.py writes and checks them):
the straggler detector's measured ROC in docs/STRAGGLERS.md (rows of
``gbtrace simulate --roc``, docs/bench/stragglers-*.jsonl), the
heterogeneity-aware detector's (``gbtrace simulate --roc --classes``,
docs/bench/hetero-roc.jsonl), tracing's cost in docs/BENCHMARKS.md (rows of
bench/trace_cost.py) and rebalancing's figures (bench/rebalance_cpu.py,
bench/gpu/rebalance.sh: docs/bench/rebalance-*.jsonl)."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
BENCH = REPO / "docs" / "bench"
Rows = list[dict[str, Any]]

# The cost rows on the dev box (bench/trace_cost.py); None until measured.
TRACE_COST = "trace-devbox.jsonl"


def rows(name: str) -> Rows:
    with open(BENCH / name) as f:
        return [json.loads(line) for line in f if line.strip()]


def pct(x: float) -> str:
    return f"{100 * x:.1f}%"


def roc_cells(r: dict[str, Any]) -> str:
    """An ROC row's cells both straggler tables share: slowdown, threshold,
    flagged in the first window and at all, the delay, the false flags."""
    delay = f"{r['delay_steps_p50']:.0f} / {r['delay_steps_p99']:.0f}" if r["detected"] else "—"
    return (
        f"{r['slowdown']:.0%} | {r['threshold']:g} | {pct(r['detected_first_window'])} | "
        f"{pct(r['detected'])} | {delay} | {r['false_flags']}"
    )


def jitter_name(r: dict[str, Any]) -> str:
    if r["dist"] == "uniform":
        return f"uniform ±{r['jitter'] * 3**0.5:.0%} (SD {r['jitter']:.2%})"
    return f"{r['dist']}, SD {r['jitter']:.1%}"


def roc() -> str:
    """One table per jitter model: each slowdown at each threshold."""
    rs = rows("stragglers-roc.jsonl")
    out: list[str] = []
    models: dict[tuple[str, float], Rows] = {}
    for r in rs:
        models.setdefault((r["dist"], r["jitter"]), []).append(r)
    for (_, _), group in models.items():
        g0 = group[0]
        out += [
            f"**{jitter_name(g0)}** — {g0['ranks']} ranks, {g0['steps']} steps, windows of {g0['window']}, "
            f"{g0['trials']} trials per slowdown, onset at step 5000; {g0['clean_rank_windows']} clean "
            "rank-windows per slowdown",
            "",
            "| slowdown | threshold | flagged in the first window | flagged at all | delay p50 / p99 (steps) "
            "| false flags | mean score after onset |",
            "|---|---|---|---|---|---|---|",
        ]
        for r in group:
            out.append(f"| {roc_cells(r)} | {r['slow_score_mean']:.1f} |")
        out.append("")
    return "\n".join(out)


def goal() -> str:
    out = [
        "| jitter | window | slowdown | threshold | trials | flagged in the first window "
        "| clean rank-windows | false flags | expected over 250,560 | goal met |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows("stragglers-goal.jsonl"):
        expected = r["false_rate"] * 250_560
        met = r["detected_first_window"] >= 0.99 and r["window"] <= 100 and expected < 0.5
        out.append(
            f"| {jitter_name(r)} | {r['window']} | {r['slowdown']:.0%} | {r['threshold']:g} | "
            f"{r['trials']} | {pct(r['detected_first_window'])} | {r['clean_rank_windows']} | "
            f"{r['false_flags']} | {expected:.2f} | {'**yes**' if met else 'no'} |"
        )
    return "\n".join(out) + "\n"


def cost() -> str:
    rs = rows(TRACE_COST)
    head = next(r for r in rs if r["kind"] == "host")
    rec = {r["config"]: r for r in rs if r["kind"] == "recorder"}
    demo = [r for r in rs if r["kind"] == "demo"]
    dc = next(r for r in rs if r["kind"] == "demo-cost")
    ring, traced = rec["ring"], rec["traced"]
    out = [
        f"Host: {head['host']}, {head['cpus']} CPUs, load average {head['load_before']:.1f} before and "
        f"{head['load_after']:.1f} after; commit {head['commit']}.",
        "",
        "| what | per collective | goal |",
        "|---|---|---|",
        f"| an entry's life as before tracing (anchor) | {ring['anchor_ns'] / 1e3:.2f} µs | |",
        "| the flight recorder (marks, call details, ring), tracing off | "
        f"{ring['cost_ns_p50'] / 1e3:.2f} µs "
        f"(p10 {ring['cost_ns_p10'] / 1e3:.2f}, p90 {ring['cost_ns_p90'] / 1e3:.2f}) | ≤ 1 µs |",
        f"| a traced record (built, encoded, buffered, written) | {traced['cost_ns_p50'] / 1e3:.2f} µs "
        f"(p10 {traced['cost_ns_p10'] / 1e3:.2f}, p90 {traced['cost_ns_p90'] / 1e3:.2f}) | |",
        "",
        "| make demo's job | samples/s, untraced | samples/s, traced |",
        "|---|---|---|",
    ]
    for i in sorted({r["round"] for r in demo}):
        a = next(r for r in demo if r["round"] == i and not r["traced"])
        b = next(r for r in demo if r["round"] == i and r["traced"])
        out.append(f"| round {i + 1} | {a['samples_per_s']:.0f} | {b['samples_per_s']:.0f} |")
    out += [
        "",
        f"Step time {dc['step_ms']:.1f} ms with {dc['records_per_step']:.2f} records per rank and step: "
        f"tracing costs {pct(dc['cost_share'])} of the step (goal ≤ 2%); the medians of the runs differ by "
        f"{pct(dc['ab_share'])} (samples/s untraced over traced, less 1).",
    ]
    return "\n".join(out) + "\n"


def hetero_roc() -> str:
    """One table per simulated job: each slowdown at each threshold, with
    the false flags scaled to 250,000 rank-windows and what the plain
    detector flags in the same clean windows."""
    models: dict[tuple[str, bool, str, float], Rows] = {}
    for r in rows("hetero-roc.jsonl"):
        models.setdefault((r["classes"], r["uniform"], r["dist"], r["jitter"]), []).append(r)
    out: list[str] = []
    for (classes, uniform, _, _), group in models.items():
        g0 = group[0]
        shares = "even shares" if uniform else "shares in proportion to speed"
        out += [
            f"**{classes}**, {shares}, {jitter_name(g0)} — {g0['ranks']} ranks, {g0['steps']} steps, "
            f"windows of {g0['window']} after a calibration of {g0['calibrate']}, {g0['trials']} trials "
            f"per slowdown, onset at step 5000; {g0['clean_rank_windows']} clean rank-windows per slowdown",
            "",
            "| slowdown | threshold | flagged in the first window | flagged at all | delay p50 / p99 (steps) "
            "| false flags | per 250,000 rank-windows | mean score after onset | plain detector's flags |",
            "|---|---|---|---|---|---|---|---|---|",
        ]
        for r in group:
            out.append(
                f"| {roc_cells(r)} | {r['false_rate'] * 250_000:.2f} | {r['slow_score_mean']:.1f} | "
                f"{r['classic_flags']} |"
            )
        out.append("")
    return "\n".join(out)


def rebalance() -> str:
    """Rebalancing's figures: the dev box's CPU rows and the GPU's."""
    out = [
        "| where | commit | load | even shares | n \u00d7 slowest | ideal | rebalanced | rebalanced / ideal "
        "| plans |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for name in sorted((BENCH).glob("rebalance-*.jsonl")):
        for r in rows(name.name):
            if r["kind"] == "cpu":
                where = f"{r['cpus']}-core box, CPU (samples/s)"
                load = f"{r['load_before']:.1f} / {r['load_after']:.1f}"
                vals = [r["even_per_s"], r["n_slowest_per_s"], r["ideal_per_s"], r["rebalanced_per_s"]]
                cells = [f"{v:.0f}" for v in vals]
                ratio = r["rebalanced_per_s"] / r["ideal_per_s"]
            else:
                f = r.get("figures_samples_per_s", {})
                seq = r["config"]["seq"]
                where = f"{r['host']}, split test (tokens/s)"
                load = "—"
                vals = [
                    r["even_tokens_per_s"], f.get("n_slowest_per_s", 0) * seq, r.get("ideal_tokens_per_s", 0),
                    r["rebalanced_tokens_per_s"],
                ]  # fmt: skip
                cells = [f"{v:,.0f}" if v else "—" for v in vals]
                ratio = r["rebalanced_tokens_per_s"] / vals[2] if vals[2] else 0
            plans = ", ".join(f"{p[1]} at {p[0]}" for p in r["plans"])
            out.append(f"| {where} | {r['commit']} | {load} | {' | '.join(cells)} | {ratio:.2f} | {plans} |")
    return "\n".join(out) + "\n"


STRAGGLER_BLOCKS: dict[str, Callable[[], str]] = {
    "stragglers-roc": roc,
    "stragglers-goal": goal,
    "hetero-roc": hetero_roc,
}
REBALANCE_BLOCKS: dict[str, Callable[[], str]] = {"rebalance": rebalance}
TRACE_BLOCKS: dict[str, Callable[[], str]] = {"tracing-cost": cost}
