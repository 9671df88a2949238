"""Correctness of the gpubridge backend on real GPUs (one rank of a torchrun
job; run by bench/gpu/plugin.sh with GPUBRIDGE_SPLIT_TEST=half).

This is a split test: every GPU is an NVIDIA H200, the ranks are labeled as
two vendors, so the islands are NCCL groups joined by gbbridge — the code path
of a mixed job, on one vendor's hardware.

argv: OUTDIR REFERENCE. REFERENCE is "nccl" (a world NCCL group on the same
data; possible when every rank has its own GPU) or "gloo" (a world Gloo group
on CPU copies of the same data; when two islands share the GPUs). Every rank
writes OUTDIR/check.<rank>.json.
"""

from __future__ import annotations

import json
import os
import sys
import time
import traceback
from pathlib import Path

import torch
import torch.distributed as dist

import gpubridge

# A torchrun worker: --help is the only thing it does outside torchrun.
if __name__ == "__main__" and sys.argv[1:2] in (["-h"], ["--help"]):
    print(__doc__)
    sys.exit(0)
rank = int(os.environ["RANK"])
outdir = Path(sys.argv[1])
reference = sys.argv[2]
DTYPES = [torch.float32, torch.float64, torch.bfloat16, torch.float16]
DTYPES += [torch.int32, torch.int64, torch.int8, torch.uint8]
OPS = [dist.ReduceOp.SUM, dist.ReduceOp.AVG, dist.ReduceOp.MAX, dist.ReduceOp.MIN]


def data(dtype: torch.dtype, n: int, seed: int, dev: torch.device) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    hi = {torch.int8: 10, torch.uint8: 10, torch.bfloat16: 50, torch.float16: 50}.get(dtype, 200)
    lo = 0 if dtype == torch.uint8 else -hi
    return torch.randint(lo, hi, (n,), generator=g).to(dtype).to(dev)


def same(a: torch.Tensor, b: torch.Tensor, what: str) -> None:
    a, b = a.cpu(), b.cpu()
    if not torch.equal(a.reshape(-1).view(torch.uint8), b.reshape(-1).view(torch.uint8)):
        raise AssertionError(f"rank {rank}: {what}: {a.reshape(-1)[:6]} != {b.reshape(-1)[:6]}")


class Ref:
    """The reference collectives: NCCL on the GPU tensors, or Gloo on CPU copies."""

    def __init__(self, kind: str) -> None:
        self.kind = kind
        self.group = dist.new_group(backend="nccl" if kind == "nccl" else "gloo")

    def _t(self, x: torch.Tensor) -> torch.Tensor:
        return x if self.kind == "nccl" else x.cpu()

    def all_reduce(self, x: torch.Tensor, op: object) -> torch.Tensor:
        y = self._t(x.clone())
        gop = dist.ReduceOp.SUM if op == dist.ReduceOp.AVG else op
        dist.all_reduce(y, op=gop, group=self.group)
        if op == dist.ReduceOp.AVG:
            y.div_(dist.get_world_size())
        return y

    def broadcast(self, x: torch.Tensor, root: int) -> torch.Tensor:
        y = self._t(x.clone())
        dist.broadcast(y, src=root, group=self.group)
        return y

    def all_gather(self, x: torch.Tensor, world: int) -> torch.Tensor:
        y = self._t(x.clone())
        out = torch.empty(world * y.numel(), dtype=y.dtype, device=y.device)
        dist.all_gather_into_tensor(out, y, group=self.group)
        return out


