"""Package layering, checked statically: the import statements of every module (lazy, function-level ones
included) are read with ast; nothing is imported, so the rules hold whatever is installed."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
PACKAGE = REPO / "tapetrain"

# (file or directory under tapetrain/, forbidden module, why)
RULES = [
    ("checkpoint", "tapetrain.train", "checkpoint code must not depend on the train package"),
    ("distributed.py", "tapetrain.train", "the shared process-group module must not depend on the train package"),
    ("distributed.py", "tapetrain.checkpoint", "the shared process-group module must not depend on checkpoint"),
    ("model", "deepspeed", "model code is single-device PyTorch and never imports deepspeed"),
    ("model", "tapetrain.parallel", "the model sees sequence parallelism only through its SequenceShard protocol"),
    ("parallel", "tapetrain.train", "parallelism serves training and evaluation alike"),
    (".", "tools", "package code never depends on the tools/ scripts (they are thin shims over the package)"),
]
# Calls that load code by path or bend the import path: the package imports modules by name, and tools/ import the
# installed package (`pip install -e .`), so neither needs them.
PATH_LOADING = {"spec_from_file_location", "run_path", "sys.path.insert", "sys.path.append", "sys.path.extend"}


def module_name(path: Path) -> str:
    """tapetrain/checkpoint/store.py -> tapetrain.checkpoint.store; a package's __init__.py -> the package."""
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imported_modules(source: str, module: str, is_package: bool = False) -> set[str]:
    """Absolute names that the import statements in `source` (the code of `module`) refer to. `from a import b`
    gives both `a` and `a.b`, since `b` may be a submodule; relative imports are resolved against `module`."""
    package = module if is_package else module.rpartition(".")[0]
    names: set[str] = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                prefix = ".".join(base + ([node.module] if node.module else []))
            else:
                prefix = node.module or ""
            names.add(prefix)
            names.update(f"{prefix}.{alias.name}" for alias in node.names)
    return names


def path_loading_calls(source: str) -> set[str]:
    """The PATH_LOADING calls in `source`, as written (`importlib.util.spec_from_file_location` counts as
    `spec_from_file_location`)."""
    found = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Call):
            name = ast.unparse(node.func)
            found.update(n for n in PATH_LOADING if name == n or name.endswith("." + n))
    return found


def runtime_imports(source: str, module: str, is_package: bool = False) -> set[str]:
    """imported_modules without the imports under `if TYPE_CHECKING:` (they never run)."""
    tree = ast.parse(source)
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            node.body = [ast.Pass()]
    return imported_modules(ast.unparse(tree), module, is_package)


def unit_of(module: str) -> str:
    """The room a module belongs to: a top-level module (tapetrain.distributed) or a subpackage (tapetrain.data)."""
    return ".".join(module.split(".")[:2])


def unit_graph(sources: dict[str, tuple[str, bool]]) -> dict[str, dict[str, list[str]]]:
    """{unit: {unit it imports: ["module -> module", ...]}} from {module: (source, is_package)}; imports of the
    package root (tapetrain/__init__.py) are not edges."""
    edges: dict[str, dict[str, list[str]]] = {}
    for module, (source, is_package) in sources.items():
        for name in runtime_imports(source, module, is_package):
            while name and name not in sources:
                name = name.rpartition(".")[0]
            if not name.startswith("tapetrain.") or unit_of(name) == unit_of(module):
                continue
            edges.setdefault(unit_of(module), {}).setdefault(unit_of(name), []).append(f"{module} -> {name}")
    return edges


