"""How this rank's trace clock maps onto the reference rank's, measured once
at set-up through the group's store.

The trace clock is the host's CLOCK_MONOTONIC, which every process of one
boot shares exactly: ranks whose boot id is the reference rank's (group rank
0) get offset 0 with no error. On every other boot the lowest rank asks the
reference for its clock a few times through the store, as NTP does: it reads
its own clock before (t1) and after (t2) each request, so the reference's
reading T lies between them and the offset m - T (m the midpoint of t1 and
t2) is off by at most half the round trip, (t2 - t1) / 2; the round with
the shortest trip wins. The other ranks of that boot take its result.
``offset_ns`` is this clock minus the reference's: a time t here is t -
offset_ns on the reference's clock, within ``error_ns``.
"""

from __future__ import annotations

import datetime
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

__all__ = ["Clock", "boot_id", "measure"]

ROUNDS = 5
_KEY = "gpubridge/clock"


@dataclass(frozen=True)
class Clock:
    offset_ns: int | None  # this clock minus the reference's; None: not measured
    error_ns: int | None  # |true offset - offset_ns| is at most this
    ref: int  # the reference: global rank
    method: str  # "same boot", "store round trip", "not measured: …"
    boot: str

    def to_dict(self) -> dict[str, Any]:
        return {
            "offset_ns": self.offset_ns, "error_ns": self.error_ns, "ref": self.ref,
            "method": self.method, "boot": self.boot,
        }  # fmt: skip


def boot_id() -> str:
    """The kernel's boot id: equal for every process whose CLOCK_MONOTONIC
    is the same clock (containers of one host included)."""
    try:
        return Path("/proc/sys/kernel/random/boot_id").read_text().strip()
    except OSError:
        return "unknown"


def unmeasured(why: str, ref: int = 0) -> Clock:
    """A clock whose offset is unknown (same-boot ranks still share it)."""
    return Clock(None, None, ref, f"not measured: {why}", boot_id())


def measure(store: Any, rank: int, size: int, secs: float) -> Clock:
    """This rank's clock against group rank 0's, through the group's store;
    every rank of the group calls it at the same point of set-up (the first
    group, whose rank 0 is the job's rank 0 but for odd set-ups). Waits secs
    at most for any step; a failure gives an unmeasured clock, never an
    error."""
    me = boot_id()
    ref = 0  # the first group's rank 0: the job's rank 0 with the default or native group first
    try:
        store.set(f"{_KEY}/boot/{rank}", me)
        wait = datetime.timedelta(seconds=secs)
        store.wait([f"{_KEY}/boot/{r}" for r in range(size)], wait)
        boots = [store.get(f"{_KEY}/boot/{r}").decode() for r in range(size)]
    except Exception as e:
        return unmeasured(f"the ranks' boot ids were not all in the store ({e})", ref)
    # One asker per boot other than the reference's: its lowest rank.
    askers: dict[str, int] = {}
    for r, b in enumerate(boots):
        if r > 0 and (b != boots[0] or b == "unknown"):
            askers.setdefault(f"{b}/{r}" if b == "unknown" else b, r)
    if rank > 0 and me == boots[0] and me != "unknown":
        return Clock(0, 0, ref, "same boot", me)
    try:
        if rank == 0:
            for r in sorted(askers.values()):
                for i in range(ROUNDS):
                    store.wait([f"{_KEY}/q/{r}/{i}"], wait)
                    store.set(f"{_KEY}/a/{r}/{i}", str(time.monotonic_ns()))
            return Clock(0, 0, ref, "reference" if askers else "same boot", me)
        asker = askers.get(me if me != "unknown" else f"{me}/{rank}", rank)
        if asker != rank:
            store.wait([f"{_KEY}/r/{asker}"], wait)
            off, err = (int(x) for x in store.get(f"{_KEY}/r/{asker}").decode().split())
            return Clock(off, err, ref, "store round trip", me)
        best: tuple[int, int] | None = None
        for i in range(ROUNDS):
            t1 = time.monotonic_ns()
            store.set(f"{_KEY}/q/{rank}/{i}", "1")
            store.wait([f"{_KEY}/a/{rank}/{i}"], wait)
            got = int(store.get(f"{_KEY}/a/{rank}/{i}").decode())
            t2 = time.monotonic_ns()
            cand = ((t1 + t2) // 2 - got, (t2 - t1 + 1) // 2)
            if best is None or cand[1] < best[1]:
                best = cand
        assert best is not None
        store.set(f"{_KEY}/r/{rank}", f"{best[0]} {best[1]}")
        return Clock(best[0], best[1], ref, "store round trip", me)
    except Exception as e:
        return unmeasured(f"the exchange with rank {ref} failed ({e})", ref)
