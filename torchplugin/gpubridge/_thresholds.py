"""The sizes at which ``GPUBRIDGE_POLICY=auto`` changes an all_reduce's
policy (gpubridge._policies): the built-in ones, measured on the dev box
(docs/BENCHMARKS.md, "all_reduce policies"), or a file written by
``python -m gpubridge.tune --write-thresholds FILE`` on the live job and
named by ``GPUBRIDGE_THRESHOLDS``.

The file is JSON, at most MAX_FILE bytes::

    {"schema": "gpubridge.thresholds/v1",
     "flat_max_bytes": 4096,        # all_reduces of at most this many bytes go flat
     "sharded_min_bytes": 67108864, # from this many bytes on, sharded (equal islands)
     ...}                           # anything else (what was measured) is kept, unread

A negative size turns a policy off in auto. Every rank must use the same
thresholds: discovery compares their digest (:attr:`Thresholds.digest`).
"""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import dataclass
from typing import Any, Final

__all__ = ["BUILTIN", "MAX_FILE", "SCHEMA", "Thresholds", "ThresholdsError"]

SCHEMA: Final = "gpubridge.thresholds/v1"
MAX_FILE: Final = 1 << 20  # a thresholds file is a few hundred bytes


class ThresholdsError(ValueError):
    """A thresholds file that cannot be used (the message says why)."""


@dataclass(frozen=True)
class Thresholds:
    """flat_max_bytes: auto sends an all_reduce of at most this many bytes
    over the flat bridge (negative: never); sharded_min_bytes: from this
    many bytes on, sharded when the islands are equal (negative: never);
    source: "builtin" or the file's path; digest: what discovery compares."""

    flat_max_bytes: int
    sharded_min_bytes: int
    source: str = "builtin"
    digest: str = "builtin"

    @classmethod
    def parse(cls, raw: bytes, source: str) -> Thresholds:
        """The thresholds of a file's bytes; ThresholdsError says what is
        wrong with them."""
        if len(raw) > MAX_FILE:
            raise ThresholdsError(f"{source}: {len(raw)} bytes, more than a thresholds file's {MAX_FILE}")
        try:
            doc: Any = json.loads(raw)
        except (ValueError, UnicodeDecodeError) as e:
            raise ThresholdsError(f"{source}: not JSON ({e})") from None
        if not isinstance(doc, dict) or doc.get("schema") != SCHEMA:
            got = doc.get("schema") if isinstance(doc, dict) else type(doc).__name__
            raise ThresholdsError(f"{source}: schema {got!r}, want {SCHEMA!r}")
        sizes = []
        for k in ("flat_max_bytes", "sharded_min_bytes"):
            v = doc.get(k)
            if not isinstance(v, int) or isinstance(v, bool):
                raise ThresholdsError(f"{source}: {k} must be an integer (bytes; negative: never), got {v!r}")
            sizes.append(v)
        return cls(sizes[0], sizes[1], source, hashlib.sha256(raw).hexdigest()[:16])

    @classmethod
    def read(cls, path: str) -> Thresholds:
        """The thresholds in the file at path; ThresholdsError otherwise."""
        try:
            with open(path, "rb") as f:
                raw = f.read(MAX_FILE + 1)
        except OSError as e:
            raise ThresholdsError(f"{path}: {e.strerror or e}") from None
        return cls.parse(raw, os.fspath(path))

    def to_json(self, measured: dict[str, Any]) -> str:
        """A thresholds file of these sizes with what was measured."""
        doc = {
            "schema": SCHEMA,
            "flat_max_bytes": self.flat_max_bytes,
            "sharded_min_bytes": self.sharded_min_bytes,
            **measured,
        }
        return json.dumps(doc, indent=1, sort_keys=False) + "\n"


# From the dev box (2 cores, 4 CPU ranks as 2 + 2, shm bridges; docs/
# BENCHMARKS.md, "all_reduce policies"): flat beat reduce-bridge-broadcast
# at every size measured, and sharded never did. Flat stops at 32 KiB,
# gbbridge's recursive doubling range: above it the simulation pits Gloo
# over loopback TCP (its islands) against shared memory, which says
# nothing of NCCL islands on GPUs. A job measures its own with
# gpubridge.tune.
BUILTIN: Final = Thresholds(flat_max_bytes=32 << 10, sharded_min_bytes=-1)
