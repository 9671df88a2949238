"""The tiny call's shortcuts without a job, each against the general path
it stands in for (CPU): a small tensor's copies to and from the staging
region by memmove (gpubridge._staging.Staging.raw) give the same bytes, the
same steps and the same version counter as the torch copies, through a
whole flat all_reduce (gpubridge._bridged) too; a collective run inline
(gpubridge._worker) gives the same result, error, future and record as
one run on the worker's thread."""

from __future__ import annotations

import datetime
import math
import mmap
import struct
import threading
from typing import Any

import pytest
import torch
import torch.distributed as dist
from testenv import scale

from gpubridge import _inflight as fl
from gpubridge._bridged import all_reduce_on
from gpubridge._dtypes import as_bytes
from gpubridge._feed import Codec, Done, Op, Region, Status
from gpubridge._staging import RAW_MAX, Staging
from gpubridge._worker import _FINISHED, Worker


class _Feed:
    """map_region as a FeedClient does it; request stands for gbbridge's
    all_reduce of four ranks that all hold the same float32 values (the
    span's values times four, in place)."""

    error = None

    def __init__(self) -> None:
        self.regions: dict[int, Region] = {}
        self.requests = 0

    def map_region(self, size: int) -> Region:
        r = Region(len(self.regions) + 1, size, mmap.mmap(-1, size))
        self.regions[r.id] = r
        return r

    def release(self, region: Region) -> None:
        pass

    def request(self, kind: Any, timeout: Any = None, **kw: Any) -> Done:
        self.requests += 1
        span = kw["buf"]
        mem = self.regions[span.region].mem
        n = span.nbytes // 4
        vals = struct.unpack_from(f"<{n}f", mem, span.offset)
        struct.pack_into(f"<{n}f", mem, span.offset, *(4 * v for v in vals))
        return Done(self.requests, Status.OK, self.requests, span.nbytes, 0, 0, "")


class _Endpoint:
    """What all_reduce_on uses of a BridgeEndpoint."""

    def __init__(self) -> None:
        self.feed = _Feed()
        self.staging = Staging(self.feed, torch.device("cpu"), None, None, 10.0)  # type: ignore[arg-type]

    def join(self, name: str, members: tuple[int, ...]) -> int:
        return 1


def _entry() -> fl.Entry:
    e = fl.Entry("tiny-call-test", 1, "allreduce", 4, fl.QUEUED, "test")
    e.set_step(fl.RUNNING)
    return e


def _steps(e: fl.Entry) -> list[str]:
    return [str(s) for s in e.marks[::2]] + [e.step]


def _values(dtype: torch.dtype, n: int) -> torch.Tensor:
    """n values of dtype with the awkward ones first: NaNs with payloads
    (a quiet and a signalling one), -0.0, a subnormal, infinities."""
    if not dtype.is_floating_point:
        return torch.arange(n, dtype=torch.int64).mul(7919).to(dtype)
    t = torch.linspace(-3, 3, n, dtype=torch.float32).to(dtype)
    if dtype == torch.float32 and n >= 6:
        bits = [0x7FC01234, 0x7F801234, 0x80000000, 0x00000001, 0x7F800000, 0xFF800000]
        t[:6] = torch.tensor(bits, dtype=torch.int64).to(torch.int32).view(torch.float32)
    return t


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.int64, torch.uint8])
@pytest.mark.parametrize("n", [1, 7, 1000])
def test_raw_copies_match_the_torch_copies(dtype: torch.dtype, n: int) -> None:
    """Copies in and out by memmove leave the region and the tensor the
    same bytes as the torch copies of its byte view, mark the same steps
    and move the tensor's version counter alike."""
    got: dict[bool, tuple[bytes, bytes, list[str], int]] = {}
    for raw in (True, False):
        st = Staging(_Feed(), torch.device("cpu"), None, None, 10.0)  # type: ignore[arg-type]
        t = _values(dtype, n)
        assert st.raw(t)
        src = t if raw else as_bytes(t)
        host = st.tensor(src.nbytes)
        e = _entry()
        v0 = t._version
        st.copy_in(e, host, src, raw)
        region = bytes(host.numpy())
        host.copy_(torch.arange(host.numel(), dtype=torch.int64).mul(31).remainder(256).to(torch.uint8))
        st.copy_out(e, src, host, raw)
        got[raw] = (region, bytes(as_bytes(t).numpy()), _steps(e), t._version - v0)
    assert got[True] == got[False]
    region, _, steps, versions = got[True]
    assert region == bytes(as_bytes(_values(dtype, n)).numpy())
    assert steps == [fl.QUEUED, fl.RUNNING, fl.COPY, fl.COPY_BACK]
    assert versions == got[False][3] >= 1


