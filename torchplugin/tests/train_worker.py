"""A rank of a training job over the gpubridge backend (run by torchrun from
test_training.py).

argv: VENDORS OUTDIR VARIANTS [STEPS]. VENDORS is a comma-separated vendor
per rank (GPUBRIDGE_VENDOR is set from RANK before gpubridge initialises);
VARIANTS a comma-separated list of ``ddp`` (DistributedDataParallel as it
comes), ``hook`` (DDP with ``gpubridge.ddp_comm_hook``) and ``fsdp``
(``fully_shard`` on a DeviceMesh over the gpubridge world group).

Each variant trains the same model twice in this job: over the gpubridge
world group and over a plain Gloo group (``dist.new_group(backend="gloo")``;
for ``hook`` with the equivalent Gloo hook: sum, then divide once). Every rank
then checks, through the Gloo group, that its final parameters are identical
bit for bit to the Gloo run's and to every other rank's, and writes
OUTDIR/rank<R>.json: {"ok": true, "variants": {...}} or {"error": text}.

Why bit-exact comparisons hold whatever order the ranks' gradients are summed
in: the model is float64, the data and the teacher's targets are small
integers, the weights start on a 2**-5 grid and are put back on it (rounded,
clamped to [-1, 1]) after every SGD step (lr 2**-6), and the loss is a mean
over 8 x 4 = 32 elements. Every forward and backward value is then a dyadic
rational of a few dozen significant bits (checked at every step: a multiple
of 2**-GRAD_GRID below 2**GRAD_MAX_LOG2), far inside float64's 53, so every
partial sum of the gradient reductions is exact, and so are the divisions by
the world size (a power of two). Two runs agree bit for bit exactly when
every reduction they made delivered the exact result.
"""

import hashlib
import json
import os
import sys
import time
import traceback
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.nn.parallel import DistributedDataParallel as DDP

rank = int(os.environ["RANK"])
vendors = sys.argv[1].split(",")
outdir = Path(sys.argv[2])
variants = [v for v in sys.argv[3].split(",") if v]
STEPS = int(sys.argv[4]) if len(sys.argv) > 4 else 12
# VENDOR or VENDOR:NAME (the simulated island VENDOR-NAME, for three islands)
os.environ["GPUBRIDGE_VENDOR"], _, _island = vendors[rank].partition(":")
if _island:
    os.environ["GPUBRIDGE_SIM_ISLAND"] = _island

import gpubridge  # noqa: E402  (registers the backend)

D_IN, HIDDEN, D_OUT, BATCH = 16, 30, 4, 8  # HIDDEN 30: uneven FSDP shards over 4 ranks
GRID = 32  # weights are multiples of 1/GRID in [-1, 1]
LR = 2.0**-6
GRAD_GRID = 40  # every gradient is a multiple of 2**-GRAD_GRID ...
GRAD_MAX_LOG2 = 12  # ... below 2**GRAD_MAX_LOG2 in magnitude: 52 bits at most


