"""gpubridge._codec against the Go codec, bit for bit: every vector of
lib/codec/testdata/vectors (every bfloat16 and float16 input, every E4M3
code at every scale, random and edge-case float32 blocks, error feedback,
short tails), on CPU here and on GPUs through bench/gpu/codec_check.py."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from codec_vectors import TAILS, computed_inputs, decode_all_packed, load

from gpubridge import _codec


def f32(bits: np.ndarray) -> torch.Tensor:
    return torch.from_numpy(bits.astype(np.uint32).view(np.int32).copy()).view(torch.float32)


def u8(t: torch.Tensor) -> np.ndarray:
    return t.cpu().numpy().view(np.uint8)


def bits32(t: torch.Tensor) -> np.ndarray:
    return t.contiguous().view(torch.int32).cpu().numpy().view(np.uint32)


def bits16(t: torch.Tensor) -> np.ndarray:
    return t.contiguous().view(torch.int16).cpu().numpy().view(np.uint16)


def first_difference(got: np.ndarray, want: np.ndarray) -> str:
    if got.shape != want.shape:
        return f"shape {got.shape} != {want.shape}"
    bad = np.flatnonzero(got != want)
    if not len(bad):
        return ""
    i = bad[0]
    return f"{len(bad)} differ, first at {i}: {got[i]:#x} != {want[i]:#x}"


INPUTS = computed_inputs()


@pytest.mark.parametrize("name", ["bf16_all", "bf16_perm", "bits"])
def test_fp8_encode_computed_inputs(name):
    got = u8(_codec.mxfp8_encode(f32(INPUTS[name])))
    assert first_difference(got, load(f"{name}.fp8")) == ""


def test_fp8_encode_bfloat16_and_float16_inputs():
    # every bfloat16 as a bfloat16 tensor: the same bytes as its widening
    top = (INPUTS["bf16_all"] >> 16).astype(np.uint16)
    bf = torch.from_numpy(top.view(np.int16).copy()).view(torch.bfloat16)
    assert first_difference(u8(_codec.mxfp8_encode(bf)), load("bf16_all.fp8")) == ""
    f16 = torch.from_numpy(INPUTS["f16_all"].view(np.int16).copy()).view(torch.float16)
    assert first_difference(u8(_codec.mxfp8_encode(f16)), load("f16_all.fp8")) == ""


@pytest.mark.parametrize("name", ["edge", "random"])
def test_fp8_encode_stored_inputs(name):
    got = u8(_codec.mxfp8_encode(f32(load(f"{name}.in"))))
    assert first_difference(got, load(f"{name}.fp8")) == ""


@pytest.mark.parametrize("n", TAILS)
def test_fp8_short_tails(n):
    x = f32(load("random.in")[:n])
    packed = _codec.mxfp8_encode(x)
    assert packed.numel() == _codec.mxfp8_len(n)
    assert first_difference(u8(packed), load(f"tail_{n}.fp8")) == ""


@pytest.mark.parametrize(
    ("dtype", "suffix"), [(torch.float32, "f32"), (torch.bfloat16, "bf16"), (torch.float16, "f16")]
)
def test_fp8_decode_every_code_at_every_scale(dtype, suffix):
    packed = torch.from_numpy(decode_all_packed())
    got = _codec.mxfp8_decode(packed, 1 << 16, dtype)
    assert got.dtype == dtype
    want = load(f"decode_all.{suffix}")
    conv = bits32 if dtype == torch.float32 else bits16
    assert first_difference(conv(got), want) == ""


def test_fp8_encode_feedback():
    x = f32(load("random.in"))
    res = f32(load("residual.in")).clone()
    packed = _codec.mxfp8_encode_feedback(x, res)
    assert first_difference(u8(packed), load("random.fp8_ef")) == ""
    assert first_difference(bits32(res), load("random.fp8_residual")) == ""


def test_fp8_decode_add():
    # acc: the random values; added: the packing of the first 8192 'bits' values
    acc = f32(load("random.in")).clone()
    packed = _codec.mxfp8_encode(f32(INPUTS["bits"][:8192]))
    _codec.mxfp8_decode_add(acc, packed)
    assert first_difference(bits32(acc), load("random.fp8_decode_add")) == ""


@pytest.mark.parametrize("name", ["bits", "edge", "random"])
def test_bf16_encode(name):
    x = f32(INPUTS[name] if name == "bits" else load(f"{name}.in"))
    got = _codec.bf16_encode(x).numpy().view(np.uint16)
    assert first_difference(got, load(f"{name}.bf16")) == ""


def test_bf16_decode_and_passthrough():
    want = load("bits.bf16")
    packed = torch.from_numpy(want.view(np.uint8).copy())
    back = _codec.bf16_decode(packed, want.size)
    assert first_difference(bits32(back), want.astype(np.uint32) << 16) == ""
    as_bf16 = _codec.bf16_decode(packed, want.size, torch.bfloat16)
    assert torch.equal(_codec.bf16_encode(as_bf16), packed), "a bfloat16 tensor passes unchanged"


def test_bf16_encode_feedback_and_decode_add():
    x = f32(load("random.in"))
    res = f32(load("residual.in")).clone()
    packed = _codec.bf16_encode_feedback(x, res)
    assert first_difference(packed.numpy().view(np.uint16), load("random.bf16_ef")) == ""
    assert first_difference(bits32(res), load("random.bf16_residual")) == ""
    acc = f32(load("random.in")).clone()
    _codec.bf16_decode_add(acc, _codec.bf16_encode(f32(INPUTS["bits"][:8192])))
    assert first_difference(bits32(acc), load("random.bf16_decode_add")) == ""


def test_the_wire_format_is_not_the_devices_fp8():
    """The codes are OCP E4M3 "FN": where torch's float8_e4m3fn agrees (finite
    values in range, at scale 2^0), the bytes are that type's; float8_e4m3fnuz
    (AMD MI300's native type) has other bytes for the same values, which is
    why nothing here uses a device fp8 type."""
    x = torch.tensor([448.0, -448.0, 1.0, -(2.0**-9), 0.0, 3.5, 240.0])
    # a block whose max is 448 has scale 2^0 (scale byte 127)
    packed = _codec.mxfp8_encode(x)
    assert packed[0].item() == 127
    fn = x.to(torch.float8_e4m3fn).view(torch.uint8)
    assert torch.equal(packed[1:], fn)
    fnuz = x[2:4].to(torch.float8_e4m3fnuz).view(torch.uint8)
    assert not torch.equal(packed[3:5], fnuz)


def test_errors():
    with pytest.raises(TypeError, match="fp8 takes float32, bfloat16 or float16"):
        _codec.mxfp8_encode(torch.zeros(3, dtype=torch.int32))
    with pytest.raises(ValueError, match=r"fp8/v1: 34 packed bytes for 32 values \(want 33\)"):
        _codec.mxfp8_decode(torch.zeros(34, dtype=torch.uint8), 32)
    with pytest.raises(TypeError, match="bf16 takes float32 or bfloat16"):
        _codec.bf16_encode(torch.zeros(3, dtype=torch.float16))
    with pytest.raises(ValueError, match="a residual is a contiguous float32 tensor"):
        _codec.mxfp8_encode_feedback(torch.zeros(4), torch.zeros(3))
    with pytest.raises(TypeError, match="decode-add accumulates into a contiguous float32 tensor"):
        _codec.mxfp8_decode_add(torch.zeros(4, dtype=torch.float64), torch.zeros(5, dtype=torch.uint8))
    assert _codec.mxfp8_encode(torch.zeros(0)).numel() == 0
    assert _codec.mxfp8_decode(torch.zeros(0, dtype=torch.uint8), 0).numel() == 0
