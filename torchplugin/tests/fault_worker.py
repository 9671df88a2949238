"""A rank of a job that loses a process in the middle of training (run by
test_failures.py without torchrun, as srun or a plain env:// launch would
start it, so that no agent tears the survivors down).

argv: OUTDIR VICTIM MODE WORKLOAD.
- MODE: ``kill`` (rank VICTIM SIGKILLs itself), ``exit`` (os._exit, as a
  crashing rank does), ``stop`` (it SIGSTOPs itself) or ``bridge`` (it
  SIGKILLs its own gbbridge serve child and carries on).
- WORKLOAD: ``loop`` (an all_reduce of a 256 KiB gradient per step), ``ddp``
  (DistributedDataParallel) or ``fsdp`` (FSDP2's fully_shard on the world
  mesh), each on a small model; or ``p2p`` (2+2: per step each rank
  exchanges 64 KiB with the rank at its place in the other island, both
  directions at once, so the non-leaders have endpoints of their own, then
  an all_reduce).

The fault comes at step 5. Every rank that is still running writes
OUTDIR/rank<R>.json with the error it got, when, and what
gpubridge.in_flight() showed 3 s after the fault. A crash (a segfault) writes
nothing, which the test reports.
"""

from __future__ import annotations

import datetime
import faulthandler
import json
import os
import signal
import sys
import tempfile
import threading
import time
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

import gpubridge
from gpubridge._group import live_groups

faulthandler.enable()
rank = int(os.environ["RANK"])
outdir = Path(sys.argv[1])
victim = int(sys.argv[2])
mode = sys.argv[3]
workload = sys.argv[4]
timeout = float(os.environ.get("KILL_TEST_TIMEOUT", "20"))
FAULT_STEP = 5

dist.init_process_group(backend="gpubridge", timeout=datetime.timedelta(seconds=timeout))
stuck: list[dict[str, object]] = []


def watchdog() -> None:
    """What a hang finder sees: 3 s after the fault, which collective this
    rank is inside (gpubridge.in_flight never blocks)."""
    while not (outdir / "victim").exists():
        time.sleep(0.05)
    time.sleep(3)
    stuck.extend(gpubridge.in_flight())


def fault() -> None:
    if mode == "bridge":
        bridge = live_groups()[0]._endpoint
        assert bridge is not None, f"rank {rank} runs no gbbridge serve"
        (outdir / "victim").write_text(json.dumps({"at": time.time(), "pid": bridge.process.proc.pid}))
        os.kill(bridge.process.proc.pid, signal.SIGKILL)
        return
    # The private directories this process holds as it dies (the test
    # checks that the next group removes them; another job's group may be
    # first, so they are named now, not looked for afterwards).
    mine = sorted(str(d) for d in Path(tempfile.gettempdir()).glob(f"gpubridge-{os.getpid()}-*"))
    (outdir / "victim").write_text(json.dumps({"at": time.time(), "pid": os.getpid(), "dirs": mine}))
    if mode == "exit":
        os._exit(0)
    os.kill(os.getpid(), signal.SIGKILL if mode == "kill" else signal.SIGSTOP)


def model() -> nn.Module:
    torch.manual_seed(0)
    m = nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 4))
    if workload == "ddp":
        return nn.parallel.DistributedDataParallel(m)
    from torch.distributed.device_mesh import init_device_mesh  # noqa: PLC0415
    from torch.distributed.fsdp import fully_shard  # noqa: PLC0415

    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    for layer in m:
        if isinstance(layer, nn.Linear):
            fully_shard(layer, mesh=mesh)
    fully_shard(m, mesh=mesh)
    return m


threading.Thread(target=watchdog, daemon=True).start()
step = 0
try:
    if workload == "p2p":
        world = dist.get_world_size()
        peer = (rank + world // 2) % world
        mine, got, grad = torch.full((1 << 14,), float(rank)), torch.zeros(1 << 14), torch.ones(1 << 10)
        for step in range(1000):
            if step == FAULT_STEP and rank == victim:
                fault()
            works = [dist.isend(mine, peer, tag=1), dist.irecv(got, peer, tag=1)]
            for w in works:
                w.wait()
            assert torch.equal(got, torch.full((1 << 14,), float(peer))), got[:4]
            dist.all_reduce(grad)
            time.sleep(0.01)
    elif workload == "loop":
        grad = torch.ones(1 << 16)
        for step in range(1000):
            if step == FAULT_STEP and rank == victim:
                fault()
            grad.fill_(1.0)
            dist.all_reduce(grad)
            time.sleep(0.01)
    else:
        net = model()
        opt = torch.optim.SGD(net.parameters(), lr=0.01)
        g = torch.Generator().manual_seed(rank)
        for step in range(1000):
            if step == FAULT_STEP and rank == victim:
                fault()
            x = torch.randn(16, 32, generator=g)
            loss = net(x).square().mean()
            opt.zero_grad()
            loss.backward()  # type: ignore[no-untyped-call]
            opt.step()
            time.sleep(0.01)
except RuntimeError as e:
    res = {"error": str(e), "step": step, "at": time.time(), "in_flight": stuck}
    (outdir / f"rank{rank}.json").write_text(json.dumps(res))
    sys.exit(1)
(outdir / f"rank{rank}.json").write_text(json.dumps({"ok": True, "step": step}))
