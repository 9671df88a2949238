"""One rank of a gloo process group whose store is an external server.

Run with MASTER_ADDR/MASTER_PORT pointing at the store, RANK, WORLD_SIZE and
TORCHELASTIC_USE_AGENT_STORE=True, so every rank is a TCPStore client.
Prints "rank R sum S" after an all_reduce of (rank + 1).
"""

import os
from datetime import timedelta

import torch
import torch.distributed as dist


def main() -> None:
    dist.init_process_group("gloo", init_method="env://", timeout=timedelta(seconds=60))
    rank = dist.get_rank()
    world = dist.get_world_size()
    t = torch.tensor([float(rank + 1)])
    dist.all_reduce(t)
    want = world * (world + 1) / 2
    if t.item() != want:
        raise SystemExit(f"rank {rank}: all_reduce gave {t.item()}, want {want}")
    objs = [None] * world
    dist.all_gather_object(objs, {"rank": rank, "pid": os.getpid()})
    assert [o["rank"] for o in objs] == list(range(world)), objs
    dist.barrier()
    print(f"rank {rank} sum {t.item():g}", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
