"""Files written atomically (temp name, then rename) get the mode any other new file gets under the umask.

mkstemp creates 0600 files and safetensors writes 0600, so config.yaml, exported weights and eval results used to
be unreadable for the rest of a team sharing a run directory (umask 022 gives everything else 0644)."""

from __future__ import annotations

import os
import stat
from pathlib import Path

import pytest
from model_helpers import build

from tapetrain.atomic_io import write_json
from tapetrain.checkpoint.hf_export import export_model
from tapetrain.config import RunConfig, save_resolved
from tapetrain.eval.report import plot_ppl


@pytest.fixture
def umask_022():
    old = os.umask(0o022)
    yield
    os.umask(old)


def modes(root: Path) -> dict[str, int]:
    return {str(p.relative_to(root)): stat.S_IMODE(p.stat().st_mode) for p in root.rglob("*") if p.is_file()}


def test_atomic_writes_respect_the_umask(tmp_path, umask_022):
    save_resolved(RunConfig(), str(tmp_path / "run" / "config.yaml"))
    write_json(tmp_path / "eval" / "ppl.json", {"results": []}, parents=True)
    plot_ppl([{"model": "m", "protocol": "nonoverlap", "results": [{"length": 8, "ppl": 3.0}]}],
             str(tmp_path / "eval" / "ppl.png"))
    export_model(build("tape"), str(tmp_path / "hf"), verify=False)
    found = modes(tmp_path)
    assert {"run/config.yaml", "eval/ppl.json", "eval/ppl.png", "hf/model.safetensors", "hf/config.json"} <= set(found)
    assert found == dict.fromkeys(found, 0o644)
