"""A rank of a job whose set-up after discovery may fail on one rank (run by
test_setup.py as a plain env:// process).

argv: OUTDIR [HOLD]. The rank initialises the gpubridge backend, all-reduces
once and writes OUTDIR/rank<R>.json: {"ok": true, "sum": ...} or {"error":
text, "elapsed": seconds}. With HOLD, it writes OUTDIR/rank<R>.ready after
the first all_reduce, waits until the file HOLD exists and all-reduces once
more before it ends.
"""

from __future__ import annotations

import datetime
import json
import os
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

import gpubridge  # noqa: F401  (registers the backend)

rank = int(os.environ["RANK"])
outdir = Path(sys.argv[1])
timeout = float(os.environ.get("SETUP_TEST_TIMEOUT", "30"))
t0 = time.monotonic()
try:
    dist.init_process_group(backend="gpubridge", timeout=datetime.timedelta(seconds=timeout))
    t = torch.ones(4)
    dist.all_reduce(t)
    if len(sys.argv) > 2:
        (outdir / f"rank{rank}.ready").touch()
        hold, end = Path(sys.argv[2]), time.monotonic() + 4 * timeout
        while not hold.exists() and time.monotonic() < end:
            time.sleep(0.05)
        t = torch.ones(4)
        dist.all_reduce(t)
    dist.destroy_process_group()
    res: dict[str, object] = {"ok": True, "sum": t.tolist()}
except RuntimeError as e:
    res = {"error": str(e)}
res["elapsed"] = time.monotonic() - t0
(outdir / f"rank{rank}.json").write_text(json.dumps(res))
sys.exit(0 if res.get("ok") else 3)