def main() -> int:
    t0 = time.monotonic()
    dist.init_process_group(backend="gpubridge")
    pg = dist.distributed_c10d._get_default_group()
    topo = gpubridge.get_topology()
    world = dist.get_world_size()
    dev = torch.device("cuda", torch.cuda.current_device())
    info: dict[str, object] = {
        "rank": rank,
        "device": str(dev),
        "run_kind": topo["run_kind"],
        "split_test": topo.get("split_test"),
        "islands": [(i["label"], i["ranks"], i["backend"]) for i in topo["islands"]],
        "bridge": topo["bridge"]["transport"],
        "init_s": round(time.monotonic() - t0, 2),
    }
    ref = Ref(reference)
    checks = 0
    for dtype in DTYPES:
        ops = [op for op in OPS if dtype.is_floating_point or op != dist.ReduceOp.AVG]
        for op in ops:
            for n in (1, 4097, 3 << 20):  # 3M elements: several copy chunks
                x = data(dtype, n, 1000 * rank + n, dev)
                want = ref.all_reduce(x, op)
                dist.all_reduce(x, op=op)
                same(x, want, f"all_reduce {dtype} {op} n={n}")
                checks += 1
            n = 1 << 16
            inp = data(dtype, n * world, 31 * rank + 5, dev)
            want = ref.all_reduce(inp, op)[rank * n : (rank + 1) * n]
            out = torch.empty(n, dtype=dtype, device=dev)
            dist.reduce_scatter_tensor(out, inp, op=op)
            same(out, want, f"reduce_scatter_tensor {dtype} {op}")
            checks += 1
        for root in range(world):
            x = data(dtype, 100003, 77 + rank, dev)
            want = ref.broadcast(x, root)
            dist.broadcast(x, src=root)
            same(x, want, f"broadcast {dtype} root {root}")
            checks += 1
        x = data(dtype, 50001, rank + 9, dev)
        want = ref.all_gather(x, world)
        out = torch.zeros(world * x.numel(), dtype=dtype, device=dev)
        dist.all_gather_into_tensor(out, x)
        same(out, want, f"all_gather_into_tensor {dtype}")
        outs = [torch.zeros_like(x) for _ in range(world)]
        dist.all_gather(outs, x)
        same(torch.cat(outs), want, f"all_gather {dtype}")
        checks += 2
    info["checks"] = checks
    info["checks_s"] = round(time.monotonic() - t0, 2)

    # Stream semantics: the value is written on the caller's stream after a
    # long sleep; the async all_reduce must see it, return at once, and not be
    # complete before the stream got there.
    x = torch.zeros(1 << 20, device=dev)
    torch.cuda.synchronize()
    torch.cuda._sleep(int(2e9))  # about a second of GPU time on the caller's stream
    x.fill_(float(rank + 1))
    t = time.monotonic()
    w = dist.all_reduce(x, async_op=True)
    call_ms = (time.monotonic() - t) * 1e3
    early = w.is_completed()
    time.sleep(0.05)
    flight = gpubridge.in_flight()
    w.wait()
    torch.cuda.current_stream().synchronize()
    same(x, torch.full_like(x, float(world * (world + 1) // 2)), "all_reduce after a busy stream")
    info["async"] = {
        "call_ms": round(call_ms, 3),
        "completed_at_once": early,
        "completed_after_wait": w.is_completed(),
        "in_flight_while_waiting": flight,
    }
    assert not early, "is_completed() was true while the caller's stream was still busy"
    assert call_ms < 100, f"the async call took {call_ms:.1f} ms"

    # DDP trains; every rank ends with the same parameters.
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.ReLU(), torch.nn.Linear(256, 8)).to(dev)
    ddp = torch.nn.parallel.DistributedDataParallel(model, device_ids=[dev.index])
    opt = torch.optim.SGD(ddp.parameters(), lr=0.05)
    g = torch.Generator(device=dev).manual_seed(rank)
    losses = []
    for _ in range(30):
        xb = torch.randn(32, 64, device=dev, generator=g)
        yb = xb[:, :8].sum(dim=1, keepdim=True).expand(-1, 8)
        loss = torch.nn.functional.mse_loss(ddp(xb), yb)
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    flat = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    gathered = torch.zeros(world * flat.numel(), device=dev)
    dist.all_gather_into_tensor(gathered, flat)
    for r in range(world):
        same(gathered[r * flat.numel() : (r + 1) * flat.numel()], flat, f"DDP parameters of rank {r}")
    info["ddp"] = {"loss_first": losses[0], "loss_last": losses[-1], "params_identical": True}

    # How many all_reduces this leader reduced on the GPU itself (the
    # exchange-and-add path, GPUBRIDGE_BRIDGE_REDUCE); 0 off the bridge.
    ep = getattr(pg, "_endpoint", None)
    info["exchanged"] = ep.exchanged if ep is not None else 0
    info["reduce_mode"] = os.environ.get("GPUBRIDGE_BRIDGE_REDUCE", "auto")
    dist.destroy_process_group()
    info["bridge_exit"] = getattr(pg, "bridge_exit", None)
    info["ok"] = True
    info["total_s"] = round(time.monotonic() - t0, 2)
    (outdir / f"check.{rank}.json").write_text(json.dumps(info, indent=1))
    return 0


if __name__ == "__main__":
    try:
        sys.exit(main())
    except Exception:
        err = {"rank": rank, "error": traceback.format_exc()}
        (outdir / f"check.{rank}.json").write_text(json.dumps(err))
        raise
