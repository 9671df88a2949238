"""The Go codec's test vectors (lib/codec/testdata/vectors, written by
lib/codec's TestVectors) and the checks of gpubridge._codec against them,
on any device: tests/test_codec.py runs them on CPU, bench/gpu/codec_check.py
on a GPU. Each check returns "" when the bytes are equal, else what differs.
Needs torch and numpy only (no pytest)."""

from __future__ import annotations

import gzip
import io
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch

from gpubridge import _codec

VECTORS = Path(__file__).resolve().parents[2] / "lib" / "codec" / "testdata" / "vectors"
TAILS = (1, 7, 31, 33, 1057)


def load(name: str) -> np.ndarray:
    """A vector file (NAME.npy.gz) as its numpy array of raw bits."""
    with gzip.open(VECTORS / f"{name}.npy.gz") as f:
        return np.load(io.BytesIO(f.read()))


def computed_inputs() -> dict[str, np.ndarray]:
    """The inputs vectors_test.go computes instead of storing, as raw bits:
    uint32 (float32) or uint16 (float16)."""
    i = np.arange(1 << 16, dtype=np.uint64)
    return {
        "bf16_all": (i << 16).astype(np.uint32),
        "bf16_perm": ((i * 40503 % 65536) << 16).astype(np.uint32),
        "bits": (i * 2654435761 % (1 << 32)).astype(np.uint32),
        "f16_all": i.astype(np.uint16),
    }


