"""Package code puts files in place only through tapetrain.atomic_io (issue #37): no other module renames files
itself, so every writer gets the same guarantee (fsync of file and directory, the project's file mode, the temp
removed on failure). Checked statically with ast; nothing is imported."""

from __future__ import annotations

import ast
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
PACKAGE = REPO / "tapetrain"
ATOMIC_IO = "atomic_io.py"

RENAMES = {"os.replace", "os.rename", "shutil.move"}
IMPORTED_RENAMES = {("os", "replace"), ("os", "rename"), ("shutil", "move")}
PATH_METHODS = {"rename", "replace"}  # Path.rename / Path.replace (one argument: the target)

# (file under tapetrain/, enclosing function, call) -> why it may rename without atomic_io
ALLOWED = {
    ("data/prepare.py", "_install", "shutil.move"):
        "carries the user's own files from the replaced dataset directory into the new one; writes nothing",
    ("checkpoint/store.py", "set_aside", ".rename"):
        "renames a damaged checkpoint out of the way for inspection; publishes nothing",
}


def _dotted(node: ast.AST) -> str:
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.Attribute):
        return f"{_dotted(node.value)}.{node.attr}"
    return ""


def _call_name(call: ast.Call) -> str | None:
    """'os.replace' etc., '.rename'/'.replace' for a one-argument method call (Path's, not str.replace(a, b) nor
    dataclasses.replace(obj, **changes)), or None."""
    name = _dotted(call.func)
    if name in RENAMES:
        return name
    func = call.func
    if (isinstance(func, ast.Attribute) and func.attr in PATH_METHODS and len(call.args) == 1 and not call.keywords
            and _dotted(func.value) != "dataclasses"):
        return f".{func.attr}"
    return None


def rename_calls(source: str) -> list[tuple[int, str, str]]:
    """(line, call, enclosing function or '<module>') of every rename in `source`, imported renames included."""
    found: list[tuple[int, str, str]] = []

    def visit(node: ast.AST, function: str) -> None:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            function = node.name
        if isinstance(node, ast.Call) and (name := _call_name(node)):
            found.append((node.lineno, name, function))
        if isinstance(node, ast.ImportFrom):
            found.extend((node.lineno, f"{node.module}.{a.name}", function) for a in node.names
                         if (node.module, a.name) in IMPORTED_RENAMES)
        for child in ast.iter_child_nodes(node):
            visit(child, function)

    visit(ast.parse(source), "<module>")
    return found


def violations() -> list[str]:
    out = []
    for path in sorted(PACKAGE.rglob("*.py")):
        rel = path.relative_to(PACKAGE).as_posix()
        if rel == ATOMIC_IO:
            continue
        for line, name, function in rename_calls(path.read_text()):
            if (rel, function, name) not in ALLOWED:
                out.append(f"tapetrain/{rel}:{line} {name} in {function}()")
    return out


def test_only_atomic_io_renames_files():
    found = violations()
    assert not found, ("write files with tapetrain.atomic_io (write_text/_bytes/_json, write_via, publish_file, "
                       "publish_dir) instead of renaming them yourself:\n" + "\n".join(found))


def test_every_allowed_rename_still_exists():
    """A stale allow-list entry would silently permit a new rename in that function."""
    present = {(path.relative_to(PACKAGE).as_posix(), function, name)
               for path in PACKAGE.rglob("*.py") for _, name, function in rename_calls(path.read_text())}
    assert set(ALLOWED) <= present


def test_the_checker_catches_each_form():
    source = '''
import os, shutil
from os import replace
def save(tmp, path):
    os.replace(tmp, path)
    os.rename(tmp, path)
    shutil.move(tmp, path)
    tmp.rename(path)
    Path(tmp).replace(path)
'''
    calls = rename_calls(source)
    assert [(name, function) for _, name, function in calls] == [
        ("os.replace", "<module>"), ("os.replace", "save"), ("os.rename", "save"), ("shutil.move", "save"),
        (".rename", "save"), (".replace", "save")]


def test_the_checker_ignores_string_and_dataclass_replace():
    source = 'x = "a_b".replace("_", "-")\ny = dataclasses.replace(cfg, steps=2)\nz = dataclasses.replace(cfg)\n'
    assert rename_calls(source) == []


def test_atomic_io_is_the_lowest_layer():
    """Any module may use it, so it imports nothing from tapetrain but file_modes."""
    tree = ast.parse((PACKAGE / ATOMIC_IO).read_text())
    imported = {n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)}
    imported |= {a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
    assert {m for m in imported if m and m.startswith("tapetrain")} <= {"tapetrain.file_modes"}
