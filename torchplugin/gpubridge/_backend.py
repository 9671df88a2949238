"""The ``gpubridge`` torch.distributed backend (issue 4, first slice).

This slice runs in **simulation** only: ``GPUBRIDGE_VENDOR`` set per process,
CPU tensors, Gloo islands (gbdiscover's topology mode ``cpu``).

Creating a group (``dist.init_process_group(backend="gpubridge")`` or
``new_group(backend="gpubridge")``), on every rank of it:

1. ``gbprobe --json | gbdiscover run`` against the job's own TCPStore (found
   by walking the PrefixStore chain torch hands the backend), with the
   group's rank and size, ``LOCAL_RANK`` from the environment and the
   namespace ``job-<TORCHELASTIC_RUN_ID>/attempt-<TORCHELASTIC_RESTART_COUNT>/
   group-<group name>`` (``GPUBRIDGE_NAMESPACE``, when set, replaces the
   first two parts), so that subgroups and restart attempts never share
   keys. Any failure raises the same RuntimeError on every rank, with
   gbdiscover's problems, before any group exists.
2. One Gloo ProcessGroup per island of two or more ranks, created directly on
   a PrefixStore of the group's store (``gpubridge/island/<label>``), not with
   ``dist.new_group`` (the gpubridge group may be the default group that is
   being created).
3. Each island leader, when the bridge is not ``none``, starts ``gbbridge
   serve`` (GPUBRIDGE_STORE = the store's host:port), connects a
   :class:`FeedClient` and maps a region that grows with the tensors.

allreduce, in this order: island reduce onto the leader (Gloo; AVG reduces
with SUM), the leader copies the tensor into the region, the bridge
all-reduces in place (AVG with SUM), the leader copies back, divides by the
group's size for AVG (once, at the very end, after every sum, in the
tensor's dtype: ``t.div_(size)``), then the island broadcast from the leader.
broadcast is three hops: inside the root's island from the root, over the
bridge from the root's island leader, inside the other islands from their
leaders. barrier is an allreduce of one int32.

Everything runs synchronously; the Work returned is already complete.
Anything else is refused with a RuntimeError naming the op, before any
communication.
"""

from __future__ import annotations

import atexit
import contextlib
import datetime
import json
import mmap
import os
import shutil
import subprocess
import tempfile
import threading
import weakref
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch._C import _distributed_c10d as _c10d
from torch._C._distributed_c10d import PrefixStore, ProcessGroupGloo, TCPStore

from gpubridge._feed import BridgeProcess, DType, FeedClient, FeedError, Op, Region, start_bridge

__all__ = ["BACKEND_NAME", "GpubridgeProcessGroup", "find_tool", "register", "store_address"]

BACKEND_NAME = "gpubridge"

_DTYPES: dict[torch.dtype, DType] = {
    torch.float32: DType.FLOAT32,
    torch.float64: DType.FLOAT64,
    torch.bfloat16: DType.BFLOAT16,
    torch.float16: DType.FLOAT16,
    torch.int32: DType.INT32,
    torch.int64: DType.INT64,
    torch.int8: DType.INT8,
    torch.uint8: DType.UINT8,
}
_FLOATS = {torch.float32, torch.float64, torch.bfloat16, torch.float16}
_OPS: list[tuple[Any, Op]] = [
    (dist.ReduceOp.SUM, Op.SUM),
    (dist.ReduceOp.AVG, Op.AVG),
    (dist.ReduceOp.MAX, Op.MAX),
    (dist.ReduceOp.MIN, Op.MIN),
]


def _op_of(rop: Any) -> Op | None:
    """The feed op of a torch ReduceOp (options carry a ReduceOp object that
    compares equal to, but does not hash like, ReduceOp.SUM and friends)."""
    for t, op in _OPS:
        if rop == t:
            return op
    return None


def _op_name(rop: Any) -> str:
    return str(getattr(rop, "op", rop)).rsplit(".", 1)[-1]


_MIN_REGION = 1 << 20


# ---- tools, store, discovery ----


