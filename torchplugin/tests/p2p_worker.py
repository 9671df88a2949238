"""A rank of a point-to-point test job over the gpubridge backend (run by
torchrun from test_p2p.py).

argv: VENDORS OUTDIR MODE. VENDORS as in backend_worker.py (VENDOR or
VENDOR:ISLAND per rank). MODE:
- ``pairs``: every rank sends to and receives from every other rank at
  once (isend/irecv, all posted before any is waited for): two tags per
  peer, sent in one order and received in the other, two messages on one
  tag (their order kept), several dtypes and sizes (more than one chunk of
  GPUBRIDGE_P2P_CHUNK); tags past 2^24 (BIG_TAGS: the wire's tag is the
  torch tag, feed protocol 5) with a message of a whole window of chunks
  on one; then a batch_isend_irecv and blocking
  send/recv between every pair; every received byte checked against what
  its sender made. The rank records whether it has an endpoint, which
  bridges it joined, and how many point-to-point channels it still holds
  once every transfer is over (none: idle ones are dropped).
- ``leaders``: collectives (GPUBRIDGE_POLICY=reduce-bridge-broadcast), P2P
  inside islands and between leaders only: no rank that leads no island may
  have started an endpoint.

Writes OUTDIR/rank<R>.json: {"ok": true, ...} or {"error": text}. A call
that stalls fails at the group's timeout (GROUP_TIMEOUT_S, well within the
test's deadline for the job), so that a stuck transfer is reported by every
rank, naming its peer, rather than killed from outside.
"""

from __future__ import annotations

import datetime
import json
import os
import sys
import time
import traceback
from pathlib import Path

import torch
import torch.distributed as dist
from testenv import scale

rank = int(os.environ["RANK"])
vendors = sys.argv[1].split(",")
outdir = Path(sys.argv[2])
mode = sys.argv[3]
os.environ["GPUBRIDGE_VENDOR"], _, island = vendors[rank].partition(":")
if island:
    os.environ["GPUBRIDGE_SIM_ISLAND"] = island
if mode == "leaders":  # auto would send the small all_reduces flat (every rank on a bridge)
    os.environ["GPUBRIDGE_POLICY"] = "reduce-bridge-broadcast"

import gpubridge  # noqa: E402,F401  (registers the backend)

# (dtype, elements): 5000 float32 are 20000 bytes, several chunks of the
# test's GPUBRIDGE_P2P_CHUNK (4096)
SHAPES = [(torch.float32, 5000), (torch.bfloat16, 33), (torch.int64, 7)]
# Tags across islands past the 2^24 of the lanes of old, up to the largest
# torch passes (a C int); tag BIG_TAGS[0] carries LONG float32 (160000
# bytes: 14 chunks, 4096 grown to 12288 to stay within the window's 16).
BIG_TAGS = ((1 << 24) + 5, (1 << 31) - 1)
LONG = 40000
GROUP_TIMEOUT_S = scale(60)


def payload(src: int, dst: int, tag: int, k: int, dtype: torch.dtype, n: int) -> torch.Tensor:
    """What src sends dst as message k with tag: values no other message
    has (exact in every dtype used)."""
    g = torch.Generator().manual_seed(((src * 64 + dst) * 64 + tag) * 64 + k)
    hi = 100 if dtype == torch.bfloat16 else 1 << 20
    return torch.randint(-hi, hi, (n,), generator=g).to(dtype)


def same(got: torch.Tensor, want: torch.Tensor, what: str) -> None:
    if not torch.equal(got.view(-1).view(torch.uint8), want.view(-1).view(torch.uint8)):
        raise AssertionError(f"rank {rank}: {what}: got {got[:6].tolist()}, want {want[:6].tolist()}")


