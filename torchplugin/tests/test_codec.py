"""gpubridge._codec against the Go codec, bit for bit: every check of
codec_vectors (every bfloat16 and float16 input, every E4M3 code at every
scale, random and edge-case float32 blocks, error feedback, decode-add with
NaNs, short tails) on CPU; bench/gpu/codec_check.py runs the same checks on
a GPU."""

from __future__ import annotations

import pytest
import torch
from codec_vectors import Checks

from gpubridge import _codec, _codec_compile

CHECKS = Checks(torch.device("cpu"))


@pytest.mark.parametrize("name", list(CHECKS.all()))
def test_against_the_go_codec(name):
    assert CHECKS.all()[name]() == ""


def test_the_wire_format_is_not_the_devices_fp8():
    """The codes are OCP E4M3 "FN": where torch's float8_e4m3fn agrees (finite
    values in range, at scale 2^0), the bytes are that type's; float8_e4m3fnuz
    (AMD MI300's native type) has other bytes for the same values, which is
    why nothing here uses a device fp8 type."""
    x = torch.tensor([448.0, -448.0, 1.0, -(2.0**-9), 0.0, 3.5, 240.0])
    packed = _codec.mxfp8_encode(x)
    assert packed[0].item() == 127, "a block whose max is 448 has scale 2^0"
    assert torch.equal(packed[1:], x.to(torch.float8_e4m3fn).view(torch.uint8))
    assert not torch.equal(packed[3:5], x[2:4].to(torch.float8_e4m3fnuz).view(torch.uint8))


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


def _values(n: int, dtype: torch.dtype, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    scale = torch.exp(torch.randn((n + 31) // 32, generator=g) * 3).repeat_interleave(32)[:n]
    x = (torch.randn(n, generator=g) * scale).to(dtype)
    x.view(torch.int16 if dtype.itemsize == 2 else torch.int32)[::97] = -1  # NaNs with payloads
    return x


@pytest.mark.parametrize("n", [1, 1023, 1024, 1025, 3 * 1024, 3 * 1024 + 77])
@pytest.mark.parametrize("codec", ["fp8", "bf16"])
def test_whole_groups_and_tail_give_the_whole_buffers_bytes(monkeypatch, n, codec):
    """On GPUs the codec runs a buffer's whole groups compiled and its tail
    eagerly (gpubridge._codec_compile): the pieces must be the bytes and the
    residuals of the whole. Here the "compiled" pieces run eagerly on CPU, so
    what is checked is the cutting and the joining."""
    ran = []
    monkeypatch.setattr(_codec_compile, "enabled", lambda t: True)
    monkeypatch.setattr(_codec_compile, "run", lambda fn, *a: ran.append(fn) or fn(*a))
    fp8 = codec == "fp8"
    e_enc = _codec._e_mxfp8_encode_feedback if fp8 else _codec._e_bf16_encode_feedback
    e_dec = _codec._e_mxfp8_decode if fp8 else _codec._e_bf16_decode
    enc = _codec.mxfp8_encode_feedback if fp8 else _codec.bf16_encode_feedback
    dec = _codec.mxfp8_decode if fp8 else _codec.bf16_decode
    dec_add = _codec.mxfp8_decode_add if fp8 else _codec.bf16_decode_add
    plain, e_plain = (_codec.mxfp8_encode, _codec._e_mxfp8_encode) if fp8 else (
        _codec.bf16_encode, _codec._e_bf16_encode)  # fmt: skip
    for dtype in (torch.float32, torch.bfloat16):
        x = _values(n, dtype, n)
        r_whole = torch.where(torch.rand(n) < 0.5, torch.randn(n) * 1e-3, torch.zeros(n))
        r_cut = r_whole.clone()
        want = e_enc(x, r_whole)
        got = enc(x, r_cut)
        assert torch.equal(got, want)
        assert torch.equal(r_cut.view(torch.int32), r_whole.view(torch.int32))
        assert torch.equal(plain(x), e_plain(x))
        for to in (torch.float32, torch.bfloat16):
            assert torch.equal(dec(got, n, to).view(torch.uint8), e_dec(want, n, to).view(torch.uint8))
        acc_whole = _values(n, torch.float32, n + 1)
        acc_cut = acc_whole.clone()
        (_codec._e_mxfp8_decode_add if fp8 else _codec._e_bf16_decode_add)(acc_whole, want)
        dec_add(acc_cut, got)
        assert torch.equal(acc_cut.view(torch.int32), acc_whole.view(torch.int32))
        for to in (torch.bfloat16, torch.float16):
            narrowed = _codec.to_dtype(acc_cut, to).view(torch.int16)
            assert torch.equal(narrowed, _codec._e_to_dtype(acc_whole, to).view(torch.int16))
    assert bool(ran) == (n >= 1024), "whole groups run through the compiled path, nothing else"
