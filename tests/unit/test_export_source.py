"""Which run an export came from (tapetrain/checkpoint/export_source.py), on run directories as the trainer lays
them out (config.yaml, config_history/, checkpoints/step_X/config.yaml); the end-to-end case, a real run and export
compared from another directory and after moves, is in test_compare.py."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

from tapetrain.checkpoint.export_source import find_export_run, run_record


def make_run_dir(path: Path, config: str = "model: {pe: tape}\n", step: int = 4) -> Path:
    checkpoint = path / "checkpoints" / f"step_{step:08d}"
    checkpoint.mkdir(parents=True)
    for where in (path / "config.yaml", checkpoint / "config.yaml"):
        where.write_text(config)
    (path / "config_history").mkdir()
    (path / "config_history" / "start_001_from_step_00000000.yaml").write_text(config)
    return path


def make_export(path: Path, record: dict) -> Path:
    path.mkdir(parents=True)
    (path / "tapetrain_export.json").write_text(json.dumps(record))
    return path


def test_the_run_is_found_where_recorded_beside_the_export_or_among_known_runs(tmp_path):
    run = make_run_dir(tmp_path / "W" / "runs" / "tape")
    out = tmp_path / "W" / "hf" / "tape"
    record = run_record(run / "checkpoints" / "step_00000004", run, out)
    assert record["run_dir"] == str(run) and record["run_dir_from_export"] == "../../runs/tape"
    assert len(record["run_config_sha256"]) == 64
    make_export(out, record)
    assert find_export_run(out).run_dir == run

    shutil.move(tmp_path / "W", tmp_path / "W2")  # together: found relative to the export
    assert find_export_run(tmp_path / "W2" / "hf" / "tape").run_dir == tmp_path / "W2" / "runs" / "tape"

    moved = tmp_path / "elsewhere" / "tape"
    moved.parent.mkdir()
    shutil.move(tmp_path / "W2" / "runs" / "tape", moved)  # alone: found among the runs the caller knows
    export = tmp_path / "W2" / "hf" / "tape"
    other = make_run_dir(tmp_path / "other", config="model: {pe: rope}\n")
    assert find_export_run(export, [other, moved]).run_dir == moved
    lost = find_export_run(export, [other])
    assert lost.run_dir is None and f"exported from {run}" in lost.problem and "is no longer there" in lost.problem

    # Another run now at the recorded place is not taken for it; the export's run, its exported checkpoint since
    # rotated out (keep_last), is still recognised by its config history.
    shutil.copytree(other, run)
    lost = find_export_run(export)
    assert lost.run_dir is None and "holds another run" in lost.problem
    shutil.rmtree(moved / "checkpoints" / "step_00000004")
    (moved / "checkpoints" / "step_00000008").mkdir()
    (moved / "config.yaml").write_text("model: {pe: tape}\ntrain: {steps: 8}\n")  # resumed with another setting
    assert find_export_run(export, [moved]).run_dir == moved


def test_an_older_record_is_resolved_from_the_directories_above_the_export(tmp_path):
    """Exports written before the run's identity was recorded name the checkpoint as typed, relative to the
    directory `export hf` ran in; compare looks for it from each directory above the export."""
    run = make_run_dir(tmp_path / "W" / "runs" / "rope")
    export = make_export(tmp_path / "W" / "hf" / "rope", {"checkpoint": "runs/rope/checkpoints/step_00000004"})
    assert find_export_run(export).run_dir == run
    shutil.rmtree(run)
    assert "run not found: exported from runs/rope" in find_export_run(export).problem
    assert find_export_run(make_export(tmp_path / "hf-import", {"model_config": {}})) is None  # no run to find
