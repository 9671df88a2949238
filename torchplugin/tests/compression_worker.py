"""A rank of a compression test job (run by torchrun from test_compression.py).

argv: VENDORS OUTDIR MODE. VENDORS: a vendor per rank (VENDOR:NAME puts the
rank in the simulated island VENDOR-NAME). Writes OUTDIR/rank<R>.json:
{"ok": true, ...} or {"error": text}. Modes:

- ``exchange`` (2+2): the job compresses with fp8 (GPUBRIDGE_COMPRESSION).
  Keyed compressed all_reduces (fp8, bf16; float32, bfloat16, float16) over
  several steps with error feedback, once with the leaders reducing on the
  GPU path (their endpoints' reduce_mode "caller", on CPU tensors) and once
  in gbbridge ("host"), against a reference computed here from
  gpubridge._codec; plain all_reduces (no key) compressed without feedback;
  MAX, MIN, integers, broadcast and all_gather exact against Gloo; zstd
  against the exact sum; the records' codecs and the bytes that crossed the
  bridge; the residuals freed with the group.
- ``ring`` (three islands): fp8 and bf16 all_reduces through gbbridge's
  ring: identical on every rank and within COMPRESSION.md's error bound.
- ``native``: set-up failures (GPUBRIDGE_COMPRESSION differing between
  ranks, and a value that is no compression) on groups made in turn, then
  the native API's per-call override with a feedback key.
- ``accuracy`` (2+2): one model trained four times with DDP (see
  :func:`accuracy`): exact, fp8 with error feedback (in gbbridge, and on
  the leaders' GPU path), fp8 without; the loss curves, the weights'
  digests and the bytes that crossed the bridge.
"""

from __future__ import annotations

import datetime
import hashlib
import json
import os
import sys
import traceback
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

rank = int(os.environ["RANK"])
world = int(os.environ["WORLD_SIZE"])
vendors = sys.argv[1].split(",")
outdir = Path(sys.argv[2])
mode = sys.argv[3]
os.environ["GPUBRIDGE_VENDOR"], _, _island = vendors[rank].partition(":")
if _island:
    os.environ["GPUBRIDGE_SIM_ISLAND"] = _island

import gpubridge  # noqa: E402
from gpubridge import _codec  # noqa: E402
from gpubridge._group import GpubridgeProcessGroup  # noqa: E402

STEPS = 3
N = 5000  # values: whole groups of 1024 and a short one


