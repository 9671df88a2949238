"""Turns ci/bench/run.sh's rows.jsonl into the Markdown tables of
docs/BENCHMARKS.md: algbw (GB/s) by size for each configuration, and the
ratios the goals are stated in. Usage: report.py ROWS.jsonl [TITLE]"""

from __future__ import annotations

import json
import sys
from collections import defaultdict

with open(sys.argv[1]) as f:
    rows = [json.loads(line) for line in f if line.strip()]
# Names of configurations in runs made before the default became 8 streams.
ALIASES = {
    "shm-allreduce": "shm-allreduce-s4",
    "shm-exchange": "shm-exchange-s4",
    "shm-allreduce-crc": "shm-allreduce-s4-crc",
    "tcp-allreduce-4m": "tcp-allreduce-4m-s4",
    "shm-allreduce-4m": "shm-allreduce-4m-s4",
}
for r in rows:
    r["config"] = ALIASES.get(r["config"], r["config"])
title = sys.argv[2] if len(sys.argv) > 2 else "run"
bw: dict[str, dict[int, float]] = defaultdict(dict)
wrong: dict[str, int] = defaultdict(int)
desc: dict[str, str] = {}
for r in rows:
    bw[r["config"]][r.get("size", 0)] = r["algbw_gbps"]
    wrong[r["config"]] += int(r.get("wrong", 0))
    desc[r["config"]] = r.get("transport", "")
sizes = sorted({s for c in bw for s in bw[c] if s})


def human(n: int) -> str:
    for unit, div in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= div and n % div == 0:
            return f"{n // div} {unit}"
    return f"{n} B"


def table(cols: list[tuple[str, str]], ratios: list[tuple[str, str, str]] = ()) -> None:
    cols = [(h, c) for h, c in cols if c in bw]
    ratios = [(h, a, b) for h, a, b in ratios if a in bw and b in bw]
    print("| size | " + " | ".join(h for h, _ in cols) + "".join(f" | {h}" for h, _, _ in ratios) + " |")
    print("|---" * (1 + len(cols) + len(ratios)) + "|")
    for s in sizes:
        cells = [f"{bw[c].get(s, float('nan')):.2f}" for _, c in cols]
        cells += [
            f"{bw[a].get(s, float('nan')) / bw[b].get(s, float('nan')):.2f}\u00d7"
            if bw[b].get(s)
            else "\u2013"
            for _, a, b in ratios
        ]
        print(f"| {human(s)} | " + " | ".join(cells) + " |")
    print()


print(f"### {title}\n")
print(
    "algbw in GB/s (bytes of the buffer / time per call; nccl-tests' definition). "
    "Every gbbridge row was checked element by element after timing; wrong elements in total: "
    + ", ".join(f"{c} {w}" for c, w in sorted(wrong.items()) if w)
    + (" none." if not any(wrong.values()) else ".")
    + "\n"
)
print("#### 2 members, the default 8 streams: gbbridge vs Gloo and the ceilings\n")
table(
    [
        ("Gloo", "gloo-2"),
        ("TCP exchange (ceiling)", "tcp-exchange-s8"),
        ("gbbridge TCP", "tcp-allreduce-s8"),
        ("shm exchange", "shm-exchange-s8"),
        ("gbbridge shm", "shm-allreduce-s8"),
        ("memcpy, 1 core", "memcpy"),
    ],
    [
        ("TCP / Gloo", "tcp-allreduce-s8", "gloo-2"),
        ("TCP / ceiling", "tcp-allreduce-s8", "tcp-exchange-s8"),
        ("shm / Gloo", "shm-allreduce-s8", "gloo-2"),
    ],
)
print("#### TCP streams (2 members)\n")
table(
    [(f"exchange {s}", f"tcp-exchange-s{s}") for s in (1, 2, 4, 8, 16)]
    + [(f"all_reduce {s}", f"tcp-allreduce-s{s}") for s in (1, 2, 4, 8, 16)]
)
print("#### shm streams (2 members)\n")
table(
    [(f"exchange {s}", f"shm-exchange-s{s}") for s in (4, 8, 16)]
    + [(f"all_reduce {s}", f"shm-allreduce-s{s}") for s in (4, 8, 16)]
)
print("#### CRC32C per frame on and off (2 members, 4 streams)\n")
table(
    [
        ("TCP, no CRC", "tcp-allreduce-s4"),
        ("TCP, CRC", "tcp-allreduce-s4-crc"),
        ("exchange, no CRC", "tcp-exchange-s4"),
        ("exchange, CRC", "tcp-exchange-s4-crc"),
        ("shm, no CRC", "shm-allreduce-s4"),
        ("shm, CRC", "shm-allreduce-s4-crc"),
    ],
    [
        ("TCP with CRC / without", "tcp-allreduce-s4-crc", "tcp-allreduce-s4"),
        ("shm with CRC / without", "shm-allreduce-s4-crc", "shm-allreduce-s4"),
    ],
)
print("#### 4 members (ring)\n")
table(
    [
        ("Gloo, 4 ranks", "gloo-4"),
        ("gbbridge TCP 4 streams", "tcp-allreduce-4m-s4"),
        ("gbbridge TCP 8 streams", "tcp-allreduce-4m-s8"),
        ("gbbridge shm 4 streams", "shm-allreduce-4m-s4"),
        ("gbbridge shm 8 streams", "shm-allreduce-4m-s8"),
    ],
    [("TCP 8 / Gloo", "tcp-allreduce-4m-s8", "gloo-4"), ("shm 8 / Gloo", "shm-allreduce-4m-s8", "gloo-4")],
)
for r in rows:
    if r["collective"] == "iperf3":
        print(
            f"- {r['transport']}: {r['forward_gbps']:.2f} GB/s one way, "
            f"{r['reverse_gbps']:.2f} GB/s the other"
            " (iperf3 3.12 runs both directions of --bidir in one thread)"
        )
print()
print(
    "Transports as the members described them: "
    + "; ".join(
        f"`{c}`: {desc[c]}" for c in sorted(desc) if c.startswith(("tcp-allreduce-s8", "shm-allreduce-s8"))
    )
    + "."
)
