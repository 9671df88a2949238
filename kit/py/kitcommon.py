"""What the kit's Python scripts share, without torch: JSON lines on stdout,
the task's place in the heterogeneous job (from kit/lib/task.sh's
variables), and where the gpubridge tools are."""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import sys
from pathlib import Path
from typing import Any

TOOLS = ("gbprobe", "gbdiscover", "gbbridge", "gbtrace")


def emit(row: dict[str, Any]) -> None:
    """One compact JSON line on stdout (srun carries whole lines)."""
    sys.stdout.write(json.dumps(row, separators=(",", ":")) + "\n")
    sys.stdout.flush()


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def env_int(name: str, default: int | None = None) -> int:
    v = os.environ.get(name)
    if v is None:
        if default is None:
            raise SystemExit(f"kit: {name} is not set (run through kit/lib/task.sh inside a kit job)")
        return default
    try:
        return int(v)
    except ValueError:
        raise SystemExit(f"kit: {name}={v!r} is not an integer") from None


def simulated() -> bool:
    return os.environ.get("KIT_SIMULATE", "0") == "1"


def in_kit_job() -> bool:
    """Whether kit_begin laid out this job (else a driver runs under a plain
    torchrun, e.g. on one GPU host, and has no components to check)."""
    return "KIT_K" in os.environ


def component() -> dict[str, Any]:
    """This task's component: index, partition, vendor, node. lib/task.sh
    sets KIT_COMPONENT; under torchrun's workers it is the node's (the
    same); without a kit job it is None."""
    k: int | None = None
    if "KIT_COMPONENT" in os.environ:
        k = env_int("KIT_COMPONENT")
    elif in_kit_job() and "RANK" in os.environ:
        rank = env_int("RANK")
        k = next(
            (c["component"] for c in components() if c["first_rank"] <= rank < c["first_rank"] + c["ranks"]),
            None,
        )
    return {
        "component": k,
        "partition": os.environ.get("KIT_PARTITION", ""),
        "vendor": os.environ.get("KIT_VENDOR", ""),
        "node": os.environ.get("SLURMD_NODENAME", ""),
    }


def components() -> list[dict[str, Any]]:
    """Every component of the job, as kit_begin exported them ([] outside a
    kit job)."""
    if not in_kit_job():
        return []
    out = []
    for k in range(env_int("KIT_K")):
        out.append(
            {
                "component": k,
                "partition": os.environ.get(f"KIT_PARTITION_{k}", ""),
                "vendor": os.environ.get(f"KIT_VENDOR_{k}", ""),
                "first_rank": env_int(f"KIT_OFFSET_{k}"),
                "ranks": env_int(f"KIT_NTASKS_{k}"),
                "nodes": os.environ.get(f"KIT_NODES_{k}", "").split(),
            }
        )
    return out


def find_tool(name: str) -> str | None:
    """A gpubridge tool: GPUBRIDGE_BIN_DIR, the installed package's own
    gpubridge/bin (found without importing it, which would import torch),
    then PATH — the plugin's order, less its build-on-first-use."""
    d = os.environ.get("GPUBRIDGE_BIN_DIR")
    if d and os.access(Path(d) / name, os.X_OK):
        return str(Path(d) / name)
    try:
        spec = importlib.util.find_spec("gpubridge")
    except (ImportError, ValueError):
        spec = None
    for loc in (spec.submodule_search_locations or []) if spec else []:
        p = Path(loc) / "bin" / name
        if os.access(p, os.X_OK):
            return str(p)
    return shutil.which(name)


if __name__ == "__main__":
    # kitcommon.py tool NAME: print the tool's path (exit 1 when not found).
    if len(sys.argv) == 3 and sys.argv[1] == "tool":
        path = find_tool(sys.argv[2])
        if path is None:
            sys.exit(1)
        print(path)
        sys.exit(0)
    print("usage: kitcommon.py tool NAME", file=sys.stderr)
    sys.exit(2)
