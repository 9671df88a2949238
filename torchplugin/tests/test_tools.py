"""gpubridge._tools and gpubridge._discovery: finding (and building) the
tools, this rank's problems, and start-up failures that every rank must
report the same way.

The build test runs a real ``go build`` into a temporary cache (fast with a
warm Go build cache). The torchrun tests launch tests/failure_worker.py with
a fault on rank 1 and check that every rank raises a RuntimeError naming it,
well before the discovery timeout, and that the job leaves no process
running.
"""

from __future__ import annotations

import datetime
import json
import os
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import hung
import pytest
import torch.distributed as dist
from testenv import scale

from gpubridge import _tools
from gpubridge._discovery import discover, rank_problems
from gpubridge._tools import ToolNotFoundError, find_tool

HERE = Path(__file__).resolve().parent
PKG = HERE.parent
REPO = PKG.parent
BIN = REPO / "bin"
TOOLS = [BIN / t for t in _tools.TOOLS]
WORKER = HERE / "failure_worker.py"
GO = shutil.which("go")

needs_tools = pytest.mark.skipif(
    not all(os.access(t, os.X_OK) for t in TOOLS),
    reason=f"needs bin/gbprobe, bin/gbdiscover and bin/gbbridge: run `make build` in {REPO}",
)
needs_go = pytest.mark.skipif(GO is None, reason="needs go on PATH")

ENV_KEYS = (
    "GPUBRIDGE_BIN_DIR", "GPUBRIDGE_BIN_STRICT", "GPUBRIDGE_NO_BUILD", "GPUBRIDGE_VENDOR",
    "GPUBRIDGE_NAMESPACE", "GPUBRIDGE_BRIDGE", "GPUBRIDGE_SIM_HOSTNAME", "LOCAL_RANK",
    "SLURM_LOCALID", "LOCAL_WORLD_SIZE", "TORCHELASTIC_RUN_ID",
)  # fmt: skip


@pytest.fixture(autouse=True)
def clean(monkeypatch: pytest.MonkeyPatch) -> None:
    for k in ENV_KEYS:
        monkeypatch.delenv(k, raising=False)
    monkeypatch.setattr(_tools, "_built", {})


def executable(path: Path, text: str = "#!/bin/sh\nexit 0\n") -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    path.chmod(0o755)
    return path


def tools_without(tmp: Path, missing: str) -> Path:
    """A directory of links to the built tools, lacking one."""
    d = tmp / f"no{missing.removeprefix('gb')}"
    d.mkdir(parents=True, exist_ok=True)
    for t in TOOLS:
        if t.name != missing:
            (d / t.name).symlink_to(t)
    return d


# ---- find_tool ----


