"""Point-to-point: send and recv inside an island on the native group (tags
as the native group treats them); across islands between leaders only, on a
region of their own, through gbbridge's tagged SEND/RECV (which never wait
behind collectives). On GPUs across islands is refused for now (its staging
copies are not written); between non-leaders of different islands a message
would need a relay on both leaders, which do not take part in the call, so
it is refused on both ranks, naming the leaders."""

from __future__ import annotations

import contextlib
import datetime
import threading
from typing import Any

import torch

from gpubridge import _inflight as fl
from gpubridge._dtypes import as_bytes
from gpubridge._endpoint import BridgeEndpoint
from gpubridge._failure import Breaker
from gpubridge._feed import Kind
from gpubridge._island import IslandGroup
from gpubridge._layout import Layout
from gpubridge._worker import Task, Work

__all__ = ["PointToPoint"]


class PointToPoint:
    def __init__(
        self,
        group: str,
        layout: Layout,
        island: IslandGroup,
        endpoint: BridgeEndpoint | None,
        breaker: Breaker,
        device: torch.device,
        timeout: datetime.timedelta,
    ) -> None:
        self._group = group
        self._layout = layout
        self._island = island
        self._endpoint = endpoint
        self._breaker = breaker
        self._device = device
        self._timeout = timeout
        self._threads: set[threading.Thread] = set()

    def start(self, op: str, t: torch.Tensor, peer: int, tag: int) -> Any:
        """A send (op "send") or recv of t to or from rank peer; returns its
        Work."""
        lay = self._layout
        if not 0 <= peer < lay.size or peer == lay.rank:
            raise RuntimeError(f"gpubridge: {op}: peer {peer} is not another rank of the group")
        peer_island = lay.island_of(peer)
        if peer_island.label == lay.island.label:
            local = lay.island.ranks.index(peer)
            return self._island.send(t, local, tag) if op == "send" else self._island.recv(t, local, tag)
        if not (lay.is_leader and peer_island.leader == peer):
            raise RuntimeError(
                f"gpubridge: {op} between rank {lay.rank} (island {lay.island.label}) and rank {peer} "
                f"(island {peer_island.label}): point-to-point across islands runs between island leaders "
                f"only (ranks {', '.join(str(m) for m in lay.members)})"
            )
        if self._device.type == "cuda":
            raise RuntimeError(
                f"gpubridge: {op} across islands is not supported on GPUs yet (CPU tensors only)"
            )
        return self._bridged(op, t, lay.members.index(peer), tag)

    def _bridged(self, op: str, t: torch.Tensor, peer: int, tag: int) -> Work:
        """A send or recv between leaders over the bridge, on a region of its
        own, completed by a thread of its own (SEND and RECV run concurrently
        in gbbridge, so an isend/irecv pair never waits on the other)."""
        assert self._endpoint is not None
        feed = self._endpoint.feed
        self._breaker.refuse(op)
        fut: Any = torch.futures.Future()
        src = as_bytes(t)
        nb = src.numel()
        region = feed.map_region(max(nb, 1))
        box = {"host": torch.frombuffer(region.mem, dtype=torch.uint8, count=max(nb, 1))[:nb]}
        if op == "send":
            box["host"].copy_(src)
        call = feed.start(Kind.SEND if op == "send" else Kind.RECV, region.span(0, nb), peer=peer, tag=tag)
        entry = fl.Entry(self._group, 0, op, nb, fl.P2P, threading.current_thread().name)
        task = Task(entry, lambda e: None, fut, [t])

        def run() -> None:
            fl.enter(entry)
            try:
                d = call.wait()
                if op == "recv":
                    if d.nbytes != nb:
                        raise RuntimeError(f"recv: got {d.nbytes} bytes, the tensor holds {nb}")
                    src.copy_(box["host"])
                task.done.set()
                fut.set_result([t])
            except BaseException as exc:
                task.exc = self._breaker.fail(entry, exc)
                task.done.set()
                fut.set_exception(task.exc)
            finally:
                fl.leave()
                box.clear()  # the view goes before its mapping
                with contextlib.suppress(Exception):
                    feed.release(region)
                self._threads.discard(threading.current_thread())

        th = threading.Thread(target=run, name=f"gpubridge-{self._group}-{op}", daemon=True)
        self._threads.add(th)
        th.start()
        return Work(task, self._device, self._timeout)

    def join(self, secs: float) -> None:
        """Waits (secs for each at most) for the bridged sends and recvs in
        flight."""
        for th in list(self._threads):
            th.join(secs)