def decode_all_packed() -> np.ndarray:
    """The packing of 65536 values in which block b has scale b // 8 and
    codes 32*(b%8) ... 32*(b%8)+31: every code at every scale."""
    out = []
    for g in range(64):  # 64 groups of 32 blocks
        blocks = np.arange(32 * g, 32 * g + 32)
        out += [(blocks // 8).astype(np.uint8), (np.arange(1024 * g, 1024 * g + 1024) % 256).astype(np.uint8)]
    return np.concatenate(out)


def differ(got: np.ndarray, want: np.ndarray) -> str:
    """ "" if the arrays are equal, else how they differ."""
    if got.shape != want.shape:
        return f"shape {got.shape} != {want.shape}"
    bad = np.flatnonzero(got != want)
    if not len(bad):
        return ""
    i = bad[0]
    return f"{len(bad)} differ, first at {i}: {int(got[i]):#x} != {int(want[i]):#x}"


class Checks:
    """The checks, on one device."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.inputs = computed_inputs()

    def f32(self, bits: np.ndarray) -> torch.Tensor:
        t = torch.from_numpy(bits.astype(np.uint32).view(np.int32).copy())
        return t.to(self.device).view(torch.float32)

    def bytes_(self, a: np.ndarray) -> torch.Tensor:
        return torch.from_numpy(np.ascontiguousarray(a).view(np.uint8).copy()).to(self.device)

    @staticmethod
    def u8(t: torch.Tensor) -> np.ndarray:
        return t.cpu().numpy().view(np.uint8)

    @staticmethod
    def bits32(t: torch.Tensor) -> np.ndarray:
        return t.contiguous().view(torch.int32).cpu().numpy().view(np.uint32)

    @staticmethod
    def bits16(t: torch.Tensor) -> np.ndarray:
        return t.contiguous().view(torch.int16).cpu().numpy().view(np.uint16)

    def all(self) -> dict[str, Callable[[], str]]:
        c: dict[str, Callable[[], str]] = {}
        for name in ("bf16_all", "bf16_perm", "bits"):
            c[f"fp8 encode {name}"] = lambda n=name: differ(
                self.u8(_codec.mxfp8_encode(self.f32(self.inputs[n]))), load(f"{n}.fp8")
            )
        c["fp8 encode bfloat16 tensors"] = self.bfloat16_input
        c["fp8 encode float16 tensors"] = self.float16_input
        for name in ("edge", "random"):
            c[f"fp8 encode {name}"] = lambda n=name: differ(
                self.u8(_codec.mxfp8_encode(self.f32(load(f"{n}.in")))), load(f"{n}.fp8")
            )
        for n in TAILS:
            c[f"fp8 tail of {n}"] = lambda k=n: differ(
                self.u8(_codec.mxfp8_encode(self.f32(load("random.in")[:k]))), load(f"tail_{k}.fp8")
            )
        for dtype, suffix in ((torch.float32, "f32"), (torch.bfloat16, "bf16"), (torch.float16, "f16")):
            c[f"fp8 decode every code at every scale to {suffix}"] = lambda d=dtype, s=suffix: (
                self.decode_all(d, s)
            )
        c["fp8 error feedback"] = self.fp8_feedback
        c["fp8 decode-add"] = self.fp8_decode_add
        for name in ("bits", "edge", "random"):
            c[f"bf16 encode {name}"] = lambda n=name: differ(
                self.u8(
                    _codec.bf16_encode(self.f32(self.inputs[n] if n == "bits" else load(f"{n}.in")))
                ).view(np.uint16),
                load(f"{n}.bf16"),
            )
        c["bf16 decode and pass-through"] = self.bf16_decode
        c["bf16 error feedback and decode-add"] = self.bf16_feedback
        return c

    def bfloat16_input(self) -> str:
        top = (self.inputs["bf16_all"] >> 16).astype(np.uint16)
        bf = torch.from_numpy(top.view(np.int16).copy()).to(self.device).view(torch.bfloat16)
        return differ(self.u8(_codec.mxfp8_encode(bf)), load("bf16_all.fp8"))

    def float16_input(self) -> str:
        h = torch.from_numpy(self.inputs["f16_all"].view(np.int16).copy()).to(self.device).view(torch.float16)
        return differ(self.u8(_codec.mxfp8_encode(h)), load("f16_all.fp8"))

    def decode_all(self, dtype: torch.dtype, suffix: str) -> str:
        got = _codec.mxfp8_decode(self.bytes_(decode_all_packed()), 1 << 16, dtype)
        if got.dtype != dtype:
            return f"dtype {got.dtype}"
        conv = self.bits32 if dtype == torch.float32 else self.bits16
        return differ(conv(got), load(f"decode_all.{suffix}"))

    def fp8_feedback(self) -> str:
        res = self.f32(load("residual.in"))
        packed = _codec.mxfp8_encode_feedback(self.f32(load("random.in")), res)
        return differ(self.u8(packed), load("random.fp8_ef")) or differ(
            self.bits32(res), load("random.fp8_residual")
        )

    def fp8_decode_add(self) -> str:
        acc = self.f32(load("random.in"))
        _codec.mxfp8_decode_add(acc, _codec.mxfp8_encode(self.f32(self.inputs["bits"][:8192])))
        return differ(self.bits32(acc), load("random.fp8_decode_add"))

    def bf16_decode(self) -> str:
        want = load("bits.bf16")
        packed = self.bytes_(want)
        back = _codec.bf16_decode(packed, want.size)
        as_bf16 = _codec.bf16_decode(packed, want.size, torch.bfloat16)
        if not torch.equal(_codec.bf16_encode(as_bf16), packed):
            return "a bfloat16 tensor did not pass unchanged"
        return differ(self.bits32(back), want.astype(np.uint32) << 16)

    def bf16_feedback(self) -> str:
        res = self.f32(load("residual.in"))
        packed = _codec.bf16_encode_feedback(self.f32(load("random.in")), res)
        acc = self.f32(load("random.in"))
        _codec.bf16_decode_add(acc, _codec.bf16_encode(self.f32(self.inputs["bits"][:8192])))
        return (
            differ(self.u8(packed).view(np.uint16), load("random.bf16_ef"))
            or differ(self.bits32(res), load("random.bf16_residual"))
            or differ(self.bits32(acc), load("random.bf16_decode_add"))
        )
