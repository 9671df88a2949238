"""A rank of a training-like job that loses a rank (run by test_failures.py
without torchrun, as srun or a plain env:// launch would start it, so that the
survivors are not torn down by an agent).

argv: OUTDIR VICTIM. GPUBRIDGE_VENDOR comes from the environment. Every rank
all-reduces a 256 KiB gradient per step; at step 5 rank VICTIM kills itself
with SIGKILL (mode "kill") or stops itself with SIGSTOP (mode "stop"). The
others write OUTDIR/rank<R>.json with the error they got and how long after
the victim's last step it came.
"""

from __future__ import annotations

import datetime
import json
import os
import signal
import sys
import threading
import time
from pathlib import Path

import torch
import torch.distributed as dist

import gpubridge

rank = int(os.environ["RANK"])
outdir = Path(sys.argv[1])
victim = int(sys.argv[2])
mode = sys.argv[3]
timeout = float(os.environ.get("KILL_TEST_TIMEOUT", "20"))

dist.init_process_group(backend="gpubridge", timeout=datetime.timedelta(seconds=timeout))
grad = torch.ones(1 << 16)
stuck: list[dict[str, object]] = []


def watchdog() -> None:
    """What a hang finder sees: 3 s after the victim went, which collective
    this rank is inside (gpubridge.in_flight never blocks)."""
    while not (outdir / "victim").exists():
        time.sleep(0.05)
    time.sleep(3)
    stuck.extend(gpubridge.in_flight())


threading.Thread(target=watchdog, daemon=True).start()
step = 0
t_fail = 0.0
try:
    for step in range(1000):
        if step == 5 and rank == victim:
            (outdir / "victim").write_text(str(time.time()))
            os.kill(os.getpid(), signal.SIGKILL if mode == "kill" else signal.SIGSTOP)
        grad.fill_(1.0)
        dist.all_reduce(grad)
        time.sleep(0.01)
except RuntimeError as e:
    t_fail = time.time()
    res = {"error": str(e), "step": step, "at": t_fail, "in_flight": stuck}
    (outdir / f"rank{rank}.json").write_text(json.dumps(res))
    sys.exit(1)
(outdir / f"rank{rank}.json").write_text(json.dumps({"ok": True, "step": step}))
