"""The compression tables of docs/BENCHMARKS.md (issue 13), from the rows
of bench/codec.sh and bench/codec_accuracy.py; docs.py renders them with
the rest (BLOCKS)."""

from __future__ import annotations

import json
import statistics
from collections.abc import Callable
from pathlib import Path
from typing import Any

BENCH = Path(__file__).resolve().parents[1] / "docs" / "bench"
RUN = "e4a3cf3"  # the commit of the codec rows
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


# ---- compression on the bridge (phase 2): bench/codec_bridge.sh ----

BRIDGE_RUN = "ef34a2e"  # the commit of the bridge rows (bench/codec_bridge.sh)
BRIDGE = f"codec-bridge-devbox-{BRIDGE_RUN}.jsonl"
MIB = 1 << 20


def med(values: list[float]) -> float:
    return statistics.median(values)


def spread(values: list[float], scale: float = 1.0, fmt: str = "{:.2f}") -> str:
    """'median (min to max)' of values / scale, with an en dash."""
    v = [x / scale for x in values]
    return f"{fmt.format(med(v))} ({fmt.format(min(v))}{DASH}{fmt.format(max(v))})"


def bridge_kernels() -> str:
    rs = [r for r in rows(BRIDGE) if r["schema"] == "gpubridge.codec-bench/v1"]
    by: dict[tuple[str, str], Rows] = {}
    for r in rs:
        by.setdefault((r["bench"], r["case"]), []).append(r)
    memcpy = med([r["cpu_mbps"] for r in by[("MXFP8", "memcpy")]])
    out = [
        "| codec | operation | AVX2: GB/s per core, median (min"
        + DASH
        + "max) | wall GB/s, median | Go: GB/s per core | AVX2 / memcpy |",
        "|---|---|---|---|---|---|",
    ]
    for bench in ("MXFP8", "BF16"):
        for op in ("encode", "decode", "decode-add", "encode-feedback"):
            a, g = by.get((bench, f"{op}/avx2")), by.get((bench, f"{op}/go"))
            if a is None or g is None:
                continue
            cpu = [r["cpu_mbps"] for r in a]
            out.append(
                f"| {'fp8' if bench == 'MXFP8' else 'bf16'} | {op} | {spread(cpu, 1e3)} | "
                f"{med([r['wall_mbps'] for r in a]) / 1e3:.2f} | "
                f"{med([r['cpu_mbps'] for r in g]) / 1e3:.2f} | "
                f"{med(cpu) / memcpy:.2f} |"
            )
    mc = by[("MXFP8", "memcpy")]
    out.append(
        f"| {DASH} | memcpy (the anchor) | {spread([r['cpu_mbps'] for r in mc], 1e3)} | "
        f"{med([r['wall_mbps'] for r in mc]) / 1e3:.2f} | {DASH} | 1 |"
    )
    enc = med([r["cpu_mbps"] for r in by[("MXFP8", "encode/avx2")]]) / 1e3
    add = med([r["cpu_mbps"] for r in by[("MXFP8", "decode-add/avx2")]]) / 1e3
    met = enc >= GOAL_GBPS and add >= GOAL_GBPS
    r0 = rs[0]
    out += [
        "",
        f"{len(mc)} runs of each benchmark. The goal, fp8 encode and decode+add "
        f"\u2265 {GOAL_GBPS:g} GB/s per core "
        f"for float32, {'holds' if met else '**does not hold**'}: {enc:.1f} and {add:.1f} GB/s (medians). "
        f"Machine: {r0['cpu']}, {r0['cpus']} cores, load average {r0['load_before'][0]} before and "
        f"{r0['load_after'][0]} after.",
    ]
    return "\n".join(out) + "\n"


CONFIGS = [  # (label, bench/codec_bridge.sh's configuration) in table order
    ("memcpy, one core (anchor)", "memcpy"),
    ("raw exchange, nothing reduced (the ceiling)", "exchange"),
    ("all_reduce raw", "raw"),
    ("all_reduce bf16", "bf16"),
    ("all_reduce fp8", "fp8"),
    ("all_reduce fp8, error feedback", "fp8-feedback"),
    ("all_reduce zstd", "zstd"),
    ("all_reduce fp8, 512 KiB chunks", "fp8-chunk512K"),
]


