"""Launchers of the Go tools shipped in the gpubridge wheel.

The wheel carries gbprobe, gbdiscover, gbbridge (every ``tools/gb*`` of the
checkout it was built from) in ``gpubridge/bin/``; the console script of each
tool (``gbprobe = gpubridge_tools:gbprobe``) execs that binary, so the tools
are on the environment's PATH after ``pip install``. An editable install
(``pip install -e``) carries no tools: its launchers run the checkout's
``bin/`` (``make build``). This module is apart from
the package ``gpubridge`` because importing that imports torch (it registers
the backend): a launcher starts in a few milliseconds, not seconds.
"""

from __future__ import annotations

import os
import re
import sys
from collections.abc import Callable
from pathlib import Path

__all__ = ["run", "tools_dir"]

_NAME = re.compile(r"gb[a-z0-9]+")


def tools_dir() -> Path:
    """The directory of the tools this installation ships
    (``<site-packages>/gpubridge/bin``)."""
    return Path(__file__).resolve().parent / "gpubridge" / "bin"


def _checkout_bin() -> Path | None:
    """bin/ of the checkout this module sits in (an editable install), if
    it is one (go.mod next to torchplugin/)."""
    root = Path(__file__).resolve().parent.parent
    return root / "bin" if (root / "go.mod").is_file() else None


def run(name: str, args: list[str] | None = None) -> int:
    """Replaces this process with the shipped tool name (args: the command
    line after the name, by default this process's). Returns 2, having said
    why on stderr, only when the tool is not there."""
    p = tools_dir() / name
    cb = _checkout_bin()
    if not os.access(p, os.X_OK) and cb is not None:
        if not os.access(cb / name, os.X_OK):
            print(
                f"{name}: this gpubridge is an editable install in the checkout {cb.parent}, whose "
                f"bin/ has no {name}: run `make build` there",
                file=sys.stderr,
            )
            return 2
        p = cb / name
    if not os.access(p, os.X_OK):
        print(
            f"{name}: {p} is missing: this gpubridge installation does not carry {name} (a wheel "
            "built without it, or files removed since); reinstall gpubridge from a gpubridge checkout "
            "with Go 1.21 or later on PATH (`pip install --force-reinstall ./torchplugin`)",
            file=sys.stderr,
        )
        return 2
    argv = sys.argv[1:] if args is None else args
    os.execv(p, [name, *argv])
    return 0  # not reached: execv returns only by raising


def __getattr__(name: str) -> Callable[[], int]:
    """gpubridge_tools.gbprobe (any gb* name) is the console script's entry
    point for that tool: the wheel names them after the tools it ships."""
    if not _NAME.fullmatch(name):
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")

    def main() -> int:
        return run(name)

    main.__name__ = main.__qualname__ = name
    return main
