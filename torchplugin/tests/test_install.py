"""The package as pip installs it: setup.py compiles the Go tools into a
platform wheel (and fails, saying what to install, without Go), the console
scripts exec the shipped tools, and a fresh venv with ``pip install
./torchplugin`` runs the DDP and FSDP examples with nothing else set.

The fresh-venv test downloads and installs torch (the newest the package
allows, about 5 GB installed) and takes minutes: it runs when
GPUBRIDGE_INSTALL_TEST=1 (``make test`` sets it).
"""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import subprocess
import sys
import sysconfig
import time
import zipfile
from pathlib import Path
from types import ModuleType

import pytest
from testenv import scale

HERE = Path(__file__).resolve().parent
PKG = HERE.parent
REPO = PKG.parent
EXAMPLES = REPO / "examples"
GO = shutil.which("go")
TOOLS = sorted(p.name for p in (REPO / "tools").glob("gb*") if p.is_dir())

needs_go = pytest.mark.skipif(GO is None, reason="needs go on PATH (setup.py compiles the tools)")


def load_setup() -> ModuleType:
    """torchplugin/setup.py as a module (its setup() call runs only as
    __main__, which is how setuptools runs it)."""
    spec = importlib.util.spec_from_file_location("gpubridge_setup", PKG / "setup.py")
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def executable(path: Path, text: str) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    path.chmod(0o755)
    return path


def ci_torch_versions() -> list[tuple[int, ...]]:
    """The torch versions make test runs the plugin's suite on besides the
    project's own (the Makefile's TORCH_VERSIONS), oldest first."""
    line = next(x for x in (REPO / "Makefile").read_text().splitlines() if x.startswith("TORCH_VERSIONS"))
    return sorted(tuple(int(p) for p in v.split(".")) for v in line.split(":=")[1].split())


def test_torch_bounds_are_the_tested_range() -> None:
    """pyproject's torch bounds, the README's stated range and the versions
    CI runs the suite on say the same: the oldest tested is the lower bound,
    the newest tested is the last minor below the upper bound."""
    req = next(x for x in (PKG / "pyproject.toml").read_text().splitlines() if x.strip().startswith('"torch'))
    assert req.strip() == '"torch>=2.8,<2.16",', req
    oldest, newest = ci_torch_versions()[0], ci_torch_versions()[-1]
    assert oldest[:2] == (2, 8), oldest
    assert newest[:2] == (2, 15), newest
    readme = (REPO / "README.md").read_text()
    assert "Supported torch: 2.8 through 2.15 (`torch>=2.8,<2.16`)" in readme


# ---- setup.py, in process ----


def test_tool_names_are_every_tools_gb_dir(tmp_path: Path) -> None:
    setup = load_setup()
    assert {"gbprobe", "gbdiscover", "gbbridge"} <= set(setup.tool_names(REPO))
    for d in ("gbx", "gby", "testdata"):
        (tmp_path / "tools" / d).mkdir(parents=True)
    (tmp_path / "tools" / "gbfile").write_text("")
    assert setup.tool_names(tmp_path) == ["gbx", "gby"]


