"""What the kit's torch drivers share: the rank's device, the process group
over the gpubridge backend, and the check that the heterogeneous job's
layout is the one gpubridge found (each component's ranks contiguous, its
ranks in its vendor's island, nothing else in that island)."""

from __future__ import annotations

import json
import os
import socket
import traceback
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

import gpubridge
from kitcommon import component, components, emit, env_int, simulated

RANK_SCHEMA = "gpubridge.kit-rank/v1"
CHECK_SCHEMA = "gpubridge.kit-layout-check/v1"


class Failed(Exception):
    """A check failed (FAIL, not ERROR): the message says what and where."""


def pick_device() -> torch.device:
    """CPU in simulation or with GPUBRIDGE_CPU_ONLY, else cuda:LOCAL_RANK
    (ROCm builds call AMD GPUs cuda too), else CPU."""
    if os.environ.get("GPUBRIDGE_VENDOR") or os.environ.get("GPUBRIDGE_CPU_ONLY") == "1":
        return torch.device("cpu")
    if torch.cuda.is_available():
        dev = torch.device("cuda", env_int("LOCAL_RANK"))
        torch.cuda.set_device(dev)
        return dev
    return torch.device("cpu")


def gather_objects(obj: Any, device: torch.device) -> list[Any]:
    """Every rank's obj (JSON-able), through tensors on the rank's device.
    dist.all_gather_object would stage them on the CPU for a backend that
    serves both cpu and cuda, and a gpubridge rank on a GPU takes only
    tensors on its GPU."""
    mine = torch.tensor(list(json.dumps(obj).encode()), dtype=torch.uint8, device=device)
    world = dist.get_world_size()
    sizes = torch.zeros(world, dtype=torch.int64, device=device)
    sizes[dist.get_rank()] = mine.numel()
    dist.all_reduce(sizes)
    most = int(sizes.max().item())
    padded = torch.zeros(most, dtype=torch.uint8, device=device)
    padded[: mine.numel()] = mine
    every = torch.empty(world * most, dtype=torch.uint8, device=device)
    dist.all_gather_into_tensor(every, padded)
    rows = every.view(world, most).cpu()
    return [json.loads(bytes(rows[r, : int(sizes[r])].tolist()).decode()) for r in range(world)]


def layout_problems(
    rank_rows: list[dict[str, Any]], comps: list[dict[str, Any]], topo: dict[str, Any]
) -> list[str]:
    """What is wrong with the layout, one sentence each: a component whose
    ranks are not the contiguous block Slurm's variables promise, a rank in
    another vendor's island, an island with ranks of other components."""
    if not comps:
        return []  # not a kit job (a plain torchrun): nothing to compare
    problems = []
    by_comp: dict[int, list[int]] = {}
    for r in rank_rows:
        if r["component"] is None:
            problems.append(f"rank {r['rank']} is in no component")
            continue
        by_comp.setdefault(int(r["component"]), []).append(int(r["rank"]))
    split = topo.get("run_kind") == "split-test"
    for c in comps:
        want = list(range(c["first_rank"], c["first_rank"] + c["ranks"]))
        got = sorted(by_comp.get(c["component"], []))
        if got != want:
            problems.append(
                f"component {c['component']} (partition {c['partition']}) has ranks {got}, "
                f"want the contiguous block {want[0]}-{want[-1]}"
                if want
                else f"component {c['component']} has no ranks"
            )
    if split:
        return problems  # islands are labels of one vendor's GPUs: nothing to match
    islands = {i["label"]: i for i in topo.get("islands", [])}
    for r in rank_rows:
        if r["island_vendor"] != r["vendor_expected"]:
            problems.append(
                f"rank {r['rank']} (component {r['component']}, partition {r['partition']}, "
                f"node {r['node']}) is in island {r['island']} of vendor {r['island_vendor']}, "
                f"but the partition is configured as {r['vendor_expected']}"
            )
    for vendor in sorted({c["vendor"] for c in comps}):
        want_ranks = sorted(
            rank
            for c in comps
            if c["vendor"] == vendor
            for rank in range(c["first_rank"], c["first_rank"] + c["ranks"])
        )
        got_ranks = sorted(rank for i in islands.values() if i["vendor"] == vendor for rank in i["ranks"])
        if want_ranks != got_ranks:
            problems.append(
                f"the {vendor} island(s) hold ranks {got_ranks}, the {vendor} components {want_ranks}"
            )
    return problems