def data(seed: int, dtype: torch.dtype, n: int = N) -> torch.Tensor:
    """Gradient-like values: 8 decades of magnitudes in each 32-block (what
    fp8 quantizes coarsely at the bottom, and error feedback carries on)."""
    g = torch.Generator().manual_seed(seed)
    scale = torch.logspace(-6, 2, 32).repeat(-(-n // 32))[:n]
    return (torch.randn(n, generator=g) * scale).to(dtype)


def digest(t: torch.Tensor) -> str:
    return hashlib.sha256(t.contiguous().view(-1).view(torch.uint8).numpy().tobytes()).hexdigest()


def same_bits(a: torch.Tensor, b: torch.Tensor, what: str) -> None:
    if not torch.equal(a.reshape(-1).view(torch.uint8), b.reshape(-1).view(torch.uint8)):
        bad = (a.float() != b.float()).nonzero()[:4].view(-1).tolist()
        raise AssertionError(f"rank {rank}: {what}: differ at {bad}: {a.view(-1)[bad]} vs {b.view(-1)[bad]}")


_ENC = {
    "fp8": (_codec.mxfp8_encode, _codec.mxfp8_encode_feedback, _codec.mxfp8_decode, _codec.mxfp8_decode_add),
    "bf16": (_codec.bf16_encode, _codec.bf16_encode_feedback, _codec.bf16_decode, _codec.bf16_decode_add),
}


class Reference:
    """What every rank ends with in a two-island compressed all_reduce
    (COMPRESSION.md): each island's exact partial, quantized by its leader
    (with the residual of the call's key), dec(q0) + dec(q1) in float32,
    member 0's first, then the dtype. Computed from every rank's input."""

    def __init__(self, islands: list[list[int]], codec: str) -> None:
        self.islands = islands  # ranks of each bridge member's island, in member order
        self.codec = codec
        self.residuals: dict[Any, list[torch.Tensor]] = {}

    def result(self, inputs: list[torch.Tensor], key: Any) -> torch.Tensor:
        enc, enc_fb, dec, dec_add = _ENC[self.codec]
        n, dtype = inputs[0].numel(), inputs[0].dtype
        partials = []
        for ranks in self.islands:
            # an island's exact sum (two ranks: one rounding, in any order)
            p = inputs[ranks[0]].float()
            for r in ranks[1:]:
                p = p + inputs[r].float()
            partials.append(p.to(dtype) if len(ranks) > 1 else inputs[ranks[0]])
        if key is None:
            qs = [enc(p) for p in partials]
        else:
            rs = self.residuals.setdefault(key, [torch.zeros(n) for _ in partials])
            qs = [enc_fb(p, r) for p, r in zip(partials, rs, strict=True)]
        acc = dec(qs[0], n)
        dec_add(acc, qs[1])
        return _codec.to_dtype(acc, dtype)


class Codecs(gpubridge.CollectiveObserver):
    """Per collective: its codec and, on leaders, the bytes it sent over the bridge."""

    def __init__(self) -> None:
        self.seen: list[tuple[str, str, int | None]] = []

    def on_collective(self, record: Any) -> None:
        sent = record.bridge.bytes_sent if record.bridge is not None else None
        self.seen.append((record.call, record.codec, sent))


def bridge_islands(topo: dict[str, Any]) -> list[list[int]]:
    by_leader = {i["leader"]: i["ranks"] for i in topo["islands"]}
    return [by_leader[m] for m in topo["bridge"]["members"]]


def set_mode(pg: GpubridgeProcessGroup, how: str) -> None:
    """Where the leaders reduce from now on (every leader alike)."""
    if pg._endpoint is not None:
        pg._endpoint.reduce_mode = how


def exchange() -> dict[str, Any]:
    os.environ["GPUBRIDGE_COMPRESSION"] = "fp8"
    dist.init_process_group(backend="gpubridge")
    pg = dist.distributed_c10d._get_default_group()
    assert isinstance(pg, GpubridgeProcessGroup) and pg.compression == "fp8"
    flat = dist.new_group(backend="gloo")
    obs = Codecs()
    gpubridge.add_observer(obs)
    islands = bridge_islands(pg.topology)
    hashes: dict[str, str] = {}
    checks = 0
    cases = [("fp8", torch.float32), ("fp8", torch.bfloat16), ("fp8", torch.float16)]
    cases += [("bf16", torch.float32), ("bf16", torch.bfloat16)]
    for codec, dtype in cases:
        results: dict[str, list[torch.Tensor]] = {}
        for how in ("caller", "host"):
            set_mode(pg, how)
            ref = Reference(islands, codec)
            got = []
            for step in range(STEPS):
                inputs = [data(1000 * step + 10 * r + len(codec), dtype) for r in range(world)]
                x = inputs[rank].clone()
                w = pg.allreduce_compressed(x, dist.ReduceOp.SUM, codec, ("case", codec, str(dtype), how))
                w.wait()
                same_bits(x, ref.result(inputs, ("k",)), f"{codec} {dtype} {how} step {step}")
                got.append(x)
                hashes[f"{codec} {dtype} {how} {step}"] = digest(x)
                checks += 1
            results[how] = got
        for step in range(STEPS):
            same_bits(
                results["caller"][step], results["host"][step], f"{codec} {dtype} caller vs host {step}"
            )
    # AVG: the bridged sum, divided once afterwards in the dtype.
    for how in ("caller", "host"):
        set_mode(pg, how)
        inputs = [data(77 + r, torch.float32) for r in range(world)]
        x = inputs[rank].clone()
        pg.allreduce_compressed(x, dist.ReduceOp.AVG, "fp8").wait()
        same_bits(x, Reference(islands, "fp8").result(inputs, None).div_(world), f"fp8 AVG {how}")
        hashes[f"avg {how}"] = digest(x)
        # The group's fp8 on a plain all_reduce: no key, no feedback.
        y = inputs[rank].clone()
        dist.all_reduce(y)
        same_bits(y, Reference(islands, "fp8").result(inputs, None), f"plain all_reduce {how}")
        checks += 2
    # What fp8 does not take stays exact (against the flat Gloo group).
    set_mode(pg, "caller")
    rop = dist.ReduceOp
    exact = [
        (torch.float32, rop.MAX), (torch.float32, rop.MIN), (torch.int32, rop.SUM), (torch.int64, rop.MAX),
        (torch.float64, rop.SUM),
    ]  # fmt: skip
    for dtype, op in exact:
        x = (data(5 + rank, torch.float32) * 1000).to(dtype)
        want = x.clone()
        dist.all_reduce(want, op=op, group=flat)
        dist.all_reduce(x, op=op)
        same_bits(x, want, f"fp8 job, {dtype} {op}")
        checks += 1
    b = data(9 + rank, torch.float32)
    want = b.clone()
    dist.broadcast(want, src=2, group=flat)
    dist.broadcast(b, src=2)
    same_bits(b, want, "broadcast")
    g = torch.empty(world * 100)
    dist.all_gather_into_tensor(g, data(3 + rank, torch.float32, 100))
    want = torch.cat([data(3 + r, torch.float32, 100) for r in range(world)])
    same_bits(g, want, "all_gather")
    # zstd (a per-call override): raw's bits, on both paths.
    for how in ("caller", "host"):
        set_mode(pg, how)
        x = data(11 + rank, torch.float32)
        want = x.clone()
        pg.allreduce_compressed(want, dist.ReduceOp.SUM, "none").wait()
        pg.allreduce_compressed(x, dist.ReduceOp.SUM, "zstd").wait()
        same_bits(x, want, f"zstd {how}")
        checks += 1
    checks += 2
    ep = pg._endpoint
    residuals = ep.residual_bytes if ep is not None else 0
    gpubridge.remove_observer(obs)
    dist.destroy_process_group(flat)
    dist.destroy_process_group()
    return {
        "checks": checks, "hashes": hashes, "records": obs.seen, "residual_bytes": residuals,
        "residual_bytes_after": ep.residual_bytes if ep is not None else 0,
        "role": pg.topology["self"]["role"], "bridge_exit": pg.bridge_exit,
    }  # fmt: skip


def ring() -> dict[str, Any]:
    os.environ["GPUBRIDGE_COMPRESSION"] = "fp8"
    dist.init_process_group(backend="gpubridge")
    pg = dist.distributed_c10d._get_default_group()
    assert isinstance(pg, GpubridgeProcessGroup)
    assert len(pg.topology["islands"]) >= 3, pg.topology["islands"]
    hashes, errors = {}, {}
    for codec, dtype in (("fp8", torch.float32), ("bf16", torch.float32), ("fp8", torch.bfloat16)):
        inputs = [data(40 + r, dtype) for r in range(world)]
        for step in range(2):  # the second with the first's residuals
            x = inputs[rank].clone()
            pg.allreduce_compressed(x, dist.ReduceOp.SUM, codec, ("ring", codec, str(dtype))).wait()
            hashes[f"{codec} {dtype} {step}"] = digest(x)
        x = inputs[rank].clone()
        pg.allreduce_compressed(x, dist.ReduceOp.SUM, codec).wait()  # without feedback
        hashes[f"{codec} {dtype} plain"] = digest(x)
        exact = torch.stack([i.double() for i in inputs]).sum(0)
        errors[f"{codec} {dtype}"] = {
            "err": (x.double() - exact).abs().tolist(),
            "abs": torch.stack([i.double().abs() for i in inputs]).sum(0).tolist(),
        }
    dist.destroy_process_group()
    return {
        "hashes": hashes, "errors": errors if rank == 0 else {}, "members": len(pg.topology["islands"]),
        "role": pg.topology["self"]["role"], "bridge_exit": pg.bridge_exit,
    }  # fmt: skip


def native() -> dict[str, Any]:
    """Groups made in turn on torchrun's store: two that must fail at
    set-up, the same way on every rank, then the native API's."""
    store, r, n = next(dist.rendezvous("env://", timeout=datetime.timedelta(seconds=120)))  # type: ignore[attr-defined]
    failures = {}
    for case, value in (("mismatch", "fp8" if rank == 1 else "none"), ("bad", "fp4" if rank == 2 else "fp8")):
        os.environ["GPUBRIDGE_COMPRESSION"] = value
        try:
            GpubridgeProcessGroup(
                dist.PrefixStore(f"{case}/", store), r, n, datetime.timedelta(seconds=120), case
            ).shutdown()
        except RuntimeError as e:
            failures[case] = str(e)
        else:
            raise AssertionError(f"{case}: the group was made")
    os.environ["GPUBRIDGE_COMPRESSION"] = "none"
    topo = gpubridge.init()
    islands = bridge_islands(topo)
    ref = Reference(islands, "fp8")
    for step in range(STEPS):
        inputs = [data(500 + 10 * step + q, torch.float32) for q in range(world)]
        x = inputs[rank].clone()
        gpubridge.all_reduce(x, compression="fp8", feedback_key="weights")
        same_bits(x, ref.result(inputs, "w"), f"native fp8 step {step}")
    y = data(600 + rank, torch.float32)
    want = torch.stack([data(600 + q, torch.float32) for q in range(world)]).sum(0)
    z = y.clone()
    gpubridge.all_reduce(z)  # the group's compression: none
    assert torch.allclose(z, want, rtol=0, atol=1e-4), "raw sum"
    from gpubridge import _native  # noqa: PLC0415

    pg = _native._pg
    assert pg is not None
    ep = pg._endpoint
    before = ep.residual_bytes if ep is not None else 0
    gpubridge.destroy()
    return {
        "failures": failures, "residual_bytes": before,
        "residual_bytes_after": ep.residual_bytes if ep is not None else 0,
        "role": topo["self"]["role"], "bridge_exit": pg.bridge_exit,
    }  # fmt: skip


# The accuracy model: a linear regression on D = 32 x BLOCKS inputs, trained
# on a fixed shard of SAMPLES per rank (the whole shard every step) with SGD
# and a cosine learning rate. In each 32-value block of the weight, one
# entry is frozen (a fine-tuning mask zeroes its update after the
# all_reduce) and slightly off; its input is LOUD times larger than the
# others, so its gradient is about 1e6 times the trainable entries' every
# step and sets the block's fp8 scale: their gradients are below half the
# smallest E4M3 step and fp8 without error feedback flushes them to zero,
# every step, while error feedback carries them on until they get through.
BLOCKS, SAMPLES, LOUD, NOISE = 16, 512, 1e6, 0.01
TRAIN_STEPS, LR, LOG_EVERY = 300, 0.05, 10
# The frozen entries' offset: their gradient over 2 ranks of an island,
# about 4 LOUD^2 OFFSET, puts the block's flush threshold (at least 2^-10
# of its scale, which is at least amax / 448) at about 10 while the
# trainable entries' island sums stay below about 5.
OFFSET = 1.2 * 2 / (LOUD**2 * 2.2e-6)


def accuracy_problem(r: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Rank r's inputs and targets, the frozen mask and the starting weights
    (every rank makes every rank's from the same seeds)."""
    d = 32 * BLOCKS
    g = torch.Generator().manual_seed(1234)
    frozen = torch.zeros(d, dtype=torch.bool)
    frozen[::32] = True
    target = torch.where(frozen, 0.0, torch.sign(torch.randn(d, generator=g)))
    w0 = torch.where(frozen, OFFSET * torch.sign(torch.randn(d, generator=g)), 0.0)
    scale = torch.where(frozen, LOUD, 1.0)
    gr = torch.Generator().manual_seed(100 + r)
    x = torch.randn(SAMPLES, d, generator=gr) * scale
    y = x @ target + NOISE * torch.randn(SAMPLES, generator=gr)
    return x, y, frozen, w0


def accuracy() -> dict[str, Any]:
    """Trains the model four times in this job: "exact" (gpubridge's
    ddp_comm_hook), "fp8-ef" (compressed_hook, fp8 with error feedback, in
    gbbridge: CPU tensors take the host path), "fp8-ef-gpu-path" (the same
    with the leaders quantizing and decoding themselves: their endpoints'
    reduce_mode "caller"), "fp8" (no error feedback). Returns per variant
    the loss every LOG_EVERY steps (the mean over every rank's shard),
    the final weights' digest, and the bytes this rank sent over the
    bridge for the gradients."""
    from torch.nn.parallel import DistributedDataParallel as DDP  # noqa: PLC0415

    dist.init_process_group(backend="gpubridge")
    pg = dist.distributed_c10d._get_default_group()
    assert isinstance(pg, GpubridgeProcessGroup)
    flat = dist.new_group(backend="gloo")
    x, y, frozen, w0 = accuracy_problem(rank)
    out: dict[str, Any] = {}
    for variant in ("exact", "fp8-ef", "fp8-ef-gpu-path", "fp8"):
        set_mode(pg, "caller" if variant == "fp8-ef-gpu-path" else "host")
        model = torch.nn.Linear(32 * BLOCKS, 1, bias=False)
        with torch.no_grad():
            model.weight.copy_(w0)
        ddp = DDP(model)
        if variant == "exact":
            ddp.register_comm_hook(None, gpubridge.ddp_comm_hook)
        else:
            state = gpubridge.CompressionState(codec="fp8", error_feedback=variant != "fp8")
            ddp.register_comm_hook(state, gpubridge.compressed_hook)
        opt = torch.optim.SGD(ddp.parameters(), lr=LR)
        sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, TRAIN_STEPS)
        obs = Codecs()
        gpubridge.add_observer(obs)
        losses = []
        for step in range(TRAIN_STEPS + 1):
            opt.zero_grad()
            loss = torch.nn.functional.mse_loss(ddp(x).squeeze(1), y)
            if step % LOG_EVERY == 0 or step == TRAIN_STEPS:
                mean = loss.detach().clone()
                dist.all_reduce(mean, group=flat)
                losses.append([step, mean.item() / world])
            if step == TRAIN_STEPS:
                break
            loss.backward()
            model.weight.grad[0, frozen] = 0.0  # the mask: frozen entries keep their values
            opt.step()
            sched.step()
        gpubridge.remove_observer(obs)
        sent = sum(b for call, _, b in obs.seen if call.startswith("allreduce") and b is not None)
        codecs = sorted({c for call, c, _ in obs.seen if call.startswith("allreduce")})
        out[variant] = {
            "losses": losses, "digest": digest(model.weight.detach()), "bytes_sent": sent,
            "codecs": codecs, "steps": TRAIN_STEPS,
        }  # fmt: skip
    dist.destroy_process_group(flat)
    dist.destroy_process_group()
    return {"variants": out, "role": pg.topology["self"]["role"], "bridge_exit": pg.bridge_exit}


if __name__ == "__main__":
    try:
        modes = {"exchange": exchange, "ring": ring, "native": native, "accuracy": accuracy}
        res = {"ok": True, **modes[mode]()}
    except Exception:
        res = {"error": traceback.format_exc()}
    (outdir / f"rank{rank}.json").write_text(json.dumps(res))
    sys.exit(0 if res.get("ok") else 1)