def test_source_root_must_be_a_checkout(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    setup = load_setup()
    assert setup.source_root() == REPO
    monkeypatch.setenv("GPUBRIDGE_SOURCE_DIR", str(tmp_path))
    with pytest.raises(SystemExit, match=f"GPUBRIDGE_SOURCE_DIR={tmp_path} is not a gpubridge checkout"):
        setup.source_root()
    assert setup.console_scripts() == []


@pytest.mark.parametrize(
    ("go", "want"),
    [
        (None, r"Go was not found \(no go on PATH\): install Go 1.21 or later"),
        ("echo go1.19.8", r"is go1.19.8, older than go1.21: install Go 1.21 or later"),
        ("echo go1.22.1", None),
        ("echo go1.26rc1", None),
    ],
    ids=["missing", "too-old", "ok", "rc"],
)
def test_find_go(monkeypatch: pytest.MonkeyPatch, tmp_path: Path, go: str | None, want: str | None) -> None:
    setup = load_setup()
    (tmp_path / "bin").mkdir()
    if go is not None:
        executable(tmp_path / "bin" / "go", f"#!/bin/sh\n{go}\n")
    monkeypatch.setenv("PATH", str(tmp_path / "bin"))
    monkeypatch.delenv("GO", raising=False)
    if want is None:
        assert setup.find_go() == str(tmp_path / "bin" / "go")
    else:
        with pytest.raises(SystemExit, match=want):
            setup.find_go()


def test_build_failure_is_named(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    setup = load_setup()
    script = '#!/bin/sh\n[ "$1" = env ] && { echo go1.26.0; exit 0; }\necho "tools/gbx/main.go:1: boom" >&2\n'
    script += "exit 1\n"
    go = executable(tmp_path / "go", script)
    (tmp_path / "src" / "tools" / "gbx").mkdir(parents=True)
    monkeypatch.setenv("GO", str(go))
    with pytest.raises(SystemExit) as e:
        setup.build_tools(tmp_path / "out", tmp_path / "src")
    msg = str(e.value)
    assert "build -trimpath -o" in msg and "exited 1" in msg and "tools/gbx/main.go:1: boom" in msg, msg


# ---- the launchers ----


def test_launcher_execs_the_shipped_tool(tmp_path: Path) -> None:
    """gpubridge_tools.<tool>() (a console script) replaces the process with
    gpubridge/bin/<tool> of the same installation, passing the arguments;
    a missing tool exits 2 naming it; importing it does not import torch."""
    site = tmp_path / "site"
    site.mkdir()
    shutil.copy(PKG / "gpubridge_tools.py", site)
    executable(site / "gpubridge" / "bin" / "gbfake", '#!/bin/sh\necho "gbfake: $*"; exit 7\n')
    code = (
        "import sys; import gpubridge_tools as g; assert 'torch' not in sys.modules; "
        "sys.exit(getattr(g, sys.argv.pop(1))())"  # as a console script: the arguments after the name
    )
    env = dict(os.environ, PYTHONPATH=str(site))

    def launch(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [sys.executable, "-c", code, *args], cwd=tmp_path, env=env, capture_output=True, text=True
        )

    p = launch("gbfake", "--json", "a b")
    assert (p.returncode, p.stdout) == (7, "gbfake: --json a b\n"), p
    p = launch("gbnone")
    assert p.returncode == 2, p
    want = f"gbnone: {site / 'gpubridge' / 'bin' / 'gbnone'} is missing: this gpubridge installation"
    assert p.stderr.startswith(want), p.stderr
    p = launch("nogb")
    assert p.returncode == 1 and "has no attribute 'nogb'" in p.stderr, p


def test_editable_launcher_runs_the_checkouts_bin(tmp_path: Path) -> None:
    """An editable install carries no tools: its launchers run bin/ of the
    checkout (make build), or say to run make build."""
    (tmp_path / "go.mod").write_text("module x\n")
    (tmp_path / "torchplugin").mkdir()
    shutil.copy(PKG / "gpubridge_tools.py", tmp_path / "torchplugin")
    code = "import sys, gpubridge_tools as g; sys.exit(getattr(g, sys.argv.pop(1))())"
    env = dict(os.environ, PYTHONPATH=str(tmp_path / "torchplugin"))

    def launch(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [sys.executable, "-c", code, *args], cwd=tmp_path, env=env, capture_output=True, text=True
        )

    p = launch("gbfake", "x")
    assert p.returncode == 2, p
    assert p.stderr.startswith(f"gbfake: this gpubridge is an editable install in the checkout {tmp_path}")
    assert "run `make build` there" in p.stderr, p.stderr
    executable(tmp_path / "bin" / "gbfake", '#!/bin/sh\necho "checkout: $*"\n')
    p = launch("gbfake", "x")
    assert (p.returncode, p.stdout) == (0, "checkout: x\n"), p


# ---- pip, for real ----


def pip_wheel(out: Path, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "-w", str(out), str(PKG)],
        env=env,
        capture_output=True,
        text=True,
        timeout=scale(900),
    )


@needs_go
def test_wheel_carries_the_tools(tmp_path: Path) -> None:
    """pip wheel: a py3-none-<platform> wheel with every tools/gb* compiled
    into gpubridge/bin (executable) and a console script for each."""
    p = pip_wheel(tmp_path, dict(os.environ))
    assert p.returncode == 0, p.stdout + p.stderr
    wheels = list(tmp_path.glob("*.whl"))
    plat = sysconfig.get_platform().replace("-", "_").replace(".", "_")
    assert [w.name for w in wheels] == [f"gpubridge-0.1.0.dev0-py3-none-{plat}.whl"], wheels
    with zipfile.ZipFile(wheels[0]) as z:
        names = set(z.namelist())
        for t in TOOLS:
            info = z.getinfo(f"gpubridge/bin/{t}")
            assert (info.external_attr >> 16) & 0o111 == 0o111, (t, oct(info.external_attr >> 16))
            assert info.file_size > 1 << 20, (t, info.file_size)
        assert {"gpubridge_tools.py", "gpubridge/__main__.py", "gpubridge/py.typed"} <= names
        eps = z.read("gpubridge-0.1.0.dev0.dist-info/entry_points.txt").decode()
        wheel = z.read("gpubridge-0.1.0.dev0.dist-info/WHEEL").decode()
        meta = z.read("gpubridge-0.1.0.dev0.dist-info/METADATA").decode()
    for t in TOOLS:
        assert f"{t} = gpubridge_tools:{t}\n" in eps, eps
    assert "Root-Is-Purelib: false" in wheel, wheel
    assert "Requires-Dist: torch<2.16,>=2.8" in meta, meta


def test_wheel_without_go_fails_saying_what_to_install(tmp_path: Path) -> None:
    """No Go at build time: the build fails, naming what to install, instead
    of making a wheel without tools."""
    empty = tmp_path / "nopath"
    empty.mkdir()
    env = {k: v for k, v in os.environ.items() if k != "GO"}
    env["PATH"] = str(empty)
    p = pip_wheel(tmp_path / "out", env)
    out = p.stdout + p.stderr
    assert p.returncode != 0, out
    assert "gpubridge: building the wheel compiles gpubridge's Go tools" in out, out
    assert "install Go 1.21 or later" in out, out
    assert not list(tmp_path.glob("out/*.whl"))


FRESH = os.environ.get("GPUBRIDGE_INSTALL_TEST", "") == "1"


@needs_go
@pytest.mark.skipif(
    not FRESH,
    reason="set GPUBRIDGE_INSTALL_TEST=1 (make test does): it installs torch into a new venv "
    "(about 5 GB, minutes)",
)
def test_fresh_venv_runs_the_examples(tmp_path: Path) -> None:
    """pip install ./torchplugin into a new venv (no system site packages;
    torch resolved as a user gets it), then from a temporary directory,
    with no checkout on PYTHONPATH, no GPUBRIDGE_BIN_DIR and neither the
    venv's bin nor go on PATH: the tools the plugin runs are the package's,
    and the 4-rank DDP and FSDP examples pass in CPU simulation."""
    venv = tmp_path / "venv"
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    times: dict[str, float] = {}
    try:
        t0 = time.monotonic()
        subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True, timeout=scale(300))
        py = venv / "bin" / "python"
        p = subprocess.run(
            [py, "-m", "pip", "install", "-q", "--disable-pip-version-check", str(PKG)],
            capture_output=True,
            text=True,
            timeout=scale(1800),
        )
        assert p.returncode == 0, p.stdout + p.stderr
        times["pip install"] = time.monotonic() - t0

        site = Path(
            subprocess.run(
                [py, "-c", "import sysconfig; print(sysconfig.get_path('platlib'))"],
                capture_output=True,
                text=True,
                check=True,
            ).stdout.strip()
        )
        shipped = site / "gpubridge" / "bin"
        path = "/usr/bin:/bin"
        for t in TOOLS:
            assert shutil.which(t, path=path) is None, f"{t} is on {path}: the test could not tell"
        env = {k: v for k, v in os.environ.items() if not k.startswith(("GPUBRIDGE_", "PYTHON"))}
        env.update(PATH=path, XDG_CACHE_HOME=str(tmp_path / "cache"), OMP_NUM_THREADS="1")

        def run(*args: str | Path, extra: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
            return subprocess.run(
                [str(a) for a in args],
                cwd=run_dir,
                env={**env, **(extra or {})},
                capture_output=True,
                text=True,
                timeout=scale(600),
            )

        # pip took the newest torch the package allows, which CI also tests.
        p = run(py, "-c", "import torch; print(torch.__version__)")
        assert p.returncode == 0, p.stderr
        installed = tuple(int(x) for x in p.stdout.split("+")[0].split(".")[:2])
        assert installed == ci_torch_versions()[-1][:2], (p.stdout, ci_torch_versions())

        p = run(py, "-m", "gpubridge", "--tools")
        assert p.returncode == 0, p.stderr
        assert p.stdout == "".join(f"{t}\t{shipped / t}\n" for t in ("gbprobe", "gbdiscover", "gbbridge"))
        p = run(py, "-m", "gpubridge", "--tools-dir")
        assert p.stdout == f"{shipped}\n", p
        for t in TOOLS:  # the console scripts
            p = run(venv / "bin" / t, "--version")
            assert p.returncode == 0 and p.stdout.startswith(f"{t} "), (t, p)

        sim = {"GPUBRIDGE_SIM_VENDORS": "nvidia,nvidia,amd,amd"}
        for ex in ("ddp_train.py", "fsdp_train.py"):
            shutil.copy(EXAMPLES / ex, run_dir)
        torchrun = [py, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "4"]
        t0 = time.monotonic()
        p = run(*torchrun, "ddp_train.py", "--max-steps", "40", "--log-every", "10", "--json", extra=sim)
        times["ddp_train"] = time.monotonic() - t0
        assert p.returncode == 0, (p.stdout + p.stderr)[-6000:]
        recs = [json.loads(line) for line in p.stdout.splitlines() if line.startswith("{")]
        topo = next(r for r in recs if r["kind"] == "topology")
        assert [i["ranks"] for i in topo["islands"]] == [[0, 1], [2, 3]], topo
        assert topo["bridge"]["members"] == [0, 2] and topo["simulated"], topo
        result = next(r for r in recs if r["kind"] == "result")
        assert result["params_identical"] and result["steps"] == 40, result
        assert "bridge: leaders [0, 2]" in p.stderr, p.stderr[-3000:]

        t0 = time.monotonic()
        p = run(*torchrun, "fsdp_train.py", "--steps", "10", extra=sim)
        times["fsdp_train"] = time.monotonic() - t0
        assert p.returncode == 0, (p.stdout + p.stderr)[-6000:]
        assert "parameters identical on every rank" in p.stderr, p.stderr[-3000:]
        assert "bridge: leaders [0, 2]" in p.stderr, p.stderr[-3000:]
        # Nothing was built: an installed package never builds its tools.
        assert not (tmp_path / "cache" / "gpubridge").exists()
    finally:
        shutil.rmtree(venv, ignore_errors=True)  # about 5 GB
        sys.stderr.write(
            "\ntest_fresh_venv_runs_the_examples: "
            + ", ".join(f"{k} {v:.0f} s" for k, v in times.items())
            + "\n"
        )
