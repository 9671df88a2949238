"""Step 1 on one node: gbprobe --json --require <the component's words>;
prints one JSON line (schema gpubridge.kit-probe/v1) and exits 0 whatever
the verdict (the row carries it; the batch script judges every node).

In simulation (KIT_SIMULATE=1) the simulated vendor may satisfy nvidia/amd
(--allow-simulated, said in the row); gpu and gpus=N still count real GPUs.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

from kitcommon import component, emit, find_tool, simulated

SCHEMA = "gpubridge.kit-probe/v1"


def main() -> int:
    row = {"schema": SCHEMA, **component(), "require": os.environ.get("KIT_REQUIRE", "")}
    row["simulated_vendor"] = os.environ.get("GPUBRIDGE_VENDOR") if simulated() else None
    tool = find_tool("gbprobe")
    if tool is None:
        row.update(
            rc=2, ok=False, failed=["gbprobe not found (GPUBRIDGE_BIN_DIR, the gpubridge package, PATH)"]
        )
        emit(row)
        return 0
    cmd = [tool, "--json"]
    if row["require"]:
        cmd += ["--require", row["require"]]
    if simulated():
        cmd.append("--allow-simulated")
    row["command"] = " ".join(cmd)
    t0 = time.monotonic()
    try:
        p = subprocess.run(cmd, capture_output=True, text=True, timeout=120, check=False)
    except subprocess.TimeoutExpired:
        row.update(rc=2, ok=False, failed=["gbprobe did not answer within 120 s"])
        emit(row)
        return 0
    row["seconds"] = round(time.monotonic() - t0, 3)
    row["rc"] = p.returncode
    row["ok"] = p.returncode == 0
    lines = [ln for ln in p.stderr.splitlines() if ln.startswith("gbprobe: ")]
    row["failed"] = lines or (
        [] if p.returncode == 0 else [p.stderr.strip()[-500:] or f"gbprobe exit {p.returncode}"]
    )
    try:
        rep = json.loads(p.stdout)
    except json.JSONDecodeError:
        rep = None
    if isinstance(rep, dict):
        row["hostname"] = rep.get("hostname")
        row["vendor_found"] = rep.get("vendor")
        row["real_vendor"] = rep.get("real_vendor")
        row["probe_simulated"] = rep.get("simulated")
        gpus = rep.get("gpus") or []
        row["gpus"] = len(gpus)
        row["gpu_names"] = sorted({str(g.get("name")) for g in gpus})
        row["nics_up"] = [n.get("name") for n in rep.get("nics") or [] if n.get("state") == "up"]
        row["rdma_active"] = [
            f"{d.get('name')}/{p_.get('port')} {p_.get('link_layer')} {p_.get('rate')}"
            for d in rep.get("rdma") or []
            for p_ in d.get("ports") or []
            if str(p_.get("state", "")).upper().endswith("ACTIVE")
        ]
        row["problems"] = rep.get("problems") or []
        row["requirements"] = rep.get("requirements") or []
    emit(row)
    return 0


if __name__ == "__main__":
    sys.exit(main())
