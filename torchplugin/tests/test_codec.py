"""gpubridge._codec against the Go codec, bit for bit: every check of
codec_vectors (every bfloat16 and float16 input, every E4M3 code at every
scale, random and edge-case float32 blocks, error feedback, decode-add with
NaNs, short tails) on CPU; bench/gpu/codec_check.py runs the same checks on
a GPU."""

from __future__ import annotations

import pytest
import torch
from codec_vectors import Checks

from gpubridge import _codec

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
