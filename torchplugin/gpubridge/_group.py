"""The group torch sees: ``GpubridgeProcessGroup``.

Creating one (``dist.init_process_group(backend="gpubridge")``,
``new_group(backend="gpubridge")`` or :func:`gpubridge.init`) on every rank
runs discovery, then builds this rank's parts: its island group
(:mod:`gpubridge._island`), and on a leader of a bridged group its end of the
bridge (:mod:`gpubridge._endpoint`: gbbridge serve, the feed, the staging
region); no rank returns before every rank has (:mod:`gpubridge._setup`).
Any other rank gets an endpoint on its first cross-island need
(:mod:`gpubridge._endpoints`).
torch calls the collectives here: each call's arguments are checked
(:mod:`gpubridge._checks`) and the collective goes to the group's worker
(:mod:`gpubridge._worker`), which runs the algorithm
(:mod:`gpubridge._collectives`); point-to-point is :mod:`gpubridge._p2p`. A
failure breaks the group on every rank with one root cause
(:mod:`gpubridge._failure`).
"""

from __future__ import annotations

import atexit
import contextlib
import datetime
import itertools
import logging
import weakref
from collections.abc import Hashable
from typing import Any

import torch
import torch.distributed as dist

from gpubridge import _check_calls, _gpu, _setup, _trace
from gpubridge import _inflight as fl
from gpubridge._checks import Checks
from gpubridge._collectives import Collectives
from gpubridge._discovery import store_address
from gpubridge._dtypes import OP_NAMES
from gpubridge._endpoint import BridgeEndpoint
from gpubridge._endpoints import Endpoints
from gpubridge._failure import Breaker, read_pids
from gpubridge._feed import Op
from gpubridge._island import IslandGroup
from gpubridge._layout import Layout
from gpubridge._p2p import PointToPoint
from gpubridge._policy import POLICIES, Policy, parse_codec
from gpubridge._worker import Worker

__all__ = ["BACKEND_NAME", "GpubridgeProcessGroup", "find_group", "live_groups"]

BACKEND_NAME = "gpubridge"
log = logging.getLogger("gpubridge")


def _refused(op: str) -> Any:
    """A collective this group does not run."""

    def refuse(self: GpubridgeProcessGroup, *args: Any, **kw: Any) -> Any:
        raise RuntimeError(f"gpubridge: {op} is not supported")

    return refuse


