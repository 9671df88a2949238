"""Builds the gpubridge wheel with the Go tools inside it.

``pip install ./torchplugin`` and ``pip wheel ./torchplugin``, run from a
gpubridge checkout, compile every ``tools/gb*`` of the repository (gbprobe,
gbdiscover, gbbridge, and any tool added later) with ``go build`` into
``gpubridge/bin/`` of the wheel. The wheel is then a platform wheel
(``py3-none-<platform>``: native tools, no Python extension), and each tool
gets a console script of its name (:mod:`gpubridge_tools` execs the shipped
binary). Without Go 1.21 or later on PATH (or in ``$GO``) the build fails,
saying what to install, instead of making a wheel that fails at run time.

``GPUBRIDGE_SOURCE_DIR`` names the checkout when this directory is not inside
one (a build from an unpacked sdist).
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

from setuptools import Distribution, setup
from setuptools.command.build_py import build_py

GO_MODULE = "github.com/gpubridge/gpubridge"
GO_MIN = (1, 21)
HERE = Path(__file__).resolve().parent


class BuildError(SystemExit):
    """Stops the build with a message (setuptools prints it, pip shows it)."""

    def __init__(self, msg: str) -> None:
        super().__init__(f"gpubridge: {msg}")


def source_root() -> Path:
    """The gpubridge checkout the tools are built from."""
    env = os.environ.get("GPUBRIDGE_SOURCE_DIR")
    root = Path(env).resolve() if env else HERE.parent
    gomod = root / "go.mod"
    try:
        first = gomod.read_text(encoding="utf-8", errors="replace").splitlines()[:1]
    except OSError:
        first = []
    if first != [f"module {GO_MODULE}"]:
        where = f"GPUBRIDGE_SOURCE_DIR={env}" if env else f"{root} (the directory above {HERE.name}/)"
        raise BuildError(
            f"building the gpubridge wheel needs the gpubridge Go sources, and {where} is not a "
            f"gpubridge checkout (no go.mod of {GO_MODULE}): build from the repository "
            "(`pip install ./torchplugin` or `pip wheel ./torchplugin` with pip 21.3 or later, which "
            "build in place), or set GPUBRIDGE_SOURCE_DIR to the checkout"
        )
    return root


def tool_names(root: Path) -> list[str]:
    """Every tools/gb* directory: the tools the wheel ships (as make build)."""
    return sorted(p.name for p in (root / "tools").glob("gb*") if p.is_dir())


def find_go() -> str:
    """The go command, 1.21 or later (older ones cannot read go.mod's
    toolchain line)."""
    go = os.environ.get("GO") or shutil.which("go")
    hint = (
        "install Go 1.21 or later (go.dev/dl; Debian 12's golang package, 1.19, is too old) and put "
        "it on PATH (or set GO=/path/to/go), then build again"
    )
    if not go or not os.access(go, os.X_OK):
        raise BuildError(
            "building the wheel compiles gpubridge's Go tools (gbprobe, gbdiscover, gbbridge), and Go "
            f"was not found ({'GO=' + go + ' is not executable' if go else 'no go on PATH'}): {hint}"
        )
    try:
        out = subprocess.run(
            [go, "env", "GOVERSION"], capture_output=True, text=True, check=True, timeout=120
        ).stdout.strip()
    except (OSError, subprocess.SubprocessError) as e:
        raise BuildError(f"`{go} env GOVERSION` failed ({e}): {hint}") from e
    m = re.match(r"go(\d+)\.(\d+)", out)
    if m and (int(m[1]), int(m[2])) < GO_MIN:
        raise BuildError(f"{go} is {out}, older than go1.21: {hint}")
    return go


def build_tools(dest: Path, root: Path | None = None) -> list[str]:
    """Compiles every tool of the checkout into dest (emptied first: no
    stale tool from an earlier build); returns their names."""
    root = root or source_root()
    names = tool_names(root)
    if not names:
        raise BuildError(f"no tools/gb* in {root}: nothing to build")
    go = find_go()
    dest = dest.resolve()  # go build runs in root
    if dest.exists():
        shutil.rmtree(dest)
    dest.mkdir(parents=True)
    # The tools are built for the build platform, which the wheel's tag
    # names: no cross-compiling settings from the environment.
    env = {k: v for k, v in os.environ.items() if k not in ("GOOS", "GOARCH")}
    env["CGO_ENABLED"] = "1"  # go-nvml loads libnvidia-ml through cgo
    env.setdefault("CGO_CFLAGS", "-O2 -g -Wno-deprecated-declarations")
    cmd = [go, "build", "-trimpath", "-o", f"{dest}{os.sep}", *(f"./tools/{n}" for n in names)]
    print(f"gpubridge: building {', '.join(names)} with {go} in {root}", file=sys.stderr, flush=True)
    p = subprocess.run(
        cmd, cwd=root, env=env, stdin=subprocess.DEVNULL, capture_output=True, text=True, check=False
    )
    missing = [n for n in names if not os.access(dest / n, os.X_OK)]
    if p.returncode != 0 or missing:
        raise BuildError(
            f"`{' '.join(cmd)}` in {root} exited {p.returncode}"
            + (f" without building {', '.join(missing)}" if missing and p.returncode == 0 else "")
            + f":\n{(p.stderr + p.stdout).strip()[-4000:]}"
        )
    return names


class BuildPyWithTools(build_py):
    """build_py, then the Go tools into gpubridge/bin/ of the build. An
    editable install skips them: the package stays in the checkout, which
    finds its tools in bin/ or builds them on first use."""

    def run(self) -> None:
        super().run()
        if getattr(self, "editable_mode", False):
            return
        build_tools(Path(self.build_lib) / "gpubridge" / "bin")


class WithTools(Distribution):
    """The tools are native code: the package goes to platlib and the wheel
    is not pure."""

    def has_ext_modules(self) -> bool:
        return True


def platform_wheel() -> type:
    """bdist_wheel making a wheel for this platform but any Python 3:
    py3-none-<platform> (imported here: the tests import this module where
    setuptools may be older than 70.1, which brought bdist_wheel)."""
    from setuptools.command.bdist_wheel import bdist_wheel  # noqa: PLC0415

    class PlatformWheel(bdist_wheel):
        def get_tag(self) -> tuple[str, str, str]:
            _, _, plat = super().get_tag()
            return "py3", "none", plat

    return PlatformWheel


def console_scripts() -> list[str]:
    """A console script per tool of the checkout (none when there is no
    checkout: the build then stops in build_py, saying why)."""
    try:
        names = tool_names(source_root())
    except BuildError:
        return []
    return [f"{n} = gpubridge_tools:{n}" for n in names]


if __name__ == "__main__":
    setup(
        distclass=WithTools,
        cmdclass={"build_py": BuildPyWithTools, "bdist_wheel": platform_wheel()},
        entry_points={"console_scripts": console_scripts()},
    )
