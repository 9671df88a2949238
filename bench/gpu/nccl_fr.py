"""torch's own Flight Recorder on an NCCL job of one rank (one GPU): a few
collectives with TORCH_NCCL_TRACE_BUFFER_SIZE and TORCH_NCCL_ENABLE_TIMING,
then the dump in both forms torch writes (pickle, as on a timeout, and
JSON), for gbtrace fr (bench/gpu/trace-check.sh). argv: OUTDIR."""

from __future__ import annotations

import sys

import torch
import torch._C._distributed_c10d as c10d
import torch.distributed as dist

out = sys.argv[1]
dist.init_process_group("nccl", device_id=torch.device("cuda", 0))
t = torch.ones(1 << 20, device="cuda")
for _ in range(3):
    dist.all_reduce(t)
dist.broadcast(t, 0)
o = torch.empty(1 << 20, device="cuda")
dist.all_gather_into_tensor(o, t)
dist.reduce_scatter_tensor(t[: 1 << 20], o)
torch.cuda.synchronize()
dumps = {"nccl_trace_rank_0": c10d._dump_nccl_trace, "nccl_trace_rank_0.json": c10d._dump_nccl_trace_json}
for name, dump in dumps.items():
    with open(f"{out}/{name}", "wb") as f:
        f.write(dump())
dist.destroy_process_group()
print("nccl fr dumps written")
