"""Pipeline parallelism across NVIDIA and AMD GPUs: stage 0 of a model on one
vendor's GPU, stage 1 on the other's, with torch's own pipelining API
(``torch.distributed.pipelining``: ``PipelineStage`` and ``ScheduleGPipe``
or ``Schedule1F1B``).

A plain pipelining script; what makes it run across vendors is marked
``# gpubridge:``. Activations go forward and their gradients back by
point-to-point between the two ranks, which gpubridge carries across the
islands (two ranks of one vendor each: over the bridge between their
gbbridge serve processes). Launch it with two ranks, one on each vendor:

    torchrun --nnodes 2 --nproc-per-node 1 ... examples/pipeline_train.py --schedule 1f1b

In simulation (no GPUs; CPU tensors, one simulated vendor per rank):

    GPUBRIDGE_SIM_VENDORS=nvidia,amd torchrun --standalone --nproc-per-node 2 examples/pipeline_train.py

The model is a small LLaMA-style decoder (pre-norm RMSNorm blocks of causal
self-attention and a SwiGLU MLP; learned positions instead of rotary ones,
for brevity) cut in two: embeddings and the first half of the blocks, then
the rest, the final norm and the head; it learns a synthetic token map. The
last stage logs the loss on stderr; every rank logs tokens/s.

``--check`` runs the same schedule's arithmetic in one process on every
rank (microbatches one after the other through both stages, gradients
summed in microbatch order and divided by their number, the same
optimizer) and compares each rank's parameters and the last stage's
per-microbatch losses with it bit for bit (exit status 1 otherwise).
``--backend gloo`` or ``nccl`` runs the same schedule without gpubridge,
for comparison. ``--json`` writes one result row (schema
``gpubridge.pipeline/v1``) per rank on stdout.
"""

from __future__ import annotations

# ruff: noqa: E402 - the command line is parsed before torch is imported
import argparse
import json
import os
import sys
import time


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    p.add_argument("--schedule", choices=("gpipe", "1f1b"), default="1f1b")
    p.add_argument("--backend", choices=("gpubridge", "gloo", "nccl"), default="gpubridge")
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--microbatches", type=int, default=4)
    p.add_argument("--batch-size", type=int, default=8, help="sequences per step (all microbatches)")
    p.add_argument("--seq-len", type=int, default=64)
    p.add_argument("--vocab", type=int, default=256)
    p.add_argument("--dim", type=int, default=64)
    p.add_argument("--layers", type=int, default=4, help="blocks, half on each stage")
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32")
    p.add_argument("--warmup", type=int, default=2, help="steps left out of tokens/s")
    p.add_argument("--log-every", type=int, default=5)
    p.add_argument("--check", action="store_true", help="compare with a single-process run, bit for bit")
    p.add_argument("--json", action="store_true", help="a result row per rank on stdout")
    a = p.parse_args(argv)
    if a.batch_size % a.microbatches or a.layers < 2:
        p.error("--batch-size must be a multiple of --microbatches, and --layers at least 2")
    return a


if __name__ == "__main__":
    # First: --help (or a wrong argument) answers at once, with neither torch
    # nor gpubridge installed or on PYTHONPATH.
    ARGS = parse_args()

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe


def simulated_vendor() -> str | None:
    """GPUBRIDGE_SIM_VENDORS (a vendor per local rank) sets GPUBRIDGE_VENDOR,
    the per-process simulation switch, unless that is set already."""
    vendors = os.environ.get("GPUBRIDGE_SIM_VENDORS")
    if vendors and "GPUBRIDGE_VENDOR" not in os.environ:
        os.environ["GPUBRIDGE_VENDOR"] = vendors.split(",")[int(os.environ["LOCAL_RANK"])]
    return os.environ.get("GPUBRIDGE_VENDOR")


