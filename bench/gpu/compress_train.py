"""Training with compression on the bridge (issue 13): the 110M-parameter
LLaMA-style model (bench/gpu/llama.py) with DDP over gpubridge, its gradient
buckets all-reduced exactly (gpubridge.ddp_comm_hook), with fp8 and error
feedback, and with fp8 without (gpubridge.CompressionState +
compressed_hook), from the same initial weights on the same data; the loss
curves side by side, and tokens/s of each beside a compute-only anchor. A
torchrun worker, one per rank, 2 ranks, each the leader of its own island
(GPUBRIDGE_SPLIT_TEST=half; with ONE GPU both ranks share it as two torchrun
"nodes" of one rank: a split test of two islands on ONE GPU).

Usage:
    torchrun ... bench/gpu/compress_train.py OUT.jsonl [--steps 500] [--batch 8]
        [--speed-steps 30] [--speed-batch 16] [--modes exact,fp8-ef,fp8] [--device cuda|cpu] [--tiny]

The data is learnable, so that the curves say something: sequences over 2048
of the vocabulary's tokens where each next token is a fixed random function
of the one before with probability 0.9 and uniform otherwise (a loss floor
near 0.1 ln 2048 + H(0.9) = 1.09 nats), drawn from a seeded generator per
rank and step, the same for every mode. bf16 parameters and gradients,
AdamW (lr 3e-4).

Rank 0 appends JSON lines (schema gpubridge.compress-train/v1) to OUT.jsonl:

  kind "curve"  per mode: the loss every 10 steps (the mean over the ranks'
                losses), the mean of the last 50 steps, params_in_sync (the
                SHA-256 of every parameter's bytes equal on every rank),
                bridge_bytes (bytes this leader's gbbridge sent per step, from
                the trace of the last step's collectives: DONE's bridge stats).
  kind "speed"  per mode and "compute-only" (a comm hook that communicates
                nothing: the ranks' compute alone on the shared GPU, an upper
                bound no communication can beat; NCCL cannot put two ranks of
                one communicator on one GPU, so there is no all-NCCL anchor on
                one GPU): tokens/s over --speed-steps timed steps of
                --speed-batch sequences per rank, after 5 warm-up steps.
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import hashlib
import json
import os
import statistics
import sys
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

sys.path.insert(0, str(Path(__file__).resolve().parent))
from llama import Config, Llama, loss_of

SCHEMA = "gpubridge.compress-train/v1"
os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
USED = 2048  # tokens of the vocabulary the data uses


def batches(cfg: Config, batch: int, steps: int, rank: int, device: torch.device) -> list[torch.Tensor]:
    """steps batches of (batch, seq + 1) token ids of the learnable source."""
    used = min(USED, cfg.vocab)
    g = torch.Generator().manual_seed(12345)
    nxt = torch.randperm(used, generator=g)  # the same function on every rank
    g.manual_seed(1000 + rank)
    out = []
    for _ in range(steps):
        t = torch.empty(batch, cfg.seq + 1, dtype=torch.int64)
        t[:, 0] = torch.randint(0, used, (batch,), generator=g)
        noise = torch.rand(batch, cfg.seq, generator=g) >= 0.9
        rnd = torch.randint(0, used, (batch, cfg.seq), generator=g)
        for i in range(cfg.seq):
            t[:, i + 1] = torch.where(noise[:, i], rnd[:, i], nxt[t[:, i]])
        out.append(t.to(device))
    return out


def digest(model: torch.nn.Module) -> str:
    h = hashlib.sha256()
    for p in model.parameters():
        h.update(p.detach().contiguous().view(torch.uint8).cpu().numpy().tobytes())
    return h.hexdigest()


class Run:
    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.rank = int(os.environ["RANK"])
        self.world = int(os.environ["WORLD_SIZE"])
        self.cuda = args.device == "cuda"
        if self.cuda:
            local = int(os.environ.get("LOCAL_RANK", "0"))
            self.device = torch.device("cuda", local % torch.cuda.device_count())
            torch.cuda.set_device(self.device)
            os.environ.setdefault("GPUBRIDGE_SPLIT_TEST", "half")
        else:
            self.device = torch.device("cpu")
            os.environ.setdefault("GPUBRIDGE_VENDOR", "nvidia" if self.rank < self.world // 2 else "amd")
        import gpubridge  # noqa: PLC0415

        self.gb = gpubridge
        dist.init_process_group("gpubridge", timeout=timedelta(seconds=600))
        self.gloo = dist.new_group(backend="gloo")
        self.cfg = Config.tiny() if args.tiny else Config()
        self.bytes_sent: list[int] = []
        gpubridge.add_observer(self)

    def on_collective(self, record: Any) -> None:
        b = getattr(record, "bridge", None)  # DONE's bridge stats, on leaders
        if b is not None:
            self.bytes_sent.append(int(b.bytes_sent))

    def row(self, **kw: Any) -> None:
        if self.rank != 0:
            return
        note = "split test: two islands of one rank on ONE GPU" if self.cuda else "CPU smoke test"
        r = {
            "schema": SCHEMA,
            "commit": os.environ.get("GB_COMMIT", "unknown"),
            "world": self.world,
            "device": torch.cuda.get_device_name(self.device) if self.cuda else "cpu",
            "note": note,
            **kw,
        }
        with open(self.args.out, "a") as f:
            f.write(json.dumps(r) + "\n")
        print(json.dumps({k: v for k, v in r.items() if k not in ("schema", "losses")}), file=sys.stderr)

    def model(self, mode: str) -> tuple[torch.nn.Module, Any]:
        torch.manual_seed(0)
        m = Llama(self.cfg).to(device=self.device, dtype=torch.bfloat16)
        ddp = DDP(m, device_ids=[self.device.index] if self.cuda else None, bucket_cap_mb=25.0,
                  gradient_as_bucket_view=True)  # fmt: skip
        if mode == "exact":
            ddp.register_comm_hook(None, self.gb.ddp_comm_hook)
        elif mode in ("fp8-ef", "fp8", "bf16-ef"):
            state = self.gb.CompressionState(codec=mode.split("-", 1)[0], error_feedback=mode.endswith("-ef"))
            ddp.register_comm_hook(state, self.gb.compressed_hook)
        elif mode == "compute-only":
            ddp.register_comm_hook(None, _no_comm)
        else:
            raise SystemExit(f"unknown mode {mode}")
        opt = torch.optim.AdamW(ddp.parameters(), lr=3e-4, weight_decay=0.0)
        return ddp, opt

    def step(self, ddp: Any, opt: Any, t: torch.Tensor) -> torch.Tensor:
        loss = loss_of(ddp, t[:, :-1], t[:, 1:])
        torch.autograd.backward(loss)
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss.detach()

    def sync(self) -> None:
        if self.cuda:
            torch.cuda.synchronize(self.device)

    def curve(self, mode: str, data: list[torch.Tensor]) -> None:
        ddp, opt = self.model(mode)
        losses = []
        t0 = time.perf_counter()
        for i, t in enumerate(data):
            self.bytes_sent.clear()
            losses.append(self.step(ddp, opt, t))
            if i % 50 == 0:
                self.sync()
        self.sync()
        secs = time.perf_counter() - t0
        vec = torch.stack(losses).float().to(self.device)
        dist.all_reduce(vec)
        vec /= self.world
        curve = [float(x) for x in vec.tolist()]
        got: list[Any] = [None] * self.world
        dist.all_gather_object(got, digest(ddp.module), group=self.gloo)
        self.row(kind="curve", mode=mode, steps=len(data), batch=self.args.batch, seq=self.cfg.seq,
                 losses=curve[::10], final_loss=statistics.fmean(curve[-50:]), first_loss=curve[0],
                 params_in_sync=len(set(got)) == 1, seconds=secs,
                 bridge_bytes_per_step=sum(self.bytes_sent))  # fmt: skip
        del ddp, opt
        gc.collect()
        if self.cuda:
            torch.cuda.empty_cache()

    def speed(self, mode: str) -> None:
        data = batches(self.cfg, self.args.speed_batch, 2, self.rank, self.device)
        ddp, opt = self.model(mode)
        for i in range(5):
            self.step(ddp, opt, data[i % 2])
        self.sync()
        dist.barrier(group=self.gloo)
        t0 = time.perf_counter()
        for i in range(self.args.speed_steps):
            self.step(ddp, opt, data[i % 2])
        self.sync()
        secs = time.perf_counter() - t0
        rate = torch.tensor([self.args.speed_batch * self.cfg.seq * self.args.speed_steps / secs])
        rates: list[Any] = [None] * self.world
        dist.all_gather_object(rates, float(rate.item()), group=self.gloo)
        self.row(kind="speed", mode=mode, batch=self.args.speed_batch, seq=self.cfg.seq,
                 steps=self.args.speed_steps, tokens_per_s_ranks=rates, tokens_per_s_total=sum(rates),
                 step_ms=secs / self.args.speed_steps * 1e3)  # fmt: skip
        del ddp, opt
        gc.collect()
        if self.cuda:
            torch.cuda.empty_cache()


def _no_comm(state: Any, bucket: Any) -> Any:
    """A DDP comm hook that communicates nothing (the compute-only anchor)."""
    fut: Any = torch.futures.Future()
    fut.set_result(bucket.buffer())
    return fut


# DDP checks a hook's annotations as types (this module's are strings).
_no_comm.__annotations__ = {
    "state": object, "bucket": dist.GradBucket, "return": torch.futures.Future[torch.Tensor]
}  # fmt: skip


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("out")
    ap.add_argument("--steps", type=int, default=500)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--speed-steps", type=int, default=30)
    ap.add_argument("--speed-batch", type=int, default=16)
    ap.add_argument("--modes", default="exact,fp8-ef,fp8")
    ap.add_argument("--speed-modes", default="compute-only,exact,fp8-ef")
    ap.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    ap.add_argument("--tiny", action="store_true")
    args = ap.parse_args()
    run = Run(args)
    if args.tiny:
        run.cfg = dataclasses.replace(Config.tiny())
    data = batches(run.cfg, args.batch, args.steps, run.rank, run.device)
    for mode in filter(None, args.speed_modes.split(",")):
        run.speed(mode)
    for mode in filter(None, args.modes.split(",")):
        run.curve(mode, data)
    dist.barrier(group=run.gloo)
    gc.collect()
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
