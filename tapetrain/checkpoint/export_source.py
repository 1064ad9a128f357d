"""The training run behind a Hugging Face export: recorded in tapetrain_export.json when exporting, found again later.

The record names the run directory absolutely and relative to the export, and the run's identity: the sha256 of
the config that produced the exported checkpoint. A directory is the export's run when it holds a config with that
hash (the checkpoint's own copy, config.yaml, or one start's copy in config_history/: the checkpoint itself may
have been rotated out by train.keep_last since). So the run is found from any working directory, after export and
run moved together (relative to the export), and after the run alone moved when the caller knows the new place
(`compare` offers the run directories it was given); another run now at the recorded path is not mistaken for it.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

from tapetrain.checkpoint.store import CHECKPOINTS, CONFIG_HISTORY

EXPORT_INFO = "tapetrain_export.json"
RUN_CONFIG = "config.yaml"


def config_sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def run_record(checkpoint: Path, run_dir: Path | None, out_dir: Path) -> dict:
    """What tapetrain_export.json records about the run of `checkpoint`, for an export written to `out_dir`."""
    checkpoint = checkpoint.resolve()
    config = next((p for p in (checkpoint / RUN_CONFIG, *([run_dir / RUN_CONFIG] if run_dir else [])) if p.is_file()),
                  None)
    run = run_dir.resolve() if run_dir is not None else None
    return {
        "checkpoint": str(checkpoint),
        "run_dir": str(run) if run is not None else None,
        "run_dir_from_export": os.path.relpath(run, out_dir.resolve()) if run is not None else None,
        "run_config_sha256": config_sha256(config) if config is not None else None,
    }


@dataclass(frozen=True)
class ExportRun:
    """Where an export's training run is now (`run_dir`), or why it was not found (`problem`)."""

    run_dir: Path | None
    problem: str | None = None


def _configs_of(run_dir: Path) -> list[Path]:
    return [run_dir / RUN_CONFIG, *sorted(run_dir.glob(f"{CHECKPOINTS}/*/{RUN_CONFIG}")),
            *sorted((run_dir / CONFIG_HISTORY).glob("*.yaml"))]


def is_same_run(run_dir: Path, sha256: str | None) -> bool:
    """Whether `run_dir` is a run holding a config with hash `sha256` (any run, for an older record without one)."""
    if not (run_dir / CHECKPOINTS).is_dir():
        return False
    return sha256 is None or any(p.is_file() and config_sha256(p) == sha256 for p in _configs_of(run_dir))


def find_export_run(export_dir: Path, known_runs: Iterable[Path] = ()) -> ExportRun | None:
    """The run `export_dir` was exported from, looked for at its recorded path, relative to the export, then among
    `known_runs`; None when the export records no run (made from a lone checkpoint, or not by tapetrain)."""
    info = export_dir / EXPORT_INFO
    if not info.is_file():
        return None
    record = json.loads(info.read_text())
    sha256 = record.get("run_config_sha256")
    if record.get("run_dir"):
        recorded = Path(record["run_dir"])
        candidates = [recorded, export_dir / record["run_dir_from_export"]]
    elif record.get("checkpoint") and Path(record["checkpoint"]).parent.name == CHECKPOINTS:
        # An older export recorded the checkpoint as typed: relative to a working directory we no longer know, so
        # try it from here and from each directory above the export.
        recorded = Path(record["checkpoint"]).parent.parent
        candidates = [recorded, *(parent / recorded for parent in export_dir.resolve().parents)]
    else:
        return None
    for candidate in [*candidates, *known_runs]:
        if is_same_run(candidate, sha256):
            return ExportRun(candidate.resolve())
    identity = f" (config sha256 {sha256[:12]}…)" if sha256 else ""
    there = "holds another run" if (recorded / CHECKPOINTS).is_dir() else "is no longer there"
    return ExportRun(None, f"run not found: exported from {recorded}{identity}, which {there}; pass the run "
                           "directory as a MODEL too, or export it again from where it is now")