def on_grid(shape: tuple[int, ...], g: torch.Generator) -> torch.Tensor:
    return torch.randint(-GRID // 2, GRID // 2 + 1, shape, generator=g).double() / GRID


def make_model() -> nn.Sequential:
    """The same weights on every rank and in every run."""
    m = nn.Sequential(
        nn.Linear(D_IN, HIDDEN),
        nn.ReLU(),
        nn.Linear(HIDDEN, HIDDEN),
        nn.ReLU(),
        nn.Linear(HIDDEN, D_OUT),
    ).double()
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for p in m.parameters():
            p.copy_(on_grid(tuple(p.shape), g))
    return m


TEACHER = nn.Sequential(nn.Linear(D_IN, 24), nn.ReLU(), nn.Linear(24, D_OUT)).double()
with torch.no_grad():
    _g = torch.Generator().manual_seed(2)
    for _p in TEACHER.parameters():
        _p.copy_(on_grid(tuple(_p.shape), _g))


def batch(step: int, r: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Rank r's batch of step `step`: small integers, integer targets."""
    g = torch.Generator().manual_seed(1000 * step + r)
    x = torch.randint(-2, 3, (BATCH, D_IN), generator=g).double()
    with torch.no_grad():
        t = torch.round(TEACHER(x))
    return x, t


def local(t: torch.Tensor) -> torch.Tensor:
    """The rank's own part of a (possibly sharded) tensor."""
    to_local = getattr(t, "to_local", None)
    return to_local() if to_local is not None else t


def check_exact(model: nn.Module, what: str, step: int) -> None:
    """The premise of the bit-exact comparison (see the module docstring)."""
    for name, p in model.named_parameters():
        if p.grad is None:
            continue
        gr = local(p.grad)
        scaled = gr * 2.0**GRAD_GRID
        if not torch.equal(scaled, torch.round(scaled)) or bool(gr.abs().max() >= 2.0**GRAD_MAX_LOG2):
            raise AssertionError(
                f"rank {rank}: {what} step {step}: gradient of {name} leaves the exact range "
                f"(max |g| {gr.abs().max().item()}): the test's premise broke, not the backend"
            )


def full_params(model: nn.Module) -> torch.Tensor:
    """Every parameter, whole (FSDP's are all-gathered over the model's own
    group), as one float64 vector."""
    parts = []
    for p in model.parameters():
        full = p.full_tensor() if hasattr(p, "full_tensor") else p
        parts.append(full.detach().reshape(-1))
    return torch.cat(parts)


def train(model: nn.Module, what: str) -> tuple[torch.Tensor, list[float], float]:
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    losses = []
    t0 = time.perf_counter()
    for step in range(STEPS):
        x, t = batch(step, rank)
        opt.zero_grad(set_to_none=True)
        loss = nn.functional.mse_loss(model(x), t)
        loss.backward()  # type: ignore[no-untyped-call]
        check_exact(model, what, step)
        opt.step()
        with torch.no_grad():
            for p in model.parameters():
                p.mul_(GRID).round_().clamp_(-GRID, GRID).div_(GRID)
        losses.append(loss.item())
    secs = time.perf_counter() - t0
    return full_params(model), losses, secs


def gloo_avg_hook(
    group: dist.ProcessGroup,
    bucket: dist.GradBucket,  # type: ignore[name-defined]
) -> torch.futures.Future[torch.Tensor]:
    """The Gloo counterpart of gpubridge.ddp_comm_hook: sum, then divide once.

    (DDP compares a hook's annotations with dist.GradBucket and
    Future[Tensor]: this module has no ``from __future__ import annotations``,
    which would make them strings that DDP refuses.)"""
    world = group.size()
    work = dist.all_reduce(bucket.buffer(), group=group, async_op=True)
    assert work is not None
    fut: torch.futures.Future[torch.Tensor] = work.get_future().then(lambda f: f.value()[0].div_(world))
    return fut


def run(variant: str, group: dist.ProcessGroup | None) -> nn.Module:
    """The variant's model, wrapped over `group` (None: the gpubridge world)."""
    model = make_model()
    if variant in ("ddp", "hook"):
        ddp = DDP(model, process_group=group)
        if variant == "hook":
            if group is None:
                ddp.register_comm_hook(state=None, hook=gpubridge.ddp_comm_hook)
            else:
                ddp.register_comm_hook(state=group, hook=gloo_avg_hook)
        return ddp
    if variant == "fsdp":
        if group is None:  # as a user would: the world mesh is the default (gpubridge) group
            mesh = init_device_mesh("cpu", (dist.get_world_size(),))
            assert dist.get_backend(mesh.get_group()) == "gpubridge", dist.get_backend(mesh.get_group())
        else:
            mesh = DeviceMesh.from_group(group, "cpu")
        for layer in model:
            if isinstance(layer, nn.Linear):
                fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)
        return model
    raise ValueError(f"unknown variant {variant!r}")


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.int64)


def digest(t: torch.Tensor) -> str:
    return hashlib.sha256(t.contiguous().view(torch.uint8).numpy().tobytes()).hexdigest()[:16]


def same_everywhere(vec: torch.Tensor, gloo: dist.ProcessGroup, what: str) -> None:
    """vec is identical bit for bit on every rank (compared through Gloo)."""
    world = dist.get_world_size(gloo)
    got = [torch.empty_like(vec) for _ in range(world)]
    dist.all_gather(got, vec, group=gloo)
    for r, other in enumerate(got):
        if not torch.equal(bits(other), bits(vec)):
            n = int((bits(other) != bits(vec)).sum())
            raise AssertionError(f"rank {rank}: {what}: parameters differ from rank {r}'s in {n} elements")


def main() -> int:
    try:
        dist.init_process_group(backend="gpubridge")
    except RuntimeError as e:
        (outdir / f"rank{rank}.json").write_text(json.dumps({"error": str(e)}))
        return 3
    assert dist.get_backend() == "gpubridge", dist.get_backend()
    pg = dist.distributed_c10d._get_default_group()
    bridge = getattr(pg, "_endpoint", None)
    bridge_pid = bridge.process.proc.pid if bridge is not None else None
    gloo = dist.new_group(backend="gloo")
    out: dict[str, Any] = {}
    for variant in variants:
        ours, losses, secs = train(run(variant, None), f"{variant}/gpubridge")
        ref, ref_losses, ref_secs = train(run(variant, gloo), f"{variant}/gloo")
        if not torch.equal(bits(ours), bits(ref)):
            n = int((bits(ours) != bits(ref)).sum())
            raise AssertionError(
                f"rank {rank}: {variant}: parameters after {STEPS} steps differ from the Gloo run's "
                f"in {n} of {ours.numel()} elements"
            )
        if losses != ref_losses:
            raise AssertionError(f"rank {rank}: {variant}: losses differ: {losses} vs Gloo {ref_losses}")
        same_everywhere(ours, gloo, variant)
        out[variant] = {
            "digest": digest(ours),
            "gloo_digest": digest(ref),
            "params": ours.numel(),
            "losses": losses,
            "seconds": round(secs, 3),
            "gloo_seconds": round(ref_secs, 3),
        }
    dist.barrier()
    dist.destroy_process_group()
    info = {"bridge_pid": bridge_pid, "bridge_exit": getattr(pg, "bridge_exit", None)}
    (outdir / f"rank{rank}.json").write_text(json.dumps({"ok": True, "variants": out, **info}))
    return 0


if __name__ == "__main__":
    try:
        sys.exit(main())
    except Exception:
        (outdir / f"rank{rank}.json").write_text(json.dumps({"error": traceback.format_exc()}))
        raise
