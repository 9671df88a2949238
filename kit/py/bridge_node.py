"""Step 2 on one component's leader node (one task per component):

1. gbprobe --json | gbdiscover among the leaders (one discovery rank per
   component, the component's vendor): the transport a job's bridge would
   use between these nodes, and why (GPUBRIDGE_BRIDGE asks for one);
2. gbbridge selftest --store across the leaders over that transport: every
   collective x dtype x op bit for bit, then an all_reduce bandwidth sweep.

Prints JSON lines: the topology as each leader saw it
(gpubridge.kit-bridge-topology/v1); on component 0 the selftest's report
(gpubridge.kit-bridge-selftest/v1), its bandwidth rows as perftest-style
rows (gpubridge.kit-bridge-bw/v1) and the summary
(gpubridge.kit-bridge-summary/v1); on the others their exit status
(gpubridge.kit-bridge-member/v1). Exits 0 when the selftest passed on this
member, 1 when it failed, 2 when it could not run. The perftest-style table
goes to stderr.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from typing import Any

from kitcommon import component, emit, env_int, find_tool, log


class StepError(Exception):
    """What stopped this member; fail: the cluster failed the step (else the
    kit could not run it)."""

    def __init__(self, msg: str, fail: bool = False) -> None:
        super().__init__(msg)
        self.fail = fail


def last_lines(text: str, n: int = 3) -> str:
    return " | ".join(ln for ln in text.strip().splitlines()[-n:] if ln)


def discover(tools: dict[str, str], store: str, ns: str, k: int, count: int) -> dict[str, Any]:
    """The leaders' topology, as gbdiscover decides it for a job."""
    probe = subprocess.run(
        [tools["gbprobe"], "--json"], capture_output=True, text=True, timeout=300, check=False
    )
    if probe.returncode != 0:
        raise StepError(f"gbprobe --json exited {probe.returncode}: {last_lines(probe.stderr)}")
    cmd = [tools["gbdiscover"], "--store", store, "--rank", str(k), "--world-size", str(count)]
    cmd += ["--namespace", ns, "--local-rank", "0", "--pid", str(os.getpid())]
    disc = subprocess.run(cmd, input=probe.stdout, capture_output=True, text=True, timeout=600, check=False)
    try:
        topo: dict[str, Any] = json.loads(disc.stdout)
    except json.JSONDecodeError:
        topo = {}
    if disc.returncode != 0 or topo.get("schema") != "gpubridge.topology/v1":
        problems = "; ".join(map(str, topo.get("problems") or [last_lines(disc.stderr)]))
        # Discovery refusing these leaders (exit 1) is the cluster failing the step.
        raise StepError(
            f"gbdiscover among the leaders (exit {disc.returncode}): {problems}", disc.returncode == 1
        )
    return topo


def perftest_rows(bw: list[dict[str, Any]]) -> None:
    """The selftest's bandwidth rows, as JSON lines and as a perftest-style
    table on stderr."""
    log(f"{'#bytes':>12} {'t_avg[usec]':>12} {'BW average[GB/s]':>17} {'busBW[GB/s]':>12}")
    for r in bw:
        row = {
            "schema": "gpubridge.kit-bridge-bw/v1",
            "bytes": r.get("size"),
            "t_avg_us": r.get("time_us"),
            "bw_average_gbps": r.get("algbw_gbps"),
            "busbw_gbps": r.get("busbw_gbps"),
            "members": r.get("members"),
            "collective": r.get("collective"),
            "type": r.get("type"),
            "transport": r.get("transport"),
            "wrong": r.get("wrong"),
        }
        emit(row)
        t, bw_avg, bus = row["t_avg_us"], row["bw_average_gbps"], row["busbw_gbps"]
        log(f"{row['bytes']:>12} {t:>12.1f} {bw_avg:>17.3f} {bus:>12.3f}")


def verdict(run: dict[str, Any], ok: bool, rc: int, stderr: str, bridge: dict[str, Any], count: int) -> str:
    transport = bridge.get("transport")
    hosts = ", ".join(map(str, bridge.get("hosts") or []))
    if ok:
        bw = run.get("bandwidth") or []
        top = max(bw, key=lambda r: r.get("size", 0)) if bw else None
        fig = ""
        if top:
            mib, bus, us = top["size"] >> 20, top["busbw_gbps"], top["time_us"]
            fig = f"; all_reduce {mib} MiB: {bus:.2f} GB/s busbw, {us:.0f} us"
        return (
            f"selftest over {transport} between {count} leaders ({hosts}; discovery: "
            f"{bridge.get('reason')}): {run.get('cases')} cases bit for bit "
            f"in {run.get('seconds', 0):.1f} s{fig}"
        )
    if run.get("failures"):
        f0 = run["failures"][0]
        what = f0.get("error") or f"{f0.get('wrong_elements')} elements wrong"
        return (
            f"selftest over {transport} between {hosts}: {run.get('failed')} of {run.get('cases')} "
            f"cases failed; first: {f0.get('case')}: {what}"
        )
    return f"selftest over {transport} between {hosts} exited {rc}: {last_lines(stderr)}"


