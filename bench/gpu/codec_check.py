"""gpubridge._codec on a GPU: every check of torchplugin/tests/codec_vectors.py
(the Go codec's vectors: the same bytes, bit for bit, as on CPU and in Go),
then the quantizer's speed on the GPU beside a copy of the same bytes and the
device-to-host copies it saves (raw float32 against its fp8 packing, pinned).

    PYTHONPATH=torchplugin python3 bench/gpu/codec_check.py [OUT] [--cpu]

Writes OUT/codec-check.jsonl (default $OUT or /tmp/gpubridge-out): one line
per check (schema gpubridge.codec-check/v1) and one per timing (schema
gpubridge.codec-gpu-bench/v1). Exit 0 when every check passed, 1 when one
failed, 2 when it could not run (no GPU). About 30 s on an H200, most of it
CUDA's start-up. --cpu runs it all on the CPU (a dry run of the script, with
a smaller timing buffer and no host copies)."""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "torchplugin" / "tests"))
from codec_vectors import Checks

from gpubridge import _codec


def timed(f: Any, dev: torch.device, reps: int = 5) -> float:
    """The median time of f() in seconds (CUDA events on a GPU), after a
    warm-up."""
    f()
    times = []
    for _ in range(reps):
        if dev.type != "cuda":
            t0 = time.perf_counter()
            f()
            times.append(time.perf_counter() - t0)
            continue
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        f()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b) / 1e3)
    return sorted(times)[len(times) // 2]


def device_name(dev: torch.device) -> str:
    return torch.cuda.get_device_name(dev) if dev.type == "cuda" else "cpu"


def bench(dev: torch.device, out: list[dict[str, Any]]) -> None:
    values = (64 if dev.type == "cuda" else 4) << 20  # 256 MiB of float32 on a GPU
    g = torch.Generator(device=dev).manual_seed(1)
    x = torch.randn(values, device=dev, generator=g) * 1e-3
    raw = x.numel() * 4
    packed = _codec.mxfp8_encode(x)
    acc = torch.zeros_like(x)
    res = torch.zeros_like(x)
    bf = _codec.bf16_encode(x)
    cases = {
        "copy (anchor)": x.clone,
        "fp8 encode": lambda: _codec.mxfp8_encode(x),
        "fp8 decode": lambda: _codec.mxfp8_decode(packed, x.numel()),
        "fp8 decode-add": lambda: _codec.mxfp8_decode_add(acc, packed),
        "fp8 encode with feedback": lambda: _codec.mxfp8_encode_feedback(x, res),
        "bf16 encode": lambda: _codec.bf16_encode(x),
        "bf16 decode-add": lambda: _codec.bf16_decode_add(acc, bf),
    }
    if dev.type == "cuda":
        host_raw = torch.empty(raw, dtype=torch.uint8, pin_memory=True)
        host_packed = torch.empty(packed.numel(), dtype=torch.uint8, pin_memory=True)
        cases["D2H float32 (pinned)"] = lambda: host_raw.copy_(x.view(torch.uint8), non_blocking=True)
        cases["D2H fp8 packing (pinned)"] = lambda: host_packed.copy_(packed, non_blocking=True)
    for name, f in cases.items():
        s = timed(f, dev)
        row = {
            "schema": "gpubridge.codec-gpu-bench/v1",
            "case": name,
            "values": x.numel(),
            "raw_bytes": raw,
            "seconds": s,
            "raw_gbps": raw / s / 1e9,
            "device": device_name(dev),
        }
        print(f"  {name:28s} {s * 1e3:8.2f} ms  {raw / s / 1e9:7.1f} GB/s of float32", flush=True)
        out.append(row)


def main() -> int:
    args = [a for a in sys.argv[1:] if a != "--cpu"]
    out_dir = Path(args[0] if args else os.environ.get("OUT", "/tmp/gpubridge-out"))
    out_dir.mkdir(parents=True, exist_ok=True)
    if "--cpu" in sys.argv:
        dev = torch.device("cpu")
    elif torch.cuda.is_available():
        dev = torch.device("cuda", 0)
    else:
        print("codec_check: no CUDA device (--cpu for a dry run)", file=sys.stderr)
        return 2
    print(f"torch {torch.__version__} on {device_name(dev)}", flush=True)
    rows: list[dict[str, Any]] = []
    failed = 0
    for name, check in Checks(dev).all().items():
        t0 = time.perf_counter()
        try:
            err = check()
        except Exception as e:  # a check that raises is a failed check, reported with the rest
            err = f"{type(e).__name__}: {e}"
        rows.append(
            {
                "schema": "gpubridge.codec-check/v1",
                "check": name,
                "ok": not err,
                "error": err,
                "seconds": time.perf_counter() - t0,
                "device": device_name(dev),
            }
        )
        print(f"  {'ok  ' if not err else 'FAIL'} {name}{': ' + err if err else ''}", flush=True)
        failed += bool(err)
    print(f"{len(rows) - failed} of {len(rows)} checks bit for bit equal to the Go codec", flush=True)
    bench(dev, rows)
    with open(out_dir / "codec-check.jsonl", "w") as f:
        for r in rows:
            f.write(json.dumps(r) + "\n")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