def bridge_table(link: str) -> str:
    rs = [r for r in rows(BRIDGE) if r["schema"] == "gpubridge.bench/v1" and r["link"] == link]
    sizes = sorted({r["size"] for r in rs})
    head = " | ".join(f"{s // MIB} MiB: GB/s, median (min{DASH}max)" for s in sizes)
    big = sizes[-1]
    out = [
        f"| configuration | {head} | sent per call at {big // MIB} MiB "
        f"| vs all_reduce raw at {big // MIB} MiB |",
        "|---|" + "---|" * (len(sizes) + 2),
    ]

    def pick(config: str, size: int) -> Rows:
        return [r for r in rs if r["config"] == config and r["size"] == size]

    raw = med([r["algbw_gbps"] for r in pick("raw", big)])
    for label, config in CONFIGS:
        last = pick(config, big)
        if not last:
            continue
        cells = [spread([r["algbw_gbps"] for r in pick(config, s)]) for s in sizes]
        sent = med([r.get("sent_bytes", 0) for r in last])
        sent_cell = DASH if sent == 0 else f"{sent / MIB:.1f} MiB"
        vs = med([r["algbw_gbps"] for r in last]) / raw
        out.append(f"| {label} | " + " | ".join(cells) + f" | {sent_cell} | {vs:.2f}{X} |")
    loads = [r["load"] for r in rs]
    rounds = sorted({r["round"] for r in rs})
    wrong = sum(r["wrong"] for r in rs)
    out += [
        "",
        f"2 members over TCP (8 streams, 4 MiB chunks), float32 sum of random values in [-8, 8), "
        f"{len(rounds)} rounds; GB/s is algbw (the buffer over the slowest member's mean time of 3 "
        f"calls). Load average during the rounds: "
        f"{min(loads):.1f}{DASH}{max(loads):.1f} on 2 cores. Every row checked: {wrong} wrong elements.",
    ]
    return "\n".join(out) + "\n"


def bridge_loopback() -> str:
    return bridge_table("loopback")


def bridge_limited() -> str:
    links = sorted(
        {r["link"] for r in rows(BRIDGE) if r["schema"] == "gpubridge.bench/v1" and r["link"] != "loopback"}
    )
    return bridge_table(links[0])


# ---- the GPU path (issue 13 phase 2, one H200: a split test) ----

GPU_BEFORE, GPU_RUN = "h200x1-compress-514e49e.jsonl", "h200x1-compress-5b2ae60.jsonl"
GPU_TRAIN = "h200x1-compress-train.jsonl"
GPU_COMPILE, GPU_CODEC = "h200x1-codec-compile-f58d414.jsonl", "h200x1-codec-check-5b2ae60.jsonl"
GIB = 1 << 30


def human(n: int) -> str:
    return f"{n >> 30} GiB" if n >= GIB and n % GIB == 0 else f"{n >> 20} MiB"


GPU_GOAL = 0.4  # the issue's: a bridged 1 GiB float32 all_reduce with fp8 at most 0.4x the exact run's time


def gpu_codec() -> str:
    """The torch codec on the GPU: eager against compiled (codec_compile.py),
    and the compiled operations' speed beside a copy (codec_check.py)."""
    out = [
        "| operation (64 Mi values) | eager ms | compiled ms | compiled GB/s of float32 | compile s "
        "| same bits as eager |",
        "|---|---|---|---|---|---|",
    ]
    for r in rows(GPU_COMPILE):
        out.append(
            f"| {r['op']} | {r['eager_ms']:.2f} | {r['compiled_ms']:.2f} | {r['gbps']:.0f} | "
            f"{r['compile_s']:.1f} | {'yes' if r['same_bits'] else '**no**'} ({len(r['sizes'])} sizes) |"
        )
    checks = [r for r in rows(GPU_CODEC) if r["schema"] == "gpubridge.codec-check/v1"]
    bench = [r for r in rows(GPU_CODEC) if r["schema"] == "gpubridge.codec-gpu-bench/v1"]
    ok = sum(r["ok"] for r in checks)
    out += [
        "",
        "Against the Go codec's vectors with the compiled codec "
        f"(`bench/gpu/codec_check.py`, {GPU_CODEC[-13:-6]}): "
        f"{ok} of {len(checks)} checks bit for bit. Its timings (one call on 64 Mi values, GB/s of float32): "
        + ", ".join(f"{r['case']} {r['raw_gbps']:.0f}" for r in bench)
        + ".",
    ]
    return "\n".join(out) + "\n"


