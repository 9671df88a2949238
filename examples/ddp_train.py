"""Data-parallel training with DistributedDataParallel across NVIDIA and AMD GPUs.

A plain DDP script; what makes it run on a mixed-vendor job is marked
``# gpubridge:`` -- the import that registers the backend and the backend's
name. Launch it as any DDP script (see examples/README.md):

    torchrun --nproc-per-node 4 examples/ddp_train.py

In simulation (no GPUs; CPU tensors, one simulated vendor per rank), give the
vendor of each local rank:

    GPUBRIDGE_SIM_VENDORS=nvidia,nvidia,amd,amd torchrun --nproc-per-node 4 examples/ddp_train.py

The model is an MLP classifier on a synthetic data set (labels from a fixed
random teacher). Rank 0 logs the loss (averaged over the ranks) and the
throughput on stderr; ``--json`` also writes them as JSON lines (schema
``gpubridge.demo/v1``) on stdout, with the topology gpubridge found. At the
end every rank checks that its parameters are identical, bit for bit, to
every other rank's (exit status 1 otherwise), and the result says how many
bytes the island leaders sent over the bridge.

``--compression fp8`` (or bf16, zstd) all-reduces the gradients with
gpubridge's compressed DDP hook (error feedback on; ``--no-error-feedback``
turns it off): the bridge carries the codec's packing instead of float32
(docs/COMPRESSION.md).
"""

from __future__ import annotations

# ruff: noqa: E402 - the command line is parsed before torch is imported
import argparse
import hashlib
import json
import os
import sys
import time
from typing import Any

SCHEMA = "gpubridge.demo/v1"


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    p.add_argument("--epochs", type=int, default=2)
    p.add_argument("--max-steps", type=int, default=0, help="stop after this many steps (0: no limit)")
    p.add_argument("--batch-size", type=int, default=64, help="per rank")
    p.add_argument("--samples", type=int, default=16384, help="size of the synthetic data set")
    p.add_argument("--features", type=int, default=64)
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--classes", type=int, default=10)
    p.add_argument("--lr", type=float, default=0.05)
    p.add_argument("--log-every", type=int, default=20)
    p.add_argument("--json", action="store_true", help="rank 0 writes JSON lines on stdout")
    p.add_argument(
        "--compression", default="none", help="codec of the gradients on the bridge: none, fp8, bf16, zstd"
    )
    p.add_argument("--no-error-feedback", action="store_true", help="with a lossy --compression")
    return p.parse_args()


if __name__ == "__main__":
    # First: --help (or a wrong argument) answers at once, with neither torch
    # nor gpubridge installed or on PYTHONPATH.
    ARGS = parse_args()

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, TensorDataset
from torch.utils.data.distributed import DistributedSampler

import gpubridge  # gpubridge: registers the torch.distributed backend "gpubridge"


def simulated_vendor() -> str | None:
    """GPUBRIDGE_SIM_VENDORS (a vendor per local rank) sets GPUBRIDGE_VENDOR,
    the per-process simulation switch, unless that is set already."""
    vendors = os.environ.get("GPUBRIDGE_SIM_VENDORS")
    if vendors and "GPUBRIDGE_VENDOR" not in os.environ:
        os.environ["GPUBRIDGE_VENDOR"] = vendors.split(",")[int(os.environ["LOCAL_RANK"])]
    return os.environ.get("GPUBRIDGE_VENDOR")


def synthetic_data(args: argparse.Namespace) -> TensorDataset:
    """The same data set on every rank: Gaussian features, labels from a
    fixed random two-layer teacher."""
    g = torch.Generator().manual_seed(1234)
    x = torch.randn(args.samples, args.features, generator=g)
    w1 = torch.randn(args.features, 32, generator=g)
    w2 = torch.randn(32, args.classes, generator=g)
    y = (torch.tanh(x @ w1) @ w2).argmax(dim=1)
    return TensorDataset(x, y)


def param_digest(model: nn.Module) -> torch.Tensor:
    """SHA-256 of every parameter's bytes, as 32 uint8 on the model's device."""
    h = hashlib.sha256()
    for p in model.parameters():
        h.update(p.detach().contiguous().view(-1).view(torch.uint8).cpu().numpy().tobytes())
    device = next(model.parameters()).device
    return torch.frombuffer(bytearray(h.digest()), dtype=torch.uint8).to(device)


def report_topology(as_json: bool) -> None:
    """Rank 0: the islands and the bridge gpubridge set up for this job."""
    topo = gpubridge.get_topology()
    islands = [{k: i[k] for k in ("label", "vendor", "backend", "ranks", "leader")} for i in topo["islands"]]
    bridge = {k: topo["bridge"].get(k) for k in ("members", "transport", "reason")}
    head = {k: topo.get(k) for k in ("world_size", "run_kind", "simulated", "digest")}
    emit({"kind": "topology", **head, "islands": islands, "bridge": bridge}, as_json)
    for i in islands:
        log(f"island {i['label']}: ranks {i['ranks']}, leader {i['leader']}, {i['backend']}")
    log(f"bridge: leaders {bridge['members']} over {bridge['transport']} ({bridge['reason']})")