def find_tool(name: str) -> str:
    """Path of a gpubridge tool: GPUBRIDGE_BIN_DIR, then PATH, then the
    repository's bin/ (a source checkout). RuntimeError names a missing one."""
    tried = []
    d = os.environ.get("GPUBRIDGE_BIN_DIR")
    if d:
        p = Path(d) / name
        if os.access(p, os.X_OK):
            return str(p)
        tried.append(f"GPUBRIDGE_BIN_DIR={d}")
    w = shutil.which(name)
    if w:
        return w
    tried.append("PATH")
    p = Path(__file__).resolve().parents[2] / "bin" / name
    if os.access(p, os.X_OK):
        return str(p)
    tried.append(str(p.parent))
    raise RuntimeError(
        f"gpubridge: the tool {name} was not found (looked in {', '.join(tried)}); "
        "build it with `make build` in the gpubridge repository or set GPUBRIDGE_BIN_DIR"
    )


def store_address(store: Any) -> tuple[str, int]:
    """Host and port of the TCPStore under a chain of PrefixStores."""
    s = store
    for _ in range(64):
        if isinstance(s, TCPStore):
            return str(s.host), int(s.port)
        u = getattr(s, "underlying_store", None)
        if u is None:
            break
        s = u
    raise RuntimeError(
        f"gpubridge: the group's store is not a TCPStore (found {type(s).__name__}); "
        "gpubridge needs the job's TCPStore (env:// or tcp:// init, or torchrun)"
    )


def _namespace(group: str) -> str:
    base = os.environ.get("GPUBRIDGE_NAMESPACE") or (
        f"job-{os.environ.get('TORCHELASTIC_RUN_ID') or os.environ.get('SLURM_JOB_ID') or 'default'}"
        f"/attempt-{os.environ.get('TORCHELASTIC_RESTART_COUNT') or '0'}"
    )
    return f"{base}/group-{group}"


def _discover(host: str, port: int, rank: int, size: int, namespace: str, topo_path: Path) -> dict[str, Any]:
    """Runs gbprobe --json | gbdiscover run; returns the topology or raises
    RuntimeError with gbdiscover's problems (the same on every rank)."""
    gbprobe, gbdiscover = find_tool("gbprobe"), find_tool("gbdiscover")
    local = os.environ.get("LOCAL_RANK", "-1")
    cmd = [
        gbdiscover, "run", "--store", f"{host}:{port}", "--rank", str(rank),
        "--world-size", str(size), "--local-rank", local, "--namespace", namespace,
    ]  # fmt: skip
    probe = subprocess.Popen([gbprobe, "--json"], stdin=subprocess.DEVNULL, stdout=subprocess.PIPE)
    try:
        assert probe.stdout is not None
        disc = subprocess.run(cmd, stdin=probe.stdout, capture_output=True, check=False)
    finally:
        if probe.stdout is not None:
            probe.stdout.close()
        probe.wait()
    out = disc.stdout.decode("utf-8", "replace").strip()
    try:
        doc = json.loads(out) if out else None
    except ValueError:
        doc = None
    if disc.returncode == 0 and isinstance(doc, dict) and doc.get("schema") == "gpubridge.topology/v1":
        topo_path.write_bytes(disc.stdout)
        return doc
    if isinstance(doc, dict) and doc.get("problems"):
        raise RuntimeError("gpubridge: discovery failed: " + "; ".join(str(p) for p in doc["problems"]))
    err = disc.stderr.decode("utf-8", "replace").strip()
    raise RuntimeError(f"gpubridge: gbdiscover exited {disc.returncode}: {err or out}")


# ---- the process group ----


def _completed(result: list[torch.Tensor]) -> Any:
    fut: torch.futures.Future[list[torch.Tensor]] = torch.futures.Future()
    fut.set_result(result)
    return _c10d._create_work_from_future(fut)  # type: ignore[attr-defined]