class GpubridgeProcessGroup(dist.ProcessGroup):
    """Native islands joined by gbbridge."""

    def __init__(
        self,
        store: Any,
        rank: int,
        size: int,
        timeout: datetime.timedelta,
        group: str = "default",
        problems: list[str] | None = None,
    ) -> None:
        super().__init__(rank, size)  # type: ignore[call-arg]  # (rank, size) is a real overload
        self._rank = rank
        self._size = size
        self._timeout = timeout
        self._group = group
        self._store = store
        self.bridge_exit: int | None = None  # gbbridge serve's exit status once closed
        self._device = torch.device("cpu")
        self._stream: Any = None  # GPU: the worker's
        self._island: IslandGroup | None = None
        self._endpoints: Endpoints | None = None
        self._breaker = Breaker(store, rank, size, on_break=self._break_links, why_dead=self._dead_bridge)
        self._dir = _setup.private_dir()
        self.created = next(_CREATED)
        self._group_name = group
        # GPUBRIDGE_COMPRESSION and GPUBRIDGE_BRIDGE_REDUCE: settings every
        # rank must share (discovery compares them), bad values problems.
        self._policy = Policy.read()
        try:
            topo = _setup.discover(
                store, rank, size, timeout, group, self._dir, [*(problems or []), *self._policy.problems],
                self._policy.settings(),
            )  # fmt: skip
            failed: BaseException | None = None
            try:
                self._build(topo)
            except Exception as e:
                failed = e
            _setup.agree(store, rank, size, timeout, failed)
            self._breaker.pids = read_pids(store, size)
        except BaseException:
            self._breaker.closed = True
            self._release(abort=True)
            raise
        assert self._island is not None
        self._checks: Checks = Checks(size, self._device)
        assert self._endpoints is not None
        pol = self._policy
        self._algo: Collectives = Collectives(
            self._layout, self._island, self._endpoints, pol.codec, pol.policy, pol.thresholds
        )
        self._p2p: PointToPoint = PointToPoint(
            group, self._layout, self._island, self._endpoints, self._breaker, self._device, timeout,
            self._policy.p2p_chunk,
        )  # fmt: skip
        compare = self._compare_calls if _check_calls.enabled() else None
        self._worker: Worker = Worker(group, self._device, self._stream, timeout, self._breaker, compare)
        w = self._worker
        _trace.attach(
            group, rank, size, self._layout, str(self._device), lambda: w.seq, lambda: _global_ranks(self),
            store, timeout.total_seconds(),
        )  # fmt: skip
        _LIVE.add(self)

    def _build(self, topo: dict[str, Any]) -> None:
        """The island group and, on leaders, gbbridge serve and the feed."""
        _setup.publish_pid(self._store, self._rank)
        self.topology: dict[str, Any] = topo
        layout = Layout.of(topo, self._rank, self._size)
        self._layout = layout
        if topo.get("split_test"):
            log.warning(
                "gpubridge: rank %d: split test (%s): a single-vendor job labeled as two vendors; "
                "results are not mixed-vendor results",
                self._rank, topo.get("split_test"),
            )  # fmt: skip
        if layout.mode == "gpu":
            self._device = _setup.use_gpu(self._rank)  # only now: discovery passed
            self._stream = _gpu.new_stream(self._device)
        self._island = IslandGroup.join(self._store, layout, self._timeout)
        self._endpoints = Endpoints(
            self._dir, store_address(self._store), str(topo["namespace"]), layout, self._device, self._stream,
            self._timeout, self._policy.bridge_reduce, self._policy.codec,
        )  # fmt: skip
        if layout.bridged and layout.is_leader:
            # A leader whose peer failed its own set-up (say its gbbridge
            # could not start) would wait for that serve until the timeout:
            # the failure that peer published ends the wait.
            store = self._store
            self._endpoints.start_leader(give_up=lambda: _setup.failure_elsewhere(store))

    @property
    def _endpoint(self) -> BridgeEndpoint | None:
        """This rank's end of the bridge, if it has one up (a leader's from
        the start; another rank's once it needed one)."""
        return self._endpoints.current if self._endpoints is not None else None

    # ---- identity ----

    def getBackendName(self) -> str:  # the name C++ calls
        return BACKEND_NAME

    def name(self) -> str:
        return BACKEND_NAME

    def rank(self) -> int:
        return self._rank

    def size(self) -> int:
        return self._size

    # torch uses this object as the group itself (it is a ProcessGroup) and
    # names it through _set_group_name; the C++ base keeps a name only in a
    # registered backend, which a Python group has none of, so the name lives
    # here (DeviceMesh, for one, reads group_name).
    def _set_group_name(self, name: str) -> None:
        self._group_name = str(name)

    @property
    def group_name(self) -> str:  # type: ignore[override]
        return self._group_name

    # torch looks up a group's backend per device and asks it what it
    # supports (torch 2.14+'s batch_isend_irecv on every call; init with a
    # device_id; 2.15's dist.get_backend_impl). A Python group has no
    # per-device backend in the C++ base, whose lookup raises "No backend
    # type associated with device type cpu": this group is its own backend,
    # for every device, with none of the optional capabilities.
    supports_coalescing = False
    supports_splitting = False

    def _get_backend(self, device: Any = None) -> GpubridgeProcessGroup:  # type: ignore[override]
        return self

    get_backend = _get_backend

    def supports_tensor_alloc(self, device: Any = None) -> bool:
        return False

    def stats(self) -> dict[str, Any]:
        """Host-side time per collective and step since the group began
        (seconds, summed over calls; "queued" is the wait behind earlier
        collectives). On GPUs the island steps only queue work on the stream,
        so their device time shows up in the next step that waits for it (the
        leader's copy into the region)."""
        w = self._worker
        return {
            "schema": "gpubridge.stats/v1", "rank": self._rank, "collectives": w.seq, "ops": w.stats(),
            "all_reduce_policies": dict(self._algo.policy_calls),
            "all_reduce_fallbacks": list(self._algo.fallbacks),
        }  # fmt: skip

    @property
    def device(self) -> torch.device:
        """The device this rank's tensors must be on."""
        return self._device

    @property
    def compression(self) -> str:
        """The group's compression (GPUBRIDGE_COMPRESSION when it was
        created): "raw", "bf16", "fp8" or "zstd"."""
        return str(self._policy.codec)

    # ---- checks ----

    def _one(self, op: str, tensors: list[torch.Tensor]) -> torch.Tensor:
        self._breaker.refuse(op)
        return self._checks.one(op, tensors)

    def _compare_calls(self, e: fl.Entry, sig: bytes) -> None:
        _check_calls.compare(e, sig, self._size, self._device, self._algo.all_gather)

    # ---- collectives ----

    def allreduce(self, tensors: list[torch.Tensor], opts: Any = None) -> Any:  # type: ignore[override]
        t = self._one("allreduce", tensors)
        op = self._checks.reduce_op("allreduce", opts, t.dtype)
        return self._worker.submit(
            "allreduce", t.nbytes, lambda e: self._algo.all_reduce(e, t, op), [t],
            opts=opts, detail=OP_NAMES[op],
        )  # fmt: skip

    def allreduce_compressed(
        self,
        tensor: torch.Tensor,
        op: Any = dist.ReduceOp.SUM,
        codec: str | None = None,
        feedback_key: Hashable | None = None,
        async_op: bool = True,
    ) -> Any:
        """An all_reduce of tensor in place whose bridged step uses codec
        (None: the group's; "none", "bf16", "fp8", "zstd") with the error
        feedback of feedback_key (None: none is kept); returns its Work,
        like allreduce. A lossy codec applies to floating SUM and AVG of
        the dtypes it packs, the rest stays exact (docs/COMPRESSION.md).
        Every rank passes the same codec; each island leader keeps one
        float32 residual per key and buffer size, 4 bytes a value (in GPU
        memory on the two-island GPU path, else in gbbridge), freed with
        the group."""
        self._breaker.refuse("allreduce_compressed")
        self._checks.tensor("allreduce_compressed", tensor)
        try:
            c = self._policy.codec if codec is None else parse_codec(codec)
        except ValueError as e:
            raise RuntimeError(f"gpubridge: allreduce_compressed: {e}") from None
        opts = dist.AllreduceOptions()
        opts.reduceOp = op
        opts.asyncOp = async_op
        rop = self._checks.reduce_op("allreduce_compressed", opts, tensor.dtype)
        t = tensor
        return self._worker.submit(
            "allreduce_compressed", t.nbytes, lambda e: self._algo.all_reduce(e, t, rop, c, feedback_key),
            [t], opts=opts, detail=rop.name, codec=str(c),
        )  # fmt: skip

    def allreduce_with_policy(self, tensor: torch.Tensor, policy: str, async_op: bool = False) -> Any:
        """A SUM all_reduce of tensor in place under policy (one of
        gpubridge._policy.POLICIES) instead of the group's: what
        ``python -m gpubridge.tune`` measures. Every rank passes the same
        policy. Returns its Work."""
        self._breaker.refuse("allreduce_with_policy")
        self._checks.tensor("allreduce_with_policy", tensor)
        if policy not in POLICIES:
            raise RuntimeError(f"gpubridge: allreduce_with_policy: {policy!r} is not one of {POLICIES}")
        opts = dist.AllreduceOptions()
        opts.asyncOp = async_op
        t = tensor
        return self._worker.submit(
            "allreduce", t.nbytes, lambda e: self._algo.all_reduce(e, t, Op.SUM, policy=policy), [t],
            opts=opts, detail=f"SUM {policy}",
        )  # fmt: skip

    def allreduce_coalesced(self, tensors: list[torch.Tensor], opts: Any = None) -> Any:
        self._breaker.refuse("allreduce_coalesced")
        if not tensors:
            return self._worker.submit("allreduce_coalesced", 0, lambda e: None, [])
        for t in tensors:
            self._checks.tensor("allreduce_coalesced", t)
        if len({t.dtype for t in tensors}) != 1:
            raise RuntimeError("gpubridge: allreduce_coalesced: every tensor must have the same dtype")
        op = self._checks.reduce_op("allreduce_coalesced", opts, tensors[0].dtype)

        def run(e: fl.Entry) -> None:
            flat = torch.cat([t.reshape(-1) for t in tensors])
            self._algo.all_reduce(e, flat, op)
            off = 0
            for t in tensors:
                t.copy_(flat[off : off + t.numel()].view_as(t))
                off += t.numel()

        nbytes = sum(t.nbytes for t in tensors)
        return self._worker.submit(
            "allreduce_coalesced", nbytes, run, list(tensors), opts=opts, detail=op.name
        )

    def broadcast(self, tensors: list[torch.Tensor], opts: Any = None) -> Any:  # type: ignore[override]
        t = self._one("broadcast", tensors)
        root = int(opts.rootRank) if opts is not None else 0
        if not 0 <= root < self._size:
            raise RuntimeError(f"gpubridge: broadcast: root {root} is not a rank of the group")
        return self._worker.submit(
            "broadcast", t.nbytes, lambda e: self._algo.broadcast(e, t, root), [t],
            opts=opts, detail=f"root {root}",
        )  # fmt: skip

    def barrier(self, opts: Any = None) -> Any:
        self._breaker.refuse("barrier")
        t = torch.zeros(1, dtype=torch.int32, device=self._device)
        return self._worker.submit(
            "barrier", 4, lambda e: self._algo.all_reduce(e, t, Op.SUM), [t], opts=opts
        )

    # all_gather

    def allgather(  # type: ignore[override]
        self, output_tensors: list[list[torch.Tensor]], input_tensors: list[torch.Tensor], opts: Any = None
    ) -> Any:
        inp = self._one("allgather", input_tensors)
        outs = self._checks.one_list(
            "allgather", output_tensors, inp, ("output", "every output tensor", "input")
        )

        def run(e: fl.Entry) -> None:
            flat = torch.empty(self._size * inp.numel(), dtype=inp.dtype, device=inp.device)
            self._algo.all_gather(e, flat, inp)
            for r, o in enumerate(outs):
                o.copy_(flat[r * inp.numel() : (r + 1) * inp.numel()].view_as(o))

        return self._worker.submit("allgather", inp.nbytes * self._size, run, list(outs), [inp], opts)

    def _allgather_base(self, output: torch.Tensor, input: torch.Tensor, opts: Any = None) -> Any:
        self._breaker.refuse("all_gather_into_tensor")
        self._checks.sizes("all_gather_into_tensor", output, input, ("output", "input"))

        def run(e: fl.Entry) -> None:
            self._algo.all_gather(e, output.reshape(-1), input.reshape(-1))

        return self._worker.submit("all_gather_into_tensor", output.nbytes, run, [output], [input], opts)

    def allgather_into_tensor_coalesced(
        self, outputs: list[torch.Tensor], inputs: list[torch.Tensor], opts: Any = None
    ) -> Any:
        self._breaker.refuse("allgather_into_tensor_coalesced")
        self._checks.same_count("allgather_into_tensor_coalesced", outputs, inputs)
        for o, i in zip(outputs, inputs, strict=True):
            self._checks.sizes("allgather_into_tensor_coalesced", o, i, ("output", "input"))

        def run(e: fl.Entry) -> None:
            for o, i in zip(outputs, inputs, strict=True):
                self._algo.all_gather(e, o.reshape(-1), i.reshape(-1))

        nbytes = sum(o.nbytes for o in outputs)
        return self._worker.submit(
            "allgather_into_tensor_coalesced", nbytes, run, list(outputs), list(inputs)
        )

    def allgather_coalesced(
        self, output_lists: list[list[torch.Tensor]], inputs: list[torch.Tensor], opts: Any = None
    ) -> Any:
        self._breaker.refuse("allgather_coalesced")
        if len(output_lists) != self._size or any(len(ol) != len(inputs) for ol in output_lists):
            raise RuntimeError(
                f"gpubridge: allgather_coalesced: the output must be {self._size} lists "
                f"of {len(inputs)} tensors"
            )
        for i in inputs:
            self._checks.tensor("allgather_coalesced", i)

        def run(e: fl.Entry) -> None:
            for k, i in enumerate(inputs):
                flat = torch.empty(self._size * i.numel(), dtype=i.dtype, device=i.device)
                self._algo.all_gather(e, flat, i.reshape(-1))
                for r in range(self._size):
                    output_lists[r][k].copy_(
                        flat[r * i.numel() : (r + 1) * i.numel()].view_as(output_lists[r][k])
                    )

        nbytes = sum(i.nbytes for i in inputs) * self._size
        return self._worker.submit(
            "allgather_coalesced", nbytes, run, [t for ol in output_lists for t in ol], list(inputs)
        )

    # reduce_scatter

    def reduce_scatter(  # type: ignore[override]
        self, output_tensors: list[torch.Tensor], input_tensors: list[list[torch.Tensor]], opts: Any = None
    ) -> Any:
        out = self._one("reduce_scatter", output_tensors)
        ins = self._checks.one_list("reduce_scatter", input_tensors, out, ("input", "every input", "output"))
        op = self._checks.reduce_op("reduce_scatter", opts, out.dtype)

        def run(e: fl.Entry) -> None:
            self._algo.reduce_scatter(e, out.reshape(-1), torch.cat([i.reshape(-1) for i in ins]), op)

        return self._worker.submit(
            "reduce_scatter", out.nbytes * self._size, run, [out], list(ins), opts, op.name
        )

    def _reduce_scatter_base(self, output: torch.Tensor, input: torch.Tensor, opts: Any = None) -> Any:
        self._breaker.refuse("reduce_scatter_tensor")
        self._checks.sizes("reduce_scatter_tensor", input, output, ("input", "output"))
        op = self._checks.reduce_op("reduce_scatter_tensor", opts, output.dtype)

        def run(e: fl.Entry) -> None:
            self._algo.reduce_scatter(e, output.reshape(-1), input.reshape(-1).clone(), op)

        return self._worker.submit(
            "reduce_scatter_tensor", input.nbytes, run, [output], [input], opts, op.name
        )

    def reduce_scatter_tensor_coalesced(
        self, outputs: list[torch.Tensor], inputs: list[torch.Tensor], opts: Any = None
    ) -> Any:
        self._breaker.refuse("reduce_scatter_tensor_coalesced")
        self._checks.same_count("reduce_scatter_tensor_coalesced", outputs, inputs)
        ops = []
        for o, i in zip(outputs, inputs, strict=True):
            self._checks.sizes("reduce_scatter_tensor_coalesced", i, o, ("input", "output"))
            ops.append(self._checks.reduce_op("reduce_scatter_tensor_coalesced", opts, o.dtype))

        def run(e: fl.Entry) -> None:
            for o, i, op in zip(outputs, inputs, ops, strict=True):
                self._algo.reduce_scatter(e, o.reshape(-1), i.reshape(-1).clone(), op)

        nbytes = sum(i.nbytes for i in inputs)
        return self._worker.submit(
            "reduce_scatter_tensor_coalesced", nbytes, run, list(outputs), list(inputs),
            detail=",".join(o.name for o in ops),
        )  # fmt: skip

    # point to point

    def send(self, tensors: list[torch.Tensor], dst: int, tag: int = 0) -> Any:
        _trace.refuse_in_callback("send")
        t = self._one("send", tensors)
        return self._p2p.start("send", t, dst, tag)

    def recv(self, tensors: list[torch.Tensor], src: int, tag: int = 0) -> Any:
        _trace.refuse_in_callback("recv")
        t = self._one("recv", tensors)
        return self._p2p.start("recv", t, src, tag)

    # refused
    reduce = _refused("reduce")
    alltoall = _refused("alltoall")
    alltoall_base = _refused("alltoall_base (all_to_all_single)")
    gather = _refused("gather")
    scatter = _refused("scatter")
    recv_anysource = _refused("recv from any source")

    # torch 2.13 and later call the tensor collectives by new names
    # (dist.all_gather_into_tensor calls all_gather_single, and so on).
    # Without these, the C++ base runs them on its per-device backend, which
    # a Python group has none of: "No backend type associated with device
    # type cpu".
    all_gather_single = _allgather_base
    all_gather_single_coalesced = allgather_into_tensor_coalesced
    reduce_scatter_single = _reduce_scatter_base
    reduce_scatter_single_coalesced = reduce_scatter_tensor_coalesced
    all_to_all_single = alltoall_base
    gather_single = gather
    gather_into_tensor = gather

    # ---- failure and closing ----

    def _break_links(self) -> None:
        """After a failure: aborts the feed (gbbridge sends abort frames to
        the other members) and drops the island group (its closed
        connections wake the island's peers)."""
        if self._endpoints is not None:
            self._endpoints.abort()
        if self._island is not None:
            self._island.abort()

    def _dead_bridge(self) -> str | None:
        return self._endpoints.exit_reason() if self._endpoints is not None else None

    def shutdown(self) -> None:
        self._close(abort=False)

    def abort(self) -> None:
        self._close(abort=True)

    def _close(self, abort: bool) -> None:
        """Finishes the queued collectives, says BYE to gbbridge and waits for
        it (or kills it), drops the island group and the private directory.
        Idempotent."""
        if self._breaker.closed:
            return
        w = self._worker
        if abort and not w.on_worker_thread():
            self._breaker.abort()
        w.close(self._timeout.total_seconds() + 60.0)
        self._breaker.closed = True
        self._p2p.join(5.0)
        self._release(abort)

    def _release(self, abort: bool) -> None:
        """Stops gbbridge serve, drops the island group and the private
        directory (also when set-up failed half way)."""
        eps = self._endpoints
        if eps is not None:
            rc = eps.close(abort or self._breaker.error is not None)
            if rc is not None:
                self.bridge_exit = rc
        if self._island is not None:
            self._island.close(abort)
        _setup.remove_private_dir(self._dir)
        _LIVE.discard(self)


