"""Discovery for a group: ``gbprobe --json | gbdiscover run`` against the
job's TCPStore, and what the plugin tells it.

:func:`discover` returns the topology, or raises the same RuntimeError on
every rank. What is wrong with this rank before discovery
(:func:`rank_problems`: a bad LOCAL_RANK, a missing gbbridge; a missing
gbprobe) is handed to gbdiscover as ``--problem``, so every rank fails naming
it. A rank without gbdiscover writes a failure record into the store itself
(:func:`publish_failure`), so the other ranks fail at once with its cause
instead of waiting for it until the timeout. The store is found under
torch's PrefixStore chain (:func:`store_address`); :func:`namespace` keeps
jobs, restart attempts and groups apart in it.
"""

from __future__ import annotations

import datetime
import json
import os
import re
import socket
import subprocess
import time
from pathlib import Path
from typing import Any

from torch._C._distributed_c10d import TCPStore

from gpubridge._tools import TOOLS, lookup

__all__ = ["discover", "namespace", "publish_failure", "rank_problems", "store_address"]

# What gbdiscover reads and writes in the store (lib/discover: record.go,
# exchange.go): the record of rank r is the wire key
# "/gpubridge/<namespace>/record/<r>"; "reported" counts the records written
# and "read" the ranks that have the verdict. Python's TCPStore adds the
# leading "/" itself.
RECORD_SCHEMA = "gpubridge.record/v1"
TOPOLOGY_SCHEMA = "gpubridge.topology/v1"


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


def namespace(group: str) -> str:
    base = os.environ.get("GPUBRIDGE_NAMESPACE") or (
        f"job-{os.environ.get('TORCHELASTIC_RUN_ID') or os.environ.get('SLURM_JOB_ID') or 'default'}"
        f"/attempt-{os.environ.get('TORCHELASTIC_RESTART_COUNT') or '0'}"
    )
    return f"{base}/group-{group}"


_INT = re.compile(r"-?[0-9]+")


def _local_rank() -> tuple[int, list[str]]:
    """This rank's LOCAL_RANK (or SLURM_LOCALID), -1 when neither is set,
    and what is wrong with it."""
    var = "LOCAL_RANK" if "LOCAL_RANK" in os.environ else "SLURM_LOCALID"
    v = os.environ.get(var)
    if v is None:
        return -1, []
    if not _INT.fullmatch(v.strip()):
        return -1, [f"{var}={v!r} is not an integer"]
    n = int(v)
    if n < 0:
        return -1, [f"{var}={v!r} is negative"]
    lws = os.environ.get("LOCAL_WORLD_SIZE")
    if lws is not None:
        if not _INT.fullmatch(lws.strip()) or int(lws) < 1:
            return n, [f"LOCAL_WORLD_SIZE={lws!r} is not a positive integer"]
        if n >= int(lws):
            return n, [f"{var}={v!r} is not below LOCAL_WORLD_SIZE={lws!r}"]
    return n, []


def rank_problems() -> list[str]:
    """What is wrong with this rank before discovery, one sentence each
    (without the rank: gbdiscover names it): LOCAL_RANK (or SLURM_LOCALID)
    not an integer, negative, or not below LOCAL_WORLD_SIZE; tools not found
    (one sentence naming them all: gbprobe, gbdiscover, and gbbridge, since
    any rank may lead an island). discover() checks these itself."""
    _, problems = _local_rank()
    _, missing = lookup(list(TOOLS))
    if missing is not None:
        problems.append(missing.problem)
    return problems


def _hostname() -> str:
    """The host name gbdiscover would report for this rank."""
    sim = os.environ.get("GPUBRIDGE_SIM_HOSTNAME")
    if sim and os.environ.get("GPUBRIDGE_VENDOR"):
        return sim
    return socket.gethostname()


def _failure_message(problems: list[str]) -> str:
    return "gpubridge: discovery failed: " + "; ".join(problems)


def publish_failure(
    host: str, port: int, rank: int, size: int, namespace: str, problems: list[str], timeout: float = 60.0
) -> None:
    """Writes a record of this rank holding only problems into the store,
    for a rank that cannot run gbdiscover: the other ranks' gbdiscover then
    decides at once and fails naming "rank R (host): problem". Counts this
    rank as having read the verdict; rank 0 (whose process may host the
    store) then waits, within timeout, until every rank has read it."""
    deadline = time.monotonic() + timeout
    secs = datetime.timedelta(seconds=max(1.0, timeout))
    store = TCPStore(host, port, is_master=False, wait_for_workers=False, timeout=secs)
    ns = f"gpubridge/{namespace}/"
    rec = {
        "schema": RECORD_SCHEMA,
        "rank": rank,
        "world_size": size,
        "local_rank": _local_rank()[0],
        "hostname": _hostname(),
        "problems": problems,
    }
    store.set(f"{ns}record/{rank}", json.dumps(rec))
    store.add(f"{ns}reported", 1)
    store.add(f"{ns}read", 1)
    if rank == 0:
        wait = 0.002
        while store.add(f"{ns}read", 0) < size and time.monotonic() + wait < deadline:
            time.sleep(wait)
            wait = min(wait * 2, 0.05)


