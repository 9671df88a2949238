"""Rebalancing on a GPU (bench/gpu/rebalance.sh): a rank of a split test of
two islands on one GPU, training a small LLaMA (bench/gpu/llama.py) with
DDP through the gpubridge backend, gpubridge.RebalancingSampler and
gpubridge.weighted_comm_hook, every step marked (gpubridge.observe.step)
and traced (GPUBRIDGE_TRACE).

The island of the rank whose REBALANCE_SLOW is 1 is slowed: after its
forward, it runs EXTRA matmuls of N x N (bf16) per sample on the current
stream (REBALANCE_EXTRA, REBALANCE_N), so that its compute per sample is a
few times the other's. Phase 1: even shares (rebalance=False), WARM + STEPS
steps; phase 2: rebalanced (re-planned every REPLAN steps), WARM + STEPS
steps. Tokens per second of each phase over its last STEPS steps (wall
clock, a device sync at both ends), and the shares.

argv: OUTDIR. Writes OUTDIR/rank<R>.json. REBALANCE_JOB_CPU=1 runs it on
the CPU with a tiny model (a dry run of the script).
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset

sys.path.insert(0, str(Path(__file__).resolve().parent))
import llama

import gpubridge
from gpubridge import observe

out = Path(sys.argv[1])
CPU = os.environ.get("REBALANCE_JOB_CPU") == "1"
SLOW = os.environ.get("REBALANCE_SLOW") == "1"
EXTRA = int(os.environ.get("REBALANCE_EXTRA", "2"))
N = int(os.environ.get("REBALANCE_N", "4096"))
GLOBAL_BATCH = int(os.environ.get("REBALANCE_BATCH", "32"))
WARM = int(os.environ.get("WARM", "30"))  # steps per phase before the timed ones
STEPS = int(os.environ.get("STEPS", "60"))  # timed steps per phase
REPLAN = int(os.environ.get("REPLAN", "15"))


class Tokens(Dataset[tuple[torch.Tensor, torch.Tensor]]):
    """Random token sequences, the same on every rank (seeded)."""

    def __init__(self, cfg: llama.Config, n: int) -> None:
        g = torch.Generator().manual_seed(0)
        self.t = torch.randint(0, cfg.vocab, (n, cfg.seq + 1), generator=g)

    def __len__(self) -> int:
        return len(self.t)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.t[i, :-1], self.t[i, 1:]


def sync() -> None:
    if not CPU:
        torch.cuda.synchronize()


def phase(net: Any, data: Tokens, dev: torch.device, rebalance: bool, cfg: llama.Config) -> dict[str, Any]:
    sampler = gpubridge.RebalancingSampler(
        data, GLOBAL_BATCH, rebalance=rebalance, replan_every=REPLAN, seed=1
    )
    loader = DataLoader(data, batch_sampler=sampler)
    weights = gpubridge.SampleWeights()
    net.register_comm_hook(weights, gpubridge.weighted_comm_hook)
    opt = torch.optim.AdamW(net.parameters(), lr=1e-4)
    a = torch.randn(N, N, device=dev, dtype=torch.bfloat16) if SLOW else None
    done, t0, epoch = 0, 0.0, 0
    losses = []
    while done < WARM + STEPS:
        sampler.set_epoch(epoch)
        for xc, yc in loader:
            if done == WARM:
                sync()
                t0 = time.perf_counter()
            if done == WARM + STEPS:
                break
            x, y = xc.to(dev, non_blocking=True), yc.to(dev, non_blocking=True)
            with observe.step(len(x)):
                loss = llama.loss_of(net, x, y)
                if a is not None:
                    for _ in range(EXTRA * len(x)):
                        torch.mm(a, a)
                weights.set(len(x), GLOBAL_BATCH)
                loss.backward()  # type: ignore[no-untyped-call]
                opt.step()
                opt.zero_grad(set_to_none=True)
            losses.append(loss.detach())
            done += 1
        epoch += 1
    sync()
    secs = time.perf_counter() - t0
    gpubridge.remove_observer(sampler.meter)
    return {
        "rebalance": rebalance, "steps": STEPS, "seconds": secs,
        "tokens_per_s": GLOBAL_BATCH * cfg.seq * STEPS / secs, "plans": sampler.plans,
        "last_loss": float(losses[-1]),
    }  # fmt: skip


res: dict[str, Any] = {}
try:
    dist.init_process_group(backend="gpubridge")
    rank = dist.get_rank()
    res["rank"] = rank
    dev = torch.device("cpu") if CPU else torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
    cfg = llama.Config.tiny() if CPU else llama.Config(dim=512, layers=4, heads=8, hidden=1408, seq=256)
    res["config"] = {"dim": cfg.dim, "layers": cfg.layers, "seq": cfg.seq, "vocab": cfg.vocab}
    res["slowed"], res["extra"], res["n"] = SLOW, EXTRA, N
    data = Tokens(cfg, GLOBAL_BATCH * 40)
    phases = []
    for rebalance in (False, True):
        torch.manual_seed(0)
        model = llama.Llama(cfg).to(dev)
        if not CPU:
            model = model.to(torch.bfloat16)
        net = DDP(model, device_ids=None if CPU else [dev.index])
        phases.append(phase(net, data, dev, rebalance, cfg))
    res["phases"] = phases
    res["speedup"] = phases[1]["tokens_per_s"] / phases[0]["tokens_per_s"]
    dist.barrier()
    dist.destroy_process_group()
    res["ok"] = True
except Exception as e:  # the script reports what failed
    import traceback

    res["error"] = f"{e!r}\n{traceback.format_exc()}"
(out / f"rank{res.get('rank', os.environ.get('RANK', 'x'))}.json").write_text(json.dumps(res, indent=1))
sys.exit(0 if res.get("ok") else 1)
