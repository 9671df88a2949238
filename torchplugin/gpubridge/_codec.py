"""fp8/v1 (MXFP8) and bf16/v1 in torch ops: the bytes lib/codec writes.

docs/COMPRESSION.md is the specification. Everything here is integer
arithmetic on the float32 bits (and int->float conversions of integers below
2^24, which are exact everywhere), never the device's fp8 or bfloat16
conversions: those differ between vendors (NVIDIA's E4M3FN, AMD MI300's
FNUZ; CUDA's NaN for bfloat16) and in how they treat denormals, so the same
input gives the same bytes on a CPU, an NVIDIA GPU and an AMD GPU. Signs
are applied with ``copysign``, which copies the bit (NaNs included), and
no result depends on how a device adds or multiplies NaNs.

Packed data is a flat uint8 tensor. Tested bit for bit against the Go
codec's vectors (lib/codec/testdata/vectors) in tests/test_codec.py, and on
GPUs by bench/gpu/codec_check.py.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Protocol

import torch

from gpubridge import _codec_compile as _compile

__all__ = [
    "BLOCK",
    "GROUP",
    "GROUP_BYTES",
    "Decoder",
    "bf16_decode",
    "bf16_decode_add",
    "bf16_encode",
    "bf16_encode_feedback",
    "mxfp8_decode",
    "mxfp8_decode_add",
    "mxfp8_encode",
    "mxfp8_encode_feedback",
    "mxfp8_len",
    "mxfp8_offset",
    "to_dtype",
]

BLOCK = 32  # values per E8M0 scale
GROUP_BLOCKS = 32
GROUP = BLOCK * GROUP_BLOCKS  # values per group: 32 scale bytes, then 1024 codes
GROUP_BYTES = GROUP_BLOCKS + GROUP
_QNAN = 0x7FC00000
_FLOATS = (torch.float32, torch.bfloat16, torch.float16)


def mxfp8_len(n: int) -> int:
    """Packed bytes of n values: n + ceil(n/32)."""
    return n + (n + BLOCK - 1) // BLOCK


def mxfp8_offset(v: int) -> int:
    """Where the packing of the values from v on starts in a whole buffer's
    packing (v a multiple of GROUP): 1056 bytes per whole group
    (lib/codec's MXFP8Offset)."""
    if v % GROUP:
        raise ValueError(f"fp8/v1: value {v} does not start a group of {GROUP}")
    return v // GROUP * GROUP_BYTES


def _bits(x: torch.Tensor) -> torch.Tensor:
    """The float32 bits (int32) of a float32, bfloat16 or float16 tensor,
    flattened; the 16-bit types widen exactly."""
    if x.dtype not in _FLOATS:
        raise TypeError(f"fp8 takes float32, bfloat16 or float16 tensors, not {x.dtype}")
    flat = x.reshape(-1).contiguous()
    if x.dtype == torch.bfloat16:  # the top half of a float32, on every device
        return (flat.view(torch.int16).to(torch.int32) & 0xFFFF) << 16
    w = flat.to(torch.float32).view(torch.int32)
    if x.dtype == torch.float16:
        # CUDA widens every float16 NaN to one positive NaN: a NaN's bits
        # are set from the input's, as CPUs widen it (quiet, the sign, the
        # payload at the top).
        h = flat.view(torch.int16).to(torch.int32) & 0xFFFF
        nan = (h & 0x7FFF) > 0x7C00
        w = torch.where(nan, ((h & 0x8000) << 16) | _QNAN | ((h & 0x3FF) << 13), w)
    return w


def _signed(mag: torch.Tensor, negative: torch.Tensor) -> torch.Tensor:
    """float32 of the magnitude bits mag (int32, sign bit clear) with the
    sign bit set where negative."""
    f = mag.view(torch.float32)
    return torch.copysign(f, torch.where(negative, -1.0, 1.0).to(torch.float32))


# ---- MXFP8 ----


def _scales(w: torch.Tensor) -> torch.Tensor:
    """The E8M0 scale (int32) of each block of 32 float32 bits (a 2-d
    [blocks, 32] tensor, short blocks padded with zeros): the smallest s >= 0
    with max|finite x| <= 448 * 2^(s-127)."""
    a = w & 0x7FFFFFFF
    a = torch.where(a < 0x7F800000, a, 0)
    amax = a.amax(dim=1)
    s = (amax >> 23) - 8 + ((amax & 0x7FFFFF) > 0x600000).to(torch.int32)
    return s.clamp(min=0)


def _e4m3(w: torch.Tensor, s: torch.Tensor) -> torch.Tensor:
    """E4M3 codes (int32) of float32 bits w at scale bytes s (one per value):
    w / 2^(s-127) rounded to nearest even, the sign kept, NaN and ±Inf the
    code S.1111.111."""
    a = w & 0x7FFFFFFF
    ea = a >> 23
    m = a & 0x7FFFFF
    # Normalize the significand; a float32 denormal m goes through an exact
    # int->float conversion to find its leading bit.
    fm = m.to(torch.float32).view(torch.int32)
    den = ea == 0
    ea = torch.where(den, (fm >> 23) - 149, ea)
    m = torch.where(den, (fm & 0x7FFFFF) | 0x800000, m | 0x800000)
    t = ea - s + 7  # the E4M3 biased exponent
    normal = t >= 1
    sh = torch.where(normal, 20, (21 - t).clamp(max=31))
    base = torch.where(normal, (t - 1) << 3, 0)
    half = torch.bitwise_left_shift(torch.ones_like(sh), sh - 1)
    q = (m + (half - 1) + ((m >> sh) & 1)) >> sh
    code = base + q
    code = torch.where(a == 0, 0, code)
    code = torch.where(a >= 0x7F800000, 0x7F, code)
    return code | torch.where(w < 0, 0x80, 0)


def _e_mxfp8_encode(x: torch.Tensor) -> torch.Tensor:
    """Pack the values of x (float32, bfloat16 or float16, any shape, taken
    flat) as fp8/v1: a uint8 tensor of mxfp8_len(x.numel()) bytes on x's
    device."""
    w = _bits(x)
    n = w.numel()
    nb = (n + BLOCK - 1) // BLOCK
    padded = torch.zeros(nb * BLOCK, dtype=torch.int32, device=w.device)
    padded[:n] = w
    s = _scales(padded.view(nb, BLOCK))
    codes = _e4m3(w, s.repeat_interleave(BLOCK)[:n]).to(torch.uint8)
    return _pack(s.to(torch.uint8), codes)


def _pack(scales: torch.Tensor, codes: torch.Tensor) -> torch.Tensor:
    """The group layout: per group its scale bytes, then its codes."""
    n = codes.numel()
    g = n // GROUP
    parts = []
    if g:
        whole = [scales[: g * GROUP_BLOCKS].view(g, GROUP_BLOCKS), codes[: g * GROUP].view(g, GROUP)]
        parts.append(torch.cat(whole, 1).view(-1))
    if n > g * GROUP:
        parts += [scales[g * GROUP_BLOCKS :], codes[g * GROUP :]]
    if not parts:
        return torch.empty(0, dtype=torch.uint8, device=codes.device)
    return torch.cat(parts)


def _unpack(packed: torch.Tensor, n: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The scale bytes and codes of a packing of n values."""
    if packed.dtype != torch.uint8 or packed.dim() != 1:
        raise TypeError(f"packed data is a flat uint8 tensor, not {packed.dtype} {tuple(packed.shape)}")
    if packed.numel() != mxfp8_len(n):
        raise ValueError(f"fp8/v1: {packed.numel()} packed bytes for {n} values (want {mxfp8_len(n)})")
    g = n // GROUP
    whole = packed[: g * GROUP_BYTES].view(g, GROUP_BYTES)
    tail = packed[g * GROUP_BYTES :]
    r = n - g * GROUP
    tb = (r + BLOCK - 1) // BLOCK
    scales = torch.cat([whole[:, :GROUP_BLOCKS].reshape(-1), tail[:tb]])
    codes = torch.cat([whole[:, GROUP_BLOCKS:].reshape(-1), tail[tb:]])
    return scales, codes


_TABLES: dict[torch.device, tuple[torch.Tensor, torch.Tensor]] = {}


def _tables(device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """Per E4M3 magnitude (0..127): its unbiased exponent p and its 23-bit
    fraction f, value = (1 + f/2^23) * 2^p (codes 0 and 0x7f unused)."""
    if device not in _TABLES:
        p, f = [0] * 128, [0] * 128
        for c in range(1, 127):
            e, m = c >> 3, c & 7
            if e:
                p[c], f[c] = e - 7, m << 20
            else:  # m * 2^-9, normalized
                lead = m.bit_length() - 1
                p[c], f[c] = lead - 9, (m << (23 - lead)) & 0x7FFFFF
        _TABLES[device] = (
            torch.tensor(p, dtype=torch.int32, device=device),
            torch.tensor(f, dtype=torch.int32, device=device),
        )
    return _TABLES[device]


def _e_mxfp8_decode(packed: torch.Tensor, n: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """The n values of an fp8/v1 packing, exactly (±Inf past float32's
    range; NaN codes and the NaN scale the quiet NaN with the code's sign),
    as float32, or rounded to nearest even as bfloat16 or float16."""
    scales, codes = _unpack(packed, n)
    c = codes.to(torch.int32)
    s = scales.to(torch.int32).repeat_interleave(BLOCK)[:n]
    mag = c & 0x7F
    p_tab, f_tab = _tables(packed.device)
    idx = mag.long()
    p, f = p_tab[idx], f_tab[idx]
    b = p + s  # the float32 biased exponent of the value
    bits = torch.where(b >= 1, (b.clamp(1, 254) << 23) | f, (0x800000 | f) >> (1 - b).clamp(0, 31))
    bits = torch.where(b >= 255, 0x7F800000, bits)
    bits = torch.where(mag == 0, 0, bits)
    bits = torch.where((mag == 0x7F) | (s == 255), _QNAN, bits)
    out = _signed(bits, c >= 0x80)
    return out if dtype == torch.float32 else _narrow(out, dtype)


def _add(acc: torch.Tensor, d: torch.Tensor) -> None:
    """acc += d in float32 with lib/reduce's NaN rule: a NaN result is acc
    quieted if acc is a NaN, else d quieted if d is one, else the default
    quiet NaN (devices disagree on which NaN an addition returns)."""
    total = acc + d
    ab, db = acc.view(torch.int32), d.view(torch.int32)
    pick = torch.where(torch.isnan(acc), ab | 0x400000, torch.where(torch.isnan(d), db | 0x400000, _QNAN))
    acc.copy_(torch.where(torch.isnan(total), pick.view(torch.float32), total))


def _e_mxfp8_decode_add(acc: torch.Tensor, packed: torch.Tensor) -> None:
    """acc += the decoded values of packed: acc a contiguous float32 tensor
    of as many values (lib/codec's DecodeAddMXFP8)."""
    _check_acc(acc)
    _add(acc.view(-1), _e_mxfp8_decode(packed, acc.numel()))


def _check_acc(acc: torch.Tensor) -> None:
    if acc.dtype != torch.float32 or not acc.is_contiguous():
        raise TypeError(f"decode-add accumulates into a contiguous float32 tensor, not {acc.dtype}")


def _feedback_input(x: torch.Tensor, residual: torch.Tensor, codec: str) -> torch.Tensor:
    """u = x + r in float32, a NaN of x kept with its sign (devices return
    different NaNs from an addition; the residual is always finite)."""
    takes = _FLOATS if codec == "fp8" else (torch.float32, torch.bfloat16)
    if x.dtype not in takes:
        names = " or ".join(str(t).removeprefix("torch.") for t in takes)
        raise TypeError(f"{codec} takes {names} tensors, not {x.dtype}")
    if residual.dtype != torch.float32 or residual.numel() != x.numel() or not residual.is_contiguous():
        raise ValueError(
            f"a residual is a contiguous float32 tensor of the input's {x.numel()} values, "
            f"not {residual.dtype} of {residual.numel()}"
        )
    xf = _bits(x).view(torch.float32)  # widened exactly, a float16 NaN's sign kept (CPU's .float() drops it)
    r = residual.view(-1)
    return torch.where(torch.isnan(xf), xf, xf + r)


def _keep_residual(residual: torch.Tensor, u: torch.Tensor, d: torch.Tensor) -> None:
    """r = u - d where both are finite, +0 elsewhere."""
    fin = torch.isfinite(u) & torch.isfinite(d)
    residual.view(-1).copy_(torch.where(fin, u - d, torch.zeros_like(u)))


def _e_mxfp8_encode_feedback(x: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
    """mxfp8_encode with error feedback (lib/codec's EncodeFeedbackMXFP8):
    u = x + residual; packed = encode(u); residual = u - decode(packed)
    (+0 where either is not finite). residual is updated in place."""
    u = _feedback_input(x, residual, "fp8")
    packed = _e_mxfp8_encode(u)
    _keep_residual(residual, u, _e_mxfp8_decode(packed, u.numel()))
    return packed


# ---- bf16 ----


def _bf16_bits(w: torch.Tensor) -> torch.Tensor:
    """bfloat16 bits (int32, 0..0xffff) of float32 bits w: rounded to
    nearest even; a NaN quiet with its sign and the top of its payload."""
    nan = (w & 0x7FFFFFFF) > 0x7F800000
    safe = torch.where(nan, 0, w)  # no overflow: |w| + 0x8000 stays in range
    r = ((safe + 0x7FFF + ((safe >> 16) & 1)) >> 16) & 0xFFFF
    return torch.where(nan, ((w >> 16) & 0xFFFF) | 0x40, r)


def _as_u16_bytes(h: torch.Tensor) -> torch.Tensor:
    """Little-endian bytes of 16-bit values held in int32 (0..0xffff)."""
    return torch.where(h >= 0x8000, h - 0x10000, h).to(torch.int16).view(torch.uint8)


def _from_u16_bytes(packed: torch.Tensor) -> torch.Tensor:
    return packed.view(torch.int16).to(torch.int32) & 0xFFFF


def _e_bf16_encode(x: torch.Tensor) -> torch.Tensor:
    """Pack x (float32, or bfloat16 which passes unchanged) as bf16/v1: a
    uint8 tensor of 2 bytes a value."""
    if x.dtype == torch.bfloat16:
        return x.reshape(-1).contiguous().view(torch.uint8).clone()
    if x.dtype != torch.float32:
        raise TypeError(f"bf16 takes float32 or bfloat16 tensors, not {x.dtype} (float16: use fp8)")
    return _as_u16_bytes(_bf16_bits(x.reshape(-1).contiguous().view(torch.int32)))


def _e_bf16_decode(packed: torch.Tensor, n: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """The n values of a bf16/v1 packing as float32 (exact) or bfloat16."""
    if packed.dtype != torch.uint8 or packed.numel() != 2 * n:
        raise ValueError(f"bf16/v1: {packed.numel()} packed bytes for {n} values (want {2 * n})")
    if dtype == torch.bfloat16:
        return packed.clone().view(torch.bfloat16)
    h = _from_u16_bytes(packed)
    return _signed((h & 0x7FFF) << 16, h >= 0x8000)


def _e_bf16_decode_add(acc: torch.Tensor, packed: torch.Tensor) -> None:
    """acc += the decoded values of packed (lib/codec's DecodeAddBF16)."""
    _check_acc(acc)
    _add(acc.view(-1), _e_bf16_decode(packed, acc.numel()))


def _e_bf16_encode_feedback(x: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
    """bf16_encode with error feedback (lib/codec's EncodeFeedbackBF16)."""
    u = _feedback_input(x, residual, "bf16")
    packed = _e_bf16_encode(u)
    _keep_residual(residual, u, _e_bf16_decode(packed, u.numel()))
    return packed


def _e_to_dtype(f: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """A float32 tensor (a decoded sum) as dtype: itself for float32,
    rounded to nearest even for bfloat16 and float16 with lib/reduce's NaN
    rule (F32ToBF16, F32ToF16): the last step of a compressed all_reduce."""
    return f if dtype == torch.float32 else _narrow(f, dtype)


def _narrow(f: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """float32 to bfloat16 or float16, to nearest even, a NaN quiet with its
    sign (lib/reduce's F32ToBF16 and F32ToF16)."""
    w = f.view(torch.int32)
    if dtype == torch.bfloat16:
        return _as_u16_bytes(_bf16_bits(w)).view(torch.bfloat16)
    if dtype != torch.float16:
        raise TypeError(f"fp8 decodes to float32, bfloat16 or float16, not {dtype}")
    # float16 rounding of non-NaN values is IEEE's, the same on every device;
    # NaNs are set explicitly: quiet, the sign and the top 10 payload bits.
    h = f.to(torch.float16).view(torch.int16).to(torch.int32) & 0xFFFF
    nan = torch.isnan(f)
    nan_bits = ((w >> 16) & 0x8000) | 0x7E00 | ((w >> 13) & 0x3FF)
    return _as_u16_bytes(torch.where(nan, nan_bits, h)).view(torch.float16)


# ---- the public operations: compiled on GPUs, whole groups at a time ----
#
# A buffer's packing is its whole groups' packing followed by its tail's
# (COMPRESSION.md, "The packed layout"; bf16 has no groups, the same cut is
# used), so each operation runs the whole groups compiled
# (gpubridge._codec_compile) and a tail of under 1024 values eagerly: the
# same bytes as running it whole.


def _whole(x: torch.Tensor) -> int:
    """The values of x's whole groups when the codec runs compiled on its
    device, else 0 (all of it runs eagerly)."""
    k = x.numel() // GROUP * GROUP
    return k if k and _compile.enabled(x) else 0


def _cat(head: torch.Tensor, tail: torch.Tensor | None) -> torch.Tensor:
    return head if tail is None else torch.cat([head, tail])


def _encoder(eager: Callable[[torch.Tensor], torch.Tensor]) -> Callable[[torch.Tensor], torch.Tensor]:
    @functools.wraps(eager)
    def encode(x: torch.Tensor) -> torch.Tensor:
        k = _whole(x)
        if not k:
            return eager(x)
        flat = x.reshape(-1)
        return _cat(_compile.run(eager, flat[:k]), eager(flat[k:]) if k < flat.numel() else None)

    return encode


def _feedback_encoder(
    eager: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
) -> Callable[[torch.Tensor, torch.Tensor], torch.Tensor]:
    @functools.wraps(eager)
    def encode_feedback(x: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
        k = _whole(x)
        if not k or residual.numel() != x.numel() or not residual.is_contiguous():
            return eager(x, residual)  # (a bad residual: the eager op says why)
        flat, r = x.reshape(-1), residual.view(-1)
        head = _compile.run(eager, flat[:k], r[:k])
        return _cat(head, eager(flat[k:], r[k:]) if k < flat.numel() else None)

    return encode_feedback


class Decoder(Protocol):
    def __call__(self, packed: torch.Tensor, n: int, dtype: torch.dtype = torch.float32) -> torch.Tensor: ...


def _decoder(eager: Decoder, offset: Callable[[int], int]) -> Decoder:
    @functools.wraps(eager)
    def decode(packed: torch.Tensor, n: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        k = n // GROUP * GROUP
        if not k or not _compile.enabled(packed) or packed.dim() != 1:
            return eager(packed, n, dtype)
        b = offset(k)
        head = _compile.run(eager, packed[:b], k, dtype)
        return _cat(head, eager(packed[b:], n - k, dtype) if k < n else None)

    return decode


def _decode_adder(
    eager: Callable[[torch.Tensor, torch.Tensor], None], offset: Callable[[int], int]
) -> Callable[[torch.Tensor, torch.Tensor], None]:
    @functools.wraps(eager)
    def decode_add(acc: torch.Tensor, packed: torch.Tensor) -> None:
        k = _whole(acc)
        if not k or not acc.is_contiguous() or packed.dim() != 1:
            return eager(acc, packed)
        a, b = acc.view(-1), offset(k)
        _compile.run(eager, a[:k], packed[:b])
        if k < a.numel():
            eager(a[k:], packed[b:])
        return None

    return decode_add


def _bf16_offset(v: int) -> int:
    return 2 * v


mxfp8_encode = _encoder(_e_mxfp8_encode)
mxfp8_encode_feedback = _feedback_encoder(_e_mxfp8_encode_feedback)
mxfp8_decode = _decoder(_e_mxfp8_decode, mxfp8_offset)
mxfp8_decode_add = _decode_adder(_e_mxfp8_decode_add, mxfp8_offset)
bf16_encode = _encoder(_e_bf16_encode)
bf16_encode_feedback = _feedback_encoder(_e_bf16_encode_feedback)
bf16_decode = _decoder(_e_bf16_decode, _bf16_offset)
bf16_decode_add = _decode_adder(_e_bf16_decode_add, _bf16_offset)


def to_dtype(f: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """A float32 tensor (a decoded sum) as dtype: itself for float32,
    rounded to nearest even for bfloat16 and float16 with lib/reduce's NaN
    rule (F32ToBF16, F32ToF16): the last step of a compressed all_reduce."""
    if dtype == torch.float32:
        return f
    k = _whole(f)
    if not k:
        return _e_to_dtype(f, dtype)
    flat = f.reshape(-1)
    head = _compile.run(_e_to_dtype, flat[:k], dtype)
    return _cat(head, _e_to_dtype(flat[k:], dtype) if k < flat.numel() else None)