class BridgeBytes(gpubridge.CollectiveObserver):
    """The bytes this rank sent over the bridge (island leaders only: what
    gbbridge reported for each collective)."""

    def __init__(self) -> None:
        self.sent = 0

    def on_collective(self, record: Any) -> None:
        if record.bridge is not None:
            self.sent += record.bridge.bytes_sent


def emit(record: dict[str, Any], enabled: bool) -> None:
    if enabled:
        # One write per row: every rank shares torchrun's stdout, and print's
        # separate newline write can put two ranks' rows on one line.
        sys.stdout.write(json.dumps({"schema": SCHEMA, **record}) + "\n")
        sys.stdout.flush()


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
    if lead:
        report_topology(args.json)

    torch.manual_seed(0)
    data = synthetic_data(args)
    sampler: DistributedSampler[tuple[torch.Tensor, ...]] = DistributedSampler(
        data, num_replicas=world, rank=rank, shuffle=True, seed=0
    )
    loader = DataLoader(data, batch_size=args.batch_size, sampler=sampler, drop_last=True)
    model = nn.Sequential(
        nn.Linear(args.features, args.hidden),
        nn.ReLU(),
        nn.Linear(args.hidden, args.hidden),
        nn.ReLU(),
        nn.Linear(args.hidden, args.classes),
    ).to(device)
    ddp = DDP(model, device_ids=[device.index] if device.type == "cuda" else None)
    feedback = False
    if args.compression != "none":  # gpubridge: gradients compressed on the bridge, with error feedback
        state = gpubridge.CompressionState(codec=args.compression, error_feedback=not args.no_error_feedback)
        ddp.register_comm_hook(state, gpubridge.compressed_hook)
        feedback = state.error_feedback and state.codec in ("fp8", "bf16")
    sent = BridgeBytes()
    gpubridge.add_observer(sent)
    opt = torch.optim.SGD(ddp.parameters(), lr=args.lr, momentum=0.9)
    loss_fn = nn.CrossEntropyLoss()
    n_params = sum(p.numel() for p in model.parameters())
    if lead:
        how = "" if args.compression == "none" else f", gradients {args.compression} on the bridge"
        log(f"training: {n_params} parameters, {world} ranks x batch {args.batch_size} on {device}{how}")

    step, t_start, timed_samples, loss_avg = 0, 0.0, 0, float("nan")
    done = False
    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)
        for xb, yb in loader:
            x, y = xb.to(device, non_blocking=True), yb.to(device, non_blocking=True)
            opt.zero_grad(set_to_none=True)
            loss = loss_fn(ddp(x), y)
            loss.backward()
            opt.step()
            step += 1
            if step == 1:  # the first step builds DDP's buckets: time from here on
                t_start, timed_samples = time.perf_counter(), 0
            else:
                timed_samples += world * args.batch_size
            if step % args.log_every == 0:
                avg = loss.detach().clone()
                dist.all_reduce(avg, op=dist.ReduceOp.AVG)
                loss_avg = avg.item()
                rate = timed_samples / max(time.perf_counter() - t_start, 1e-9)
                if lead:
                    log(f"epoch {epoch} step {step}: loss {loss_avg:.4f}, {rate:.0f} samples/s")
                    rec = {"kind": "step", "epoch": epoch, "step": step, "loss": round(loss_avg, 6)}
                    emit({**rec, "samples_per_s": round(rate, 1)}, args.json)
            if step == args.max_steps:
                done = True
                break
        if done:
            break
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    seconds = time.perf_counter() - t_start

    # The bytes every leader sent over the bridge during training.
    gpubridge.remove_observer(sent)
    total = torch.tensor([sent.sent], dtype=torch.int64, device=device)
    dist.all_reduce(total)
    # Every rank must hold the same parameters: gather each rank's digest.
    mine = param_digest(model)
    every = torch.empty(world * mine.numel(), dtype=torch.uint8, device=device)
    dist.all_gather_into_tensor(every, mine)
    rows = every.view(world, -1)
    differ = [r for r in range(world) if not torch.equal(rows[r], mine)]
    if lead:
        rate = timed_samples / max(seconds, 1e-9)
        verdict = f"parameters DIFFER on ranks {differ}" if differ else "parameters identical on every rank"
        log(
            f"done: {step} steps, {rate:.0f} samples/s, final loss {loss_avg:.4f}, "
            f"{int(total.item())} bytes over the bridge; {verdict}"
        )
        result = {
            "kind": "result",
            "world_size": world,
            "steps": step,
            "parameters": n_params,
            "seconds": round(seconds, 3),
            "samples_per_s": round(rate, 1),
            "final_loss": round(loss_avg, 6),
            "compression": args.compression,
            "error_feedback": feedback,
            "bridge_bytes_sent": int(total.item()),
            "params_identical": not differ,
            "param_sha256": bytes(mine.cpu().tolist()).hex(),
        }
        emit(result, args.json)
    dist.destroy_process_group()
    return 1 if differ else 0


if __name__ == "__main__":
    sys.exit(main(ARGS))
