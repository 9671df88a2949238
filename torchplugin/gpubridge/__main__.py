"""``python -m gpubridge``: where the plugin's tools are.

``--tools-dir`` prints the directory the plugin takes gbprobe, gbdiscover and
gbbridge from (for an installed wheel, the tools it carries), e.g. to put
them on PATH: ``export PATH="$(python -m gpubridge --tools-dir):$PATH"``.
``--tools`` prints each tool's path. Exit status 1 (with the reason on
stderr) when a tool is not found, 2 on a usage error.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from gpubridge import __version__, _tools


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m gpubridge", description=__doc__.split("\n", 1)[0] if __doc__ else None
    )
    g = p.add_mutually_exclusive_group(required=True)
    g.add_argument("--tools-dir", action="store_true", help="print the directory of the tools")
    g.add_argument("--tools", action="store_true", help="print each tool's name and path")
    g.add_argument("--version", action="store_true", help="print the package's version")
    args = p.parse_args(argv)
    if args.version:
        print(f"gpubridge {__version__}")
        return 0
    try:
        found = _tools.find_tools(_tools.TOOLS)
    except _tools.ToolNotFoundError as e:
        print(e, file=sys.stderr)
        return 1
    if args.tools:
        for name, path in found.items():
            print(f"{name}\t{path}")
        return 0
    dirs = list(dict.fromkeys(str(Path(x).parent) for x in found.values()))
    if len(dirs) != 1:
        print(
            "gpubridge: the tools are in more than one directory: "
            + ", ".join(f"{n} in {Path(x).parent}" for n, x in found.items())
            + "; set GPUBRIDGE_BIN_DIR to one directory holding them all",
            file=sys.stderr,
        )
        return 1
    print(dirs[0])
    return 0


if __name__ == "__main__":
    sys.exit(main())
