"""gpubridge._codec's torch ops on a GPU, eager and under torch.compile: the
time of each operation the GPU path runs per call (fp8 and bf16 encode with
error feedback, decode-and-add, the narrowing to bfloat16/float16), the
compile time, and whether the compiled operation gives the eager one's bits
on random data with special values and on odd sizes.

    PYTHONPATH=torchplugin python3 bench/gpu/codec_compile.py OUT.jsonl [--values 268435456]

One JSON line per operation (schema gpubridge.codec-compile/v1): eager_ms,
compiled_ms (medians of 5 after a warm-up, CUDA events), compile_s (the
first call), gbps (float32 input bytes / compiled time), same_bits (every
size), sizes. Exit 0 when every compiled operation gave the same bits, 1
otherwise, 2 without a GPU or torch.compile.
"""

from __future__ import annotations

import json
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from gpubridge import _codec

SCHEMA = "gpubridge.codec-compile/v1"


def timed(f: Callable[[], Any], reps: int = 5) -> float:
    f()
    out = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        f()
        b.record()
        b.synchronize()
        out.append(a.elapsed_time(b))
    return sorted(out)[len(out) // 2]


def data(n: int, dt: torch.dtype, dev: torch.device, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    scale = torch.exp(torch.randn((n + 31) // 32, generator=g) * 3).repeat_interleave(32)[:n]
    x = (torch.randn(n, generator=g) * scale).to(dt)
    bits = {2: torch.int16, 4: torch.int32}[dt.itemsize]
    lim = 1 << (8 * dt.itemsize - 1)
    raw = torch.randint(-lim, lim, (n,), generator=g, dtype=torch.int64).to(bits)
    mask = torch.randint(0, 64, (n,), generator=g) == 0
    x.view(bits)[mask] = raw[mask]
    return x.to(dev)


def main() -> int:
    out = Path(sys.argv[1])
    values = int(sys.argv[sys.argv.index("--values") + 1]) if "--values" in sys.argv else 1 << 28
    if not torch.cuda.is_available():
        print("codec_compile: no GPU", file=sys.stderr)
        return 2
    dev = torch.device("cuda", 0)
    try:
        import triton  # noqa: F401, PLC0415

        has_triton = True
    except ImportError:
        has_triton = False
    Maker = Callable[[int, torch.dtype, int], tuple[Any, ...]]
    ops: dict[str, tuple[Callable[..., Any], Maker, torch.dtype]] = {}

    def fb_args(n: int, dt: torch.dtype, seed: int) -> tuple[Any, ...]:
        r = data(n, torch.float32, dev, seed + 1)
        r = torch.where(torch.isfinite(r), r * 1e-3, 0.0)
        return (data(n, dt, dev, seed), r)

    def da_args(n: int, dt: torch.dtype, seed: int, codec: str = "fp8") -> tuple[Any, ...]:
        x = data(n, torch.float32, dev, seed)
        packed = _codec.mxfp8_encode(x) if codec == "fp8" else _codec.bf16_encode(x)
        return (data(n, torch.float32, dev, seed + 2), packed)

    ops["fp8_encode_feedback_f32"] = (_codec.mxfp8_encode_feedback, fb_args, torch.float32)
    ops["fp8_encode_feedback_bf16"] = (_codec.mxfp8_encode_feedback, fb_args, torch.bfloat16)
    ops["fp8_encode_f32"] = (_codec.mxfp8_encode, lambda n, dt, s: (data(n, dt, dev, s),), torch.float32)
    ops["fp8_decode_add"] = (_codec.mxfp8_decode_add, da_args, torch.float32)
    ops["fp8_decode_f32"] = (_codec.mxfp8_decode, lambda n, dt, s: (
        _codec.mxfp8_encode(data(n, dt, dev, s)), n), torch.float32)  # fmt: skip
    ops["bf16_encode_feedback_f32"] = (_codec.bf16_encode_feedback, fb_args, torch.float32)
    ops["bf16_decode_add"] = (
        _codec.bf16_decode_add, lambda n, dt, s: da_args(n, dt, s, "bf16"), torch.float32
    )  # fmt: skip
    ops["to_bfloat16"] = (_codec.to_dtype, lambda n, dt, s: (data(n, torch.float32, dev, s), torch.bfloat16),
                          torch.float32)  # fmt: skip
    ops["to_float16"] = (_codec.to_dtype, lambda n, dt, s: (data(n, torch.float32, dev, s), torch.float16),
                         torch.float32)  # fmt: skip
    failed = 0
    rows = []
    for name, (fn, make, dt) in ops.items():
        row: dict[str, Any] = {"schema": SCHEMA, "op": name, "values": values, "triton": has_triton}
        args = make(values, dt, 1)

        def clone(a: tuple[Any, ...]) -> tuple[Any, ...]:
            return tuple(x.clone() if isinstance(x, torch.Tensor) else x for x in a)

        row["eager_ms"] = timed(lambda fn=fn, args=args: fn(*clone(args)))
        try:
            cfn = torch.compile(fn, dynamic=True)
            t0 = time.perf_counter()
            cfn(*clone(args))
            torch.cuda.synchronize()
            row["compile_s"] = time.perf_counter() - t0
            row["compiled_ms"] = timed(lambda cfn=cfn, args=args: cfn(*clone(args)))
            row["gbps"] = values * 4 / row["compiled_ms"] / 1e6
            sizes = [1, 31, 1000, 1023, 1025, 65536 + 7, 1 << 20, values]
            same = True
            for k, n in enumerate(sizes):
                a = make(n, dt, 100 + k)
                e_args, c_args = clone(a), clone(a)
                e_out, c_out = fn(*e_args), cfn(*c_args)
                for x, y in zip((e_out, *e_args), (c_out, *c_args), strict=True):
                    # every output and every argument updated in place
                    differs = isinstance(x, torch.Tensor) and not torch.equal(
                        x.view(torch.uint8), y.view(torch.uint8)
                    )
                    if differs:
                        same = False
            row["same_bits"], row["sizes"] = same, sizes
            failed += not same
        except Exception as e:  # a compile failure is a finding, not a crash of the run
            row["error"] = f"{type(e).__name__}: {e}"[:2000]
            failed += 1
        rows.append(row)
        print(json.dumps(row), file=sys.stderr)
        with out.open("a") as f:
            f.write(json.dumps(row) + "\n")
        torch.cuda.empty_cache()
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