def run_member(me: dict[str, Any]) -> int:
    k, count = int(me["component"]), env_int("KIT_K")
    store = f"{os.environ['MASTER_ADDR']}:{os.environ['MASTER_PORT']}"
    base = f"job-{os.environ['SLURM_JOB_ID']}/attempt-{os.environ.get('SLURM_RESTART_COUNT', '0')}/step2"
    found = {t: find_tool(t) for t in ("gbprobe", "gbdiscover", "gbbridge")}
    tools = {t: p for t, p in found.items() if p is not None}
    if len(tools) < len(found):
        missing = ", ".join(t for t in found if t not in tools)
        raise StepError(
            f"{missing} not found on {me['node']} (GPUBRIDGE_BIN_DIR, the gpubridge package, PATH)"
        )
    if count < 2:
        if k == 0:
            reason = "one component: a job of one vendor has no bridge"
            emit({"schema": "gpubridge.kit-bridge-summary/v1", "not_run": True, "ok": True, "reason": reason})
        return 0

    # 1. Discovery among the leaders: the transport a job would get here.
    topo = discover(tools, store, base + "/discover", k, count)
    bridge = topo.get("bridge", {})
    transport = str(bridge.get("transport"))
    emit(
        {
            "schema": "gpubridge.kit-bridge-topology/v1",
            **me,
            "transport": transport,
            "reason": bridge.get("reason"),
            "requested": bridge.get("requested"),
            "hosts": bridge.get("hosts"),
            "islands": [(i["label"], i["hosts"]) for i in topo.get("islands", [])],
            "run_kind": topo.get("run_kind"),
        }
    )
    if transport not in ("tcp", "shm", "verbs"):
        raise StepError(f"discovery picked transport {transport!r}; the selftest runs tcp, shm and verbs")

    # 2. The selftest across the leaders, over that transport.
    cmd = [tools["gbbridge"], "selftest", "--store", store, "--rank", str(k), "--world-size", str(count)]
    # --full: every collective x dtype x op (the default is a subset); --json:
    # the report on stdout instead of tables; --no-perf: the all_reduce sweep
    # is the step's bandwidth measurement.
    cmd += ["--namespace", base + "/selftest", "--transport", transport, "--full", "--json", "--no-perf"]
    st = subprocess.run(cmd, capture_output=True, text=True, timeout=3600, check=False)
    if k != 0:
        row = {"schema": "gpubridge.kit-bridge-member/v1", **me, "rc": st.returncode}
        emit({**row, "stderr": last_lines(st.stderr, 5)})
        return 0 if st.returncode == 0 else 1
    try:
        rep: dict[str, Any] = json.loads(st.stdout)
    except json.JSONDecodeError:
        rep = {}
    # The whole report ({"schema", "ok", "runs": [...]}) or, as a member of a
    # run across hosts prints it, the run's object alone.
    run: dict[str, Any] = (rep.get("runs") or [{}])[0] if "runs" in rep else rep
    ok = st.returncode == 0 and bool(run) and not run.get("failed") and rep.get("ok", True) is True
    detail = {k_: v for k_, v in run.items() if k_ != "bandwidth"}
    row = {"schema": "gpubridge.kit-bridge-selftest/v1", **me, "rc": st.returncode, "command": " ".join(cmd)}
    emit({**row, "ok": ok, **detail})
    perftest_rows(run.get("bandwidth") or [])
    emit(
        {
            "schema": "gpubridge.kit-bridge-summary/v1",
            "ok": ok,
            "reason": verdict(run, ok, st.returncode, st.stderr, bridge, count),
            "transport": transport,
            "hosts": bridge.get("hosts"),
        }
    )
    return 0 if ok else 1


def main() -> int:
    me = component()
    try:
        return run_member(me)
    except StepError as e:
        emit({"schema": "gpubridge.kit-error/v1", **me, "fail": e.fail, "error": str(e)})
        return 1 if e.fail else 2


if __name__ == "__main__":
    sys.exit(main())
