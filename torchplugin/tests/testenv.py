"""What the tests share about the machine they run on: deadlines in tests
catch hangs, not slowness, and GPUBRIDGE_TEST_TIMEOUT_SCALE (default 1)
stretches them on a slow or loaded machine (the same knob as the Go tests'
lib/testenv)."""

from __future__ import annotations

import os


def factor() -> float:
    try:
        f = float(os.environ.get("GPUBRIDGE_TEST_TIMEOUT_SCALE", "1"))
    except ValueError:
        return 1.0
    return max(1.0, f)


def scale(seconds: float) -> float:
    return seconds * factor()