def discover(
    host: str,
    port: int,
    rank: int,
    size: int,
    namespace: str,
    topo_path: Path,
    timeout: float = 60.0,
    problems: list[str] | None = None,
    settings: dict[str, str] | None = None,
) -> dict[str, Any]:
    """Runs gbprobe --json | gbdiscover run with a deadline of timeout
    seconds; returns the topology (also written to topo_path) or raises
    RuntimeError with gbdiscover's problems, the same on every rank.
    settings (key: value) must be equal on every rank: a rank that differs
    fails every rank's discovery, naming it.

    This rank's own problems go to gbdiscover as --problem: those of
    rank_problems() (the tools are looked up once, and all those missing
    named in one sentence), then the caller's extra problems (duplicates
    dropped). Without gbprobe, gbdiscover reads no probe report. A missing
    gbdiscover raises here at once, after publish_failure() told the other
    ranks."""
    local, own = _local_rank()
    tools, missing = lookup(list(TOOLS))
    found = (p.strip() for p in [*own, *([missing.problem] if missing else []), *(problems or [])])
    problems = list(dict.fromkeys(p for p in found if p))
    timeout = max(1.0, timeout)
    gbdiscover = tools.get("gbdiscover")
    if gbdiscover is None:
        named = [f"rank {rank} ({_hostname()}): {p}" for p in problems]
        try:
            publish_failure(host, port, rank, size, namespace, problems, timeout)
        except Exception as pe:  # the store failed too: say so, keep the cause
            raise RuntimeError(
                f"{_failure_message(named)} (and telling the other ranks through the store at "
                f"{host}:{port} failed: {pe})"
            ) from missing
        raise RuntimeError(_failure_message(named)) from missing
    gbprobe = tools.get("gbprobe")
    cmd = [
        gbdiscover, "run", "--store", f"{host}:{port}", "--rank", str(rank),
        "--world-size", str(size), f"--local-rank={local}", "--namespace", namespace,
        "--timeout", f"{timeout:.3f}s", f"--pid={os.getpid()}",  # the rank's claim names this process
    ]  # fmt: skip
    if gbprobe is None:
        cmd += ["--probe", os.devnull]
    for p in problems:
        cmd.append(f"--problem={p}")
    for k, v in sorted((settings or {}).items()):
        cmd.append(f"--setting={k}={v}")
    # LOCAL_RANK is checked above and passed as a flag; gbdiscover would
    # refuse to start on a bad value in its environment (without reporting).
    env = {k: v for k, v in os.environ.items() if k not in ("LOCAL_RANK", "SLURM_LOCALID")}
    probe = None
    if gbprobe is not None:
        probe = subprocess.Popen([gbprobe, "--json"], stdin=subprocess.DEVNULL, stdout=subprocess.PIPE)
    try:
        try:
            disc = subprocess.run(
                cmd,
                stdin=probe.stdout if probe is not None else subprocess.DEVNULL,
                capture_output=True,
                check=False,
                env=env,
                timeout=timeout + 30.0,
            )
        except subprocess.TimeoutExpired as e:
            raise RuntimeError(f"gpubridge: gbdiscover did not finish within {timeout + 30.0:.0f} s") from e
    finally:
        if probe is not None:
            if probe.stdout is not None:
                probe.stdout.close()
            try:
                probe.wait(30.0)
            except subprocess.TimeoutExpired:
                probe.kill()
                probe.wait()
    out = disc.stdout.decode("utf-8", "replace").strip()
    try:
        doc = json.loads(out) if out else None
    except ValueError:
        doc = None
    if disc.returncode == 0 and isinstance(doc, dict) and doc.get("schema") == TOPOLOGY_SCHEMA:
        topo_path.write_bytes(disc.stdout)
        return doc
    if isinstance(doc, dict) and doc.get("problems"):
        raise RuntimeError(_failure_message([str(p) for p in doc["problems"]]))
    err = disc.stderr.decode("utf-8", "replace").strip()
    raise RuntimeError(f"gpubridge: gbdiscover exited {disc.returncode}: {err or out}")
