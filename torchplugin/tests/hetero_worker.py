"""A rank of a mixed job (run by torchrun from test_hetero.py): 4 simulated
ranks, the AMD island's twice as slow per sample, training a small model
with DDP, gpubridge.RebalancingSampler and gpubridge.weighted_comm_hook,
traced (GPUBRIDGE_TRACE=OUTDIR/trace) with every step marked
(gpubridge.observe.step).

argv: VENDORS OUTDIR MODE STEPS [SLOW_RANK SLOW_FROM]. MODE: ``uniform``
(rebalance=False: even shares, the same batches) or ``rebalanced``.
Compute per sample is a sleep to a deadline: SAMPLE_MS per sample on the
NVIDIA ranks, twice that on the AMD ones, and 5% more on SLOW_RANK from step
SLOW_FROM on (a degraded GPU). Writes OUTDIR/rank<R>.json: every step's
samples and loss, the sampler's plans, or the error.
"""

import datetime
import json
import os
import sys
import time
import traceback
from pathlib import Path
from typing import Any

rank = int(os.environ["RANK"])
vendors = sys.argv[1].split(",")
outdir = Path(sys.argv[2])
mode, steps = sys.argv[3], int(sys.argv[4])
slow_rank, slow_from = (int(sys.argv[5]), int(sys.argv[6])) if len(sys.argv) > 6 else (-1, 0)
os.environ["GPUBRIDGE_VENDOR"] = vendors[rank]
os.environ["GPUBRIDGE_TRACE"] = str(outdir / "trace")
os.environ["GPUBRIDGE_CHECK_CALLS"] = "0"  # the job's own collectives only: timing is what is looked at

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from torch import nn  # noqa: E402
from torch.nn.parallel import DistributedDataParallel as DDP  # noqa: E402
from torch.utils.data import DataLoader, TensorDataset  # noqa: E402

import gpubridge  # noqa: E402
from gpubridge import observe  # noqa: E402

SAMPLE_MS = 1.5
GLOBAL_BATCH = 48
PER_EPOCH = 50  # steps


def dataset() -> TensorDataset:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(GLOBAL_BATCH * PER_EPOCH, 16, generator=g, dtype=torch.float64)
    w = torch.randn(16, 4, generator=g, dtype=torch.float64)
    noise = torch.randn(len(x), 4, generator=g, dtype=torch.float64)
    return TensorDataset(x, torch.tanh(x @ w) + 0.1 * noise)


def model() -> nn.Module:
    torch.manual_seed(1)
    return nn.Sequential(nn.Linear(16, 32), nn.Tanh(), nn.Linear(32, 4)).double()


def train() -> dict[str, Any]:
    pace = SAMPLE_MS / 1e3 * (2 if vendors[rank] == "amd" else 1)
    sampler = gpubridge.RebalancingSampler(dataset(), GLOBAL_BATCH, rebalance=mode == "rebalanced", seed=3)
    loader = DataLoader(dataset(), batch_sampler=sampler)
    net = DDP(model())
    weights = gpubridge.SampleWeights()
    net.register_comm_hook(weights, gpubridge.weighted_comm_hook)
    opt = torch.optim.SGD(net.parameters(), lr=0.05)
    log: list[tuple[int, float]] = []
    epoch = 0
    while len(log) < steps:
        sampler.set_epoch(epoch)
        for x, y in loader:
            if len(log) == steps:
                break
            degraded = rank == slow_rank and len(log) >= slow_from
            with observe.step(len(x)):
                deadline = time.monotonic() + len(x) * pace * (1.05 if degraded else 1)
                loss = nn.functional.mse_loss(net(x), y)
                time.sleep(max(0.0, deadline - time.monotonic()))
                weights.set(len(x), GLOBAL_BATCH)
                loss.backward()  # type: ignore[no-untyped-call]
                opt.step()
                opt.zero_grad(set_to_none=True)
            log.append((len(x), loss.item()))
        epoch += 1
    return {"steps": log, "plans": sampler.plans}


result: dict[str, Any] = {"rank": rank}
try:
    dist.init_process_group(backend="gpubridge", timeout=datetime.timedelta(seconds=120))
    result.update(train())
    dist.barrier()
    dist.destroy_process_group()
    result["ok"] = True
except Exception as e:
    result["error"] = f"{e}\n{traceback.format_exc()}"
(outdir / f"rank{rank}.json").write_text(json.dumps(result))
sys.exit(0 if result.get("ok") else 1)
