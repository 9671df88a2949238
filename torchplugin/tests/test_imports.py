"""The package's import rules, read from its source with ast:

- no import cycle among gpubridge's modules (imports inside functions and
  under ``if TYPE_CHECKING`` count: a cycle there is still a cycle of
  design);
- torch is imported at module level (by the module itself, or through the
  modules it imports at module level) only by the modules listed in TORCH:
  those that work on tensors or on torch's c10d objects. Every other module
  stays torch-free; gpubridge_tools above all, whose console-script
  launchers must start in milliseconds (importing anything of the package
  ``gpubridge`` runs its ``__init__``, which imports torch).
"""

from __future__ import annotations

import ast
from collections import deque
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

# Modules that import torch at module level, and why.
TORCH = {
    "gpubridge": "registers the backend on import",
    "gpubridge.__main__": "reads the package's version (so the package, above)",
    "gpubridge._backend": "registers the backend with torch.distributed",
    "gpubridge._group": "the ProcessGroup torch sees",
    "gpubridge._native": "the native API on tensors",
    "gpubridge._hook": "the DDP communication hook",
    "gpubridge._weighted": "the sample-weighted DDP hook and FSDP's gradient reduction",
    "gpubridge._rebalance": "the sampler's permutation and its plan exchange, tensors",
    "gpubridge._worker": "Works, futures, CUDA streams",
    "gpubridge._collectives": "the algorithms on tensors",
    "gpubridge._p2p": "send and recv of tensors",
    "gpubridge._endpoint": "copies of tensors into the feed region",
    "gpubridge._endpoints": "the device of the endpoint it starts (through gpubridge._endpoint)",
    "gpubridge._combine": "the caller's reduction of tensors",
    "gpubridge._staging": "the feed region as a tensor",
    "gpubridge._island": "the native island group",
    "gpubridge._checks": "checks of tensors",
    "gpubridge._check_calls": "signatures of tensors, all-gathered",
    "gpubridge._dtypes": "torch's dtypes and reduce ops",
    "gpubridge._gpu": "CUDA through torch",
    "gpubridge._trace_gpu": "CUDA events of a traced collective's steps",
    "gpubridge._setup": "the rank's device",
    "gpubridge._discovery": "the job's TCPStore",
    "gpubridge._codec": "fp8 and bf16 quantizers on tensors",
    "gpubridge._codec_compile": "torch.compile of the codec on GPUs",
    "gpubridge._feedback": "error-feedback residuals, tensors",
    "gpubridge._policy": "which dtypes a codec packs",
    "gpubridge._compressed": "the compressed DDP communication hook",
    "gpubridge._bridged": "an all_reduce of tensors over a joined bridge",
    "gpubridge._policies": "the codec's dtypes (through gpubridge._policy)",
    "gpubridge.tune": "times all_reduces of tensors on the live job",
}


@dataclass(frozen=True)
class Import:
    module: str  # the importer
    target: str  # a module of the tree when the import names one, else what it names
    line: int
    runtime: bool  # runs when the importer is imported: module level, not under TYPE_CHECKING


