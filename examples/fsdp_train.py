"""Sharded training with FSDP2 (``fully_shard``) across NVIDIA and AMD GPUs.

A plain FSDP2 script; what makes it run on a mixed-vendor job is marked
``# gpubridge:`` -- the import that registers the backend and the backend's
name. The device mesh is the default group, so every all-gather and
reduce-scatter FSDP issues goes through gpubridge. Launch it as any FSDP
script (see examples/README.md):

    torchrun --nproc-per-node 4 examples/fsdp_train.py

In simulation (no GPUs; CPU tensors, one simulated vendor per rank), give the
vendor of each local rank:

    GPUBRIDGE_SIM_VENDORS=nvidia,nvidia,amd,amd torchrun --nproc-per-node 4 examples/fsdp_train.py

The model is a small decoder-only transformer learning a synthetic token
sequence (each token determines the next), so the loss falls from ln(vocab)
towards 0. Rank 0 logs the loss (averaged over the ranks) and tokens/s on
stderr. At the end every rank gathers the full parameters and checks that
they are identical, bit for bit, on every rank (exit status 1 otherwise).
"""

from __future__ import annotations

# ruff: noqa: E402 - the command line is parsed before torch is imported
import argparse
import hashlib
import math
import os
import sys
import time


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    p.add_argument("--steps", type=int, default=60)
    p.add_argument("--batch-size", type=int, default=8, help="sequences per rank")
    p.add_argument("--seq-len", type=int, default=64)
    p.add_argument("--vocab", type=int, default=256)
    p.add_argument("--dim", type=int, default=128)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--log-every", type=int, default=10)
    return p.parse_args()


if __name__ == "__main__":
    # First: --help (or a wrong argument) answers at once, with neither torch
    # nor gpubridge installed or on PYTHONPATH.
    ARGS = parse_args()

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

import gpubridge  # gpubridge: registers the torch.distributed backend "gpubridge"


def simulated_vendor() -> str | None:
    """GPUBRIDGE_SIM_VENDORS (a vendor per local rank) sets GPUBRIDGE_VENDOR,
    the per-process simulation switch, unless that is set already."""
    vendors = os.environ.get("GPUBRIDGE_SIM_VENDORS")
    if vendors and "GPUBRIDGE_VENDOR" not in os.environ:
        os.environ["GPUBRIDGE_VENDOR"] = vendors.split(",")[int(os.environ["LOCAL_RANK"])]
    return os.environ.get("GPUBRIDGE_VENDOR")


class TinyLM(nn.Module):
    """Token and position embeddings, pre-norm causal transformer blocks, a
    linear head."""

    def __init__(self, vocab: int, dim: int, layers: int, heads: int, seq_len: int) -> None:
        super().__init__()
        self.tok = nn.Embedding(vocab, dim)
        self.pos = nn.Embedding(seq_len, dim)
        self.blocks = nn.ModuleList(
            nn.TransformerEncoderLayer(
                dim, heads, dim_feedforward=4 * dim, dropout=0.0, batch_first=True, norm_first=True
            )
            for _ in range(layers)
        )
        self.norm = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, vocab)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        n = tokens.shape[1]
        h = self.tok(tokens) + self.pos(torch.arange(n, device=tokens.device))
        mask = nn.Transformer.generate_square_subsequent_mask(n, device=tokens.device)
        for block in self.blocks:
            h = block(h, src_mask=mask, is_causal=True)
        out: torch.Tensor = self.head(self.norm(h))
        return out


def batch(step: int, rank: int, args: argparse.Namespace, device: torch.device) -> torch.Tensor:
    """Sequences where token t is followed by (5 t + 3) mod vocab, from random
    starts that differ per rank and step."""
    g = torch.Generator().manual_seed(100_000 * step + rank)
    start = torch.randint(0, args.vocab, (args.batch_size, 1), generator=g)
    seq = [start]
    for _ in range(args.seq_len):
        seq.append((seq[-1] * 5 + 3) % args.vocab)
    return torch.cat(seq, dim=1).to(device)


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def main(args: argparse.Namespace) -> int:
    vendor = simulated_vendor()
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    if torch.cuda.is_available() and vendor is None:
        device = torch.device("cuda", local_rank)
        torch.cuda.set_device(device)
    else:
        device = torch.device("cpu")

    dist.init_process_group(backend="gpubridge")  # gpubridge: was "nccl" (or "gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    lead = rank == 0
    mesh = init_device_mesh(device.type, (world,))
    if lead:
        topo = gpubridge.get_topology()
        for i in topo["islands"]:
            log(f"island {i['label']}: ranks {i['ranks']}, leader {i['leader']}, {i['backend']}")
        b = topo["bridge"]
        log(f"bridge: leaders {b.get('members')} over {b.get('transport')} ({b.get('reason')})")

    torch.manual_seed(0)  # the same initial weights on every rank
    model = TinyLM(args.vocab, args.dim, args.layers, args.heads, args.seq_len).to(device)
    n_params = sum(p.numel() for p in model.parameters())
    for block in model.blocks:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr)
    loss_fn = nn.CrossEntropyLoss()
    if lead:
        start = f"the loss starts near ln({args.vocab}) = {math.log(args.vocab):.2f}"
        log(f"training: {n_params} parameters sharded over {world} ranks on {device}; {start}")

    tokens_per_step = world * args.batch_size * args.seq_len
    t_start, loss_avg = time.perf_counter(), float("nan")
    for step in range(1, args.steps + 1):
        seq = batch(step, rank, args, device)
        logits = model(seq[:, :-1])
        loss = loss_fn(logits.reshape(-1, args.vocab), seq[:, 1:].reshape(-1))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        if step == 1:  # the first step warms up: time from here on
            t_start = time.perf_counter()
        if step % args.log_every == 0 or step == args.steps:
            avg = loss.detach().clone()
            dist.all_reduce(avg, op=dist.ReduceOp.AVG)
            loss_avg = avg.item()
            rate = (step - 1) * tokens_per_step / max(time.perf_counter() - t_start, 1e-9)
            if lead:
                log(f"step {step}: loss {loss_avg:.4f}, {rate:.0f} tokens/s")

    # The full parameters (all-gathered from the shards) must agree on every rank.
    h = hashlib.sha256()
    for p in model.parameters():
        full = p.full_tensor() if hasattr(p, "full_tensor") else p  # DTensor shards -> whole tensor
        h.update(full.detach().contiguous().view(-1).view(torch.uint8).cpu().numpy().tobytes())
    mine = torch.frombuffer(bytearray(h.digest()), dtype=torch.uint8).to(device)
    every = torch.empty(world * mine.numel(), dtype=torch.uint8, device=device)
    dist.all_gather_into_tensor(every, mine)
    differ = [r for r, row in enumerate(every.view(world, -1)) if not torch.equal(row, mine)]
    if lead:
        verdict = f"parameters DIFFER on ranks {differ}" if differ else "parameters identical on every rank"
        log(f"done: {args.steps} steps, final loss {loss_avg:.4f}; {verdict}")
    dist.destroy_process_group()
    return 1 if differ else 0


if __name__ == "__main__":
    sys.exit(main(ARGS))
