"""DDP (or FSDP2 / HSDP: --parallel) training throughput of the small LLaMA (bench/gpu/llama.py) over a
torch.distributed backend (issue 4), one torchrun worker per rank, the device
cuda:LOCAL_RANK.

Usage:
    torchrun ... bench/gpu/plugin_train.py BACKEND OUT.jsonl [--comm-hook] [--batch 16] [--seq 1024]
        [--warmup 5] [--steps 30] [--tiny] [--device cuda|cpu]

BACKEND: "nccl" (all-NCCL DDP, the reference) or "gpubridge" (on CUDA the
split test: GPUBRIDGE_SPLIT_TEST defaults to "half", so with 2 ranks every
gradient bucket crosses the bridge; on --device cpu, simulation with
GPUBRIDGE_VENDOR nvidia for the first half of the ranks and amd for the
rest). On --device cpu, "nccl" means Gloo (a smoke test of the logic).

The model's parameters are bf16 (so are the gradients DDP all-reduces), the
optimiser AdamW; every rank draws its own synthetic tokens from a seeded
generator. --comm-hook registers gpubridge.ddp_comm_hook when the package has
it (the row says whether it was used). After warm-up, the timed steps run
back to back; tokens/s per rank = batch * seq * steps / time, and the row
holds every rank's rate and their sum. At the end every rank hashes the bytes
of all its parameters (SHA-256, whole tensors) and the ranks compare the
digests: "params_in_sync" is true only when every byte of every parameter is
the same on every rank (DDP must keep them identical).

Rank 0 appends one JSON line (schema gpubridge.plugin-train/v1) to OUT.jsonl
and prints a summary on stderr.
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import hashlib
import importlib
import itertools
import json
import os
import socket
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
from llama import Config, Llama, count_parameters, loss_of, synthetic_batches

SCHEMA = "gpubridge.plugin-train/v1"

os.environ["NCCL_NVLS_ENABLE"] = "0"
os.environ["TORCH_SYMM_MEM_DISABLE_MULTICAST"] = "1"
os.environ["NVSHMEM_DISABLE_NVLS"] = "1"


def main() -> int:
    p = argparse.ArgumentParser(description="DDP tokens/s of a small LLaMA over nccl or gpubridge")
    p.add_argument("backend", choices=("nccl", "gpubridge"))
    p.add_argument("out", help="JSON lines file rank 0 appends to")
    p.add_argument("--comm-hook", action="store_true", help="register gpubridge.ddp_comm_hook if it exists")
    p.add_argument("--batch", type=int, default=16, help="sequences per rank per step")
    p.add_argument("--seq", type=int, default=0, help="sequence length (0: the config's)")
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--bucket-mb", type=float, default=25.0, help="DDP bucket_cap_mb")
    p.add_argument(
        "--parallel", choices=("ddp", "fsdp", "hsdp"), default="ddp",
        help="DDP, FSDP2 over every rank, or HSDP with the islands as shard groups",
    )  # fmt: skip
    p.add_argument("--tiny", action="store_true", help="the tiny config (CPU smoke tests)")
    p.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    p.add_argument("--timeout", type=int, default=300, help="seconds, for the process group")
    args = p.parse_args()

    rank = int(os.environ["RANK"])
    world = int(os.environ["WORLD_SIZE"])
    local = int(os.environ.get("LOCAL_RANK", "0"))
    cuda = args.device == "cuda"
    device = torch.device("cuda", local) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)

    gb: Any = None
    if args.backend == "gpubridge":
        if cuda:
            os.environ.setdefault("GPUBRIDGE_SPLIT_TEST", "half")
        else:
            os.environ.setdefault("GPUBRIDGE_VENDOR", "nvidia" if rank < world // 2 else "amd")
        gb = importlib.import_module("gpubridge")
        backend = "gpubridge"
    else:
        backend = "nccl" if cuda else "gloo"
    dist.init_process_group(backend=backend, timeout=timedelta(seconds=args.timeout))

    row = train(args, gb, rank, world, device)
    row.update(
        {
            "backend": args.backend,
            "process_group_backend": backend,
            "split_test": os.environ.get("GPUBRIDGE_SPLIT_TEST") if args.backend == "gpubridge" else None,
            "commit": os.environ.get("GB_COMMIT", "unknown"),
            "host": socket.gethostname(),
            "torch": torch.__version__,
        }
    )
    if rank == 0:
        with open(args.out, "a") as f:
            f.write(json.dumps(row) + "\n")
        print(
            f"plugin_train {args.backend} (hook: {row['comm_hook']}): {world} ranks, "
            f"{row['params'] / 1e6:.1f}M params, batch {args.batch}x{row['seq']}: "
            f"{row['tokens_per_s_total']:,.0f} tokens/s total, {row['tokens_per_s_rank0']:,.0f} on rank 0, "
            f"step {row['step_ms_median']:.1f} ms median, params in sync: {row['params_in_sync']}, "
            f"loss {row['last_loss_max']:.3f}",
            file=sys.stderr,
        )
    # DDP's reducer is gone with train()'s frame; collect it before the group
    # goes (Gloo aborts the process otherwise).
    gc.collect()
    dist.destroy_process_group()
    return 0 if row["params_in_sync"] else 1


def shard(model: Llama, parallel: str, device: torch.device, world: int) -> Any:
    """FSDP2 over every rank (fsdp), or HSDP (hsdp) with a (2, world/2) mesh:
    the shard groups are the rows, ranks [0, w/2) and [w/2, w) — the two
    islands of a split test (GPUBRIDGE_SPLIT_TEST=half), so sharding stays
    inside an island on its native library — and the replicate groups are the
    columns {i, i + w/2}, whose all_reduce is the only traffic that crosses
    the bridge."""
    from torch.distributed.device_mesh import init_device_mesh  # noqa: PLC0415
    from torch.distributed.fsdp import fully_shard  # noqa: PLC0415

    if parallel == "hsdp":
        if world % 2:
            raise SystemExit("hsdp needs an even number of ranks")
        mesh = init_device_mesh(device.type, (2, world // 2), mesh_dim_names=("replicate", "shard"))
    else:
        mesh = init_device_mesh(device.type, (world,))
    for block in model.blocks:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model


def train(args: argparse.Namespace, gb: Any, rank: int, world: int, device: torch.device) -> dict[str, Any]:
    cuda = device.type == "cuda"
    cfg = Config.tiny() if args.tiny else Config()
    if args.seq:
        cfg = dataclasses.replace(cfg, seq=args.seq)
    torch.manual_seed(0)
    model = Llama(cfg).to(device=device, dtype=torch.bfloat16)
    nparams = count_parameters(model)
    hook_used = "none"
    if args.parallel != "ddp":
        ddp = shard(model, args.parallel, device, world)
        if args.comm_hook:
            hook_used = f"not applicable ({args.parallel})"
    else:
        ddp = DDP(
            model,
            device_ids=[device.index] if cuda else None,
            bucket_cap_mb=args.bucket_mb,
            gradient_as_bucket_view=True,
        )
    if args.comm_hook and gb is None:
        hook_used = "not applicable (backend is not gpubridge)"
    elif args.comm_hook and args.parallel == "ddp":
        hook = getattr(gb, "ddp_comm_hook", None)
        if hook is None:
            hook_used = "asked for, but gpubridge has no ddp_comm_hook"
        else:
            try:
                ddp.register_comm_hook(None, hook)
                hook_used = "gpubridge.ddp_comm_hook"
            except (ValueError, TypeError, RuntimeError) as e:
                # The same on every rank: go on with DDP's own all_reduce, and say so.
                hook_used = f"refused by DDP ({e}); ran without it"
    opt = torch.optim.AdamW(ddp.parameters(), lr=3e-4, weight_decay=0.0)
    batches = synthetic_batches(cfg, args.batch, 4, seed=1000 + rank, device=device)

    def sync() -> None:
        if cuda:
            torch.cuda.synchronize(device)

    def step(i: int) -> torch.Tensor:
        inputs, targets = batches[i % len(batches)]
        loss = loss_of(ddp, inputs, targets)
        torch.autograd.backward(loss)
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss.detach()

    def new_event() -> Any:
        make: Any = torch.cuda.Event  # untyped in torch
        ev = make(enable_timing=True)
        ev.record()
        return ev

    t_start = time.perf_counter()
    for i in range(args.warmup):
        step(i)
    sync()
    warmup_s = time.perf_counter() - t_start
    marks: list[Any] = []
    cpu_marks: list[float] = []
    loss = torch.zeros((), device=device)
    pg_stats = getattr(dist.distributed_c10d._get_default_group(), "stats", None)
    stats_before = pg_stats() if callable(pg_stats) else None
    t0 = time.perf_counter()
    for i in range(args.warmup, args.warmup + args.steps):
        if cuda:
            marks.append(new_event())
        else:
            cpu_marks.append(time.perf_counter())
        loss = step(i)
    if cuda:
        marks.append(new_event())
    sync()
    elapsed = time.perf_counter() - t0
    stats_after = pg_stats() if callable(pg_stats) else None
    if cuda:
        step_ms = [a.elapsed_time(b) for a, b in itertools.pairwise(marks)]
    else:
        cpu_marks.append(time.perf_counter())
        step_ms = [(b - a) * 1e3 for a, b in itertools.pairwise(cpu_marks)]

    tokens = args.batch * cfg.seq * args.steps
    rate = tokens / elapsed
    # Every rank's rate (a SUM of one-hot vectors needs only all_reduce), and
    # the digest of its parameters' bytes.
    # FSDP/HSDP parameters are DTensor shards: compare the whole tensors.
    full = [p.detach().full_tensor() if hasattr(p, "full_tensor") else p.detach() for p in model.parameters()]
    digest = param_digest(full)
    vec = torch.zeros(world, dtype=torch.float64, device=device)
    vec[rank] = rate
    dist.all_reduce(vec)
    rates = [float(x) for x in vec.tolist()]
    in_sync = same_on_every_rank(digest, device)
    last_loss = torch.tensor([float(loss.float().item())], dtype=torch.float64, device=device)
    dist.all_reduce(last_loss, op=dist.ReduceOp.MAX)

    # Model FLOPs per token: 6 per parameter (forward + backward) plus attention's
    # 12 * layers * seq * dim (causal: half of that is wasted, counted anyway).
    flops_per_token = 6 * nparams + 12 * cfg.layers * cfg.seq * cfg.dim
    row: dict[str, Any] = {
        "schema": SCHEMA,
        "world": world,
        "device": device.type,
        "params": nparams,
        "config": dataclasses.asdict(cfg),
        "dtype": "bfloat16",
        "batch_per_rank": args.batch,
        "seq": cfg.seq,
        "bucket_cap_mb": args.bucket_mb,
        "parallel": args.parallel,
        "comm_hook": hook_used,
        "warmup_steps": args.warmup,
        "steps": args.steps,
        "warmup_s": warmup_s,
        "elapsed_s": elapsed,
        "step_ms_median": statistics.median(step_ms),
        "step_ms_min": min(step_ms),
        "step_ms_max": max(step_ms),
        "tokens_per_s_rank0": rate,
        "tokens_per_s_ranks": rates,
        "tokens_per_s_total": sum(rates),
        "model_tflops_per_rank": min(rates) * flops_per_token / 1e12,
        "last_loss_max": float(last_loss[0].item()),
        "params_in_sync": in_sync,
        "params_compared": "sha256 of every parameter's bytes, on every rank",
        "param_sha256": digest.hex(),
    }
    if stats_after is not None:
        # the backend's host-side time per step over the timed steps
        row["backend_stats"] = {"before": stats_before, "after": stats_after}
    if cuda:
        row["gpu"] = torch.cuda.get_device_name(device)
        row["max_memory_gib"] = torch.cuda.max_memory_allocated(device) / 2**30
    return row


def param_digest(params: list[torch.Tensor]) -> bytes:
    """SHA-256 of the parameters' bytes, in order (with each one's dtype and
    shape, so that a reshaped tensor cannot match)."""
    h = hashlib.sha256()
    for p in params:
        h.update(f"{p.dtype} {tuple(p.shape)};".encode())
        h.update(p.detach().contiguous().reshape(-1).view(torch.uint8).cpu().numpy().tobytes())
    return h.digest()


def same_on_every_rank(digest: bytes, device: torch.device) -> bool:
    """Whether every rank holds this digest: the digest as 56-bit words d, and
    MAX over the ranks of (d, -d) gives the largest and minus the smallest of
    each word; they agree iff every rank's word is the same."""
    words = [int.from_bytes(digest[i : i + 7], "little") for i in range(0, len(digest), 7)]
    t = torch.tensor(words + [-w for w in words], dtype=torch.int64, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    v = [int(x) for x in t.tolist()]
    return v[: len(words)] == [-x for x in v[len(words) :]]


if __name__ == "__main__":
    sys.exit(main())
