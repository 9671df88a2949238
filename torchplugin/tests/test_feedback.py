"""gpubridge._feedback: residuals per buffer identity and size."""

from __future__ import annotations

import threading

import pytest
import torch

from gpubridge import _codec
from gpubridge._feedback import ErrorFeedback


def grads(n: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, generator=g) * torch.logspace(-8, 0, n)


def test_residual_is_kept_per_key_and_size():
    ef = ErrorFeedback("fp8")
    x = grads(3000, 1)
    r0 = ef.residual("bucket0", x)
    assert torch.equal(r0, torch.zeros(3000)) and r0.dtype == torch.float32
    ef.encode("bucket0", x)
    assert ef.residual("bucket0", x) is r0, "the same residual"
    assert bool(r0.abs().sum() > 0), "now holding what quantizing lost"
    assert ef.residual("bucket1", x) is not r0, "another buffer, another residual"
    assert len(ef) == 2 and ef.nbytes == 2 * 3000 * 4
    # A size change drops the old residual: the new one starts from zero.
    r2 = ef.residual("bucket0", grads(2000, 2))
    assert r2.numel() == 2000 and not r2.any() and ef.dropped == 1
    assert ef.nbytes == (3000 + 2000) * 4


def test_encode_is_the_codecs_error_feedback():
    for codec, enc in (("fp8", _codec.mxfp8_encode_feedback), ("bf16", _codec.bf16_encode_feedback)):
        ef = ErrorFeedback(codec)
        mine = torch.zeros(5000)
        for step in range(3):
            x = grads(5000, 10 + step)
            assert torch.equal(ef.encode(7, x), enc(x, mine)), (codec, step)
            assert torch.equal(ef.residual(7, x), mine)


def test_feedback_loses_nothing_for_good():
    """A constant gradient much smaller than its block's largest value is
    flushed to zero by fp8 every step; with feedback the sum of what came
    through over many steps tracks the sum sent."""
    x = torch.zeros(32)
    x[0], x[1] = 1.0, 1e-7  # 1e-7 is below the block's smallest E4M3 step at this scale
    ef = ErrorFeedback("fp8")
    plain = torch.zeros(32)
    fed = torch.zeros(32)
    for _ in range(200):
        plain += _codec.mxfp8_decode(_codec.mxfp8_encode(x), 32)
        fed += ef.quantize("b", x)
    assert plain[1] == 0, "without feedback the small value never gets through"
    # What is still held back is at most one E4M3 step at the block's scale
    # (2^-17: amax 1 has scale 2^-8, the smallest step is 2^-9 of it).
    assert abs(fed[1].item() - 200 * 1e-7) <= 2.0**-17, fed[1].item()


def test_nonfinite_inputs_do_not_poison_the_residual():
    ef = ErrorFeedback("fp8")
    x = grads(64, 3)
    x[5], x[40] = float("nan"), float("inf")
    ef.encode("b", x)
    r = ef.residual("b", x)
    assert bool(torch.isfinite(r).all()) and r[5] == 0 and r[40] == 0


def test_clear_and_drop():
    ef = ErrorFeedback("bf16")
    ef.residual("a", torch.zeros(10))
    ef.residual("b", torch.zeros(10))
    ef.drop("a")
    assert len(ef) == 1
    ef.clear()
    assert len(ef) == 0 and ef.nbytes == 0


def test_threads_share_one_state():
    ef = ErrorFeedback("fp8")
    x = grads(1024, 4)
    got: list[torch.Tensor] = []

    def work() -> None:
        got.append(ef.residual("shared", x))

    threads = [threading.Thread(target=work) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=30)
    assert len(got) == 8 and all(r is got[0] for r in got)


def test_refuses():
    with pytest.raises(ValueError, match="error feedback is for the lossy codecs fp8 and bf16, not 'zstd'"):
        ErrorFeedback("zstd")
    with pytest.raises(
        TypeError, match=r"fp8 takes float32 or bfloat16 or float16 tensors, not torch\.int64"
    ):
        ErrorFeedback("fp8").encode("b", torch.zeros(4, dtype=torch.int64))
    with pytest.raises(TypeError, match=r"bf16 takes float32 or bfloat16 tensors, not torch\.float16"):
        ErrorFeedback("bf16").encode("b", torch.zeros(4, dtype=torch.float16))


def test_feedback_keeps_a_float16_nans_sign():
    """With a zero residual, error feedback sends what the plain encoder
    does (for inputs without -0, which x + 0 turns into +0), NaNs of every
    sign included: a float16 input is widened in bits (CPU torch's .float()
    turns float16 -NaN into +NaN on short tensors, its vectorized loop
    does not)."""
    for n in (5, 64):
        for dtype, neg_nan in ((torch.float16, -512), (torch.bfloat16, -64)):  # 0xFE00, 0xFFC0
            x = torch.randn(n, generator=torch.Generator().manual_seed(4)).to(dtype)
            x.view(torch.int16)[3] = neg_nan
            assert torch.equal(_codec.mxfp8_encode_feedback(x, torch.zeros(n)), _codec.mxfp8_encode(x)), dtype
            if dtype == torch.bfloat16:
                assert torch.equal(_codec.bf16_encode_feedback(x, torch.zeros(n)), _codec.bf16_encode(x))
