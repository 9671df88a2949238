"""Point-to-point across islands with the gpubridge plugin (issue 16), one
torchrun worker per rank: send/recv bandwidth against the bridge's
all_reduce algbw at the same size.

Usage:
    torchrun ... bench/gpu/p2p_bench.py [--sizes 64M] [--iters 10] [--warmup 2]
        [--device auto|cuda|cpu] [--timeout 300]

The world (an even number of ranks) is two islands, ranks [0, n/2) and
[n/2, n): on CUDA GPUBRIDGE_SPLIT_TEST defaults to "half"; on --device cpu
GPUBRIDGE_VENDOR defaults to nvidia for the first half and amd for the rest
(simulation). Rank i pairs with rank i + n/2, in the other island: with 2
ranks the pair is the two leaders (bridge 0), with 4 the second pair is two
non-leaders (a pair bridge of their own, on endpoints started on first
need). Per size:

- ``send_recv``: every pair, one direction (the first half sends);
- ``bidirectional``: every pair, both directions at once (isend + irecv);
  the bandwidth counts one direction;
- ``all_reduce``: the same bytes all-reduced over the world group (the
  bridged all_reduce: island reduce, bridge, island broadcast); algbw =
  bytes / time.

Each iteration is timed on its own between a barrier and a device sync; the
row's time is the median over iterations of the slowest rank's time.
Every received tensor and every all_reduce result is checked bit for bit
(integer-valued data); the row's ``wrong`` counts the elements that
differed on any rank. Rank 0 prints one JSON line per (op, size) on stdout
(schema ``gpubridge.p2p-bench/v1``), the send_recv rows with
``ratio_to_all_reduce`` (the issue's goal on GPUs: at least 0.8 at 64 MiB),
and a table on stderr.
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import statistics
import sys
import time
from datetime import timedelta

import torch
import torch.distributed as dist

UNITS = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}


def parse_size(s: str) -> int:
    s = s.strip().upper()
    return int(s[:-1]) * UNITS[s[-1]] if s[-1] in UNITS else int(s)


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    p.add_argument("--sizes", default="64M", help="comma-separated byte counts (K, M, G)")
    p.add_argument("--iters", type=int, default=10)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--device", choices=("auto", "cuda", "cpu"), default="auto")
    p.add_argument("--timeout", type=float, default=300.0)
    return p.parse_args()


class Bench:
    def __init__(self, a: argparse.Namespace) -> None:
        self.a = a
        self.rank, self.world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
        if self.world % 2:
            raise SystemExit("p2p_bench: the world needs an even number of ranks (two halves)")
        self.cuda = a.device == "cuda" or (a.device == "auto" and torch.cuda.is_available())
        if self.cuda:
            os.environ.setdefault("GPUBRIDGE_SPLIT_TEST", "half")
        else:
            os.environ.setdefault("GPUBRIDGE_VENDOR", "nvidia" if self.rank < self.world // 2 else "amd")
        importlib.import_module("gpubridge")
        dist.init_process_group(backend="gpubridge", timeout=timedelta(seconds=a.timeout))
        local = int(os.environ.get("LOCAL_RANK", "0"))
        self.device = torch.device("cuda", local) if self.cuda else torch.device("cpu")
        if self.cuda:
            torch.cuda.set_device(self.device)
        half = self.world // 2
        self.peer = (self.rank + half) % self.world
        self.sender = self.rank < half
        topo = getattr(dist.group.WORLD, "topology", {}) or {}
        self.info = {
            "world": self.world,
            "device": str(self.device),
            "run_kind": topo.get("run_kind"),
            "bridge": (topo.get("bridge") or {}).get("transport"),
            "islands": [i.get("ranks") for i in topo.get("islands", [])],
            "p2p_chunk": os.environ.get("GPUBRIDGE_P2P_CHUNK", "4M"),
            "commit": os.environ.get("GB_COMMIT"),
        }

    def sync(self) -> None:
        if self.cuda:
            torch.cuda.synchronize(self.device)

    def data(self, rank: int, n: int) -> torch.Tensor:
        """rank's integer-valued float32 data of n elements."""
        return ((torch.arange(n, device=self.device) + 3 * rank) % 7 - 3).float()

    def timed(self, fn: object, check: object) -> tuple[float, int]:
        """The median over the timed iterations of the slowest rank's
        time, and the elements that differed (any rank, any iteration)."""
        times, wrong = [], 0
        for i in range(self.a.warmup + self.a.iters):
            dist.barrier()
            self.sync()
            t0 = time.perf_counter()
            fn()  # type: ignore[operator]
            self.sync()
            dt = time.perf_counter() - t0
            wrong += int(check())  # type: ignore[operator]
            if i >= self.a.warmup:
                times.append(dt)
        t = torch.tensor([*times, float(wrong)], dtype=torch.float64, device=self.device)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        return statistics.median(t[:-1].tolist()), int(t[-1].item())

    def run(self, nbytes: int) -> list[dict[str, object]]:
        n = nbytes // 4
        mine = self.data(self.rank, n)
        want = self.data(self.peer, n)
        got = torch.zeros(n, device=self.device)

        def miss() -> int:
            return int((got != want).sum().item())

        def one_way() -> None:
            if self.sender:
                dist.send(mine, self.peer, tag=7)
            else:
                dist.recv(got, self.peer, tag=7)

        def both_ways() -> None:
            works = [dist.isend(mine, self.peer, tag=8), dist.irecv(got, self.peer, tag=8)]
            for w in works:
                w.wait()

        total = torch.zeros(n, device=self.device)
        expect = sum(self.data(r, n) for r in range(self.world))

        def all_reduce() -> None:
            total.copy_(mine)
            dist.all_reduce(total)

        rows = []
        t, wrong = self.timed(one_way, lambda: 0 if self.sender else miss())
        rows.append(self.row("send_recv", nbytes, t, wrong))
        got.zero_()
        t, wrong = self.timed(both_ways, miss)
        rows.append(self.row("bidirectional", nbytes, t, wrong))
        t, wrong = self.timed(all_reduce, lambda: int((total != expect).sum().item()))
        rows.append(self.row("all_reduce", nbytes, t, wrong))
        rows[0]["ratio_to_all_reduce"] = rows[0]["gb_s"] / rows[2]["gb_s"]  # type: ignore[operator]
        rows[1]["ratio_to_all_reduce"] = rows[1]["gb_s"] / rows[2]["gb_s"]  # type: ignore[operator]
        return rows

    def row(self, op: str, nbytes: int, t: float, wrong: int) -> dict[str, object]:
        return {
            "schema": "gpubridge.p2p-bench/v1", "op": op, "bytes": nbytes, "iters": self.a.iters,
            "median_s": t, "gb_s": nbytes / t / 1e9, "wrong": wrong, **self.info,
        }  # fmt: skip


def main() -> int:
    a = parse_args()
    b = Bench(a)
    bad = 0
    for s in a.sizes.split(","):
        for r in b.run(parse_size(s)):
            bad += int(r["wrong"] != 0)  # type: ignore[arg-type]
            if b.rank == 0:
                print(json.dumps(r), flush=True)
                ratio = r.get("ratio_to_all_reduce")
                extra = f"  ({ratio:.2f}x all_reduce)" if isinstance(ratio, float) else ""
                print(
                    f"{r['op']:>14} {r['bytes'] >> 20:>6} MiB {r['median_s'] * 1e3:9.3f} ms "
                    f"{r['gb_s']:7.3f} GB/s wrong {r['wrong']}{extra}",
                    file=sys.stderr,
                )
    dist.destroy_process_group()
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
