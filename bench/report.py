"""Turns bench/run.sh's rows.jsonl into the Markdown tables of
docs/BENCHMARKS.md: algbw (GB/s) by size for each configuration, and the
ratios the goals are stated in. Usage: report.py ROWS.jsonl [TITLE]

bench/docs.py imports it (render) to check that the tables in
docs/BENCHMARKS.md are what the rows in docs/bench/ give."""

from __future__ import annotations

import json
import math
import sys
from collections import defaultdict
from typing import Any

# Names of configurations in runs made before the default became 8 streams.
ALIASES = {
    "shm-allreduce": "shm-allreduce-s4",
    "shm-exchange": "shm-exchange-s4",
    "shm-allreduce-crc": "shm-allreduce-s4-crc",
    "tcp-allreduce-4m": "tcp-allreduce-4m-s4",
    "shm-allreduce-4m": "shm-allreduce-4m-s4",
}


def read_rows(path: str) -> list[dict[str, Any]]:
    with open(path) as f:
        rows = [json.loads(line) for line in f if line.strip()]
    for r in rows:
        r["config"] = ALIASES.get(r["config"], r["config"])
    return rows


def kind(r: dict[str, Any]) -> str:
    """What a row measured, in words: the unit the check text speaks of."""
    if r["collective"] == "iperf3":
        return "iperf3"
    if r.get("transport") == "torch gloo":
        return "Gloo all_reduce"
    return f"gbbridge {r['collective']}"


def checked(r: dict[str, Any]) -> bool:
    """Whether the row's "wrong" comes from a check. Rows carry "checked"
    since gbbridge checks its exchange and memcpy rows too; older rows lack
    it: their gbbridge exchange and memcpy rows were not checked, every other
    gbbridge and Gloo row was; iperf3 is never checked."""
    if "checked" in r:
        return bool(r["checked"])
    return r["collective"] not in ("exchange", "memcpy", "iperf3")


def human(n: int) -> str:
    for unit, div in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= div and n % div == 0:
            return f"{n // div} {unit}"
    return f"{n} B"


def iperf3_note(rows: list[dict[str, Any]]) -> str:
    versions = sorted({str(r["iperf3_version"]) for r in rows if r.get("iperf3_version")})
    one_thread = "iperf3 before 3.16 runs both directions of --bidir in one thread"
    if not versions:
        return f"(iperf3's version was not recorded in these rows; {one_thread}.)"
    return f"({', '.join(versions)}, as recorded in the rows; {one_thread}.)"