def test_bin_dir_then_path(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    a = executable(tmp_path / "a" / "gbprobe").parent
    b = executable(tmp_path / "b" / "gbprobe").parent
    (tmp_path / "c").mkdir()
    (tmp_path / "c" / "gbprobe").write_text("not executable")
    monkeypatch.setenv("PATH", str(b))
    cases = [(str(a), a / "gbprobe"), (str(tmp_path / "c"), b / "gbprobe"), ("", b / "gbprobe")]
    for bin_dir, want in cases:
        monkeypatch.setenv("GPUBRIDGE_BIN_DIR", bin_dir)
        assert find_tool("gbprobe") == str(want), bin_dir


@pytest.mark.parametrize(
    ("env", "go", "checkout", "want", "unwanted"),
    [
        ({}, False, True, ["go is not on PATH", "put Go (1.21 or later) on PATH", "make build"], []),
        ({"GPUBRIDGE_NO_BUILD": "1"}, True, True, ["GPUBRIDGE_NO_BUILD is set", "make build"], ["Go (1.21"]),
        (
            {"GPUBRIDGE_NO_BUILD": "0"},
            True,
            False,
            ["(this installation's own)", "not being in a gpubridge source checkout", "pip install ./torch"],
            ["so that gpubridge builds them", "put Go", "not built on first use", "repobin"],
        ),
    ],
    ids=["no-go", "no-build", "installed"],
)
def test_not_found_names_every_place(
    monkeypatch: pytest.MonkeyPatch,
    tmp_path: Path,
    env: dict[str, str],
    go: bool,
    checkout: bool,
    want: list[str],
    unwanted: list[str],
) -> None:
    """The error names every place looked in and the fix that applies: in a
    checkout, make build or Go; an installed package never builds (go on
    PATH is not run) and says how to reinstall it, not to install Go."""
    empty = [tmp_path / n for n in ("bindir", "path", "repobin", "pkgbin")]
    for d in empty:
        d.mkdir()
    if go:
        executable(empty[1] / "go", "#!/bin/sh\necho must not run >&2; exit 1\n")
    monkeypatch.setenv("GPUBRIDGE_BIN_DIR", str(empty[0]))
    monkeypatch.setenv("PATH", str(empty[1]))
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    monkeypatch.setattr(_tools, "_package_bin", lambda: empty[3])
    places = [f"GPUBRIDGE_BIN_DIR={empty[0]}", "PATH"]
    if checkout:
        monkeypatch.setattr(_tools, "_repo_bin", lambda: empty[2])
        places.append(str(empty[2]))
    else:
        monkeypatch.setattr(_tools, "_source_root", lambda: tmp_path)
        places.append(str(empty[3]))
    with pytest.raises(ToolNotFoundError) as e:
        find_tool("gbbridge")
    msg = str(e.value)
    assert msg.startswith("gpubridge: the tool gbbridge was not found (looked in "), msg
    for s in [*places, *want]:
        assert s in msg, (s, msg)
    for s in unwanted:
        assert s not in msg, (s, msg)
    assert e.value.problem == msg.removeprefix("gpubridge: ")
    assert e.value.tools == ("gbbridge",)
    assert not (tmp_path / "cache").exists()


def test_several_missing_tools_one_sentence(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """Tools missing together are named in one sentence, with the places
    and the fix said once (not a sentence per tool)."""
    executable(tmp_path / "bindir" / "gbdiscover")
    monkeypatch.setenv("GPUBRIDGE_BIN_DIR", str(tmp_path / "bindir"))
    monkeypatch.setenv("GPUBRIDGE_NO_BUILD", "1")
    monkeypatch.setenv("PATH", str(tmp_path / "nothing"))
    monkeypatch.setattr(_tools, "_repo_bin", lambda: tmp_path / "repobin")
    with pytest.raises(ToolNotFoundError) as e:
        _tools.find_tools(_tools.TOOLS)
    msg = e.value.problem
    assert msg.startswith("the tools gbprobe, gbbridge were not found (looked in "), msg
    assert e.value.tools == ("gbprobe", "gbbridge")
    for once in ("not found", "make build", "GPUBRIDGE_NO_BUILD is set"):
        assert msg.count(once) == 1, (once, msg)
    assert rank_problems() == [msg]
    assert _tools.find_tools(["gbdiscover"]) == {"gbdiscover": str(tmp_path / "bindir" / "gbdiscover")}


def test_installed_package_uses_its_own_tools(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """An installed package (not in a checkout) takes the tools its wheel
    carries before PATH (where its console scripts, or older tools, may be);
    GPUBRIDGE_BIN_DIR still comes first."""
    pkg = tmp_path / "site" / "gpubridge" / "bin"
    for t in _tools.TOOLS:
        executable(pkg / t)
        executable(tmp_path / "path" / t)
    executable(tmp_path / "bindir" / "gbprobe")
    monkeypatch.setattr(_tools, "_source_root", lambda: tmp_path / "site")
    monkeypatch.setattr(_tools, "_package_bin", lambda: pkg)
    monkeypatch.setenv("PATH", str(tmp_path / "path"))
    assert _tools.find_tools() == {t: str(pkg / t) for t in _tools.TOOLS}
    monkeypatch.setenv("GPUBRIDGE_BIN_DIR", str(tmp_path / "bindir"))
    assert find_tool("gbprobe") == str(tmp_path / "bindir" / "gbprobe")
    assert find_tool("gbbridge") == str(pkg / "gbbridge")


def test_tools_dir_command(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """python -m gpubridge --tools-dir prints the one directory of the tools,
    and fails (1) naming the missing ones or the split."""
    from gpubridge.__main__ import main  # noqa: PLC0415

    for t in _tools.TOOLS:
        executable(tmp_path / "a" / t)
    monkeypatch.setenv("GPUBRIDGE_BIN_DIR", str(tmp_path / "a"))
    monkeypatch.setenv("GPUBRIDGE_BIN_STRICT", "1")
    assert main(["--tools-dir"]) == 0
    assert capsys.readouterr().out == f"{tmp_path / 'a'}\n"
    assert main(["--tools"]) == 0
    assert capsys.readouterr().out == "".join(f"{t}\t{tmp_path / 'a' / t}\n" for t in _tools.TOOLS)

    (tmp_path / "a" / "gbbridge").unlink()
    (tmp_path / "a" / "gbprobe").unlink()
    assert main(["--tools-dir"]) == 1
    err = capsys.readouterr().err
    assert err.startswith("gpubridge: the tools gbprobe, gbbridge were not found"), err

    monkeypatch.delenv("GPUBRIDGE_BIN_STRICT")
    monkeypatch.setenv("PATH", str(executable(tmp_path / "b" / "gbprobe").parent))
    executable(tmp_path / "b" / "gbbridge")
    assert main(["--tools-dir"]) == 1
    assert "the tools are in more than one directory: gbprobe in " in capsys.readouterr().err
    with pytest.raises(SystemExit) as e:
        main([])
    assert e.value.code == 2


def test_strict_looks_only_in_bin_dir(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    executable(tmp_path / "path" / "gbprobe")
    (tmp_path / "bindir").mkdir()
    monkeypatch.setenv("PATH", str(tmp_path / "path"))
    monkeypatch.setenv("GPUBRIDGE_BIN_STRICT", "1")
    with pytest.raises(ToolNotFoundError, match=r"looked in GPUBRIDGE_BIN_DIR \(not set\) only"):
        find_tool("gbprobe")
    monkeypatch.setenv("GPUBRIDGE_BIN_DIR", str(tmp_path / "bindir"))
    with pytest.raises(ToolNotFoundError, match="GPUBRIDGE_BIN_STRICT is set"):
        find_tool("gbprobe")
    executable(tmp_path / "bindir" / "gbprobe")
    assert find_tool("gbprobe") == str(tmp_path / "bindir" / "gbprobe")


def test_unknown_tool_is_not_built(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    gobin = executable(tmp_path / "gobin" / "go", "#!/bin/sh\necho must not run >&2; exit 1\n").parent
    monkeypatch.setenv("PATH", str(gobin))
    monkeypatch.setenv("GPUBRIDGE_BIN_DIR", str(tmp_path))
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    with pytest.raises(ToolNotFoundError, match="gbnosuchtool is not one of the tools gpubridge builds"):
        find_tool("gbnosuchtool")
    assert not (tmp_path / "cache").exists()


def test_build_failure_is_named(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    gobin = executable(tmp_path / "gobin" / "go", "#!/bin/sh\necho 'lib/x.go:1: boom' >&2\nexit 1\n").parent
    monkeypatch.setenv("PATH", str(gobin))
    monkeypatch.setenv("GPUBRIDGE_BIN_DIR", str(tmp_path))
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    monkeypatch.setattr(_tools, "_repo_bin", lambda: None)
    with pytest.raises(ToolNotFoundError) as e:
        find_tool("gbdiscover")
    msg = str(e.value)
    assert "the tool gbdiscover was not found" in msg and "building it with go failed" in msg, msg
    assert "exited 1: lib/x.go:1: boom" in msg, msg
    assert [p.name for p in (tmp_path / "cache" / "gpubridge").iterdir()] == ["build.lock"]

    # A cache that cannot be written: named too.
    (tmp_path / "file").write_text("")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "file"))
    with pytest.raises(ToolNotFoundError, match=r"go failed: in the cache directory .*/file/"):
        find_tool("gbdiscover")


def go_env() -> dict[str, str]:
    """An environment whose PATH has go and the C compiler but none of the
    tools, keeping the user's Go build cache (a new XDG_CACHE_HOME would
    move it)."""
    assert GO is not None
    gocache = subprocess.run(
        [GO, "env", "GOCACHE"], capture_output=True, text=True, check=True
    ).stdout.strip()
    path = os.pathsep.join([str(Path(GO).parent), "/usr/bin", "/bin"])
    for t in _tools.TOOLS:
        assert shutil.which(t, path=path) is None, f"{t} is on {path}"
    return {"PATH": path, "GOCACHE": gocache}


BUILD_SCRIPT = """
import sys
from gpubridge import _tools
_tools._repo_bin = lambda: None  # not the checkout's bin/
print(_tools.find_tool(sys.argv[1]))
"""


@needs_go
@pytest.mark.torch_independent("go build of the tools into the cache: no torch in it")
def test_build_on_first_use(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """Two ranks starting together with no tools anywhere build them once,
    into the cache; later look-ups find them there without building."""
    env = dict(os.environ, **go_env(), XDG_CACHE_HOME=str(tmp_path / "cache"), PYTHONPATH=str(PKG))
    env["GPUBRIDGE_BIN_DIR"] = str(tmp_path / "empty")
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", BUILD_SCRIPT, tool],
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
        )
        for tool in ("gbdiscover", "gbbridge")
    ]
    outs = [p.communicate(timeout=_tools.BUILD_TIMEOUT + 60) for p in procs]
    err = b"".join(e for _, e in outs).decode()
    assert all(p.returncode == 0 for p in procs), err
    paths = [Path(o.decode().strip()) for o, _ in outs]
    assert paths[0].parent == paths[1].parent
    built = paths[0].parent
    assert built.parent == tmp_path / "cache" / "gpubridge" and built.name.startswith("bin-"), built
    assert err.count("gpubridge: building gbprobe, gbdiscover, gbbridge") == 1, err
    for t in _tools.TOOLS:
        v = subprocess.run([built / t, "--version"], capture_output=True, text=True, check=True, timeout=30)
        assert v.stdout.startswith(f"{t} "), v.stdout
    assert not [p for p in built.parent.iterdir() if p.name.startswith(".build-")]

    # In this process: found in the cache, nothing built again.
    for k, v in env.items():
        if k in ("PATH", "GOCACHE", "XDG_CACHE_HOME", "GPUBRIDGE_BIN_DIR"):
            monkeypatch.setenv(k, v)
    monkeypatch.setattr(_tools, "_repo_bin", lambda: None)
    assert find_tool("gbprobe") == str(built / "gbprobe")
    # A changed source gives another cache directory.
    monkeypatch.setattr(_tools, "_built", {})
    monkeypatch.setattr(_tools, "_source_digest", lambda root: "0" * 16)
    monkeypatch.setenv("GPUBRIDGE_NO_BUILD", "1")
    with pytest.raises(ToolNotFoundError, match="GPUBRIDGE_NO_BUILD is set"):
        find_tool("gbprobe")


# ---- rank_problems ----


@pytest.mark.parametrize(
    ("env", "want"),
    [
        ({}, []),
        ({"LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "2"}, []),
        ({"LOCAL_RANK": "x"}, ["LOCAL_RANK='x' is not an integer"]),
        ({"LOCAL_RANK": "1.0"}, ["LOCAL_RANK='1.0' is not an integer"]),
        ({"LOCAL_RANK": ""}, ["LOCAL_RANK='' is not an integer"]),
        ({"LOCAL_RANK": "-1"}, ["LOCAL_RANK='-1' is negative"]),
        ({"LOCAL_RANK": "2", "LOCAL_WORLD_SIZE": "2"}, ["LOCAL_RANK='2' is not below LOCAL_WORLD_SIZE='2'"]),
        (
            {"LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "two"},
            ["LOCAL_WORLD_SIZE='two' is not a positive integer"],
        ),
        ({"SLURM_LOCALID": "y"}, ["SLURM_LOCALID='y' is not an integer"]),
        ({"LOCAL_RANK": "1", "SLURM_LOCALID": "y"}, []),
    ],
)
def test_rank_problems_local_rank(
    monkeypatch: pytest.MonkeyPatch, env: dict[str, str], want: list[str]
) -> None:
    monkeypatch.setattr(_tools, "find_tool", lambda name: f"/x/{name}")
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    assert rank_problems() == want


@needs_tools
def test_rank_problems_missing_bridge(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("GPUBRIDGE_BIN_STRICT", "1")
    monkeypatch.setenv("GPUBRIDGE_BIN_DIR", str(BIN))
    assert rank_problems() == []
    monkeypatch.setenv("GPUBRIDGE_BIN_DIR", str(tools_without(tmp_path, "gbbridge")))
    monkeypatch.setenv("LOCAL_RANK", "z")
    got = rank_problems()
    assert len(got) == 2 and got[0] == "LOCAL_RANK='z' is not an integer", got
    assert got[1].startswith("the tool gbbridge was not found"), got


# ---- discover against a store ----


def master() -> Any:
    return dist.TCPStore("127.0.0.1", 0, 1, True, timeout=datetime.timedelta(seconds=30))


@needs_tools
def test_discover_single_rank(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """One rank: fine, then each own problem fails it naming the rank (a bad
    LOCAL_RANK in the environment is reported, not a gbdiscover crash)."""
    monkeypatch.setenv("GPUBRIDGE_BIN_DIR", str(BIN))
    monkeypatch.setenv("GPUBRIDGE_BIN_STRICT", "1")
    monkeypatch.setenv("GPUBRIDGE_VENDOR", "nvidia")
    store = master()
    host = socket.gethostname()
    topo = discover("127.0.0.1", store.port, 0, 1, "ok", tmp_path / "t.json", timeout=20)
    assert topo["islands"][0]["ranks"] == [0] and (tmp_path / "t.json").exists()

    monkeypatch.setenv("LOCAL_RANK", "x")
    with pytest.raises(RuntimeError) as e:
        discover(
            "127.0.0.1", store.port, 0, 1, "bad", tmp_path / "t.json", timeout=20, problems=["extra one"]
        )
    assert str(e.value) == (
        f"gpubridge: discovery failed: rank 0 ({host}): LOCAL_RANK='x' is not an integer; "
        f"rank 0 ({host}): extra one"
    )
    monkeypatch.delenv("LOCAL_RANK")

    monkeypatch.setenv("GPUBRIDGE_BIN_DIR", str(tools_without(tmp_path, "gbprobe")))
    with pytest.raises(RuntimeError) as e:
        discover("127.0.0.1", store.port, 0, 1, "noprobe", tmp_path / "t.json", timeout=20)
    msg = str(e.value)
    want = f"gpubridge: discovery failed: rank 0 ({host}): the tool gbprobe was not found"
    assert msg.startswith(want), msg
    assert "probe report is empty" in msg


@needs_tools
@pytest.mark.parametrize("present", [["gbdiscover"], []], ids=["with-gbdiscover", "none"])
def test_discover_names_missing_tools_once(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, present: list[str]
) -> None:
    """Several tools missing on a rank: discovery fails naming them all in
    one sentence, whether gbdiscover runs (it gets one --problem) or not (the
    rank's failure record holds one problem)."""
    d = tmp_path / "some"
    d.mkdir()
    for t in present:
        (d / t).symlink_to(BIN / t)
    monkeypatch.setenv("GPUBRIDGE_BIN_DIR", str(d))
    monkeypatch.setenv("GPUBRIDGE_BIN_STRICT", "1")
    monkeypatch.setenv("GPUBRIDGE_VENDOR", "nvidia")
    store = master()
    with pytest.raises(RuntimeError) as e:
        discover("127.0.0.1", store.port, 0, 1, f"some{len(present)}", tmp_path / "t.json", timeout=20)
    msg = str(e.value)
    missing = [t for t in _tools.TOOLS if t not in present]
    host = socket.gethostname()
    want = f"gpubridge: discovery failed: rank 0 ({host}): the tools {', '.join(missing)} were not found"
    assert msg.startswith(want), msg
    assert msg.count("not found") == 1 and msg.count("GPUBRIDGE_BIN_STRICT is set") == 1, msg


def cli_rank(port: int, rank: int, size: int, ns: str, vendor: str) -> subprocess.Popen[bytes]:
    env = dict(os.environ, GPUBRIDGE_VENDOR=vendor)
    line = (
        f"{BIN}/gbprobe --json | {BIN}/gbdiscover --store 127.0.0.1:{port} --rank {rank} "
        f"--world-size {size} --namespace {ns} --timeout 30s"
    )
    return subprocess.Popen(["bash", "-c", line], env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE)


@needs_tools
@pytest.mark.parametrize("missing_rank", [0, 1])
def test_missing_gbdiscover_tells_the_others(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, missing_rank: int
) -> None:
    """A rank without gbdiscover writes its failure into the store: the other
    rank's gbdiscover fails at once with the same cause (not a timeout), and
    rank 0 waits for the other to read it."""
    store = master()
    ns = f"nodisc{missing_rank}"
    other = cli_rank(store.port, 1 - missing_rank, 2, ns, "amd")
    monkeypatch.setenv("GPUBRIDGE_BIN_DIR", str(tools_without(tmp_path, "gbdiscover")))
    monkeypatch.setenv("GPUBRIDGE_BIN_STRICT", "1")
    monkeypatch.setenv("GPUBRIDGE_VENDOR", "nvidia")
    t0 = time.monotonic()
    with pytest.raises(RuntimeError) as e:
        discover("127.0.0.1", store.port, missing_rank, 2, ns, tmp_path / "t.json", timeout=30)
    out, err = other.communicate(timeout=60)
    elapsed = time.monotonic() - t0
    assert other.returncode == 1, err.decode()
    doc = json.loads(out)
    assert doc["schema"] == "gpubridge.discover-failure/v1"
    assert len(doc["problems"]) == 1, doc
    cause = doc["problems"][0]
    want = f"rank {missing_rank} ({socket.gethostname()}): the tool gbdiscover was not found"
    assert cause.startswith(want), cause
    assert str(e.value) == f"gpubridge: discovery failed: {cause}"
    assert elapsed < 15, f"took {elapsed:.1f} s: the other rank waited for a timeout"


# ---- torchrun jobs that fail at start-up ----


def left_behind(mark: str) -> list[str]:
    """Living (non-zombie) processes whose environment carries the job's
    mark: whatever the job started (gbprobe, gbdiscover, gbbridge, ranks)
    and left running. Other jobs on this host do not count."""
    out = []
    needle = f"GPUBRIDGE_TEST_MARK={mark}".encode()
    for d in os.listdir("/proc"):
        if not d.isdigit():
            continue
        try:
            environ = Path(f"/proc/{d}/environ").read_bytes().split(b"\0")
            state = Path(f"/proc/{d}/stat").read_text().rsplit(")", 1)[1].split()[0]
            cmd = Path(f"/proc/{d}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        if state != "Z" and needle in environ:
            out.append(f"{d}: {cmd}")
    return out


def test_left_behind_sees_marked_processes(tmp_path: Path) -> None:
    mark = f"{os.getpid()}-{tmp_path.name}"
    p = subprocess.Popen(["sleep", "60"], env=dict(os.environ, GPUBRIDGE_TEST_MARK=mark))
    try:
        # Popen returns when the child's close-on-exec pipe closes, which the
        # kernel does before it maps the new environment: for a moment (longer
        # under load) /proc/PID/environ reads empty. Wait for it, as a hang guard.
        deadline = time.monotonic() + scale(10)
        while not left_behind(mark) and time.monotonic() < deadline:
            time.sleep(0.01)
        assert [x.split(":")[0] for x in left_behind(mark)] == [str(p.pid)]
    finally:
        p.kill()
        p.wait()
    assert left_behind(mark) == []


FAULTS = {
    "badlocal": "LOCAL_RANK='x' is not an integer",
    "nobridge": "the tool gbbridge was not found",
    "noprobe": "the tool gbprobe was not found",
    "nodiscover": "the tool gbdiscover was not found",
}


@needs_tools
@pytest.mark.parametrize(
    "path",
    [
        pytest.param(
            "tools",
            marks=pytest.mark.torch_independent(
                "discovery straight on torchrun's store: the backend path runs it over the same store"
            ),
        ),
        "backend",
    ],
)
@pytest.mark.parametrize("fault", list(FAULTS))
def test_startup_failure_under_torchrun(tmp_path: Path, fault: str, path: str) -> None:
    """Rank 1 of a 2-rank job (NVIDIA + AMD, simulated) has a fault: both
    ranks raise a RuntimeError naming it, well within the 30 s discovery
    timeout, and nothing the job started is left running."""
    if fault != "badlocal":
        tools_without(tmp_path / "tools", "gb" + fault.removeprefix("no"))
    (tmp_path / "out").mkdir()
    mark = f"{os.getpid()}-{tmp_path.name}"
    env = dict(os.environ, GPUBRIDGE_BIN_DIR=str(BIN), PYTHONPATH=str(PKG), OMP_NUM_THREADS="1")
    env["GPUBRIDGE_TEST_MARK"] = mark
    for k in ENV_KEYS[1:]:
        env.pop(k, None)
    cmd = [
        sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
        str(WORKER), "nvidia,amd", str(tmp_path / "out"), fault, path, str(tmp_path / "tools"),
    ]  # fmt: skip
    p = hung.run(cmd, env=env, timeout=scale(120), cwd=tmp_path)
    output = (p.stdout + p.stderr).decode("utf-8", "replace")
    assert p.returncode != 0, output[-4000:]
    results = []
    for r in range(2):
        f = tmp_path / "out" / f"rank{r}.json"
        assert f.exists(), f"rank {r} wrote no result (exit {p.returncode}):\n{output[-6000:]}"
        results.append(json.loads(f.read_text()))
    cause = f"rank 1 ({socket.gethostname()}): {FAULTS[fault]}"
    for r, res in enumerate(results):
        err = res.get("error") or ""
        assert not res.get("unexpected"), err
        assert err.startswith("gpubridge: discovery failed: "), (r, err)
        assert cause in err, (r, cause, err)
        assert res["elapsed"] < 20, (r, res["elapsed"], err)
    assert results[0]["error"] == results[1]["error"], results
    left = left_behind(mark)
    assert not left, f"left running: {left}"