def all_pairs(world: int) -> int:
    checks = 0
    reqs, expect = [], []
    for peer in range(world):
        if peer == rank:
            continue
        for tag in (1, 2):
            for k in range(2 if tag == 1 else 1):  # two messages on tag 1: order kept
                for si, (dt, n) in enumerate(SHAPES):
                    reqs.append(dist.isend(payload(rank, peer, tag, k * 8 + si, dt, n), peer, tag=tag))
        for tag in (2, 1):  # received in the other order
            for k in range(2 if tag == 1 else 1):
                for si, (dt, n) in enumerate(SHAPES):
                    got = torch.zeros(n, dtype=dt)
                    reqs.append(dist.irecv(got, peer, tag=tag))
                    expect.append(
                        (got, payload(peer, rank, tag, k * 8 + si, dt, n), f"{peer}->{rank} tag {tag}")
                    )
        for tag in BIG_TAGS:
            n = LONG if tag == BIG_TAGS[0] else 9
            reqs.append(dist.isend(payload(rank, peer, tag % 64, 60, torch.float32, n), peer, tag=tag))
            got = torch.zeros(n)
            reqs.append(dist.irecv(got, peer, tag=tag))
            want = payload(peer, rank, tag % 64, 60, torch.float32, n)
            expect.append((got, want, f"{peer}->{rank} tag {tag}"))
    for q in reqs:
        q.wait()
    for got, want, what in expect:
        same(got, want, what)
        checks += 1
    for a in range(world):  # batch_isend_irecv, then blocking send/recv, pair by pair
        for b in range(a + 1, world):
            if rank not in (a, b):
                continue
            peer = b if rank == a else a
            got = torch.zeros(1000)
            ops = [
                dist.P2POp(dist.isend, payload(rank, peer, 5, 0, torch.float32, 1000), peer, tag=5),
                dist.P2POp(dist.irecv, got, peer, tag=5),
            ]
            for q in dist.batch_isend_irecv(ops):
                q.wait()
            same(got, payload(peer, rank, 5, 0, torch.float32, 1000), f"batch {peer}->{rank}")
            got2 = torch.zeros(3000)
            if rank == a:
                dist.send(payload(rank, peer, 6, 0, torch.float32, 3000), peer, tag=6)
                dist.recv(got2, peer, tag=6)
            else:
                dist.recv(got2, peer, tag=6)
                dist.send(payload(rank, peer, 6, 0, torch.float32, 3000), peer, tag=6)
            same(got2, payload(peer, rank, 6, 0, torch.float32, 3000), f"blocking {peer}->{rank}")
            checks += 2
    return checks


def leaders_only(world: int, topo: dict) -> int:
    checks = 0
    x = torch.full((100,), float(rank))
    dist.all_reduce(x)
    same(x, torch.full((100,), float(world * (world - 1) // 2)), "all_reduce")
    out = [torch.zeros(3) for _ in range(world)]
    dist.all_gather(out, torch.full((3,), float(rank)))
    for r in range(world):
        same(out[r], torch.full((3,), float(r)), f"all_gather {r}")
    checks += 2
    leaders = [i["leader"] for i in topo["islands"]]
    pairs = [(i["ranks"][0], i["ranks"][1]) for i in topo["islands"] if len(i["ranks"]) > 1]
    pairs += [(leaders[0], leaders[1])] if len(leaders) > 1 else []
    for a, b in pairs:
        if rank in (a, b):
            peer = b if rank == a else a
            got = torch.zeros(64)
            q = [
                dist.isend(payload(rank, peer, 3, 0, torch.float32, 64), peer, tag=3),
                dist.irecv(got, peer, tag=3),
            ]
            for w in q:
                w.wait()
            same(got, payload(peer, rank, 3, 0, torch.float32, 64), f"p2p {peer}->{rank}")
            checks += 1
    dist.barrier()
    return checks


def main() -> int:
    try:
        dist.init_process_group(backend="gpubridge", timeout=datetime.timedelta(seconds=GROUP_TIMEOUT_S))
    except RuntimeError as e:
        (outdir / f"rank{rank}.json").write_text(json.dumps({"error": str(e)}))
        return 3
    world = dist.get_world_size()
    pg = dist.distributed_c10d._get_default_group()
    topo = pg.topology
    checks = all_pairs(world) if mode == "pairs" else leaders_only(world, topo)
    deadline = time.monotonic() + 30.0  # a transfer lets its channel go just after its Work completes
    while pg._p2p.channels() and time.monotonic() < deadline:
        time.sleep(0.01)
    ep = pg._endpoint
    info = {
        "role": topo["self"]["role"],
        "islands": [i["ranks"] for i in topo["islands"]],
        "endpoint": ep is not None,
        "lazily_started": pg._endpoints.lazily_started,
        "bridges": ep.bridges if ep is not None else [],
        "bridge_pid": ep.process.proc.pid if ep is not None else None,
        "channels_left": pg._p2p.channels(),
    }
    dist.destroy_process_group()
    info["bridge_exit"] = pg.bridge_exit
    (outdir / f"rank{rank}.json").write_text(json.dumps({"ok": True, "checks": checks, **info}))
    return 0


if __name__ == "__main__":
    try:
        sys.exit(main())
    except Exception:
        (outdir / f"rank{rank}.json").write_text(json.dumps({"error": traceback.format_exc()}))
        raise