def _global_ranks(pg: GpubridgeProcessGroup) -> list[int] | None:
    """The group's global ranks in group rank order, once torch has
    registered it (None before, and for the native API's group)."""
    try:
        m = dist.distributed_c10d._world.pg_group_ranks.get(pg)
    except Exception:
        return None
    return [g for g, _ in sorted(m.items(), key=lambda kv: kv[1])] if m else None


_LIVE: weakref.WeakSet[GpubridgeProcessGroup] = weakref.WeakSet()
_CREATED = itertools.count()


def live_groups() -> list[GpubridgeProcessGroup]:
    """The gpubridge groups of this process that are not closed."""
    return [g for g in list(_LIVE) if not g._breaker.closed]


def find_group(group: Any, what: str) -> GpubridgeProcessGroup:
    """The gpubridge group torch knows as group (None: the default group);
    RuntimeError (naming what needs it) for any other group."""
    g = dist.group.WORLD if group is None else group
    if isinstance(g, GpubridgeProcessGroup):
        return g
    name = getattr(g, "group_name", None)
    for pg in live_groups():
        if name is not None and name in (pg._group, pg.group_name):
            return pg
    if g is None:
        raise RuntimeError(f"{what} needs a gpubridge group: torch.distributed is not initialized")
    try:
        backend = str(dist.get_backend(g))
    except Exception:
        backend = "unknown"
    raise RuntimeError(f"{what} needs a gpubridge group, this group's backend is {backend!r}")


@atexit.register
def _close_all() -> None:
    for pg in list(_LIVE):
        with contextlib.suppress(Exception):
            pg.shutdown()
