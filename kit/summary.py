#!/usr/bin/env python3
"""The kit's report: every step's outputs (out/stepN-NAME-JOB/rows.jsonl) as
one Markdown document.

    kit/summary.py [OUT] [--job N ...] [-o REPORT.md]

OUT is the kit's output directory (default: out/ beside this script, or
KIT_OUT). For each step the newest job's rows are used (the largest job id),
or the job given with --job (repeatable: one per step). Standard library
only: it runs on a login node in any python 3.9+.

Exit 0 when every step that ran passed (or says NOT RUN), 1 when a step
failed or could not run, 2 when OUT has no step outputs.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import re
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent / "py"))
from judge import Rows, load, of  # the steps' own reader

STEPS = [
    (1, "probe", "gbprobe --require on every node"),
    (2, "bridge", "gbbridge selftest between the components' leaders"),
    (3, "collectives", "every collective x dtype x op, bit for bit"),
    (4, "sweep", "bridged all_reduce vs all-native in each island"),
    (5, "train", "short DDP and FSDP runs, tokens/s"),
    (6, "trace", "gbtrace summary of the training run"),
]
DIR = re.compile(r"^step(\d+)-([a-z]+)-(\d+)$")


def cell(v: Any) -> str:
    s = "" if v is None else str(v)
    return s.replace("|", "\\|").replace("\n", " ")


def table(head: list[str], body: list[list[Any]]) -> list[str]:
    out = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    out += ["| " + " | ".join(cell(c) for c in row) + " |" for row in body]
    return [*out, ""]


def gb(v: Any) -> str:
    return f"{v:.2f}" if isinstance(v, (int, float)) else cell(v)


def size(n: Any) -> str:
    if not isinstance(n, int):
        return cell(n)
    for unit, s in (("G", 30), ("M", 20), ("K", 10)):
        if n >= 1 << s and n % (1 << s) == 0:
            return f"{n >> s} {unit}iB"
    return f"{n} B"


def find(out: Path, jobs: list[int]) -> dict[int, tuple[int, Path]]:
    """Step number -> (job, directory): the newest, or a job of --job."""
    found: dict[int, tuple[int, Path]] = {}
    for d in out.iterdir() if out.is_dir() else []:
        m = DIR.match(d.name)
        if not m or not (d / "rows.jsonl").is_file():
            continue
        step, job = int(m.group(1)), int(m.group(3))
        if jobs and job not in jobs:
            continue
        if step not in found or job > found[step][0]:
            found[step] = (job, d)
    return found


def section_probe(rows: Rows) -> list[str]:
    body = [
        [
            r.get("node"),
            r.get("component"),
            r.get("partition"),
            r.get("require"),
            "yes" if r.get("ok") else "**no**",
            r.get("vendor_found"),
            r.get("gpus"),
            ", ".join(r.get("gpu_names") or []),
            ", ".join(r.get("rdma_active") or []),
            "; ".join(r.get("failed") or []),
        ]
        for r in sorted(of(rows, "gpubridge.kit-probe/v1"), key=lambda r: (r.get("component"), r.get("node")))
    ]
    return table(
        ["node", "comp.", "partition", "--require", "held", "vendor", "GPUs", "GPU", "RDMA active", "failed"],
        body,
    )


def section_bridge(rows: Rows) -> list[str]:
    out = []
    topo = of(rows, "gpubridge.kit-bridge-topology/v1")
    if topo:
        t = topo[0]
        out += [
            f"Transport: **{t.get('transport')}** ({t.get('reason')}); "
            f"leaders on {', '.join(t.get('hosts') or [])}.",
            "",
        ]
    st = of(rows, "gpubridge.kit-bridge-selftest/v1")
    if st:
        s = st[0]
        out += [
            f"Selftest: {s.get('cases')} cases, {s.get('failed')} failed, {gb(s.get('seconds'))} s "
            f"({s.get('transport')}).",
            "",
        ]
        for f in s.get("failures") or []:
            out.append(f"- {cell(f.get('case'))}: {cell(f.get('error') or f.get('wrong_elements'))}")
        if s.get("failures"):
            out.append("")
    bw = of(rows, "gpubridge.kit-bridge-bw/v1")
    if bw:
        out += ["perftest-style rows (all_reduce, float32, the selftest's sweep):", ""]
        out += table(
            ["#bytes", "t_avg [usec]", "BW average [GB/s]", "busBW [GB/s]", "members"],
            [
                [
                    r.get("bytes"),
                    gb(r.get("t_avg_us")),
                    gb(r.get("bw_average_gbps")),
                    gb(r.get("busbw_gbps")),
                    r.get("members"),
                ]
                for r in bw
            ],
        )
    return out


def section_collectives(rows: Rows) -> list[str]:
    checks = of(rows, "gpubridge.kit-collectives/v1")
    if not checks:
        return []
    by: dict[tuple[str, str], list[bool]] = {}
    for c in checks:
        by.setdefault((str(c.get("collective")), str(c.get("dtype"))), []).append(bool(c.get("ok")))
    order = [c.get("dtype") for c in checks]
    dtypes = sorted({d for _, d in by}, key=order.index)
    colls = sorted({c for c, _ in by})
    body = []
    for coll in colls:
        line: list[Any] = [coll]
        for d in dtypes:
            oks = by.get((coll, d), [])
            line.append(f"{sum(oks)}/{len(oks)}" if oks else "")
        body.append(line)
    out = [
        "Checks exact per collective and dtype (all ops and sizes):",
        "",
        *table(["collective", *dtypes], body),
    ]
    bad = [c for c in checks if not c.get("ok")]
    if bad:
        out += [
            "Wrong:",
            "",
            *table(
                ["collective", "dtype", "op", "elements", "root", "ranks wrong", "first"],
                [
                    [
                        c.get("collective"),
                        c.get("dtype"),
                        c.get("op"),
                        c.get("elements"),
                        c.get("root"),
                        c.get("ranks_wrong"),
                        json.dumps(c.get("first")),
                    ]
                    for c in bad[:50]
                ],
            ),
        ]
    return out


def section_sweep(rows: Rows) -> list[str]:
    sweep = of(rows, "gpubridge.kit-sweep/v1")
    if not sweep:
        return []
    labels = [n["island"] for n in sweep[0].get("native", [])]
    body = []
    for r in sweep:
        nat = {n["island"]: n for n in r.get("native", [])}
        body.append(
            [size(r.get("bytes")), gb(r["bridged"]["busbw_gbps"]), gb(r["bridged"]["time_us"])]
            + [
                f"{gb(nat[x]['busbw_gbps'])} ({gb(nat[x]['time_us'])} us)"
                if nat[x].get("ranks", 2) > 1
                else "1 rank: nothing to reduce"
                for x in labels
            ]
            + [r.get("bridged_over_native"), "yes" if r.get("exact") else "**no**"]
        )
    head = (
        ["size", "bridged busbw [GB/s]", "bridged [us]"]
        + [f"{x} native busbw [GB/s]" for x in labels]
        + ["bridged / slowest native", "exact"]
    )
    return table(head, body)


def section_train(rows: Rows) -> list[str]:
    tr = of(rows, "gpubridge.kit-train/v1")
    if not tr:
        return []
    body = [
        [
            r.get("parallel"),
            r.get("world"),
            r.get("device"),
            r.get("gpu") or "",
            r.get("dtype"),
            f"{r.get('params', 0) / 1e6:.2f}M",
            f"{r.get('batch_per_rank')}x{r.get('seq')}",
            f"{r.get('tokens_per_s', 0):,.0f}",
            gb(r.get("step_ms_median")),
            f"{gb(r.get('loss_first'))} -> {gb(r.get('loss_last'))}",
            "yes" if r.get("params_in_sync") else "**no**",
        ]
        for r in tr
    ]
    return table(
        [
            "mode",
            "ranks",
            "device",
            "GPU",
            "dtype",
            "params",
            "batch x seq per rank",
            "tokens/s (all ranks)",
            "step [ms]",
            "loss",
            "params identical",
        ],
        body,
    )


def top_phases(r: dict[str, Any], n: int = 3) -> list[tuple[str, float]]:
    return sorted(r.get("phases", {}).items(), key=lambda kv: -kv[1])[:n]


def section_trace(rows: Rows) -> list[str]:
    body = [
        [
            r.get("op"),
            r.get("group_size"),
            f"<= {r.get('bucket_label')}B",
            r.get("count"),
            gb(r.get("time_p50_us")),
            gb(r.get("time_p99_us")),
            f"{r.get('busbw_gbps', 0):.3f}",
            ", ".join(f"{k} {v:.0%}" for k, v in top_phases(r)),
        ]
        for r in of(rows, "gpubridge.trace-summary/v1")
    ]
    if not body:
        return []
    head = ["op", "ranks", "size", "count", "p50 [us]", "p99 [us]", "busbw [GB/s]", "most time in"]
    return table(head, body)


SECTIONS = {
    "probe": section_probe,
    "bridge": section_bridge,
    "collectives": section_collectives,
    "sweep": section_sweep,
    "train": section_train,
    "trace": section_trace,
}


def layout_lines(rows: Rows) -> list[str]:
    lay = of(rows, "gpubridge.kit-layout/v1")
    if not lay:
        return []
    lo = lay[0]
    body = [
        [
            c["component"],
            c["partition"],
            c["vendor"],
            " ".join(c["nodes"]),
            f"{c['ranks'][0]}-{c['ranks'][1]}",
            c["require"],
        ]
        for c in lo.get("components", [])
    ]
    out = table(["component", "partition", "vendor", "nodes", "ranks", "--require"], body)
    if lo.get("simulated"):
        note = "**CPU simulation** (KIT_SIMULATE=1): each component's ranks stand in for its vendor on CPU."
        out = [note, "", *out]
    return out


def main() -> int:
    p = argparse.ArgumentParser(description="The kit's steps as one Markdown report")
    p.add_argument(
        "out", nargs="?", default=os.environ.get("KIT_OUT") or str(Path(__file__).resolve().parent / "out")
    )
    p.add_argument("--job", type=int, action="append", default=[], help="use this job's outputs (repeatable)")
    p.add_argument("-o", "--output", help="write the report here instead of stdout")
    args = p.parse_args()
    out = Path(args.out)
    found = find(out, args.job)
    if not found:
        print(f"kit/summary.py: no step outputs (stepN-NAME-JOB/rows.jsonl) in {out}", file=sys.stderr)
        return 2
    doc = [
        "# gpubridge cluster validation",
        "",
        f"From `{out}`, {datetime.datetime.now(datetime.timezone.utc).strftime('%Y-%m-%d %H:%M UTC')}.",
        "",
    ]
    verdicts: dict[int, dict[str, Any]] = {}
    all_rows: dict[int, Rows] = {}
    for step, (_, d) in sorted(found.items()):
        rows = load(d / "rows.jsonl")
        all_rows[step] = rows
        v = of(rows, "gpubridge.kit-verdict/v1")
        verdicts[step] = (
            v[-1]
            if v
            else {
                "result": "ERROR",
                "reason": f"no verdict in {d}/rows.jsonl (the job was killed?)",
                "exit": 2,
            }
        )
    body = []
    for step, name, what in STEPS:
        if step not in found:
            body.append([step, name, what, "not submitted", "", "", ""])
            continue
        verdict = verdicts[step]
        res = verdict.get("result")
        body.append(
            [
                step,
                name,
                what,
                f"**{res}**" if res in ("FAIL", "ERROR") else res,
                found[step][0],
                verdict.get("seconds", ""),
                verdict.get("reason"),
            ]
        )
    doc += table(["step", "name", "checks", "result", "job", "s", "verdict"], body)
    newest = all_rows[max(all_rows, key=lambda s: found[s][0])]
    doc += ["## Layout", "", *layout_lines(newest)]
    for step, name, what in STEPS:
        if step not in found:
            continue
        doc += [
            f"## Step {step}: {name}",
            "",
            f"{what}. Job {found[step][0]}: **{verdicts[step].get('result')}**: "
            f"{cell(verdicts[step].get('reason'))}",
            "",
        ]
        fn = SECTIONS.get(name)
        if fn:
            doc += fn(all_rows[step])
    text = "\n".join(doc).rstrip() + "\n"
    if args.output:
        Path(args.output).write_text(text)
    else:
        sys.stdout.write(text)
    bad = [s for s, v in verdicts.items() if v.get("result") in ("FAIL", "ERROR")]
    print(
        f"kit/summary.py: {len(found)} steps, "
        f"{'failed: ' + ', '.join(map(str, bad)) if bad else 'none failed'}",
        file=sys.stderr,
    )
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
