"""A timeline picture (SVG) of a stretch of a trace, drawn from `gbtrace
perfetto`'s JSON with the same tracks Perfetto shows (a row per rank and
track, one bar per collective or phase), for documents where a browser
screenshot of ui.perfetto.dev cannot be taken. Standard library only.

    gbtrace perfetto trace/ | python3 bench/trace_view.py --from-us 20000 --span-us 60000 > view.svg
"""

from __future__ import annotations

import argparse
import html
import json
import sys
from typing import Any

COLORS = {
    "queued": "#c7c7c7", "running": "#9e9e9e", "check calls": "#bcbd22", "island reduce": "#1f77b4",
    "copy": "#ff7f0e", "bridge": "#d62728", "copy back": "#ffbb78", "island broadcast": "#2ca02c",
    "island allgather": "#17becf", "island scatter": "#9467bd", "native": "#8c564b",
}  # fmt: skip
ROW, LABEL, WIDTH = 18, 190, 1100


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    ap.add_argument(
        "--from-us", type=float, default=0.0, help="start of the stretch (µs from the trace's start)"
    )
    ap.add_argument("--span-us", type=float, default=50_000.0, help="length of the stretch (µs)")
    ap.add_argument("--title", default="")
    args = ap.parse_args()
    doc = json.load(sys.stdin)
    ev: list[dict[str, Any]] = doc["traceEvents"]
    procs = {e["pid"]: e["args"]["name"] for e in ev if e["ph"] == "M" and e["name"] == "process_name"}
    tracks = {
        (e["pid"], e["tid"]): e["args"]["name"] for e in ev if e["ph"] == "M" and e["name"] == "thread_name"
    }
    lo, hi = args.from_us, args.from_us + args.span_us
    rows = sorted(tracks)
    y = {k: 30 + i * (ROW + 4) for i, k in enumerate(rows)}
    scale = (WIDTH - LABEL - 10) / args.span_us
    out = [
        f'<svg xmlns="http://www.w3.org/2000/svg" width="{WIDTH}" height="{40 + len(rows) * (ROW + 4) + 40}" '
        'font-family="sans-serif" font-size="11">',
        f'<text x="4" y="16" font-weight="bold">{html.escape(args.title)}</text>',
    ]
    for k in rows:
        out.append(f'<text x="4" y="{y[k] + 13}">{html.escape(procs.get(k[0], str(k[0])))}: '
                   f"{html.escape(tracks[k])}</text>")  # fmt: skip
    seen: set[str] = set()
    for e in ev:
        if e["ph"] != "X" or (e["pid"], e["tid"]) not in y:
            continue
        a, b = max(e["ts"], lo), min(e["ts"] + e.get("dur", 0), hi)
        if b <= a:
            continue
        top = y[(e["pid"], e["tid"])]
        coll = e.get("cat") == "collective"
        color = "#ffffff" if coll else COLORS.get(e["name"], "#e377c2")
        h = ROW if coll else ROW - 6
        x0, w = LABEL + (a - lo) * scale, max((b - a) * scale, 0.5)
        stroke = "#333" if coll else "none"
        out.append(
            f'<rect x="{x0:.1f}" y="{top + (0 if coll else 3)}" width="{w:.1f}" height="{h}" fill="{color}" '
            f'stroke="{stroke}"><title>{html.escape(e["name"])}</title></rect>'
        )
        if not coll:
            seen.add(e["name"])
    ly = 40 + len(rows) * (ROW + 4)
    x = LABEL
    for name in sorted(seen):
        out.append(f'<rect x="{x}" y="{ly}" width="10" height="10" fill="{COLORS.get(name, "#e377c2")}"/>')
        out.append(f'<text x="{x + 14}" y="{ly + 9}">{html.escape(name)}</text>')
        x += 14 + 7 * len(name) + 16
    out.append(f'<text x="{LABEL}" y="{ly + 28}">{args.span_us / 1e3:g} ms from {lo / 1e3:g} ms</text>')
    out.append("</svg>")
    print("\n".join(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
