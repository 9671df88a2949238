"""A short training run over the gpubridge backend: DDP and/or FSDP2 of a
small decoder-only transformer on synthetic tokens, with tokens/s.

The training script of the kit's hetjob launch (launch/*.sbatch) and of
step 5. Every rank prints its place in the job (gpubridge.kit-rank/v1, via
rank 0) and the layout check; then, per --parallel mode, rank 0 prints one
row (gpubridge.kit-train/v1): tokens/s over the timed steps (every rank's
and their sum), the loss, and whether every rank ends with the same
parameters, bit for bit (SHA-256 of every parameter's bytes; FSDP's
gathered in full). A summary row (gpubridge.kit-train-summary/v1) ends the
output. Exit 0 when every mode ran and the parameters agree, 1 otherwise,
2 when it could not start.

--size tiny (0.1M parameters; the default on CPU) or small (about 110M;
the default on GPUs, in bfloat16). The data: each sequence continues a
random start token by t -> (5 t + 3) mod vocab, so the loss falls.
"""

from __future__ import annotations

# ruff: noqa: E402 - --help answers before torch is imported
import argparse
import gc
import hashlib
import itertools
import math
import statistics
import sys
import time
from typing import Any

SIZES = {
    "tiny": {"vocab": 256, "dim": 64, "layers": 2, "heads": 4, "seq": 64, "batch": 4},
    "small": {"vocab": 32000, "dim": 768, "layers": 12, "heads": 12, "seq": 1024, "batch": 8},
}


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description="DDP/FSDP tokens/s over the gpubridge backend")
    p.add_argument(
        "--parallel",
        default="ddp",
        help="ddp, fsdp, or both: ddp,fsdp (one process group, one after the other)",
    )
    p.add_argument(
        "--size", choices=sorted(SIZES), default=None, help="model size (default: small on GPUs, tiny on CPU)"
    )
    p.add_argument("--steps", type=int, default=20, help="timed steps per mode")
    p.add_argument("--warmup", type=int, default=3, help="untimed steps first")
    p.add_argument("--batch", type=int, default=0, help="sequences per rank per step (0: the size's)")
    p.add_argument("--timeout", type=float, default=600, help="seconds, for the process group")
    args = p.parse_args()
    for m in args.parallel.split(","):
        if m not in ("ddp", "fsdp"):
            p.error(f"--parallel: {m!r} is not ddp or fsdp")
    return args


if __name__ == "__main__":
    ARGS = parse_args()

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

import kitdist
from kitcommon import emit, log


class TinyLM(nn.Module):
    def __init__(self, vocab: int, dim: int, layers: int, heads: int, seq: int) -> None:
        super().__init__()
        self.tok = nn.Embedding(vocab, dim)
        self.pos = nn.Embedding(seq, dim)
        self.blocks = nn.ModuleList(
            nn.TransformerEncoderLayer(dim, heads, 4 * dim, dropout=0.0, batch_first=True, norm_first=True)
            for _ in range(layers)
        )
        self.norm = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, vocab)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        n = tokens.shape[1]
        h = self.tok(tokens) + self.pos(torch.arange(n, device=tokens.device))
        mask = nn.Transformer.generate_square_subsequent_mask(n, device=tokens.device, dtype=h.dtype)
        for block in self.blocks:
            h = block(h, src_mask=mask, is_causal=True)
        out: torch.Tensor = self.head(self.norm(h))
        return out


def batches(
    cfg: dict[str, int], batch: int, rank: int, device: torch.device, count: int = 4
) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(1000 + rank)
    out = []
    for _ in range(count):
        seq = [torch.randint(0, cfg["vocab"], (batch, 1), generator=g)]
        for _ in range(cfg["seq"]):
            seq.append((seq[-1] * 5 + 3) % cfg["vocab"])
        out.append(torch.cat(seq, dim=1).to(device))
    return out


def digest(params: list[torch.Tensor]) -> bytes:
    h = hashlib.sha256()
    for p in params:
        h.update(f"{p.dtype} {tuple(p.shape)};".encode())
        h.update(p.detach().contiguous().reshape(-1).view(torch.uint8).cpu().numpy().tobytes())
    return h.digest()


def same_everywhere(d: bytes, device: torch.device) -> list[int]:
    """The ranks whose digest differs from rank 0's (every rank learns it)."""
    mine = torch.frombuffer(bytearray(d), dtype=torch.uint8).to(device)
    world = dist.get_world_size()
    every = torch.empty(world * mine.numel(), dtype=torch.uint8, device=device)
    dist.all_gather_into_tensor(every, mine)
    rows = every.view(world, -1)
    return [r for r in range(world) if not torch.equal(rows[r], rows[0])]


