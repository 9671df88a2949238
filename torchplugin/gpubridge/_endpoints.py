"""This rank's endpoint of a group, made when first needed.

An island leader of a bridged group starts its ``gbbridge serve`` with the
group (the collectives need it: bridge 0). Any other rank starts one only
when something needs the bridge from it — today its first point-to-point
with a rank of another island — with ``--no-bridge`` (feed protocol 4) and
the same topology, store, namespace and settings as the leaders' serve;
the bridges it needs come by JOIN. A group whose collectives only need
leaders therefore starts nothing new. A leader JOINs extra bridges on the
serve it has.

Failures are the group's (gpubridge._failure): an endpoint that cannot
start, a JOIN that fails, a serve that dies, each fails the operation that
needed it, which breaks the group on every rank with that root cause.
"""

from __future__ import annotations

import datetime
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from gpubridge._endpoint import BridgeEndpoint
from gpubridge._feed import Codec
from gpubridge._layout import Layout

__all__ = ["Endpoints", "pair_bridge"]


def pair_bridge(a: int, b: int) -> tuple[str, tuple[int, int]]:
    """The 2-member bridge of ranks a and b (point-to-point): its name and
    members, the same on both ranks whichever asks: ``pair/<lo>-<hi>``,
    members (lo, hi) in that order. Ranks are the group's (the topology's),
    and the name is a key under the group's own namespace in the store."""
    lo, hi = min(a, b), max(a, b)
    return f"pair/{lo}-{hi}", (lo, hi)


class Endpoints:
    """The group's endpoint on this rank: the leader's, started with the
    group (:meth:`start_leader`), or one started on first need
    (:meth:`get`); at most one."""

    def __init__(
        self,
        workdir: Path,
        store: tuple[str, int],
        namespace: str,
        layout: Layout,
        device: torch.device,
        stream: Any,
        timeout: datetime.timedelta,
        reduce_mode: str,
        codec: Codec,
    ) -> None:
        self._args = (workdir, store, namespace)
        self._layout = layout
        self._device = device
        self._stream = stream
        self._timeout = timeout
        self._reduce_mode = reduce_mode
        self._codec = codec
        self._lock = threading.Lock()
        self._ep: BridgeEndpoint | None = None  # started (perhaps not connected yet)
        self._ready: BridgeEndpoint | None = None  # connected
        self._failed: BaseException | None = None
        self._closed = False
        self.lazily_started = False  # a rank that leads no island started one

    def _start(self, bridge0: bool, give_up: Callable[[], str | None] | None = None) -> BridgeEndpoint:
        lay = self._layout
        workdir, store, namespace = self._args
        ep = BridgeEndpoint.start(
            workdir, store, namespace, lay.rank, lay.members if bridge0 else (), self._device, self._stream,
            self._timeout, self._reduce_mode, self._codec, bridge0=bridge0,
        )  # fmt: skip
        self._ep = ep  # kept before connecting: a failed start is still closed (and reaped)
        ep.connect(give_up)
        self._ready = ep
        return ep

    def start_leader(self, give_up: Callable[[], str | None] | None = None) -> BridgeEndpoint:
        """The leader's endpoint, at set-up: gbbridge serve joins bridge 0.
        give_up says why to stop waiting for the other leaders' serves (see
        BridgeProcess.wait_ready)."""
        with self._lock:
            return self._start(bridge0=True, give_up=give_up)

    @property
    def current(self) -> BridgeEndpoint | None:
        """The endpoint if this rank has one up (never starts one)."""
        return self._ready

    def get(self) -> BridgeEndpoint:
        """The endpoint, started now if this rank has none yet (a rank that
        leads no island: ``--no-bridge``). Safe from any thread; one start
        per group; a failed start fails every later call the same way."""
        ep = self._ready
        if ep is not None:
            return ep
        with self._lock:
            if self._failed is not None:
                raise RuntimeError(f"{self._failed}") from self._failed
            if self._closed:
                raise RuntimeError(f"rank {self._layout.rank}: the group's endpoint is closed")
            if self._ready is not None:
                return self._ready
            try:
                self.lazily_started = True
                return self._start(bridge0=False)
            except BaseException as e:
                self._failed = e
                raise

    def exit_reason(self) -> str | None:
        """How this rank's gbbridge serve ended, if it did."""
        ep = self._ep
        return ep.exit_reason() if ep is not None else None

    def abort(self) -> None:
        """Aborts the feed (gbbridge serve aborts its bridges, so their
        other members fail at once)."""
        ep = self._ep
        if ep is not None:
            ep.abort()

    def close(self, abort: bool) -> int | None:
        """Closes the endpoint, if any (waiting for a start in progress);
        gbbridge serve's exit status."""
        with self._lock:
            self._closed = True
            ep, self._ep, self._ready = self._ep, None, None
        return ep.close(abort) if ep is not None else None