def test_raw_takes_only_what_its_byte_view_takes() -> None:
    """Anything but a plain 1-D CPU tensor of stride 1 and at most RAW_MAX
    bytes, with a version counter and no negative bit, takes the torch
    copies (and their errors)."""
    st = Staging(_Feed(), torch.device("cpu"), None, None, 10.0)  # type: ignore[arg-type]
    assert st.raw(torch.zeros(RAW_MAX // 4))
    assert not st.raw(torch.zeros(RAW_MAX // 4 + 1))
    assert not st.raw(torch.zeros(2, 2))
    assert not st.raw(torch.zeros(()))
    assert not st.raw(torch.arange(10.0)[3::5][:1])  # contiguous, stride 5: its byte view raises
    assert not st.raw(torch._neg_view(torch.ones(2)))
    assert not st.raw(torch.nn.Parameter(torch.ones(2)))
    with torch.inference_mode():
        inf = torch.ones(2)
    assert not st.raw(inf)
    gpu = Staging(_Feed(), torch.device("cuda"), None, None, 10.0)  # type: ignore[arg-type]
    assert not gpu.raw(torch.ones(2))


@pytest.mark.parametrize("n", [1, 3, RAW_MAX // 4, RAW_MAX // 4 + 5])
def test_flat_all_reduce_raw_or_not_gives_the_same_bits_and_record(
    n: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """all_reduce_on (the flat policy's step) with the memmove copies and
    with the torch copies: the same result bit for bit, the same steps, the
    same bridge record; a leaf that requires grad is all-reduced either way
    (its byte view does not), its version moved on."""
    x = _values(torch.float32, n)
    got = {}
    for raw in (True, False):
        if not raw:
            monkeypatch.setattr(Staging, "raw", lambda self, t: False)
        ep = _Endpoint()
        t = x.clone().requires_grad_(n == 3)
        e = _entry()
        v0 = t._version
        all_reduce_on(ep, e, t, "flat", (0, 1, 2, 3), Op.SUM, Codec.RAW)  # type: ignore[arg-type]
        result = bytes(as_bytes(t.detach()).numpy())
        got[raw] = (result, _steps(e), e.bridge, tuple(e.bridge_ranks), t._version > v0)
    assert got[True] == got[False]
    result, steps, _, ranks, moved = got[True]
    want = (x * 4).view(torch.int32)
    same = torch.frombuffer(bytearray(result), dtype=torch.int32)
    finite = torch.isfinite(x)
    assert torch.equal(same[finite], want[finite])
    floats = torch.frombuffer(bytearray(result), dtype=torch.float32)
    assert all(math.isnan(v) for v in floats[x.isnan()].tolist())
    assert steps == [fl.QUEUED, fl.RUNNING, fl.COPY, fl.BRIDGE, fl.COPY_BACK]
    assert ranks == (0, 1, 2, 3) and moved


class _Breaker:
    error: str | None = None

    def refuse(self, op: str) -> None:
        pass

    def fail(self, e: fl.Entry, exc: BaseException) -> RuntimeError:
        err = RuntimeError(f"rank 0: {e.op} (collective #{e.seq}, step {e.step}): {exc}")
        err.__cause__ = exc
        return err


def _opts(sync: bool) -> Any:
    o = dist.AllreduceOptions()
    o.asyncOp = not sync
    return o


@pytest.fixture
def worker() -> Any:
    timeout = datetime.timedelta(seconds=scale(30))
    w = Worker("tiny-call-test", torch.device("cpu"), None, timeout, _Breaker(), None)  # type: ignore[arg-type]
    yield w
    w.close(scale(10))


def test_inline_call_gives_what_a_queued_one_gives(worker: Worker) -> None:
    """A synchronous call with nothing queued runs on the caller's thread,
    makes no Event of its own and no future until asked: its Work, future,
    record and statistics are what the same call run on the worker's thread
    gives."""
    got = {}
    for sync in (True, False):
        t = torch.zeros(3)

        def run(e: fl.Entry, t: torch.Tensor = t) -> None:
            e.set_step(fl.COPY)
            t.add_(2)

        w = worker.submit("allreduce", 12, run, [t], opts=_opts(sync), detail="SUM")
        assert w.wait()
        assert w.is_completed() and w.is_success() and w.exception() is None
        fut = w.get_future()
        assert fut.wait()[0] is t and w.get_future() is fut
        task = w._task
        assert (task.done is _FINISHED) == sync
        assert (task.entry.thread == threading.current_thread().name) == sync
        e = task.entry
        got[sync] = (t.tolist(), _steps(e), e.detail, e.op, e.nbytes, e.asynchronous)
    assert got[True][:5] == got[False][:5]
    assert (got[True][5], got[False][5]) == (False, True)
    assert worker.stats()["allreduce"]["calls"] == 2
    assert set(worker.stats()["allreduce"]["steps"]) == {fl.QUEUED, fl.RUNNING, fl.COPY}


def test_inline_failure_fails_its_work_and_future_alike(worker: Worker) -> None:
    """A failing inline call: wait raises the group's error, the future (made
    on demand) fails with it, and exception() is it; the same as queued."""
    msgs = {}
    for sync in (True, False):

        def run(e: fl.Entry) -> None:
            raise OSError("the peer went away")

        w = worker.submit("allreduce", 4, run, [torch.zeros(1)], opts=_opts(sync))
        with pytest.raises(RuntimeError, match="the peer went away") as err:
            w.wait()
        assert w.exception() is err.value and not w.is_success() and w.is_completed()
        with pytest.raises(RuntimeError, match="the peer went away"):
            w.get_future().wait()
        msgs[sync] = str(err.value).replace("#1", "#N").replace("#2", "#N")
    assert msgs[True] == msgs[False]
