"""The Go codec's test vectors (lib/codec/testdata/vectors, written by
lib/codec's TestVectors): loading them, and the inputs that are computed
rather than stored. Shared by test_codec.py and bench/gpu/codec_check.py."""

from __future__ import annotations

import gzip
import io
from pathlib import Path

import numpy as np

VECTORS = Path(__file__).resolve().parents[2] / "lib" / "codec" / "testdata" / "vectors"


def load(name: str, root: Path = VECTORS) -> np.ndarray:
    """A vector file (NAME.npy.gz) as its numpy array of raw bits."""
    with gzip.open(root / f"{name}.npy.gz") as f:
        return np.load(io.BytesIO(f.read()))


def computed_inputs() -> dict[str, np.ndarray]:
    """The inputs lib/codec's vectors_test.go computes instead of storing,
    as raw bits: uint32 (float32) or uint16 (float16)."""
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


TAILS = (1, 7, 31, 33, 1057)
