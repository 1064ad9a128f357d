"""The Hugging Face remote code stays in step with tapetrain/model.

checkpoint/hf_modeling/modeling_tapetrain.py ships inside export directories and loads where tapetrain is not
installed, so it cannot import the model; the blocks it restates carry `# Copied from tapetrain.model.<module>.<name>`
(optionally `with old->new, ...` for renamed identifiers) on the line above, and must be verbatim copies of the
named top-level function or class, comments and docstrings included. Everything is read with ast; nothing is
imported.
"""

from __future__ import annotations

import ast
import difflib
import re
from dataclasses import dataclass
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[2] / "tapetrain"
REMOTE = PACKAGE / "checkpoint" / "hf_modeling" / "modeling_tapetrain.py"
MARKER = re.compile(r"# Copied from (tapetrain\.model\.\w+)\.(\w+)(?: with (\w+->\w+(?:, \w+->\w+)*))?")

# Top-level names the remote code shares with tapetrain/model but implements differently on purpose.
DIFFERENT_ON_PURPOSE = {
    "PositionContext": "the remote one also carries the per-layer RandPE draw indices for its attention layers",
    "attention": "the remote one is SDPA only and takes the padding mask of left-padded generation",
}


@dataclass
class Copy:
    name: str  # the copy's own name
    module: str  # tapetrain.model.<module>
    original: str  # the name there
    renames: list[tuple[str, str]]
    text: str
    line: int


def top_level_blocks(source: str) -> dict[str, tuple[int, str]]:
    """name -> (first line, decorators included; the block's text) for every top-level function and class."""
    lines = source.splitlines()
    blocks = {}
    for node in ast.parse(source).body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            start = min([node.lineno] + [d.lineno for d in node.decorator_list])
            blocks[node.name] = (start, "\n".join(lines[start - 1:node.end_lineno]))
    return blocks


def marked_copies(source: str) -> list[Copy]:
    lines = source.splitlines()
    copies = []
    for name, (start, text) in top_level_blocks(source).items():
        above = lines[start - 2].strip() if start >= 2 else ""
        if above.startswith("# Copied from"):
            match = MARKER.fullmatch(above)
            assert match, f"line {start - 1}: unreadable marker {above!r}; write `{MARKER.pattern}`"
            renames = [tuple(pair.split("->")) for pair in match[3].split(", ")] if match[3] else []
            copies.append(Copy(name, match[1], match[2], renames, text, start))
    return copies


def module_file(module: str) -> Path:
    return PACKAGE.parent / (module.replace(".", "/") + ".py")


def drift(copy: Copy) -> str:
    """'' when the copy equals the original after its renames; else what differs, as a unified diff."""
    path = module_file(copy.module)
    blocks = top_level_blocks(path.read_text()) if path.is_file() else {}
    if copy.original not in blocks:
        return f"line {copy.line}: {copy.module}.{copy.original} is not a top-level function or class\n"
    expected = blocks[copy.original][1]
    for old, new in copy.renames:
        expected = re.sub(rf"\b{old}\b", new, expected)
    if expected == copy.text:
        return ""
    diff = difflib.unified_diff(expected.splitlines(), copy.text.splitlines(), f"{copy.module}.{copy.original}",
                                f"{REMOTE.name} line {copy.line}", lineterm="")
    return "\n".join(diff) + "\n"


def test_marked_blocks_are_copies_of_the_model():
    copies = marked_copies(REMOTE.read_text())
    assert len(copies) >= 15, [c.name for c in copies]  # the markers themselves must not disappear
    drifted = "".join(drift(c) for c in copies)
    assert not drifted, (
        "the remote code's copies differ from tapetrain/model (- model, + remote code); make the copy in "
        f"{REMOTE.relative_to(PACKAGE.parent)} the same again (keep the remote code self-contained):\n{drifted}"
    )


def test_every_restated_name_is_marked():
    """A remote-code function or class named like a model one is a marked copy, or listed above with a reason."""
    model_names = {name for path in (PACKAGE / "model").glob("*.py") for name in top_level_blocks(path.read_text())}
    remote = REMOTE.read_text()
    marked = {c.name for c in marked_copies(remote)}
    shared = model_names & set(top_level_blocks(remote))
    unmarked = sorted(shared - marked - set(DIFFERENT_ON_PURPOSE))
    assert not unmarked, f"mark as `# Copied from tapetrain.model...` or list in DIFFERENT_ON_PURPOSE: {unmarked}"
    stale = sorted(set(DIFFERENT_ON_PURPOSE) - (shared - marked))
    assert not stale, f"DIFFERENT_ON_PURPOSE lists names that are no longer separate implementations: {stale}"


def test_checker_sees_drift_renames_and_missing_originals():
    original = top_level_blocks(module_file("tapetrain.model.positions").read_text())["rotate_pairs"][1]
    marker = "# Copied from tapetrain.model.positions.rotate_pairs"

    def check(text: str) -> str:
        (copy,) = marked_copies(text)
        return drift(copy)

    assert check(f"{marker}\n{original}\n") == ""
    drifted = check(f"{marker}\n{original.replace('x2 * cos + x1 * sin', 'x2 * cos - x1 * sin')}\n")
    assert "-    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)" in drifted
    renamed = original.replace("def rotate_pairs", "def turn_pairs").replace("cos", "c_")
    assert check(f"{marker} with rotate_pairs->turn_pairs\n{renamed}\n") != ""  # `cos` was renamed unannounced
    assert check(f"{marker} with rotate_pairs->turn_pairs, cos->c_\n{renamed}\n") == ""
    assert "not a top-level" in check(f"# Copied from tapetrain.model.positions.no_such_name\n{original}\n")
