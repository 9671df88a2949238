"""A rank of a job using gpubridge's native API (run by test_native.py under
torchrun). argv: VENDORS OUTDIR. Writes OUTDIR/rank<R>.json."""

from __future__ import annotations

import json
import os
import sys
import traceback
from pathlib import Path

import torch
import torch.distributed as dist

rank = int(os.environ["RANK"])
vendors = sys.argv[1].split(",")
outdir = Path(sys.argv[2])
os.environ["GPUBRIDGE_VENDOR"] = vendors[rank]

import gpubridge  # noqa: E402


def main() -> dict[str, object]:
    world = len(vendors)
    assert not gpubridge.is_initialized()
    topo = gpubridge.init()
    assert gpubridge.is_initialized()
    assert gpubridge.get_topology() == topo
    x = torch.full((1000,), float(rank + 1))
    gpubridge.all_reduce(x)
    assert torch.equal(x, torch.full((1000,), float(world * (world + 1) // 2))), x[:4]
    y = torch.full((8,), float(rank))
    gpubridge.all_reduce(y, op="max")
    assert torch.equal(y, torch.full((8,), float(world - 1)))
    z = torch.full((5,), float(rank))
    gpubridge.broadcast(z, src=world - 1)
    assert torch.equal(z, torch.full((5,), float(world - 1)))
    out = torch.zeros(world * 3)
    gpubridge.all_gather_into_tensor(out, torch.full((3,), float(rank)))
    assert torch.equal(out, torch.arange(world).repeat_interleave(3).float())
    rs = torch.zeros(2)
    gpubridge.reduce_scatter_tensor(rs, torch.arange(2.0 * world), op="sum")
    assert torch.equal(rs, world * torch.arange(2.0 * rank, 2.0 * rank + 2))
    a = torch.full((3,), float(rank + 1))
    w = gpubridge.all_reduce(a, async_op=True)
    w.wait()
    assert torch.equal(a, torch.full((3,), float(world * (world + 1) // 2))), a
    fut = w.get_future()
    assert torch.equal(fut.wait()[0], a), "the async all_reduce's future holds another tensor"
    gpubridge.barrier()
    probe = gpubridge.probe()
    assert probe["schema"] == "gpubridge.probe/v1" and probe["simulated"], probe
    # One or the other in a process: torch.distributed's gpubridge group is refused now.
    try:
        dist.init_process_group("gpubridge")
    except RuntimeError as e:
        refused = str(e)
    else:
        raise AssertionError("init_process_group(backend='gpubridge') was not refused")
    try:
        gpubridge.init()
    except RuntimeError as e:
        twice = str(e)
    else:
        raise AssertionError("a second gpubridge.init() was not refused")
    gpubridge.destroy()
    assert not gpubridge.is_initialized()
    return {"ok": True, "islands": [i["ranks"] for i in topo["islands"]], "refused": refused, "twice": twice}


if __name__ == "__main__":
    try:
        res = main()
    except Exception:
        res = {"error": traceback.format_exc()}
    (outdir / f"rank{rank}.json").write_text(json.dumps(res))
    sys.exit(0 if res.get("ok") else 1)
