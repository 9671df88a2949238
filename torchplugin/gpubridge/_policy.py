"""The settings every rank of a group must agree on, read when the group is
created: ``GPUBRIDGE_COMPRESSION`` (the codec of the bridged collectives,
docs/COMPRESSION.md "Compression on the bridge"), ``GPUBRIDGE_BRIDGE_REDUCE``
(where two island leaders reduce) and ``GPUBRIDGE_P2P_CHUNK`` (the bytes of
one bridged message of a point-to-point transfer: both ends must cut a
tensor alike), ``GPUBRIDGE_POLICY`` (how an all_reduce across islands
runs: gpubridge._policies) and ``GPUBRIDGE_THRESHOLDS`` (the sizes at which
``auto`` changes policy, gpubridge._thresholds; compared by digest).

They go to discovery as settings (``--setting compression=fp8``), so a rank
that says otherwise fails every rank there, naming it; a value that is no
setting at all goes as a problem of this rank, with the same effect. Which
codec a call then uses (:func:`for_all_reduce`, :func:`for_transfer`) is
decided from the call alone, the same on every rank.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Final

import torch

from gpubridge._feed_protocol import Codec, Op
from gpubridge._thresholds import BUILTIN, Thresholds, ThresholdsError

__all__ = [
    "DEFAULT_P2P_CHUNK",
    "POLICIES",
    "REDUCE_MODES",
    "Policy",
    "codec_name",
    "codec_takes",
    "for_all_reduce",
    "for_transfer",
    "is_lossy",
    "parse_bytes",
    "parse_codec",
]

REDUCE_MODES: Final = ("auto", "host", "caller")
# GPUBRIDGE_POLICY's values (gpubridge._policies says what each does).
AUTO: Final = "auto"
RBB: Final = "reduce-bridge-broadcast"
SHARDED: Final = "sharded"
FLAT: Final = "flat"
POLICIES: Final = (AUTO, RBB, SHARDED, FLAT)
DEFAULT_P2P_CHUNK: Final = 4 << 20
_UNITS: Final = {"": 1, "k": 1 << 10, "m": 1 << 20, "g": 1 << 30}


def parse_bytes(v: str) -> int:
    """A byte count: digits with an optional K, M or G (powers of 1024, any
    case, an optional B or iB after). ValueError otherwise."""
    s = v.strip().lower().removesuffix("ib").removesuffix("b")
    unit = s[-1:] if s[-1:] in ("k", "m", "g") else ""
    digits = s[: len(s) - len(unit)]
    if not digits.isdigit():
        raise ValueError(f"{v!r} is not a byte count")
    return int(digits) * _UNITS[unit]


# The names lib/codec's Parse takes (with or without "/v1", any case).
_NAMES: Final[dict[str, Codec]] = {
    "raw": Codec.RAW, "none": Codec.RAW,
    "bf16": Codec.BF16, "bfloat16": Codec.BF16,
    "fp8": Codec.FP8, "mxfp8": Codec.FP8,
    "zstd": Codec.ZSTD, "lossless": Codec.ZSTD,
}  # fmt: skip

# The dtypes each lossy codec packs (docs/COMPRESSION.md, "Codecs").
_TAKES: Final[dict[Codec, tuple[torch.dtype, ...]]] = {
    Codec.FP8: (torch.float32, torch.bfloat16, torch.float16),
    Codec.BF16: (torch.float32, torch.bfloat16),
}


def parse_codec(name: str | Codec) -> Codec:
    """The codec of a name: none or raw, bf16, fp8 or mxfp8, zstd or
    lossless, with or without "/v1", in any case. ValueError names the
    choices."""
    if isinstance(name, Codec):
        return name
    s = str(name).strip().lower().removesuffix("/v1")
    try:
        return _NAMES[s]
    except KeyError:
        raise ValueError(f"unknown compression {name!r}: want none, bf16, fp8 or zstd") from None


# Per codec, what each call asks of it, without an Enum property per call.
_LOSSY: Final = frozenset(c for c in Codec if c.lossy)
_CODEC_NAMES: Final = {c: str(c) for c in Codec}


def is_lossy(codec: Codec) -> bool:
    """codec.lossy, looked up."""
    return codec in _LOSSY


def codec_name(codec: Codec) -> str:
    """str(codec), looked up."""
    return _CODEC_NAMES[codec]


def codec_takes(codec: Codec, dtype: torch.dtype) -> bool:
    """Whether a lossy codec packs dtype."""
    return dtype in _TAKES.get(codec, ())


def for_all_reduce(codec: Codec, dtype: torch.dtype, op: Op) -> Codec:
    """The codec of a bridged all_reduce under codec: a lossy one only for
    floating SUM and AVG of a dtype it packs, zstd for every one, raw for
    the rest (docs/COMPRESSION.md, "What is compressed")."""
    if codec in _LOSSY:
        return codec if op in (Op.SUM, Op.AVG) and codec_takes(codec, dtype) else Codec.RAW
    return codec


def for_transfer(codec: Codec) -> Codec:
    """The codec of a bridged broadcast or all_gather: zstd, else raw."""
    return Codec.ZSTD if codec == Codec.ZSTD else Codec.RAW


@dataclass(frozen=True)
class Policy:
    """One rank's settings, from its environment (:meth:`read`); problems:
    what is wrong with them, one sentence each, for discovery."""

    codec: Codec = Codec.RAW
    bridge_reduce: str = "auto"
    problems: list[str] = field(default_factory=list)
    p2p_chunk: int = DEFAULT_P2P_CHUNK
    policy: str = AUTO
    thresholds: Thresholds = BUILTIN

    @classmethod
    def read(cls) -> Policy:
        problems = []
        comp = os.environ.get("GPUBRIDGE_COMPRESSION", "none")
        try:
            codec = parse_codec(comp)
        except ValueError:
            codec = Codec.RAW
            problems.append(
                f"GPUBRIDGE_COMPRESSION={comp!r} is not a compression (want none, bf16, fp8 or zstd)"
            )
        mode = os.environ.get("GPUBRIDGE_BRIDGE_REDUCE", "auto")
        if mode not in REDUCE_MODES:
            problems.append(f"GPUBRIDGE_BRIDGE_REDUCE={mode!r} is not one of {', '.join(REDUCE_MODES)}")
            mode = "auto"
        chunk_s = os.environ.get("GPUBRIDGE_P2P_CHUNK", "")
        chunk = DEFAULT_P2P_CHUNK
        if chunk_s:
            try:
                chunk = parse_bytes(chunk_s)
                if chunk < 1:
                    raise ValueError(chunk_s)
            except ValueError:
                chunk = DEFAULT_P2P_CHUNK
                problems.append(
                    f"GPUBRIDGE_P2P_CHUNK={chunk_s!r} is not a byte count of at least 1 (e.g. 4M)"
                )
        policy = os.environ.get("GPUBRIDGE_POLICY", AUTO).strip().lower() or AUTO
        if policy not in POLICIES:
            problems.append(f"GPUBRIDGE_POLICY={policy!r} is not one of {', '.join(POLICIES)}")
            policy = AUTO
        thresholds = BUILTIN
        path = os.environ.get("GPUBRIDGE_THRESHOLDS", "")
        if path:
            try:
                thresholds = Thresholds.read(path)
            except ThresholdsError as e:
                problems.append(f"GPUBRIDGE_THRESHOLDS: {e}")
        return cls(codec, mode, problems, chunk, policy, thresholds)

    def settings(self) -> dict[str, str]:
        """What discovery compares between ranks (a rank with a problem is
        left out of the comparison: its problem fails discovery already)."""
        return {
            "compression": str(self.codec),
            "bridge_reduce": self.bridge_reduce,
            "p2p_chunk": str(self.p2p_chunk),
            "policy": self.policy,
            "thresholds": self.thresholds.digest,
        }
