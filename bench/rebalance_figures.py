"""The rebalancing figures of a mixed job, from `gbtrace stragglers --hetero
--all` lines (docs/REBALANCING.md, "The ideal"): the CI test
(torchplugin/tests/test_hetero.py), bench/rebalance_cpu.py and
bench/gpu/rebalance.sh all judge with this.

Rank r's rate is n_r / (n_r c_r + X): c_r its compute per sample (ready time
over samples) in the windows of even shares, n_r its even share, X the step
time beyond the slowest rank's ready time in the windows judged (the
communication and optimizer no split of the batch removes). The uniform job
makes n x min rate; the ideal is the sum of the rates; the rebalanced job
makes global batch / step time."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any


def figures(
    lines: list[dict[str, Any]], even: Sequence[int], judged: Sequence[int], global_batch: int
) -> dict[str, Any]:
    """Samples per second: each rank's rate, the ideal, n x the slowest, the
    windows of even shares and the windows judged, as measured."""
    win = {(x["rank"], x["window"]): x for x in lines if x["kind"] == "window"}
    ranks = sorted({r for r, _ in win})
    if not ranks or any((r, w) not in win for r in ranks for w in [*even, *judged]):
        raise ValueError(f"windows {list(even)} and {list(judged)} of every rank are needed")
    ready = {r: sum(win[(r, w)]["ready_us"] for w in even) for r in ranks}
    c = {r: ready[r] / sum(win[(r, w)]["samples"] for w in even) / 1e6 for r in ranks}
    share = {r: sum(win[(r, w)]["samples"] for w in even) / len(even) for r in ranks}
    cells = [(win[(r, w)], max(win[(q, w)]["ready_us"] for q in ranks)) for w in judged for r in ranks]
    extra = sum(x["step_us"] - slowest for x, slowest in cells) / len(cells) / 1e6
    step = sum(x["step_us"] for x, _ in cells) / len(cells) / 1e6
    even_step = sum(win[(r, w)]["step_us"] for r in ranks for w in even) / (len(ranks) * len(even)) / 1e6
    rates = [share[r] / (share[r] * c[r] + extra) for r in ranks]
    return {
        "us_per_sample": {str(r): round(c[r] * 1e6, 1) for r in ranks},
        "extra_us": round(extra * 1e6, 1),
        "rates_per_s": [round(x, 1) for x in rates],
        "ideal_per_s": round(sum(rates), 1),
        "n_slowest_per_s": round(len(ranks) * min(rates), 1),
        "even_per_s": round(global_batch / even_step, 1),
        "rebalanced_per_s": round(global_batch / step, 1),
    }