def modules(root: Path) -> dict[str, Path]:
    """The modules of gpubridge (the package under root) and gpubridge_tools
    (the launchers beside it), by dotted name."""
    out: dict[str, Path] = {}
    tools = root / "gpubridge_tools.py"
    if tools.exists():
        out["gpubridge_tools"] = tools
    for p in sorted((root / "gpubridge").rglob("*.py")):
        parts = list(p.relative_to(root).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        out[".".join(parts)] = p
    return out


def _type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def imports(name: str, path: Path, known: set[str]) -> list[Import]:
    """Every import statement of a module, wherever it stands."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    out: list[Import] = []

    def visit(node: ast.AST, runtime: bool) -> None:
        for child in ast.iter_child_nodes(node):
            rt = runtime and not isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda))
            if isinstance(child, ast.If) and _type_checking(child.test):
                for stmt in child.body:
                    visit(ast.Module(body=[stmt], type_ignores=[]), False)
                for stmt in child.orelse:
                    visit(ast.Module(body=[stmt], type_ignores=[]), rt)
                continue
            if isinstance(child, ast.Import):
                out.extend(Import(name, a.name, child.lineno, rt) for a in child.names)
            elif isinstance(child, ast.ImportFrom):
                base = child.module or ""
                if child.level:
                    up = package.split(".")[: len(package.split(".")) - (child.level - 1)]
                    base = ".".join([*up, *([base] if base else [])])
                for a in child.names:
                    sub = f"{base}.{a.name}"
                    out.append(Import(name, sub if sub in known else base, child.lineno, rt))
            visit(child, rt)

    visit(ast.parse(path.read_text(), str(path)), True)
    return out


def find_cycles(mods: dict[str, Path]) -> list[list[Import]]:
    """One cycle per strongly connected set of modules, as the imports that
    close it."""
    known = set(mods)
    edges: dict[str, dict[str, Import]] = {m: {} for m in mods}
    for m, p in mods.items():
        for imp in imports(m, p, known):
            if imp.target in known and imp.target != m:
                edges[m].setdefault(imp.target, imp)
    # Tarjan's strongly connected components.
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    sccs: list[list[str]] = []

    def strong(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in edges[v]:
            if w not in index:
                strong(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            scc = []
            while True:
                w = stack.pop()
                scc.append(w)
                if w == v:
                    break
            if len(scc) > 1:
                sccs.append(sorted(scc))

    for v in sorted(mods):
        if v not in index:
            strong(v)
    cycles = []
    for scc in sccs:
        inside = set(scc)
        # A shortest way back to the first module, through the set.
        start = scc[0]
        prev: dict[str, Import] = {}
        queue = deque([start])
        while queue:
            v = queue.popleft()
            for w, imp in edges[v].items():
                if w in inside and w not in prev:
                    prev[w] = imp
                    queue.append(w)
        path = [prev[start]]
        while path[-1].module != start:
            path.append(prev[path[-1].module])
        cycles.append(path[::-1])
    return cycles


def describe(cycle: list[Import], mods: dict[str, Path]) -> str:
    hops = " -> ".join([cycle[0].module, *(i.target for i in cycle)])
    where = ", ".join(f"{mods[i.module].name}:{i.line}" for i in cycle)
    return f"import cycle: {hops} ({where})"


def _is_torch(target: str) -> bool:
    return target == "torch" or target.startswith("torch.")


def torch_chains(mods: dict[str, Path]) -> dict[str, list[Import]]:
    """For each module that imports torch when it is imported, how: the
    module-level imports from it to the one that imports torch itself.
    Importing a module of a package from outside it runs the package's
    __init__ first."""
    known = set(mods)
    found = {m: imports(m, p, known) for m, p in mods.items()}
    out: dict[str, list[Import]] = {}
    for m in mods:
        prev: dict[str, list[Import]] = {m: []}
        queue = deque([m])
        while queue and m not in out:
            v = queue.popleft()
            for imp in found[v]:
                if not imp.runtime:
                    continue
                if _is_torch(imp.target):
                    out[m] = [*prev[v], imp]
                    break
                nexts = [imp.target] if imp.target in known else []
                top = imp.target.split(".")[0]
                if top in known and top != v.split(".")[0] and top not in nexts:
                    nexts.append(top)  # the package's __init__, imported first
                for w in nexts:
                    if w not in prev:
                        prev[w] = [*prev[v], imp]
                        queue.append(w)
    return out


def torch_violations(mods: dict[str, Path], allowed: dict[str, str]) -> list[str]:
    chains = torch_chains(mods)
    bad = []
    for m in sorted(mods):
        chain = chains.get(m)
        if chain is not None and m not in allowed:
            how = " -> ".join(f"{mods[i.module].name}:{i.line} imports {i.target}" for i in chain)
            bad.append(f"{m} imports torch at module level ({how}); keep it torch-free, or list it in TORCH")
        elif chain is None and m in allowed:
            bad.append(f"{m} is listed in TORCH but imports no torch at module level: take it off the list")
    bad += [
        f"{m} is listed in TORCH but is not a module of the package" for m in sorted(set(allowed) - set(mods))
    ]
    return bad


def test_no_import_cycle() -> None:
    mods = modules(ROOT)
    assert "gpubridge._group" in mods and "gpubridge_tools" in mods, sorted(mods)
    assert [describe(c, mods) for c in find_cycles(mods)] == []


def test_torch_only_where_listed() -> None:
    assert torch_violations(modules(ROOT), TORCH) == []


# ---- the checks find what they look for ----


def write(root: Path, files: dict[str, str]) -> dict[str, Path]:
    for rel, text in files.items():
        p = root / rel
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_text(text)
    return modules(root)


def test_a_cycle_through_a_function_level_import_is_found(tmp_path: Path) -> None:
    mods = write(
        tmp_path,
        {
            "gpubridge/__init__.py": "from gpubridge import _a\n",
            "gpubridge/_a.py": "from gpubridge import _b\n",
            "gpubridge/_b.py": "import os\n\n\ndef f():\n    from . import _a\n    return _a\n",
            "gpubridge/_c.py": "import typing\nif typing.TYPE_CHECKING:\n    import gpubridge._c2\n",
            "gpubridge/_c2.py": "from gpubridge._c import x\n",
        },
    )
    got = sorted(describe(c, mods) for c in find_cycles(mods))
    assert got == [
        "import cycle: gpubridge._a -> gpubridge._b -> gpubridge._a (_a.py:1, _b.py:5)",
        "import cycle: gpubridge._c -> gpubridge._c2 -> gpubridge._c (_c.py:3, _c2.py:1)",
    ], got


@pytest.mark.parametrize(
    ("files", "want"),
    [
        (
            {"gpubridge/_x.py": "import torch.distributed as dist\n"},
            ["gpubridge._x imports torch at module level (_x.py:1 imports torch.distributed)"],
        ),
        (  # through another module of the package
            {"gpubridge/_x.py": "from gpubridge import _t\n", "gpubridge/_t.py": "import torch\n"},
            [
                "gpubridge._t imports torch at module level (_t.py:1 imports torch)",
                "gpubridge._x imports torch at module level (_x.py:1 imports gpubridge._t -> _t.py:1 "
                "imports torch)",
            ],
        ),
        (  # a launcher that imports the package runs its __init__
            {"gpubridge_tools.py": "import gpubridge._tools\n", "gpubridge/__init__.py": "import torch\n"},
            [
                "gpubridge imports torch at module level (__init__.py:1 imports torch)",
                "gpubridge_tools imports torch at module level (gpubridge_tools.py:1 imports "
                "gpubridge._tools -> __init__.py:1 imports torch)",
            ],
        ),
        (  # inside a function or for type checking only: fine
            {
                "gpubridge/_x.py": "def f():\n    import torch\n",
                "gpubridge/_y.py": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    import torch\n",
            },
            [],
        ),
    ],
    ids=["direct", "through-a-module", "launcher", "not-at-module-level"],
)
def test_torch_at_module_level_is_found(tmp_path: Path, files: dict[str, str], want: list[str]) -> None:
    files.setdefault("gpubridge/__init__.py", "")
    got = torch_violations(write(tmp_path, files), {})
    assert [g.split("; keep it")[0] for g in got] == want, got


def test_stale_torch_entries_are_found(tmp_path: Path) -> None:
    mods = write(tmp_path, {"gpubridge/__init__.py": "", "gpubridge/_x.py": "import os\n"})
    assert torch_violations(mods, {"gpubridge._x": "", "gpubridge._gone": ""}) == [
        "gpubridge._x is listed in TORCH but imports no torch at module level: take it off the list",
        "gpubridge._gone is listed in TORCH but is not a module of the package",
    ]