class GpubridgeProcessGroup(dist.ProcessGroup):
    """The gpubridge group: Gloo islands joined by gbbridge (simulation)."""

    def __init__(
        self, store: Any, rank: int, size: int, timeout: datetime.timedelta, group: str = "default"
    ) -> None:
        super().__init__(rank, size)  # type: ignore[call-arg]  # (rank, size) is a real overload
        self._rank = rank
        self._size = size
        self._timeout = timeout
        self._closed = False
        self.bridge_exit: int | None = None  # gbbridge serve's exit status once closed
        self._lock = threading.Lock()
        self._island_pg: Any = None
        self._feed: FeedClient | None = None
        self._bridge: BridgeProcess | None = None
        self._region: Region | None = None
        self._dir = Path(tempfile.mkdtemp(prefix="gpubridge-"))
        try:
            self._setup(store, group)
        except BaseException:
            self._close(abort=True)
            raise
        _LIVE.add(self)

    def _setup(self, store: Any, group: str) -> None:
        host, port = store_address(store)
        topo = _discover(host, port, self._rank, self._size, _namespace(group), self._dir / "topology.json")
        self.topology = topo
        if topo.get("mode") != "cpu":
            raise RuntimeError(
                f"gpubridge: topology mode {topo.get('mode')!r}: only simulation on CPU "
                "(GPUBRIDGE_VENDOR set on every rank) is implemented so far"
            )
        me = topo["self"]
        islands = topo["islands"]
        self._island = next(i for i in islands if i["label"] == me["island"])
        self._island_of = {r: i for i in islands for r in i["ranks"]}
        ranks: list[int] = self._island["ranks"]
        self._island_rank = ranks.index(self._rank)
        self._leader = int(self._island["leader"])
        self._is_leader = self._rank == self._leader
        bridge = topo["bridge"]
        self._bridged = bridge.get("transport", "none") != "none" and len(bridge.get("members") or []) > 1
        self._members: list[int] = list(bridge.get("members") or [])
        # Every rank creates the islands' groups: only its own, on a prefix
        # of the group's store named after the island.
        if len(ranks) > 1:
            pstore = PrefixStore(f"gpubridge/island/{self._island['label']}", store)
            self._island_pg = ProcessGroupGloo(pstore, self._island_rank, len(ranks), self._timeout)
        if self._bridged and self._is_leader:
            env = dict(os.environ, GPUBRIDGE_STORE=f"{host}:{port}")
            secs = max(1, int(self._timeout.total_seconds()))
            self._bridge = start_bridge(
                self._dir / "topology.json", self._dir / "feed.sock", gbbridge=find_tool("gbbridge"),
                env=env, args=["--timeout", f"{secs}s"],
            )  # fmt: skip
            try:
                self._bridge.wait_ready(float(min(secs, 120)))
                self._feed = FeedClient.connect(
                    self._bridge.feed, timeout=60.0, name=f"gpubridge rank {self._rank}",
                    request_timeout=secs + 60.0,
                )  # fmt: skip
            except FeedError as e:
                raise RuntimeError(f"gpubridge: rank {self._rank}: starting gbbridge serve: {e}") from e

    # -- identity --

    def getBackendName(self) -> str:  # the name C++ calls
        return BACKEND_NAME

    def name(self) -> str:
        return BACKEND_NAME

    def rank(self) -> int:
        return self._rank

    def size(self) -> int:
        return self._size

    # -- helpers --

    def _check(self, op: str, tensors: list[torch.Tensor]) -> torch.Tensor:
        if self._closed:
            raise RuntimeError(f"gpubridge: {op}: the group was destroyed")
        if len(tensors) != 1:
            raise RuntimeError(
                f"gpubridge: {op}: exactly one tensor per call is supported, got {len(tensors)}"
            )
        t = tensors[0]
        if t.device.type != "cpu":
            raise RuntimeError(f"gpubridge: {op}: only CPU tensors in simulation, got a tensor on {t.device}")
        if t.dtype not in _DTYPES:
            raise RuntimeError(f"gpubridge: {op}: unsupported dtype {t.dtype}")
        if not t.is_contiguous():
            raise RuntimeError(f"gpubridge: {op}: the tensor must be contiguous")
        return t

    def _region_for(self, nbytes: int) -> Region:
        assert self._feed is not None
        r = self._region
        if r is not None and r.size >= nbytes:
            return r
        size = max(_MIN_REGION, nbytes, 2 * r.size if r is not None else 0)
        size = -(-size // mmap.PAGESIZE) * mmap.PAGESIZE
        if r is not None:
            self._region = None
            self._feed.release(r)
        self._region = self._feed.map_region(size)
        return self._region

    def _bridge_op(self, t: torch.Tensor, fn: str, op: Op = Op.NONE, root: int = -1) -> None:
        """Copies t into the region, runs fn over the bridge, copies back."""
        assert self._feed is not None
        nbytes = t.numel() * t.element_size()
        region = self._region_for(nbytes)
        flat = t.view(-1).view(torch.uint8)
        buf = torch.frombuffer(region.mem, dtype=torch.uint8, count=nbytes)
        try:
            buf.copy_(flat)
            if fn == "all_reduce":
                self._feed.all_reduce(region, 0, nbytes, _DTYPES[t.dtype], op)
            else:
                self._feed.broadcast(region, 0, nbytes, root)
            flat.copy_(buf)
        except FeedError as e:
            raise RuntimeError(f"gpubridge: rank {self._rank}: bridge {fn}: {e}") from e
        finally:
            del buf

    # -- collectives --

    def allreduce(self, tensors: list[torch.Tensor], opts: Any = None) -> Any:  # type: ignore[override]
        t = self._check("allreduce", tensors)
        rop = opts.reduceOp if opts is not None else dist.ReduceOp.SUM
        op = _op_of(rop)
        if op is None:
            raise RuntimeError(f"gpubridge: allreduce: unsupported reduce op {_op_name(rop)}")
        if op == Op.AVG and t.dtype not in _FLOATS:
            raise RuntimeError(f"gpubridge: allreduce: AVG needs a floating-point tensor, got {t.dtype}")
        if t.numel() == 0:
            return _completed([t])
        with self._lock:
            self._allreduce(t, op)
        return _completed([t])

    def _allreduce(self, t: torch.Tensor, op: Op) -> None:
        island_op: Any = {
            Op.SUM: dist.ReduceOp.SUM,
            Op.AVG: dist.ReduceOp.SUM,
            Op.MAX: dist.ReduceOp.MAX,
        }.get(op, dist.ReduceOp.MIN)
        pg = self._island_pg
        if not self._bridged:
            if pg is not None:
                o = dist.AllreduceOptions()
                o.reduceOp = island_op
                pg.allreduce([t], o).wait()
            if op == Op.AVG:
                t.div_(self._size)
            return
        leader_rank = self._island["ranks"].index(self._leader)
        if pg is not None:
            ro = dist.ReduceOptions()
            ro.reduceOp = island_op
            ro.rootRank = leader_rank
            ro.rootTensor = 0
            pg.reduce([t], ro).wait()
        if self._is_leader:
            self._bridge_op(t, "all_reduce", Op.SUM if op == Op.AVG else op)
            if op == Op.AVG:
                t.div_(self._size)
        if pg is not None:
            bo = dist.BroadcastOptions()
            bo.rootRank = leader_rank
            bo.rootTensor = 0
            pg.broadcast([t], bo).wait()

    def broadcast(self, tensors: list[torch.Tensor], opts: Any = None) -> Any:  # type: ignore[override]
        t = self._check("broadcast", tensors)
        root = int(opts.rootRank) if opts is not None else 0
        if not 0 <= root < self._size:
            raise RuntimeError(f"gpubridge: broadcast: root {root} is not a rank of the group")
        if t.numel() == 0:
            return _completed([t])
        with self._lock:
            root_island = self._island_of[root]
            pg = self._island_pg
            mine = root_island["label"] == self._island["label"]
            if mine and pg is not None:  # hop 1: from the root inside its island
                bo = dist.BroadcastOptions()
                bo.rootRank = self._island["ranks"].index(root)
                bo.rootTensor = 0
                pg.broadcast([t], bo).wait()
            if self._bridged:
                if self._is_leader:  # hop 2: from the root island's leader over the bridge
                    self._bridge_op(t, "broadcast", root=self._members.index(int(root_island["leader"])))
                if not mine and pg is not None:  # hop 3: from the leader inside the other islands
                    bo = dist.BroadcastOptions()
                    bo.rootRank = self._island["ranks"].index(self._leader)
                    bo.rootTensor = 0
                    pg.broadcast([t], bo).wait()
        return _completed([t])

    def barrier(self, opts: Any = None) -> Any:
        t = torch.zeros(1, dtype=torch.int32)
        with self._lock:
            if self._closed:
                raise RuntimeError("gpubridge: barrier: the group was destroyed")
            self._allreduce(t, Op.SUM)
        return _completed([t])

    def _refuse(self, op: str) -> Any:
        raise RuntimeError(
            f"gpubridge: {op} is not supported yet (this slice has allreduce, broadcast, barrier)"
        )

    def allgather(self, *args: Any, **kw: Any) -> Any:
        return self._refuse("allgather")

    def _allgather_base(self, *args: Any, **kw: Any) -> Any:
        return self._refuse("all_gather_into_tensor")

    def allgather_coalesced(self, *args: Any, **kw: Any) -> Any:
        return self._refuse("allgather_coalesced")

    def allgather_into_tensor_coalesced(self, *args: Any, **kw: Any) -> Any:
        return self._refuse("allgather_into_tensor_coalesced")

    def allreduce_coalesced(self, *args: Any, **kw: Any) -> Any:
        return self._refuse("allreduce_coalesced")

    def reduce(self, *args: Any, **kw: Any) -> Any:
        return self._refuse("reduce")

    def reduce_scatter(self, *args: Any, **kw: Any) -> Any:
        return self._refuse("reduce_scatter")

    def _reduce_scatter_base(self, *args: Any, **kw: Any) -> Any:
        return self._refuse("reduce_scatter_tensor")

    def reduce_scatter_tensor_coalesced(self, *args: Any, **kw: Any) -> Any:
        return self._refuse("reduce_scatter_tensor_coalesced")

    def alltoall(self, *args: Any, **kw: Any) -> Any:
        return self._refuse("alltoall")

    def alltoall_base(self, *args: Any, **kw: Any) -> Any:
        return self._refuse("alltoall_base")

    def gather(self, *args: Any, **kw: Any) -> Any:
        return self._refuse("gather")

    def scatter(self, *args: Any, **kw: Any) -> Any:
        return self._refuse("scatter")

    def send(self, *args: Any, **kw: Any) -> Any:
        return self._refuse("send")

    def recv(self, *args: Any, **kw: Any) -> Any:
        return self._refuse("recv")

    def recv_anysource(self, *args: Any, **kw: Any) -> Any:
        return self._refuse("recv_anysource")

    # -- closing --

    def shutdown(self) -> None:
        self._close(abort=False)

    def abort(self) -> None:
        self._close(abort=True)

    def _close(self, abort: bool) -> None:
        """Says BYE to gbbridge and waits for it (or kills it), drops the
        island group and the private directory. Idempotent."""
        if self._closed:
            return
        self._closed = True
        feed, self._feed = self._feed, None
        bridge, self._bridge = self._bridge, None
        self._region = None
        if feed is not None:
            if abort or feed.error is not None:
                feed.abort()
            else:
                with contextlib.suppress(FeedError, OSError):
                    feed.close()
        if bridge is not None:
            try:
                self.bridge_exit = bridge.wait(10.0)
            except FeedError:
                self.bridge_exit = -1
            finally:
                bridge.kill()
                bridge.stderr_file.close()
        self._island_pg = None
        shutil.rmtree(self._dir, ignore_errors=True)
        _LIVE.discard(self)


_LIVE: weakref.WeakSet[GpubridgeProcessGroup] = weakref.WeakSet()


@atexit.register
def _close_all() -> None:
    for pg in list(_LIVE):
        with contextlib.suppress(Exception):
            pg.shutdown()


def _create(opts: Any, backend_options: Any = None) -> GpubridgeProcessGroup:
    """The creator torch calls (extended API: the group's name comes too)."""
    return GpubridgeProcessGroup(
        opts.store, int(opts.group_rank), int(opts.group_size), opts.timeout, str(opts.group_id or "default")
    )


def register() -> None:
    """Registers the backend name "gpubridge" (once)."""
    if BACKEND_NAME.upper() in dist.Backend._plugins:
        return
    dist.Backend.register_backend(BACKEND_NAME, _create, extended_api=True, devices=["cpu"])
