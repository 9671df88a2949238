"""A rank of the sample-weighted averaging job (run by torchrun from
test_weighted.py): one training step with uneven shares of a global batch
against the same step in one process over the same samples.

argv: VENDORS OUTDIR. VENDORS: a vendor per rank (GPUBRIDGE_VENDOR is set
from RANK before gpubridge initialises). Writes OUTDIR/rank<R>.json with
{"ok": true, "checks": {...}} or {"error": text}.

The checks:
- ``ddp_dyadic``: DDP with gpubridge.weighted_comm_hook, shares 8/4/2/2 of
  16, float64 on a dyadic grid (weights multiples of 1/16, inputs and
  targets small integers): every value of forward and backward, the weights
  n * m_r / B and the division by n are exact, so the reduced gradient and
  the parameters after one SGD step equal the single process's bit for bit.
- ``ddp_float32``: shares 7/5/3/1, random float32 data: the same within a
  relative error of 1e-6 of the gradient's largest element (the sums run in
  another order; float32's epsilon is 1.2e-7).
- ``ddp_unweighted``: the control, plain averaging with shares 8/4/2/2:
  far from the single process.
- ``ddp_accumulation``: two micro-batches per rank (the first under
  no_sync), each loss scaled by its share of the rank's samples: bit for bit.
- ``fsdp_dyadic``, ``fsdp_accumulation``: fully_shard with
  gpubridge.weighted_fsdp and losses scaled by SampleWeights.loss_scale:
  bit for bit.
- ``ddp_dyadic_zstd``: ``ddp_dyadic`` with the weighted hook handing the
  bucket to gpubridge.compressed_hook with zstd (lossless): bit for bit.
- ``ddp_fp8_feedback``, ``ddp_fp8_plain``: shares 7/5/3/1, float32, the
  weighted hook handing the weighted bucket to compressed_hook with fp8,
  with and without error feedback; the same batch's backward STEPS times
  without an optimizer step, so the exact gradient is the same every time.
  With error feedback what the steps applied in sum is within one
  quantization of STEPS times the exact gradient (the residuals telescope:
  the weights apply before quantizing, feedback works on the weighted
  bucket); without, each step loses the same, STEPS times over. err is
  max |sum - STEPS * g| / max |g|; digest: the SHA-256 of the sum's bytes,
  the same on every rank.
- ``sampler``: RebalancingSampler's plan exchange through the backend, with
  a stand-in meter reporting rates 2, 2, 1, 1: every rank's plan; and
  settings that differ (rank 2's global batch): the same error everywhere.
"""

import hashlib
import json
import os
import sys
import traceback
from contextlib import nullcontext
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.nn.parallel import DistributedDataParallel as DDP

rank = int(os.environ["RANK"])
vendors = sys.argv[1].split(",")
outdir = Path(sys.argv[2])
os.environ["GPUBRIDGE_VENDOR"] = vendors[rank]

import gpubridge  # noqa: E402

D_IN, HIDDEN, D_OUT, B = 8, 6, 4, 16


def make_model(dtype: torch.dtype, dyadic: bool) -> nn.Sequential:
    m = nn.Sequential(nn.Linear(D_IN, HIDDEN), nn.ReLU(), nn.Linear(HIDDEN, D_OUT)).to(dtype)
    g = torch.Generator().manual_seed(5)
    with torch.no_grad():
        for p in m.parameters():
            if dyadic:
                p.copy_(torch.randint(-16, 17, tuple(p.shape), generator=g).to(dtype) / 16)
            else:
                p.copy_(torch.randn(tuple(p.shape), generator=g, dtype=dtype))
    return m


def data(dtype: torch.dtype, dyadic: bool) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(9)
    if dyadic:
        x = torch.randint(-2, 3, (B, D_IN), generator=g).to(dtype)
        t = torch.randint(-3, 4, (B, D_OUT), generator=g).to(dtype)
    else:
        x = torch.randn(B, D_IN, generator=g, dtype=dtype)
        t = torch.randn(B, D_OUT, generator=g, dtype=dtype)
    return x, t