def gpu_allreduce() -> str:
    """Each codec's bridged all_reduce on the GPU path, before and after the
    codec was called in pieces instead of chunk by chunk."""
    out = [
        f"| commit | size | raw ms | fp8 ms ({X} raw) | fp8 + error feedback ms ({X} raw) "
        f"| bf16 ms ({X} raw) | wrong |",
        "|---|---|---|---|---|---|---|",
    ]
    verdict = ""
    for name in (GPU_BEFORE, GPU_RUN):
        rs = [r for r in rows(name) if r["kind"] == "allreduce"]
        for size in sorted({r["size"] for r in rs}):
            by = {r["mode"]: r for r in rs if r["size"] == size}
            raw = by["raw"]["time_ms"]
            cells = [
                f"{by[m]['time_ms']:.1f} ({by[m]['time_ms'] / raw:.2f})" for m in ("fp8", "fp8-ef", "bf16")
            ]
            wrong = sum(r["wrong"] for r in by.values())
            head = f"| {rs[0]['commit']} | {human(size)} | {raw:.1f} | "
            out.append(head + " | ".join(cells) + f" | {wrong} |")
            if name == GPU_RUN and size == GIB:
                q = by["fp8"]["time_ms"] / raw
                verdict = (
                    f"The goal, fp8 at most {GPU_GOAL}{X} the exact run's time at 1 GiB, is "
                    + ("met" if q <= GPU_GOAL else f"**missed**: {q:.3f}{X}")
                    + f" ({by['fp8-ef']['time_ms'] / raw:.3f}{X} with error feedback)."
                )
    checks = [r for r in rows(GPU_BEFORE) if r["kind"] == "check"]
    bad = [r for r in checks if r["wrong"] or not r["ranks_equal"]]
    z = [r for r in rows(GPU_BEFORE) if r["kind"] == "zstd"]
    out += [
        "",
        verdict,
        f"Bit for bit ({GPU_BEFORE[-13:-6]}): {len(checks)} codec {X} dtype {X} size cases, "
        "3 calls each with error "
        f"feedback, the GPU path against gbbridge's host path and across the ranks: {len(bad)} differ; zstd "
        f"against raw on both paths: {sum(r['wrong'] for r in z)} bits differ.",
    ]
    return "\n".join(out) + "\n"


def gpu_train() -> str:
    """DDP of the 110M model: loss after 500 steps by mode, and tokens/s."""
    rs = rows(GPU_TRAIN)
    curves: dict[str, dict[str, Any]] = {}
    for r in rs:
        if r["kind"] == "curve":
            curves[r["mode"]] = r  # the later run of a mode wins
    exact = curves["exact"]["final_loss"]
    out = [
        "| mode (commit) | loss at step 0 | mean loss, last 50 of 500 steps | vs exact "
        "| bytes sent per step | params equal on both ranks |",
        "|---|---|---|---|---|---|",
    ]
    for mode in ("exact", "fp8-ef", "fp8"):
        c = curves[mode]
        out.append(
            f"| {mode} ({c['commit']}) | {c['first_loss']:.3f} | {c['final_loss']:.5f} | "
            f"{(c['final_loss'] / exact - 1) * 100:+.3f}% | {c['bridge_bytes_per_step'] / 1e6:.1f} MB | "
            f"{'yes' if c['params_in_sync'] else '**no**'} |"
        )
    speed = [r for r in rs if r["kind"] == "speed" and r["commit"] == rs[-1]["commit"]]
    by = {r["mode"]: r["tokens_per_s_total"] for r in speed}
    top = by["compute-only"]
    out += [
        "",
        "| mode | tokens/s (both ranks) | vs compute-only | vs exact |",
        "|---|---|---|---|",
    ]
    for mode in ("compute-only", "exact", "fp8-ef"):
        out.append(f"| {mode} | {by[mode]:,.0f} | {by[mode] / top:.3f} | {by[mode] / by['exact']:.3f} |")
    out += [
        "",
        f"tokens/s at {speed[0]['commit']}, {speed[0]['batch']} {X} {speed[0]['seq']} tokens "
        "per rank per step, "
        f"{speed[0]['steps']} timed steps.",
    ]
    return "\n".join(out) + "\n"


BLOCKS: dict[str, Callable[[], str]] = {
    f"codec-kernels {RUN}": kernels,
    f"codec-lossless {RUN}": lossless,
    f"codec-stat {RUN}": stat,
    f"codec-accuracy {ACCURACY_RUN}": accuracy,
    f"codec-bridge-kernels {BRIDGE_RUN}": bridge_kernels,
    f"codec-bridge-loopback {BRIDGE_RUN}": bridge_loopback,
    f"codec-bridge-limited {BRIDGE_RUN}": bridge_limited,
    "codec-gpu-kernels": gpu_codec,
    "codec-gpu-allreduce": gpu_allreduce,
    "codec-gpu-train": gpu_train,
}