def train(job: kitdist.Job, mode: str, cfg: dict[str, int], args: argparse.Namespace) -> dict[str, Any]:
    dev = job.device
    dtype = torch.bfloat16 if dev.type == "cuda" else torch.float32
    torch.manual_seed(0)  # the same initial weights on every rank
    model = TinyLM(cfg["vocab"], cfg["dim"], cfg["layers"], cfg["heads"], cfg["seq"]).to(
        device=dev, dtype=dtype
    )
    nparams = sum(p.numel() for p in model.parameters())
    net: nn.Module
    if mode == "fsdp":
        from torch.distributed.device_mesh import init_device_mesh  # noqa: PLC0415
        from torch.distributed.fsdp import fully_shard  # noqa: PLC0415

        mesh = init_device_mesh(dev.type, (job.world,))
        for block in model.blocks:
            fully_shard(block, mesh=mesh)
        fully_shard(model, mesh=mesh)
        net = model
    else:
        net = DDP(model, device_ids=[dev.index] if dev.type == "cuda" else None)
    opt = torch.optim.AdamW(net.parameters(), lr=1e-3)
    loss_fn = nn.CrossEntropyLoss()
    batch = args.batch or cfg["batch"]
    data = batches(cfg, batch, job.rank, dev)

    def step(i: int) -> torch.Tensor:
        seq = data[i % len(data)]
        logits = net(seq[:, :-1])
        loss: torch.Tensor = loss_fn(logits.float().reshape(-1, cfg["vocab"]), seq[:, 1:].reshape(-1))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        return loss.detach()

    def sync() -> None:
        if dev.type == "cuda":
            torch.cuda.synchronize(dev)

    first = step(0)
    for i in range(1, args.warmup):
        step(i)
    sync()
    marks = [time.perf_counter()]
    loss = first
    for i in range(args.steps):
        loss = step(args.warmup + i)
        sync()
        marks.append(time.perf_counter())
    elapsed = marks[-1] - marks[0]
    rate = batch * cfg["seq"] * args.steps / elapsed
    rates = torch.zeros(job.world, dtype=torch.float64, device=dev)
    rates[job.rank] = rate
    dist.all_reduce(rates)
    losses = torch.tensor(
        [float(first.float().item()), float(loss.float().item())], dtype=torch.float64, device=dev
    )
    dist.all_reduce(losses, op=dist.ReduceOp.AVG)
    full = [p.full_tensor() if hasattr(p, "full_tensor") else p for p in model.parameters()]
    differ = same_everywhere(digest(full), dev)
    finite = all(math.isfinite(x) for x in losses.tolist())
    row = {
        "schema": "gpubridge.kit-train/v1",
        "parallel": mode,
        "world": job.world,
        "device": dev.type,
        "gpu": torch.cuda.get_device_name(dev) if dev.type == "cuda" else None,
        "dtype": str(dtype).removeprefix("torch."),
        "size": args.size,
        "params": nparams,
        "batch_per_rank": batch,
        "seq": cfg["seq"],
        "warmup_steps": args.warmup,
        "steps": args.steps,
        "elapsed_s": round(elapsed, 4),
        "step_ms_median": round(statistics.median((b - a) * 1e3 for a, b in itertools.pairwise(marks)), 3),
        "tokens_per_s": round(sum(rates.tolist()), 1),
        "tokens_per_s_ranks": [round(x, 1) for x in rates.tolist()],
        "loss_first": losses[0].item(),
        "loss_last": losses[1].item(),
        "loss_finite": finite,
        "params_in_sync": not differ,
        "ranks_differing": differ,
        "simulated": bool(job.topo.get("simulated")),
        "run_kind": job.topo.get("run_kind"),
    }
    return row


def main() -> int:
    args = ARGS
    t0 = time.monotonic()
    job = kitdist.start(args.timeout)
    if args.size is None:
        args.size = "small" if job.device.type == "cuda" else "tiny"
    cfg = SIZES[args.size]
    rows = []
    for mode in args.parallel.split(","):
        row = train(job, mode, cfg, args)
        gc.collect()  # DDP's reducer must go before the group does (Gloo aborts otherwise)
        rows.append(row)
        if job.lead:
            emit(row)
            log(
                f"kit train {mode}: {row['world']} ranks on {row['device']}, {row['params'] / 1e6:.2f}M "
                f"params, {row['tokens_per_s']:,.0f} tokens/s, loss {row['loss_first']:.3f} -> "
                f"{row['loss_last']:.3f}, params in sync: {row['params_in_sync']}"
            )
    bad = [r for r in rows if not (r["params_in_sync"] and r["loss_finite"])]
    if job.lead:
        figures = "; ".join(
            f"{r['parallel']}: {r['tokens_per_s']:,.0f} tokens/s, loss {r['loss_first']:.2f} -> "
            f"{r['loss_last']:.2f}"
            for r in rows
        )
        size = f"{rows[0]['params'] / 1e6:.2f}M parameters"
        where = f"{job.world} ranks on {job.device.type}, {cfg['seq']}-token sequences, {size}"
        if bad:
            r = bad[0]
            why = (
                f"parameters differ on ranks {r['ranks_differing']}"
                if not r["params_in_sync"]
                else "the loss is not finite"
            )
            reason = f"{r['parallel']}: {why} ({where})"
        else:
            reason = f"{figures}; parameters identical on every rank ({where})"
            if job.device.type != "cuda":
                reason += "; GPU throughput not run (no GPUs: CPU figures)"
        emit(
            {
                "schema": "gpubridge.kit-train-summary/v1",
                "ok": not bad,
                "reason": reason,
                **job.summary(),
                "seconds": round(time.monotonic() - t0, 2),
            }
        )
    dist.destroy_process_group()
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(kitdist.run_main(main))
