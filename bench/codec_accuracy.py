"""What fp8 gradients do to training, before the bridge carries them: DDP
over a plain Gloo group on CPU, with a comm hook that passes every bucket
through gpubridge's fp8 quantizer (gpubridge._codec) the way the bridge's
two-member exchange will — each rank's bucket quantized (with or without
error feedback, gpubridge._feedback), the decoded values summed, divided
once — against the exact run (the same hook without the quantizer).

    python bench/codec_accuracy.py [--task lm|multitask] [--steps N] [--world N] [--out FILE]

Tasks: ``lm``, a small LLaMA-style decoder (bench/gpu/llama.py, 0.14M
parameters) learning sequences of a fixed random Markov chain with AdamW:
an ordinary model, whose gradients fp8 carries with no measurable effect;
``multitask``, 32 linear regressions sharing a (64, 32) weight whose loss
weights span eight decades (auxiliary losses with small weights), with
Adam: the 32 values of a block are one input's weights for the 32 tasks,
so a block's gradients span more than fp8 carries below its largest value,
and without error feedback the small tasks' gradients are flushed to zero
every step. Its "loss" is the mean of the tasks' own (unweighted) errors,
what a user of every task cares about.

Prints and writes one JSON line per run (schema gpubridge.codec-accuracy/v1):
the loss every 25 steps (mean over the ranks), the final loss (mean of the
last 20 steps), and whether every rank ended with the same parameters.
Phase 2 of issue 13 repeats this through the bridge.

No ``from __future__ import annotations``: DDP checks the hook's
annotations at registration and needs the real types."""

import argparse
import hashlib
import json
import math
import os
import sys
import tempfile
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn

REPO = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(REPO / "torchplugin"), str(REPO / "bench" / "gpu")]

from llama import Config, Llama, loss_of  # noqa: E402

from gpubridge import _codec  # noqa: E402
from gpubridge._feedback import ErrorFeedback  # noqa: E402

RUNS = ("exact", "fp8", "fp8-ef")


class HookState:
    def __init__(self, mode: str, world: int) -> None:
        self.mode = mode
        self.world = world
        self.ef = ErrorFeedback("fp8")


def hook(state: HookState, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    buf = bucket.buffer()
    if state.mode == "fp8":
        buf.copy_(_codec.mxfp8_decode(_codec.mxfp8_encode(buf), buf.numel()).view_as(buf))
    elif state.mode == "fp8-ef":
        buf.copy_(state.ef.quantize(bucket.index(), buf).view_as(buf))
    work = dist.all_reduce(buf, async_op=True)
    assert work is not None
    world = state.world
    return work.get_future().then(lambda f: f.value()[0].div_(world))


class MultiTask(nn.Module):
    """32 linear regressions of 64 inputs: x @ W, W of shape (64, 32)."""

    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.zeros(64, 32))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x @ self.w


def markov(vocab: int, seed: int) -> torch.Tensor:
    """A random transition matrix: each token has 4 likely successors."""
    g = torch.Generator().manual_seed(seed)
    logits = torch.full((vocab, vocab), -4.0)
    for t in range(vocab):
        logits[t, torch.randperm(vocab, generator=g)[:4]] = torch.randn(4, generator=g) + 2.0
    return torch.softmax(logits, dim=1)


def lm_batch(p: torch.Tensor, batch: int, seq: int, g: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    t = torch.empty(batch, seq + 1, dtype=torch.long)
    t[:, 0] = torch.randint(0, p.shape[0], (batch,), generator=g)
    for i in range(seq):
        t[:, i + 1] = torch.multinomial(p[t[:, i]], 1, generator=g).squeeze(1)
    return t[:, :-1], t[:, 1:]


def train(rank: int, args: argparse.Namespace, mode: str, store_path: str, result: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{store_path}", rank=rank, world_size=args.world)
    torch.manual_seed(0)
    if args.task == "lm":
        cfg = Config(vocab=256, dim=64, layers=2, heads=4, hidden=192, seq=32)
        model: nn.Module = Llama(cfg)
        opt: torch.optim.Optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.0)
        chain = markov(cfg.vocab, 1)
    else:
        model = MultiTask()
        w_true = torch.randn(64, 32, generator=torch.Generator().manual_seed(3)) / 8
        weights = torch.logspace(0, -8, 32)
        opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    ddp = nn.parallel.DistributedDataParallel(model)
    ddp.register_comm_hook(HookState(mode, args.world), hook)
    g = torch.Generator().manual_seed(100 + rank)
    losses = []
    for _ in range(args.steps):
        if args.task == "lm":
            inputs, targets = lm_batch(chain, 16, cfg.seq, g)
            loss = loss_of(ddp, inputs, targets)
        else:
            x = torch.randn(64, 64, generator=g)
            err = ((ddp(x) - x @ w_true) ** 2).mean(dim=0)  # each task's error
            loss = (weights * err).sum()
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        mean = (loss if args.task == "lm" else err.mean()).detach().clone()
        dist.all_reduce(mean)
        losses.append(mean.item() / args.world)
    digest = hashlib.sha256(b"".join(p.detach().numpy().tobytes() for p in model.parameters())).hexdigest()
    digests: list[Any] = [None] * args.world
    dist.all_gather_object(digests, digest)
    if rank == 0:
        Path(result).write_text(json.dumps({"losses": losses, "same_params": len(set(digests)) == 1}))
    dist.destroy_process_group()


def chunks(xs: list[float], n: int) -> list[list[float]]:
    return [xs[i : i + n] for i in range(0, len(xs), n)]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--task", choices=["lm", "multitask"], default="lm")
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--world", type=int, default=2)
    ap.add_argument("--out", help="append the JSON lines to this file")
    args = ap.parse_args()
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for mode in RUNS:
            store, result = os.path.join(tmp, f"store-{mode}"), os.path.join(tmp, f"result-{mode}.json")
            mp.spawn(train, args=(args, mode, store, result), nprocs=args.world, join=True)
            r = json.loads(Path(result).read_text())
            losses = r["losses"]
            rows.append(
                {
                    "schema": "gpubridge.codec-accuracy/v1",
                    "task": args.task,
                    "run": mode,
                    "world": args.world,
                    "steps": args.steps,
                    "loss_every_25": [float(f"{sum(c) / len(c):.6g}") for c in chunks(losses, 25)],
                    "final_loss": sum(losses[-20:]) / 20,
                    "same_params_on_every_rank": r["same_params"],
                    "torch": torch.__version__,
                }
            )
    exact = rows[0]["final_loss"]
    for row in rows:
        row["vs_exact"] = row["final_loss"] / exact - 1 if exact else math.nan
        print(json.dumps(row), flush=True)
    if args.out:
        with open(args.out, "a") as f:
            for row in rows:
                f.write(json.dumps(row) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
