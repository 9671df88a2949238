"""The Go tools a rank runs: where they are, built from a checkout on first use.

Finding the tools (:func:`find_tool`, :func:`find_tools`), in this order:

1. ``GPUBRIDGE_BIN_DIR``, the directory holding gbprobe, gbdiscover and
   gbbridge;
2. the package's own ``bin/`` (``gpubridge/bin``): an installed wheel carries
   the tools there (torchplugin/setup.py builds them into it);
3. ``PATH``;
4. in a source checkout (the package sits in ``torchplugin/`` of one), the
   checkout's ``bin/`` (``make build`` puts the tools there);
5. in a source checkout, built on first use: when ``go`` is on PATH, all the
   tools are built once with ``go build`` into
   ``$XDG_CACHE_HOME/gpubridge/bin-<digest of the sources>`` (default
   ``~/.cache``). Ranks on one host that start together build once: a file
   lock serialises them, and the tools are built into a temporary directory
   that is renamed into place. An installed package never builds.

``GPUBRIDGE_BIN_STRICT=1`` looks in ``GPUBRIDGE_BIN_DIR`` only (steps 2 to 5
off), for jobs that must run exactly the tools they were given;
``GPUBRIDGE_NO_BUILD=1`` turns off step 5 alone. Tools that are not found
raise one :class:`ToolNotFoundError` naming them all, every place looked in
and how to fix it. Running them: :mod:`gpubridge._discovery` (gbprobe,
gbdiscover) and :mod:`gpubridge._bridge_process` (gbbridge serve).
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import os
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import IO

__all__ = ["TOOLS", "ToolNotFoundError", "find_tool", "find_tools", "lookup"]

TOOLS = ("gbprobe", "gbdiscover", "gbbridge")
"""Every tool the plugin runs; a build on first use builds them all."""

GO_MODULE = "github.com/gpubridge/gpubridge"
BUILD_TIMEOUT = 600.0
"""Seconds a build on first use may take, waiting for another rank's
build included."""

_TRUE_OFF = ("", "0", "false", "no", "off")


class ToolNotFoundError(RuntimeError):
    """gpubridge tools are missing (``tools``: their names). ``problem`` is
    the message without the ``gpubridge:`` prefix, as it goes into a
    discovery record: one sentence, however many tools are missing."""

    def __init__(self, problem: str, tools: tuple[str, ...] = ()) -> None:
        super().__init__(f"gpubridge: {problem}")
        self.problem = problem
        self.tools = tools


def _flag(name: str) -> bool:
    return os.environ.get(name, "").strip().lower() not in _TRUE_OFF


def _source_root() -> Path:
    """The directory that holds go.mod when this package sits in a gpubridge
    source checkout (torchplugin/gpubridge/_tools.py)."""
    return Path(__file__).resolve().parents[2]


def _package_bin() -> Path:
    """The tools an installed package carries (setup.py builds them into
    gpubridge/bin of the wheel)."""
    return Path(__file__).resolve().parent / "bin"


def _repo_bin() -> Path | None:
    """The checkout's bin/ (where ``make build`` writes the tools), or None
    when the package is not in a checkout."""
    root, _ = _checkout()
    return None if root is None else root / "bin"


def _checkout() -> tuple[Path | None, str]:
    """The source checkout to build from, or None and why not."""
    root = _source_root()
    gomod = root / "go.mod"
    try:
        first = gomod.read_text(encoding="utf-8", errors="replace").splitlines()[:1]
    except OSError:
        return None, f"the package is not in a gpubridge source checkout (no {gomod})"
    if first != [f"module {GO_MODULE}"]:
        return None, f"{gomod} is not the module {GO_MODULE}"
    return root, ""


def _cache_dir() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "gpubridge"


def _source_digest(root: Path) -> str:
    """A digest of what the tools are built from: go.mod, go.sum and every
    file under lib/ and tools/ but tests (names, sizes, modification
    times)."""
    h = hashlib.sha256()
    for name in ("go.mod", "go.sum"):
        with contextlib.suppress(OSError):
            st = (root / name).stat()
            h.update(f"{name}\0{st.st_size}\0{st.st_mtime_ns}\n".encode())
    for top in ("lib", "tools"):
        for d, dirs, files in os.walk(root / top):
            dirs[:] = sorted(x for x in dirs if x != "testdata")
            for f in sorted(files):
                if f.endswith("_test.go"):
                    continue
                p = Path(d) / f
                try:
                    st = p.stat()
                except OSError:  # removed while we walk
                    continue
                h.update(f"{p.relative_to(root)}\0{st.st_size}\0{st.st_mtime_ns}\n".encode())
    return h.hexdigest()[:16]


def _complete(d: Path) -> bool:
    return all(os.access(d / t, os.X_OK) for t in TOOLS)


@contextlib.contextmanager
def _locked(path: Path, deadline: float, what: str) -> Iterator[None]:
    """Holds an exclusive flock on path, waiting until deadline at most."""
    f: IO[bytes] = open(path, "ab")  # noqa: SIM115 (held across the yield)
    try:
        while True:
            try:
                fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if time.monotonic() >= deadline:
                    raise ToolNotFoundError(
                        f"{what}: another process has held the build lock {path} for too long "
                        f"(over {BUILD_TIMEOUT:.0f} s); remove the stale build or set GPUBRIDGE_BIN_DIR"
                    ) from None
                time.sleep(0.1)
        yield
    finally:
        f.close()  # releases the lock


_built: dict[Path, Path] = {}


def _build(root: Path, go: str) -> Path:
    """Builds every tool from root into the per-user cache once; returns the
    directory. Concurrent callers on one host build once."""
    if root in _built:
        return _built[root]
    cache = _cache_dir()
    final = cache / f"bin-{_source_digest(root)}"
    if _complete(final):
        _built[root] = final
        return final
    what = "building it with go failed"
    try:
        _build_locked(root, go, cache, final, what)
    except OSError as e:  # the cache directory: not writable, full, ...
        raise ToolNotFoundError(f"{what}: in the cache directory {cache}: {e}") from e
    _built[root] = final
    return final


def _build_locked(root: Path, go: str, cache: Path, final: Path, what: str) -> None:
    cache.mkdir(parents=True, exist_ok=True)
    deadline = time.monotonic() + BUILD_TIMEOUT
    with _locked(cache / "build.lock", deadline, what):
        if not _complete(final):  # nobody built it while we waited
            tmp = Path(tempfile.mkdtemp(prefix=".build-", dir=cache))
            try:
                print(
                    f"gpubridge: building {', '.join(TOOLS)} from {root} into {final} "
                    "(first use of these sources; once)",
                    file=sys.stderr,
                    flush=True,
                )
                env = dict(os.environ, CGO_ENABLED="1")
                env.setdefault("CGO_CFLAGS", "-O2 -g -Wno-deprecated-declarations")
                cmd = [go, "build", "-trimpath", "-o", f"{tmp}/", *(f"./tools/{t}" for t in TOOLS)]
                left = max(1.0, deadline - time.monotonic())
                try:
                    p = subprocess.run(
                        cmd,
                        cwd=root,
                        env=env,
                        stdin=subprocess.DEVNULL,
                        capture_output=True,
                        check=False,
                        timeout=left,
                    )
                except subprocess.TimeoutExpired as e:
                    raise ToolNotFoundError(
                        f"{what}: `go build` did not finish within {BUILD_TIMEOUT:.0f} s "
                        f"(in {root}); run `make build` there or set GPUBRIDGE_BIN_DIR"
                    ) from e
                if p.returncode != 0 or not _complete(tmp):
                    out = (p.stderr + p.stdout).decode("utf-8", "replace").strip()
                    raise ToolNotFoundError(
                        f"{what}: `{' '.join(cmd)}` in {root} exited {p.returncode}: {out[-2000:]}"
                    )
                if final.exists():  # an incomplete leftover
                    shutil.rmtree(final, ignore_errors=True)
                os.rename(tmp, final)
            finally:
                shutil.rmtree(tmp, ignore_errors=True)


def _executable(p: Path) -> bool:
    return p.is_file() and os.access(p, os.X_OK)


def _the_tools(names: list[str]) -> str:
    """'the tool X was' or 'the tools X, Y were'."""
    if len(names) == 1:
        return f"the tool {names[0]} was"
    return f"the tools {', '.join(names)} were"


def _places(root: Path | None) -> list[tuple[str, Path | None]]:
    """Where the tools are looked for, in order: (how the place is named,
    the directory; None for PATH)."""
    places: list[tuple[str, Path | None]] = []
    d = os.environ.get("GPUBRIDGE_BIN_DIR")
    if d:
        places.append((f"GPUBRIDGE_BIN_DIR={d}", Path(d)))
    if _flag("GPUBRIDGE_BIN_STRICT"):
        return places
    pkg = _package_bin()
    if root is None or pkg.is_dir():  # a checkout has none unless someone put it there
        places.append((f"{pkg} (this installation's own)", pkg))
    places.append(("PATH", None))
    rb = _repo_bin()
    if rb is not None:
        places.append((str(rb), rb))
    return places


def lookup(names: list[str]) -> tuple[dict[str, str], ToolNotFoundError | None]:
    """The paths of the tools found, and one error naming every tool that
    was not (None when all were found)."""
    root, _ = _checkout()
    places = _places(root)
    strict = _flag("GPUBRIDGE_BIN_STRICT")
    found: dict[str, str] = {}
    for name in names:
        for _, place in places:
            hit = place / name if place is not None else shutil.which(name)
            if hit is not None and _executable(Path(hit)):
                found[name] = str(hit)
                break
    missing = [n for n in names if n not in found]
    if not missing:
        return found, None
    tried = [label for label, _ in places]
    if strict and not os.environ.get("GPUBRIDGE_BIN_DIR"):
        tried.append("GPUBRIDGE_BIN_DIR (not set)")
    looked = f"{_the_tools(missing)} not found (looked in {', '.join(tried)}"
    every = ", ".join(TOOLS)
    go = shutil.which("go")
    unknown = [n for n in missing if n not in TOOLS]
    if strict:
        problem = (
            f"{looked} only: GPUBRIDGE_BIN_STRICT is set); put {every} into GPUBRIDGE_BIN_DIR "
            "(`make build` in the gpubridge repository writes them into its bin/)"
        )
    elif unknown:
        verb = "is" if len(unknown) == 1 else "are"
        problem = f"{looked}): {', '.join(unknown)} {verb} not one of the tools gpubridge builds: {every}"
    elif root is None:  # an installed package (or a copy of the sources): it never builds
        problem = (
            f"{looked}): this gpubridge ({_package_bin().parent}) carries no tools and, not being in a "
            "gpubridge source checkout, does not build them; reinstall it with pip from a checkout "
            "(`pip install ./torchplugin` compiles the tools into the package; that needs Go 1.21 or "
            f"later on PATH), or set GPUBRIDGE_BIN_DIR to a directory holding {every} (`make build` in "
            "a checkout writes them into its bin/)"
        )
    elif _flag("GPUBRIDGE_NO_BUILD") or go is None:
        why, fix = "GPUBRIDGE_NO_BUILD is set", ""
        if go is None and not _flag("GPUBRIDGE_NO_BUILD"):
            why = "go is not on PATH"
            fix = ", or put Go (1.21 or later) on PATH so that gpubridge builds them from this checkout"
        problem = (
            f"{looked}) and {'was' if len(missing) == 1 else 'were'} not built on first use ({why}); "
            f"run `make build` in the gpubridge checkout {root}, set GPUBRIDGE_BIN_DIR to the directory "
            f"of {every}{fix}"
        )
    else:
        try:
            built = _build(root, go)
        except ToolNotFoundError as e:
            return found, ToolNotFoundError(f"{looked}), and {e.problem}", tuple(missing))
        found.update((n, str(built / n)) for n in missing)
        return found, None
    return found, ToolNotFoundError(problem, tuple(missing))


def find_tools(names: list[str] | tuple[str, ...] = TOOLS) -> dict[str, str]:
    """Paths of gpubridge tools, by name (see the module's docstring for
    where it looks). Raises one ToolNotFoundError naming every tool not
    found and every place looked in."""
    found, err = lookup(list(dict.fromkeys(names)))
    if err is not None:
        raise err
    return found


def find_tool(name: str) -> str:
    """Path of a gpubridge tool (see the module's docstring for where it
    looks). Raises ToolNotFoundError naming every place looked in."""
    return find_tools([name])[name]
