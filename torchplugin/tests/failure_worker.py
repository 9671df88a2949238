"""A rank of a job that must fail at start-up (run by torchrun from
test_tools.py).

argv: VENDORS OUTDIR FAULT PATH TOOLSDIR. VENDORS is a comma-separated vendor
per rank (GPUBRIDGE_VENDOR). Rank 1 gets FAULT before gpubridge is imported:
"badlocal" (LOCAL_RANK='x'), "nobridge", "noprobe" or "nodiscover" (the tools
are looked for only in TOOLSDIR/<fault>, which lacks that tool). PATH is
"backend" (dist.init_process_group(backend="gpubridge")) or "tools"
(gpubridge._discovery.discover against torchrun's store directly). The rank
writes OUTDIR/rank<R>.json: {"error": text, "elapsed": seconds} or
{"ok": true}.
"""

from __future__ import annotations

import datetime
import json
import os
import sys
import tempfile
import time
import traceback
from pathlib import Path

rank = int(os.environ["RANK"])
vendors = sys.argv[1].split(",")
outdir = Path(sys.argv[2])
fault, path, toolsdir = sys.argv[3], sys.argv[4], Path(sys.argv[5])
os.environ["GPUBRIDGE_VENDOR"] = vendors[rank]
if rank == 1:
    if fault == "badlocal":
        os.environ["LOCAL_RANK"] = "x"
    else:
        os.environ["GPUBRIDGE_BIN_DIR"] = str(toolsdir / fault)
        os.environ["GPUBRIDGE_BIN_STRICT"] = "1"

import torch.distributed as dist  # noqa: E402

import gpubridge  # noqa: E402, F401  (registers the backend)
from gpubridge import _discovery  # noqa: E402

TIMEOUT = 30.0


def main() -> dict[str, object]:
    if path == "backend":
        dist.init_process_group(backend="gpubridge", timeout=datetime.timedelta(seconds=TIMEOUT))
        dist.destroy_process_group()
    else:
        host, port = os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"])
        size = int(os.environ["WORLD_SIZE"])
        with tempfile.TemporaryDirectory() as d:
            _discovery.discover(
                host, port, rank, size, _discovery.namespace("default"), Path(d) / "t.json", timeout=TIMEOUT
            )
    return {"ok": True}


if __name__ == "__main__":
    t0 = time.monotonic()
    try:
        res = main()
    except RuntimeError as e:
        res = {"error": str(e)}
    except Exception:
        res = {"error": traceback.format_exc(), "unexpected": True}
    res["elapsed"] = time.monotonic() - t0
    (outdir / f"rank{rank}.json").write_text(json.dumps(res))
    sys.exit(3 if "error" in res else 0)
