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
