"""examples/ as a new user meets them: ``--help`` answers without torch or
gpubridge importable, and the FSDP example reports its bridge as the DDP
one does (ci/demo.sh runs the DDP example in full)."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import hung
import pytest
from testenv import scale

HERE = Path(__file__).resolve().parent
PKG = HERE.parent
REPO = PKG.parent
EXAMPLES = REPO / "examples"
BIN = REPO / "bin"
TOOLS = [BIN / t for t in ("gbprobe", "gbdiscover", "gbbridge")]

needs_tools = pytest.mark.skipif(
    not all(os.access(t, os.X_OK) for t in TOOLS),
    reason=f"needs bin/gbprobe, bin/gbdiscover and bin/gbbridge: run `make build` in {REPO}",
)


class _Writes:
    """A stdout that keeps each write call apart, as an unbuffered pipe does."""

    def __init__(self) -> None:
        self.calls: list[str] = []

    def write(self, s: str) -> int:
        self.calls.append(s)
        return len(s)

    def flush(self) -> None:
        pass


@pytest.mark.parametrize(("example", "extra"), [("ddp_train", (True,)), ("pipeline_train", ())])
def test_a_row_is_one_write(monkeypatch: pytest.MonkeyPatch, example: str, extra: tuple[bool, ...]) -> None:
    """Every rank shares torchrun's stdout: a row written in two parts (print's
    separate newline) let two ranks' rows land on one line in CI."""
    monkeypatch.syspath_prepend(str(PKG))
    spec = importlib.util.spec_from_file_location(example, EXAMPLES / f"{example}.py")
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    out = _Writes()
    monkeypatch.setattr(sys, "stdout", out)
    mod.emit({"rank": 1, "x": 2}, *extra)
    assert len(out.calls) == 1 and out.calls[0].endswith("}\n"), out.calls
    assert json.loads(out.calls[0])["rank"] == 1


@pytest.mark.parametrize("example", ["ddp_train.py", "fsdp_train.py", "pipeline_train.py"])
def test_help_needs_neither_torch_nor_gpubridge(tmp_path: Path, example: str) -> None:
    """python -S -I: no site-packages (so no torch) and no PYTHONPATH."""
    cmd = [sys.executable, "-S", "-I", str(EXAMPLES / example)]
    p = subprocess.run([*cmd, "--help"], cwd=tmp_path, capture_output=True, text=True, timeout=scale(30))
    assert p.returncode == 0, p.stderr
    assert p.stdout.startswith(f"usage: {example} [-h]"), p.stdout
    p = subprocess.run([*cmd, "--bogus"], cwd=tmp_path, capture_output=True, text=True, timeout=scale(30))
    assert p.returncode == 2 and "unrecognized arguments: --bogus" in p.stderr, p.stderr


@needs_tools
def test_fsdp_example_reports_the_bridge(tmp_path: Path) -> None:
    env = dict(os.environ, PYTHONPATH=str(PKG), GPUBRIDGE_BIN_DIR=str(BIN), OMP_NUM_THREADS="1")
    env["PYTHONUNBUFFERED"] = "1"  # unbuffered stdout: a row written in two parts would interleave
    env["GPUBRIDGE_SIM_VENDORS"] = "nvidia,amd"
    for k in ("GPUBRIDGE_VENDOR", "GPUBRIDGE_BRIDGE", "GPUBRIDGE_NAMESPACE"):
        env.pop(k, None)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2"]
    cmd += [str(EXAMPLES / "fsdp_train.py"), "--steps", "2", "--layers", "1", "--dim", "32"]
    p = hung.run(cmd, cwd=tmp_path, env=env, text=True, timeout=scale(180))
    assert p.returncode == 0, (p.stdout + p.stderr)[-6000:]
    lines = p.stderr.splitlines()
    assert "island nvidia: ranks [0], leader 0, gloo" in lines, p.stderr[-3000:]
    bridge = [ln for ln in lines if ln.startswith("bridge: ")]
    assert len(bridge) == 1 and bridge[0].startswith("bridge: leaders [0, 1] over "), p.stderr[-3000:]
    assert any(ln.endswith("parameters identical on every rank") for ln in lines), p.stderr[-3000:]


@needs_tools
@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
def test_pipeline_example_is_exact(tmp_path: Path, schedule: str) -> None:
    """Stage 0 on the nvidia island, stage 1 on the amd one: activations and
    their gradients cross over gpubridge's point-to-point, and every rank's
    parameters and the last stage's losses equal a single-process run of
    the same schedule's arithmetic bit for bit (--check)."""
    env = dict(os.environ, PYTHONPATH=str(PKG), GPUBRIDGE_BIN_DIR=str(BIN), OMP_NUM_THREADS="1")
    env["PYTHONUNBUFFERED"] = "1"  # unbuffered stdout: a row written in two parts would interleave
    env["GPUBRIDGE_SIM_VENDORS"] = "nvidia,amd"
    for k in ("GPUBRIDGE_VENDOR", "GPUBRIDGE_BRIDGE", "GPUBRIDGE_NAMESPACE", "GPUBRIDGE_P2P_CHUNK"):
        env.pop(k, None)
    env["GPUBRIDGE_P2P_CHUNK"] = "2K"  # an activation (8 KiB) goes as several messages
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2"]
    cmd += [str(EXAMPLES / "pipeline_train.py"), "--schedule", schedule, "--steps", "3", "--check", "--json"]
    cmd += ["--dim", "32", "--layers", "2", "--seq-len", "32", "--vocab", "64"]
    p = hung.run(cmd, cwd=tmp_path, env=env, text=True, timeout=scale(180))
    assert p.returncode == 0, (p.stdout + p.stderr)[-6000:]
    rows = [json.loads(ln) for ln in p.stdout.splitlines() if ln.startswith("{")]
    assert sorted(r["stage"] for r in rows) == [0, 1], p.stdout
    assert all(r["check"] == "bit-exact" and r["schedule"] == schedule for r in rows), rows
    assert "island nvidia: ranks [0], leader 0, gloo" in p.stderr, p.stderr[-3000:]