def render(rows: list[dict[str, Any]], title: str | None = "run") -> str:
    out: list[str] = []
    p = out.append
    bw: dict[str, dict[int, float]] = defaultdict(dict)
    desc: dict[str, str] = {}
    for r in rows:
        bw[r["config"]][r.get("size", 0)] = r["algbw_gbps"]
        desc[r["config"]] = r.get("transport", "")
    sizes = sorted({s for c in bw for s in bw[c] if s})
    kinds_checked = sorted({kind(r) for r in rows if checked(r)})
    kinds_unchecked = sorted({kind(r) for r in rows if not checked(r)})
    wrong = sum(int(r.get("wrong", 0)) for r in rows if checked(r))

    algos: dict[str, dict[int, str]] = defaultdict(dict)
    two_rings = False  # a 2-member row ran the ring: the halves (--split)
    for r in rows:
        if r.get("algorithm") and r["collective"] not in ("exchange", "memcpy"):
            algos[r["config"]][r.get("size", 0)] = r["algorithm"]
            two_rings = two_rings or (r["algorithm"] == "ring" and r.get("members") == 2)

    def table(
        title: str, cols: list[tuple[str, str]], ratios: list[tuple[str, str, str]] | None = None
    ) -> None:
        cols = [(h, c) for h, c in cols if c in bw]
        ratios = [(h, a, b) for h, a, b in ratios or [] if a in bw and b in bw]
        if not cols:
            return  # nothing of this table was measured in this run
        p(f"#### {title}\n")
        p("| size | " + " | ".join(h for h, _ in cols) + "".join(f" | {h}" for h, _, _ in ratios) + " |")
        p("|---" * (1 + len(cols) + len(ratios)) + "|")
        for s in sizes:
            cells = [f"{bw[c].get(s, math.nan):.2f}" for _, c in cols]
            cells += [
                f"{bw[a].get(s, math.nan) / bw[b].get(s, math.nan):.2f}\u00d7" if bw[b].get(s) else "\u2013"
                for _, a, b in ratios
            ]
            p(f"| {human(s)} | " + " | ".join(cells) + " |")
        p("")

    if title is not None:
        p(f"### {title}\n")
    unchecked = ""
    if kinds_unchecked:
        why = []
        if any(k.startswith("gbbridge") for k in kinds_unchecked):
            why.append("these gbbridge rows were made before gbbridge checked them")
        if "iperf3" in kinds_unchecked:
            why.append("iperf3 moves bytes and has nothing to check")
        unchecked = f" Not checked: {', '.join(kinds_unchecked)} ({'; '.join(why)})."
    p(
        "algbw in GB/s (bytes of the buffer / time per call; nccl-tests' definition). "
        "Checked after timing, with one more call on fresh data whose every element is compared "
        "with the exact result (gbbridge bit for bit, Gloo by value): "
        f"{', '.join(kinds_checked)}; wrong elements in them: "
        + (f"{wrong}." if wrong else "none.")
        + unchecked
        + "\n"
    )
    table(
        "2 members, the default 8 streams: gbbridge vs Gloo and the ceilings",
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
    table(
        "TCP streams (2 members)",
        [(f"exchange {s}", f"tcp-exchange-s{s}") for s in (1, 2, 4, 8, 16)]
        + [(f"all_reduce {s}", f"tcp-allreduce-s{s}") for s in (1, 2, 4, 8, 16)],
    )
    table(
        "shm streams (2 members)",
        [(f"exchange {s}", f"shm-exchange-s{s}") for s in (4, 8, 16)]
        + [(f"all_reduce {s}", f"shm-allreduce-s{s}") for s in (4, 8, 16)],
    )
    table(
        "CRC32C per frame on and off (2 members, 4 streams)",
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
    table(
        "4 members" + ("" if algos else " (ring)"),
        [
            ("Gloo, 4 ranks", "gloo-4"),
            ("gbbridge TCP 4 streams", "tcp-allreduce-4m-s4"),
            ("gbbridge TCP 8 streams", "tcp-allreduce-4m-s8"),
            ("gbbridge shm 4 streams", "shm-allreduce-4m-s4"),
            ("gbbridge shm 8 streams", "shm-allreduce-4m-s8"),
        ],
        [
            ("TCP 8 / Gloo", "tcp-allreduce-4m-s8", "gloo-4"),
            ("shm 8 / Gloo", "shm-allreduce-4m-s8", "gloo-4"),
        ],
    )
    if any(c.endswith("-nooverlap") for c in bw):
        table(
            "TCP, 8 streams: pieces read while earlier ones are reduced (--overlap) or one after the other",
            [
                ("exchange (ceiling)", "tcp-exchange-s8"),
                ("2 members", "tcp-allreduce-s8"),
                ("2 members, no overlap", "tcp-allreduce-s8-nooverlap"),
                ("Gloo, 4 ranks", "gloo-4"),
                ("4 members", "tcp-allreduce-4m-s8"),
                ("4 members, no overlap", "tcp-allreduce-4m-s8-nooverlap"),
            ],
            [
                ("2 / ceiling", "tcp-allreduce-s8", "tcp-exchange-s8"),
                ("2, no overlap / ceiling", "tcp-allreduce-s8-nooverlap", "tcp-exchange-s8"),
                ("4 / Gloo", "tcp-allreduce-4m-s8", "gloo-4"),
                ("4, no overlap / Gloo", "tcp-allreduce-4m-s8-nooverlap", "gloo-4"),
            ],
        )
    if any(c.endswith("-spin200") for c in bw):
        table(
            "shm, 8 streams: waiters spin 200 µs before sleeping (--spin-us 200: serve under auto) or 5 µs",
            [
                ("2 members", "shm-allreduce-s8"),
                ("2 members, spin 200", "shm-allreduce-s8-spin200"),
                ("Gloo, 4 ranks", "gloo-4"),
                ("4 members", "shm-allreduce-4m-s8"),
                ("4 members, spin 200", "shm-allreduce-4m-s8-spin200"),
            ],
            [
                ("2, spin 200 / spin 5", "shm-allreduce-s8-spin200", "shm-allreduce-s8"),
                ("4 / Gloo", "shm-allreduce-4m-s8", "gloo-4"),
                ("4, spin 200 / Gloo", "shm-allreduce-4m-s8-spin200", "gloo-4"),
            ],
        )
    if any(c.endswith("-copy") for c in bw):
        table(
            "shm, 8 streams: each piece's owner writes the result into every member's buffer "
            "(--peer-writes on, the default: direct-write) "
            "or the members copy it from the owner's (off: direct)",
            [
                ("2 members", "shm-allreduce-s8"),
                ("2 members, copies", "shm-allreduce-s8-copy"),
                ("Gloo, 4 ranks", "gloo-4"),
                ("4 members", "shm-allreduce-4m-s8"),
                ("4 members, copies", "shm-allreduce-4m-s8-copy"),
            ],
            [
                ("2, writes / copies", "shm-allreduce-s8", "shm-allreduce-s8-copy"),
                ("4, writes / copies", "shm-allreduce-4m-s8", "shm-allreduce-4m-s8-copy"),
                ("4 / Gloo", "shm-allreduce-4m-s8", "gloo-4"),
                ("4, copies / Gloo", "shm-allreduce-4m-s8-copy", "gloo-4"),
            ],
        )
    if "tcp-allreduce-s8-nosplit" in bw:
        table(
            "TCP, 8 streams: two members split from the default --split on (ring) "
            "or exchange at every size (--split off)",
            [
                ("exchange (ceiling)", "tcp-exchange-s8"),
                ("all_reduce", "tcp-allreduce-s8"),
                ("all_reduce, --split off", "tcp-allreduce-s8-nosplit"),
            ],
            [
                ("default / off", "tcp-allreduce-s8", "tcp-allreduce-s8-nosplit"),
                ("default / ceiling", "tcp-allreduce-s8", "tcp-exchange-s8"),
                ("off / ceiling", "tcp-allreduce-s8-nosplit", "tcp-exchange-s8"),
            ],
        )
    if "shm-allreduce-4m-s8-nostream" in bw:
        table(
            "shm, 8 streams: writes and copies of 128 MiB and more non-temporal (--stream 128M, the default) "
            "or ordinary (--stream off)",
            [
                ("2 members", "shm-allreduce-s8"),
                ("2 members, --stream off", "shm-allreduce-s8-nostream"),
                ("4 members", "shm-allreduce-4m-s8"),
                ("4 members, --stream off", "shm-allreduce-4m-s8-nostream"),
            ],
            [
                ("2, off / on", "shm-allreduce-s8-nostream", "shm-allreduce-s8"),
                ("4, off / on", "shm-allreduce-4m-s8-nostream", "shm-allreduce-4m-s8"),
            ],
        )
    iperf = [r for r in rows if r["collective"] == "iperf3"]
    for r in iperf:
        p(f"- {r['transport']}: {r['forward_gbps']:.2f} GB/s one way, {r['reverse_gbps']:.2f} GB/s the other")
    if iperf:
        p("")
        p(iperf3_note(iperf))
    p("")
    shown = [c for c in sorted(desc) if c.startswith(("tcp-allreduce-s8", "shm-allreduce-s8"))]
    p("Transports as the members described them: " + "; ".join(f"`{c}`: {desc[c]}" for c in shown) + ".")
    if algos:
        p("")
        p(
            "Algorithms the rows ran (`algorithm` in the rows; exchange: the two members send each other "
            "their buffers through the transport; ring: the pipelined ring"
            + (", with two members a reduce-scatter then an all-gather" if two_rings else "")
            + "; direct: the members read each other's shared memory"
            + (
                "; direct-write: the same, each piece's owner writing the result into every member's buffer"
                if any(a == "direct-write" for c in algos for a in algos[c].values())
                else ""
            )
            + "): "
            + "; ".join(f"`{c}`: {algo_sizes(algos[c])}" for c in sorted(algos))
            + "."
        )
    return "\n".join(out) + "\n"


def algo_sizes(by_size: dict[int, str]) -> str:
    """'direct' or 'exchange at 1 MiB, direct from 4 MiB' (sizes in order)."""
    sizes = sorted(by_size)
    runs: list[tuple[str, int]] = []
    for sz in sizes:
        if not runs or runs[-1][0] != by_size[sz]:
            runs.append((by_size[sz], sz))
    if len(runs) == 1:
        return runs[0][0]
    return ", ".join(
        f"{a} from {human(sz)}" if i else f"{a} at {human(sz)}" for i, (a, sz) in enumerate(runs)
    )


def main() -> int:
    if len(sys.argv) < 2:
        print(__doc__, file=sys.stderr)
        return 2
    title = sys.argv[2] if len(sys.argv) > 2 else "run"
    sys.stdout.write(render(read_rows(sys.argv[1]), title))
    return 0


if __name__ == "__main__":
    sys.exit(main())
