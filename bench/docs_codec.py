"""The compression tables of docs/BENCHMARKS.md (issue 13), from the rows
of bench/codec.sh and bench/codec_accuracy.py; docs.py renders them with
the rest (BLOCKS)."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

BENCH = Path(__file__).resolve().parents[1] / "docs" / "bench"
RUN = "cd95f29"  # the commit of the codec rows
ACCURACY_RUN = "73a04ed"  # the commit of the accuracy rows
CODEC = f"codec-devbox-{RUN}.jsonl"
ACCURACY = f"codec-accuracy-devbox-{ACCURACY_RUN}.jsonl"
GOAL_GBPS = 4.0  # fp8 encode and decode-add of float32, per core
X, DASH = "\u00d7", "\u2013"  # the signs the tables use

Rows = list[dict[str, Any]]


def rows(name: str) -> Rows:
    with open(BENCH / name) as f:
        return [json.loads(line) for line in f if line.strip()]


def kernels() -> str:
    rs = [
        r
        for r in rows(CODEC)
        if r["schema"] == "gpubridge.codec-bench/v1" and r["bench"] in ("MXFP8", "BF16")
    ]
    by = {(r["bench"], r["case"]): r for r in rs}
    memcpy = by[("MXFP8", "memcpy")]
    out = [
        "| codec | operation | AVX2: GB/s per core (wall) | Go: GB/s per core | AVX2 / memcpy |",
        "|---|---|---|---|---|",
    ]
    for bench in ("MXFP8", "BF16"):
        for op in ("encode", "decode", "decode-add", "encode-feedback"):
            a, g = by.get((bench, f"{op}/avx2")), by.get((bench, f"{op}/go"))
            if a is None or g is None:
                continue
            out.append(
                f"| {'fp8' if bench == 'MXFP8' else 'bf16'} | {op} | {a['cpu_mbps'] / 1e3:.1f} "
                f"({a['wall_mbps'] / 1e3:.1f}) | {g['cpu_mbps'] / 1e3:.2f} | "
                f"{a['cpu_mbps'] / memcpy['cpu_mbps']:.2f} |"
            )
    out.append(
        f"| {DASH} | memcpy (the anchor) | {memcpy['cpu_mbps'] / 1e3:.1f} ({memcpy['wall_mbps'] / 1e3:.1f}) "
        f"| {DASH} | 1 |"
    )
    enc, add = (
        by[("MXFP8", "encode/avx2")]["cpu_mbps"] / 1e3,
        by[("MXFP8", "decode-add/avx2")]["cpu_mbps"] / 1e3,
    )
    met = enc >= GOAL_GBPS and add >= GOAL_GBPS
    out += [
        "",
        f"The goal, fp8 encode and decode+add \u2265 {GOAL_GBPS:g} GB/s per core for float32, is "
        f"{'met' if met else '**not met**'}: {enc:.1f} and {add:.1f} GB/s. "
        f"Machine: {memcpy['cpu']}, {memcpy['cpus']} cores, load average {memcpy['load_before'][0]} before "
        f"and {memcpy['load_after'][0]} after the run (shared with CI).",
    ]
    return "\n".join(out) + "\n"


METHODS = {
    "planes-default": "zstd/v1 default (huff0; zstd on planes below 1/4)",
    "planes-zstd": "zstd/v1 `--method zstd`",
    "planes-s2": "zstd/v1 `--method s2`",
    "plain-zstd-fastest": "plain zstd, fastest level",
    "plain-zstd-default": "plain zstd, default level",
}


def lossless() -> str:
    rs = [r for r in rows(CODEC) if r["schema"] == "gpubridge.codec-bench/v1" and r["bench"] == "Lossless"]
    by = {tuple(r["case"].split("/")): r for r in rs}
    dumps = sorted({k[0] for k in by}, key=lambda d: (d.endswith("bf16.npy"), d))
    out = [
        "| dump | " + " | ".join(METHODS.values()) + " |",
        "|---|" + "---|" * len(METHODS),
    ]
    for d in dumps:
        cells = []
        for m in METHODS:
            e, dec = by[(d, m, "encode")], by[(d, m, "decode")]
            cells.append(f"{e['ratio']:.3f} ({e['cpu_mbps'] / 1e3:.2f} / {dec['cpu_mbps'] / 1e3:.2f})")
        out.append(f"| {d.removesuffix('.npy')} | " + " | ".join(cells) + " |")
    f32 = [by[(d, "planes-default", "encode")]["ratio"] for d in dumps if "f32" in d]
    bf = [by[(d, "planes-default", "encode")]["ratio"] for d in dumps if "bf16" in d]
    plain = [by[(d, "plain-zstd-fastest", "encode")]["ratio"] for d in dumps]
    out += [
        "",
        "Each cell: ratio (encode / decode GB/s per core), over the whole dump in 4 MiB chunks. "
        f"Byte planes: {min(f32):.2f}{DASH}{max(f32):.2f}{X} on float32 gradients, "
        f"{min(bf):.2f}{DASH}{max(bf):.2f}{X} on bfloat16; "
        f"plain zstd of the same bytes: {min(plain):.3f}{DASH}{max(plain):.3f}{X}.",
    ]
    return "\n".join(out) + "\n"


def stat() -> str:
    rs = [r for r in rows(CODEC) if r["schema"] == "gpubridge.compress-stat/v1"]
    out = [
        "| dump | codec | ratio | SNR dB | max rel err | RMSE | flushed to 0 | encode / decode GB/s (wall) |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in rs:
        snr = "exact" if r["snr_db"] is None else f"{r['snr_db']:.1f}"
        out.append(
            f"| {r['input'].removesuffix('.npy')} | {r['codec']} | {r['ratio']:.3f} | {snr} | "
            f"{r['max_rel_err']:.3g} | {r['rmse']:.3g} | {r['flushed_to_zero']} | "
            f"{r['encode_gbps']:.2f} / {r['decode_gbps']:.2f} |"
        )
    return "\n".join(out) + "\n"


def ratio(q: float) -> str:
    return f"{q:.5f}{X}" if q < 10 else f"{q:.3g}{X}"


def accuracy() -> str:
    rs = rows(ACCURACY)
    out = [
        f"| task | run | mean loss, steps 1{DASH}25 | 76{DASH}100 | 176{DASH}200 | 276{DASH}300 "
        "| final (last 20) | final / exact's | same parameters on every rank |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rs:
        c = r["loss_every_25"]
        out.append(
            f"| {r['task']} | {r['run']} | {c[0]:.4g} | {c[3]:.4g} | {c[7]:.4g} | {c[11]:.4g} | "
            f"{r['final_loss']:.5g} | {ratio(r['vs_exact'] + 1)} | "
            f"{'yes' if r['same_params_on_every_rank'] else 'NO'} |"
        )
    r0 = rs[0]
    out += ["", f"{r0['world']} ranks, {r0['steps']} steps each, torch {r0['torch']}, Gloo, CPU."]
    return "\n".join(out) + "\n"


BLOCKS: dict[str, Callable[[], str]] = {
    f"codec-kernels {RUN}": kernels,
    f"codec-lossless {RUN}": lossless,
    f"codec-stat {RUN}": stat,
    f"codec-accuracy {ACCURACY_RUN}": accuracy,
}
