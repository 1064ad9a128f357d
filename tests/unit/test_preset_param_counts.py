"""Parameter counts written next to a preset's name (docs tables, README, the presets' own comments) must be what
num_params() gives for that shape: `llama-1b` was called 1.08B for a long time while the model has 0.953B."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch

from tapetrain.model import Transformer
from tapetrain.model.presets import PRESETS, preset_config

REPO = Path(__file__).resolve().parents[2]
# "`llama-1b` (0.953B)" or "`paper-155m` cut to 2 layers (68.1M)" in a document
DOC_MENTION = re.compile(r"`(?P<preset>[\w.-]+)`(?: cut to (?P<layers>\d+) layers?)? \((?P<count>\d+(?:\.\d+)?[MB])\)")
# "...; 0.953B parameters" in the comment block right above `"name": dict(`
COMMENT_COUNT = re.compile(r"(?P<count>\d+(?:\.\d+)?[MB]) parameters")


def count_of(preset: str, pe: str, **overrides) -> int:
    with torch.device("meta"):
        return Transformer(preset_config(preset, pe=pe, **overrides)).num_params()


def written(n: int, unit: str) -> set[str]:
    """How n may be written in `unit` (M or B): 3 or 4 significant digits, e.g. 0.953B, 0.9532B, 162M, 162.4M."""
    value = n / (1e6 if unit == "M" else 1e9)
    return {f"{value:.{max(0, digits - 1 - int(f'{value:e}'.split('e')[1]))}f}{unit}" for digits in (3, 4)}


def allowed(preset: str, unit: str, **overrides) -> set[str]:
    """A count may be the RoPE shape's or the TAPE shape's (TAPE adds its MLP-update weights)."""
    return written(count_of(preset, "rope", **overrides), unit) | written(count_of(preset, "tape", **overrides), unit)


def doc_mentions() -> list[tuple[str, str, str, str | None]]:
    found = []
    for path in [REPO / "README.md", *sorted((REPO / "docs").rglob("*.md"))]:
        for match in DOC_MENTION.finditer(path.read_text()):
            if match["preset"] in PRESETS:
                found.append((path.name, match["preset"], match["count"], match["layers"]))
    return found


def comment_counts() -> list[tuple[str, str]]:
    found = []
    comment: list[str] = []
    for line in (REPO / "tapetrain/model/presets.py").read_text().splitlines():
        stripped = line.strip()
        if stripped.startswith("#"):
            comment.append(stripped)
            continue
        name = re.match(r'"([\w.-]+)": dict\(', stripped)
        if name:
            found += [(name[1], m["count"]) for m in COMMENT_COUNT.finditer(" ".join(comment))]
        comment = []
    return found


def test_the_checker_finds_what_it_checks():
    assert {("performance.md", "llama-1b"), ("sequence-parallel.md", "paper-155m")} <= {
        (doc, preset) for doc, preset, _, _ in doc_mentions()
    }
    assert {"llama-1b", "llama3.1-8b"} <= {preset for preset, _ in comment_counts()}
    assert written(953_223_168, "B") == {"0.953B", "0.9532B"} and "162.4M" in written(162_417_408, "M")


@pytest.mark.parametrize("where", ["docs", "presets"])
def test_written_parameter_counts_are_num_params(where):
    wrong = []
    if where == "docs":
        for doc, preset, count, layers in doc_mentions():
            shape = {"n_layers": int(layers)} if layers else {}
            expected = allowed(preset, count[-1], **shape)
            if count not in expected:
                wrong.append(f"{doc}: `{preset}` ({count}) but num_params() gives {sorted(expected)}")
    else:
        for preset, count in comment_counts():
            expected = allowed(preset, count[-1])
            if count not in expected:
                wrong.append(f"presets.py {preset}: {count} but num_params() gives {sorted(expected)}")
    assert not wrong, "\n".join(wrong)