def cycles(edges: dict[str, dict[str, list[str]]]) -> list[list[str]]:
    """The strongly connected groups of more than one unit (each a loop of imports), by Tarjan's algorithm."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in edges.get(v, {}):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            group = []
            while True:
                w = stack.pop()
                group.append(w)
                if w == v:
                    break
            if len(group) > 1:
                found.append(sorted(group))

    for v in sorted(set(edges) | {w for ws in edges.values() for w in ws}):
        if v not in index:
            visit(v)
    return found


def package_sources() -> dict[str, tuple[str, bool]]:
    return {module_name(f): (f.read_text(), f.name == "__init__.py") for f in sorted(PACKAGE.rglob("*.py"))}


def is_within(name: str, forbidden: str) -> bool:
    return name == forbidden or name.startswith(forbidden + ".")


def violations(target: str, forbidden: str) -> list[str]:
    path = PACKAGE / target
    files = sorted(path.rglob("*.py")) if path.is_dir() else [path]
    assert files, f"nothing to check under {path}"
    found = []
    for file in files:
        names = imported_modules(file.read_text(), module_name(file), is_package=file.name == "__init__.py")
        bad = [n for n in names if is_within(n, forbidden)]
        bad = [n for n in bad if not any(m != n and is_within(n, m) for m in bad)]  # `a`, not also `a.X`
        found += [f"{file.relative_to(PACKAGE.parent)} imports {n}" for n in sorted(bad)]
    return found


@pytest.mark.parametrize(("target", "forbidden", "why"), RULES, ids=[f"{t}-{f}" for t, f, _ in RULES])
def test_layering(target: str, forbidden: str, why: str) -> None:
    found = violations(target, forbidden)
    assert not found, f"{why}:\n" + "\n".join(found)


def test_no_import_loops_between_rooms() -> None:
    """No loop of runtime imports between the package's rooms (top-level modules and subpackages): each can be
    understood, tested and changed from the ones below it."""
    edges = unit_graph(package_sources())
    loops = cycles(edges)
    detail = [f"{' <-> '.join(loop)}: " + "; ".join(e for a in loop for b in loop
                                                   for e in edges.get(a, {}).get(b, [])[:2]) for loop in loops]
    assert not loops, "import loops between rooms:\n" + "\n".join(detail)


# Lower rooms never import higher ones (each row: the room and the rooms above it that it must not import).
LOWER = {
    "tapetrain.errors": ["tapetrain.distributed", "tapetrain.data", "tapetrain.model", "tapetrain.config"],
    "tapetrain.model": ["tapetrain.data", "tapetrain.train", "tapetrain.checkpoint", "tapetrain.eval",
                        "tapetrain.bench", "tapetrain.compare", "tapetrain.distributed", "tapetrain.cli"],
    "tapetrain.distributed": ["tapetrain.data", "tapetrain.parallel", "tapetrain.train", "tapetrain.checkpoint",
                              "tapetrain.eval", "tapetrain.compare", "tapetrain.bench"],
    "tapetrain.data": ["tapetrain.checkpoint", "tapetrain.train", "tapetrain.eval", "tapetrain.compare",
                       "tapetrain.bench"],
    "tapetrain.checkpoint": ["tapetrain.train", "tapetrain.eval", "tapetrain.compare", "tapetrain.bench"],
}


@pytest.mark.parametrize("room", sorted(LOWER))
def test_no_upward_imports(room: str) -> None:
    edges = unit_graph(package_sources()).get(room, {})
    up = {higher: edges[higher] for higher in LOWER[room] if higher in edges}
    assert not up, f"{room} imports rooms above it: " + "; ".join(e for v in up.values() for e in v[:3])


def test_loop_checker_can_fail() -> None:
    """A loop data -> checkpoint -> data is found; TYPE_CHECKING imports are not edges."""
    sources = {
        "tapetrain.data.commands": ("def f():\n    from tapetrain.checkpoint import manifest\n", False),
        "tapetrain.checkpoint": ("", True),
        "tapetrain.checkpoint.manifest": ("from tapetrain.data.errors import DataError\n", False),
        "tapetrain.data": ("", True),
        "tapetrain.data.errors": ("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n"
                                  "    from tapetrain.model import X\n", False),
        "tapetrain.model": ("", True),
    }
    edges = unit_graph(sources)
    assert cycles(edges) == [["tapetrain.checkpoint", "tapetrain.data"]]
    assert "tapetrain.model" not in edges.get("tapetrain.data", {})


@pytest.mark.parametrize("root", ["tapetrain", "tools"])
def test_no_code_is_loaded_by_path(root: str) -> None:
    found = [f"{file.relative_to(REPO)}: {', '.join(sorted(calls))}" for file in sorted((REPO / root).rglob("*.py"))
             if (calls := path_loading_calls(file.read_text()))]
    assert not found, "code loaded by path or sys.path changed (import the package by name instead):\n" + \
        "\n".join(found)


def test_checker_sees_tools_imports_and_path_loading() -> None:
    """The two rules that keep the package off tools/ can fail: imports by name and loading by path."""
    source = (
        "import importlib.util, sys\n"
        "def run():\n"
        "    from tools import bench_data\n"
        "    import tools.demo\n"
        "    spec = importlib.util.spec_from_file_location('bench_data', 'tools/bench_data.py')\n"
        "    sys.path.insert(0, 'tools')\n"
    )
    names = imported_modules(source, "tapetrain.bench.data")
    assert {"tools", "tools.bench_data", "tools.demo"} <= names
    assert all(is_within(n, "tools") for n in ("tools.bench_data", "tools.demo"))
    assert not is_within("toolsmith", "tools")
    assert path_loading_calls(source) == {"spec_from_file_location", "sys.path.insert"}
    assert path_loading_calls("import importlib\nimportlib.import_module('tapetrain.bench')\n") == set()


def test_checker_sees_every_import_form() -> None:
    source = (
        "import deepspeed.comm as dist\n"
        "from tapetrain import train\n"
        "def lazy():\n"
        "    from ..train.distributed import DistEnv\n"
        "    from . import store\n"
    )
    names = imported_modules(source, "tapetrain.checkpoint.run_loader")
    assert {"deepspeed.comm", "tapetrain.train", "tapetrain.train.distributed", "tapetrain.checkpoint.store"} <= names
    assert is_within("tapetrain.train.distributed", "tapetrain.train")
    assert not is_within("tapetrain.training_utils", "tapetrain.train")
    assert imported_modules("from .sub import x\n", "tapetrain.model", is_package=True) >= {"tapetrain.model.sub.x"}