class Block(nn.Module):
    """Pre-norm: x + attention(norm(x)), then + SwiGLU(norm(x))."""

    def __init__(self, dim: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.norm1, self.norm2 = nn.RMSNorm(dim, eps=1e-5), nn.RMSNorm(dim, eps=1e-5)
        self.qkv, self.proj = nn.Linear(dim, 3 * dim, bias=False), nn.Linear(dim, dim, bias=False)
        hidden = 256 * -(-(8 * dim // 3) // 256)
        self.w1, self.w3 = nn.Linear(dim, hidden, bias=False), nn.Linear(dim, hidden, bias=False)
        self.w2 = nn.Linear(hidden, dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(self.norm1(x)).view(b, t, 3, self.heads, d // self.heads).transpose(1, 3).unbind(2)
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(a.transpose(1, 2).reshape(b, t, d))
        h = self.norm2(x)
        return x + self.w2(F.silu(self.w1(h)) * self.w3(h))


class First(nn.Module):
    """Stage 0: token and position embeddings, the first blocks."""

    def __init__(self, a: argparse.Namespace, blocks: int) -> None:
        super().__init__()
        self.tok, self.pos = nn.Embedding(a.vocab, a.dim), nn.Embedding(a.seq_len, a.dim)
        self.blocks = nn.ModuleList(Block(a.dim, a.heads) for _ in range(blocks))

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.tok(tokens) + self.pos(torch.arange(tokens.shape[1], device=tokens.device))
        for blk in self.blocks:
            x = blk(x)
        return x


class Last(nn.Module):
    """Stage 1: the other blocks, the final norm and the head."""

    def __init__(self, a: argparse.Namespace, blocks: int) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(Block(a.dim, a.heads) for _ in range(blocks))
        self.norm = nn.RMSNorm(a.dim, eps=1e-5)
        self.head = nn.Linear(a.dim, a.vocab, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for blk in self.blocks:
            x = blk(x)
        return self.head(self.norm(x))


def build(a: argparse.Namespace, device: torch.device) -> tuple[nn.Module, nn.Module]:
    """Both stages, initialized alike on every rank (one seed)."""
    torch.manual_seed(0)
    first = First(a, a.layers // 2)
    last = Last(a, a.layers - a.layers // 2)
    dt = getattr(torch, a.dtype)
    return first.to(device, dt), last.to(device, dt)


def loss_fn(logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), target.reshape(-1))


def batch(step: int, a: argparse.Namespace, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """Step's tokens and targets (each token's successor under a fixed map),
    the same on every rank."""
    g = torch.Generator().manual_seed(1000 + step)
    x = torch.randint(0, a.vocab, (a.batch_size, a.seq_len), generator=g)
    return x.to(device), ((x * 7 + 3) % a.vocab).to(device)


def optimizer(m: nn.Module, a: argparse.Namespace) -> torch.optim.Optimizer:
    return torch.optim.AdamW(m.parameters(), lr=a.lr, foreach=False)


def reference(a: argparse.Namespace, device: torch.device) -> tuple[list[nn.Module], list[list[float]]]:
    """The schedule's arithmetic in this process: per step, every microbatch
    through both stages and backward in microbatch order (gradients summed
    in that order), then divided by the microbatch count, then the
    optimizers. Returns the stages and each step's microbatch losses."""
    first, last = build(a, device)
    opts = [optimizer(first, a), optimizer(last, a)]
    losses = []
    for step in range(a.steps):
        for o in opts:
            o.zero_grad()
        x, y = batch(step, a, device)
        step_losses = []
        for xm, ym in zip(x.tensor_split(a.microbatches), y.tensor_split(a.microbatches), strict=True):
            loss = loss_fn(last(first(xm)), ym)
            loss.backward()  # type: ignore[no-untyped-call]
            step_losses.append(loss.item())
        for m in (first, last):
            for p in m.parameters():
                if p.grad is not None:
                    p.grad.div_(a.microbatches)
        for o in opts:
            o.step()
        losses.append(step_losses)
    return [first, last], losses


def emit(row: dict[str, object]) -> None:
    # One write per row: both ranks share torchrun's stdout, and print's
    # separate newline write let two rows land on one line (CI, torch 2.8).
    sys.stdout.write(json.dumps(row) + "\n")
    sys.stdout.flush()


def log(msg: str) -> None:
    print(f"[rank {os.environ.get('RANK', '?')}] {msg}", file=sys.stderr, flush=True)


def main(a: argparse.Namespace) -> int:
    vendor = simulated_vendor() if a.backend == "gpubridge" else None
    if a.backend == "gpubridge":
        import gpubridge  # noqa: F401,PLC0415  gpubridge: registers the torch.distributed backend "gpubridge"
    dist.init_process_group(backend=a.backend)  # gpubridge: backend="gpubridge" instead of "nccl"
    rank, world = dist.get_rank(), dist.get_world_size()
    if world != 2:
        log(f"this example runs two stages on two ranks, not {world}")
        return 2
    local = int(os.environ.get("LOCAL_RANK", "0"))
    gpu = torch.cuda.is_available() and vendor is None and a.backend != "gloo"
    device = torch.device("cuda", local) if gpu else torch.device("cpu")
    if gpu:
        torch.cuda.set_device(device)
        if a.check:  # attention kernels whose backward is the same every time
            torch.backends.cuda.enable_flash_sdp(False)
            torch.backends.cuda.enable_mem_efficient_sdp(False)
    if a.backend == "gpubridge" and rank == 0:
        pg = dist.distributed_c10d._get_default_group()
        topo = getattr(pg, "topology", {})
        for isl in topo.get("islands", []):
            log(f"island {isl['label']}: ranks {isl['ranks']}, leader {isl['leader']}, {isl['backend']}")
    stages = build(a, device)
    mine = stages[rank]
    mb = a.batch_size // a.microbatches
    dt = getattr(torch, a.dtype)
    # The activation between the stages needs its gradient: torch 2.15's
    # stages take requires_grad from these shapes (without it the last stage
    # sends no gradient back and the first stage's backward fails).
    ins = [torch.empty(mb, a.seq_len, dtype=torch.long, device="meta"),
           torch.empty(mb, a.seq_len, a.dim, dtype=dt, device="meta", requires_grad=True)]  # fmt: skip
    outs = [ins[1], torch.empty(mb, a.seq_len, a.vocab, dtype=dt, device="meta")]
    stage = PipelineStage(mine, rank, 2, device, input_args=ins[rank], output_args=outs[rank])
    kind = ScheduleGPipe if a.schedule == "gpipe" else Schedule1F1B
    schedule = kind(stage, a.microbatches, loss_fn=loss_fn)
    opt = optimizer(mine, a)
    all_losses: list[list[float]] = []
    t0 = time.perf_counter()
    for step in range(a.steps):
        if step == a.warmup:
            if gpu:
                torch.cuda.synchronize()
            t0 = time.perf_counter()
        opt.zero_grad()
        x, y = batch(step, a, device)
        if rank == 0:
            schedule.step(x)
        else:
            losses: list[torch.Tensor] = []
            schedule.step(target=y, losses=losses)
            all_losses.append([float(v.item()) for v in losses])
            if step % a.log_every == 0 or step == a.steps - 1:
                log(f"step {step}: loss {sum(all_losses[-1]) / len(all_losses[-1]):.4f}")
        opt.step()
    if gpu:
        torch.cuda.synchronize()
    secs = time.perf_counter() - t0
    timed = max(1, a.steps - a.warmup)
    tokens_s = timed * a.batch_size * a.seq_len / secs
    log(f"{a.schedule} over {a.backend}: {tokens_s:.0f} tokens/s ({timed} steps in {secs:.2f} s)")
    verdict = "skipped"
    if a.check:
        ref, ref_losses = reference(a, device)
        same = all(
            torch.equal(p.detach().view(-1).view(torch.uint8), q.detach().view(-1).view(torch.uint8))
            for p, q in zip(mine.parameters(), ref[rank].parameters(), strict=True)
        )
        if rank == 1:
            same = same and all_losses == ref_losses
        verdict = "bit-exact" if same else "DIFFERENT"
        log(f"check against a single process: {verdict}")
    if a.json:
        row = {
            "schema": "gpubridge.pipeline/v1", "rank": rank, "stage": rank, "backend": a.backend,
            "schedule": a.schedule, "device": str(device), "dtype": a.dtype, "steps": a.steps,
            "microbatches": a.microbatches, "batch_size": a.batch_size, "seq_len": a.seq_len,
            "dim": a.dim, "layers": a.layers, "tokens_per_s": tokens_s, "seconds": secs, "check": verdict,
            "final_loss": (sum(all_losses[-1]) / len(all_losses[-1])) if all_losses else None,
        }  # fmt: skip
        emit(row)
    dist.destroy_process_group()
    return 1 if verdict == "DIFFERENT" else 0


if __name__ == "__main__":
    sys.exit(main(ARGS))