def reference(dtype: torch.dtype, dyadic: bool) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """One process, the whole global batch: its gradient and its parameters
    after one SGD step."""
    m = make_model(dtype, dyadic)
    x, t = data(dtype, dyadic)
    nn.functional.mse_loss(m(x), t).backward()  # type: ignore[no-untyped-call]
    grads = [p.grad.clone() for p in m.parameters()]  # type: ignore[union-attr]
    with torch.no_grad():
        for p in m.parameters():
            p.sub_(p.grad * 2.0**-4)  # type: ignore[operator]
    return grads, [p.detach().clone() for p in m.parameters()]


def my_slice(shares: list[int]) -> slice:
    off = sum(shares[:rank])
    return slice(off, off + shares[rank])


def full(t: torch.Tensor) -> torch.Tensor:
    f = getattr(t, "full_tensor", None)
    return f() if f is not None else t


def distributed(
    kind: str,
    shares: list[int],
    dtype: torch.dtype,
    dyadic: bool,
    micro: int,
    weighted: bool = True,
    codec: str | None = None,
) -> dict[str, Any]:
    """One step on this rank's share (micro micro-batches), through DDP with
    the weighted hook or FSDP with weighted_fsdp; compared with the single
    process."""
    model = make_model(dtype, dyadic)
    x, t = data(dtype, dyadic)
    x, t = x[my_slice(shares)], t[my_slice(shares)]
    weights = gpubridge.SampleWeights()
    if codec is not None:  # the weighted bucket goes to a compressing hook
        weights = gpubridge.SampleWeights(hook=gpubridge.compressed_hook,
                                          hook_state=gpubridge.CompressionState(codec=codec))  # fmt: skip
    weights.set(len(x), B)
    if kind == "ddp":
        wrapped: nn.Module = DDP(model)
        if weighted:
            wrapped.register_comm_hook(weights, gpubridge.weighted_comm_hook)
        else:  # the control: plain averaging, which uneven shares get wrong
            wrapped.register_comm_hook(None, gpubridge.ddp_comm_hook)
    else:
        mesh = init_device_mesh("cpu", (dist.get_world_size(),))
        for layer in model:
            if isinstance(layer, nn.Linear):
                fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)
        gpubridge.weighted_fsdp(model)
        wrapped = model
    parts = list(zip(x.chunk(micro), t.chunk(micro), strict=True))
    for i, (xm, tm) in enumerate(parts):
        last = i == len(parts) - 1
        if kind == "ddp":
            ctx: Any = nullcontext() if last else wrapped.no_sync()  # type: ignore[operator]
            scale = len(xm) / len(x)  # the micro-batch's part of the rank's mean
        else:
            wrapped.set_requires_gradient_sync(last)  # type: ignore[operator]
            ctx, scale = nullcontext(), weights.loss_scale(len(xm))
        with ctx:
            (nn.functional.mse_loss(wrapped(xm), tm) * scale).backward()  # type: ignore[no-untyped-call]
    grads = [full(p.grad) for p in model.parameters()]  # type: ignore[arg-type]
    with torch.no_grad():
        for p in model.parameters():
            p.sub_(p.grad * 2.0**-4)  # type: ignore[operator]
    params = [full(p.detach()) for p in model.parameters()]
    want_g, want_p = reference(dtype, dyadic)
    exact = all(torch.equal(a, b) for a, b in zip(grads, want_g, strict=True)) and all(
        torch.equal(a, b) for a, b in zip(params, want_p, strict=True)
    )
    top = max(float(g.abs().max()) for g in want_g)
    err = max(float((a - b).abs().max()) for a, b in zip(grads, want_g, strict=True)) / top
    return {"bit_exact": exact, "rel_err": err}