class Job:
    """The process group and the layout, after start()."""

    def __init__(self, device: torch.device, topo: dict[str, Any], rank_rows: list[dict[str, Any]]) -> None:
        self.device = device
        self.topo = topo
        self.rank_rows = rank_rows
        self.rank = dist.get_rank()
        self.world = dist.get_world_size()

    @property
    def lead(self) -> bool:
        return self.rank == 0

    def summary(self) -> dict[str, Any]:
        return {
            "world": self.world,
            "device": self.device.type,
            "run_kind": self.topo.get("run_kind"),
            "simulated": bool(self.topo.get("simulated")),
            "islands": [
                {"label": i["label"], "vendor": i["vendor"], "backend": i["backend"], "ranks": i["ranks"]}
                for i in self.topo.get("islands", [])
            ],
            "bridge": {k: self.topo.get("bridge", {}).get(k) for k in ("members", "transport", "reason")},
        }


def start(timeout_s: float = 600) -> Job:
    """init_process_group(backend="gpubridge"), then every rank's row
    (rank 0 prints them) and the layout check: a problem raises Failed on
    every rank (the rows are gathered, so every rank decides the same)."""
    device = pick_device()
    dist.init_process_group(backend="gpubridge", timeout=timedelta(seconds=timeout_s))
    topo = gpubridge.get_topology()
    me = topo["self"]
    islands = {i["label"]: i for i in topo["islands"]}
    row = {
        "schema": RANK_SCHEMA,
        "rank": dist.get_rank(),
        "local_rank": env_int("LOCAL_RANK", -1),
        "world": dist.get_world_size(),
        **component(),
        "vendor_expected": os.environ.get("KIT_VENDOR", ""),
        "island": me["island"],
        "island_vendor": islands[me["island"]]["vendor"],
        "role": me["role"],
        "host": socket.gethostname(),
        "pid": os.getpid(),
        "device": str(device),
        "gpu": torch.cuda.get_device_name(device) if device.type == "cuda" else None,
        "namespace": topo.get("namespace"),
        "run_kind": topo.get("run_kind"),
        "simulated": bool(topo.get("simulated")),
        "torch": torch.__version__,
        "launcher": "torchrun" if os.environ.get("TORCHELASTIC_RUN_ID") else "srun",
        "torchelastic_run_id": os.environ.get("TORCHELASTIC_RUN_ID"),
    }
    rows = gather_objects(row, device)
    problems = layout_problems(rows, components(), topo)
    job = Job(device, topo, rows)
    if job.lead:
        for r in rows:
            emit(r)
        emit(
            {
                "schema": CHECK_SCHEMA,
                "ok": not problems,
                "checked": bool(components()),
                "problems": problems,
                **job.summary(),
            }
        )
    if problems:
        raise Failed("layout: " + "; ".join(problems))
    return job


def run_main(main: Callable[[], int]) -> int:
    """main's exit code; a Failed or any exception becomes a
    gpubridge.kit-error/v1 row (fail: true for a failed check or collective,
    false for what stopped the driver from running) and exit 1 or 2."""
    try:
        return main()
    except Failed as e:
        emit(
            {
                "schema": "gpubridge.kit-error/v1",
                "rank": os.environ.get("RANK"),
                "fail": True,
                "error": str(e),
            }
        )
        return 1
    except SystemExit as e:
        if e.code is None or isinstance(e.code, int):
            raise
        emit(
            {
                "schema": "gpubridge.kit-error/v1",
                "rank": os.environ.get("RANK"),
                "fail": False,
                "error": str(e.code),
            }
        )
        return 2
    except Exception as e:
        # A collective that raises once the group exists, or discovery
        # refusing the job (a RuntimeError from init_process_group naming the
        # ranks), is the cluster failing the step; anything else stopped the
        # driver from running.
        started = dist.is_available() and dist.is_initialized()
        fail = started or isinstance(e, RuntimeError)
        emit(
            {
                "schema": "gpubridge.kit-error/v1",
                "rank": os.environ.get("RANK"),
                "fail": fail,
                "error": f"{type(e).__name__}: {e}",
                "traceback": traceback.format_exc()[-4000:],
            }
        )
        return 1 if fail else 2


def simulation_note() -> str:
    return "simulation on CPU" if simulated() else ""