STEPS = 8


def fp8_feedback(feedback: bool) -> dict[str, Any]:
    """The weighted hook over compressed_hook(fp8): STEPS backward passes of
    one batch (no optimizer step), their gradients summed in float64,
    against STEPS times the single process's gradient."""
    shares = [7, 5, 3, 1]
    model = make_model(torch.float32, False)
    x, t = data(torch.float32, False)
    x, t = x[my_slice(shares)], t[my_slice(shares)]
    state = gpubridge.CompressionState(codec="fp8", error_feedback=feedback)
    weights = gpubridge.SampleWeights(hook=gpubridge.compressed_hook, hook_state=state)
    weights.set(len(x), B)
    wrapped = DDP(model)
    wrapped.register_comm_hook(weights, gpubridge.weighted_comm_hook)
    total = [torch.zeros(p.shape, dtype=torch.float64) for p in model.parameters()]
    for _ in range(STEPS):
        model.zero_grad(set_to_none=True)
        nn.functional.mse_loss(wrapped(x), t).backward()  # type: ignore[no-untyped-call]
        for acc, p in zip(total, model.parameters(), strict=True):
            acc += p.grad.double()  # type: ignore[union-attr]
    want, _ = reference(torch.float32, False)
    top = max(float(g.abs().max()) for g in want)
    err = max(float((a - STEPS * g.double()).abs().max()) for a, g in zip(total, want, strict=True)) / top
    h = hashlib.sha256()
    for a in total:
        h.update(a.numpy().tobytes())
    return {"err": err, "digest": h.hexdigest()}


class FixedMeter:
    """Stands in for the sampler's meter: a fixed rate."""

    def __init__(self, rate: float) -> None:
        self.rate = rate

    def take(self) -> Any:
        return type("M", (), {"steps": 4, "samples": 16, "rate": self.rate})()


def sampler_checks() -> dict[str, Any]:
    s = gpubridge.RebalancingSampler(128, B, replan_every=4, seed=1)
    gpubridge.remove_observer(s.meter)
    s.meter = FixedMeter([2.0, 2.0, 1.0, 1.0][rank])  # type: ignore[assignment]
    batches = list(s)
    out: dict[str, Any] = {"plans": s.plans, "batches": batches}
    bad = gpubridge.RebalancingSampler(128, B if rank != 2 else 20, rebalance=False)
    try:
        list(bad)
        out["mismatch"] = "not refused"
    except RuntimeError as e:
        out["mismatch"] = str(e)
    return out


result: dict[str, Any] = {"rank": rank}
try:
    dist.init_process_group(backend="gpubridge")
    f64, f32 = torch.float64, torch.float32
    result["checks"] = {
        "ddp_dyadic": distributed("ddp", [8, 4, 2, 2], f64, True, 1),
        "ddp_float32": distributed("ddp", [7, 5, 3, 1], f32, False, 1),
        "ddp_unweighted": distributed("ddp", [8, 4, 2, 2], f64, True, 1, weighted=False),
        "ddp_accumulation": distributed("ddp", [8, 4, 2, 2], f64, True, 2),
        "fsdp_dyadic": distributed("fsdp", [8, 4, 2, 2], f64, True, 1),
        "fsdp_accumulation": distributed("fsdp", [8, 4, 2, 2], f64, True, 2),
        "ddp_dyadic_zstd": distributed("ddp", [8, 4, 2, 2], f64, True, 1, codec="zstd"),
        "ddp_fp8_feedback": fp8_feedback(True),
        "ddp_fp8_plain": fp8_feedback(False),
    }
    result["sampler"] = sampler_checks()
    dist.barrier()
    dist.destroy_process_group()
    result["ok"] = True
except Exception as e:
    result["error"] = f"{e}\n{traceback.format_exc()}"
(outdir / f"rank{rank}.json").write_text(json.dumps(result))
sys.exit(0 if result.get("ok") else 1)
