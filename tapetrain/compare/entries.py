"""The MODEL arguments of `tapetrain compare`: a run directory, a Hugging Face export, or a directory of seed runs.

A directory whose children `seed-S/` are runs or exports (runs/NAME/seed-0, runs/NAME/seed-1, ...) is one entry
of the comparison: every seed run is evaluated on its own and the tables show the mean over seeds ± their spread.
"""

from __future__ import annotations

import hashlib
import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from tapetrain.errors import InputError, MissingInputError

if TYPE_CHECKING:
    from tapetrain.checkpoint.export_source import ExportRun

SEED_DIR = re.compile(r"^seed-(\d+)$")
LABEL_CHARS = re.compile(r"[^A-Za-z0-9._+-]")
WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt")


def is_export(path: Path) -> bool:
    return (path / "config.json").is_file()


def is_model(path: Path) -> bool:
    from tapetrain.checkpoint.run_loader import is_run_or_checkpoint

    return is_export(path) or is_run_or_checkpoint(str(path))


@dataclass(frozen=True)
class ModelRun:
    """One model to evaluate: a run directory or checkpoint ('run') or an export ('hf')."""

    path: str  # as given (the report shows it); identity() resolves it
    kind: str
    key: str  # directory name of its results: the entry's label, or LABEL/seed-S in a group
    seed: int | None = None

    def identity(self) -> dict:
        """What a cached result was computed from: the checkpoint (path and the time its trainer state was
        written) or the export's config and weight files (names, sizes, modification times). A new checkpoint
        or a re-export makes every cached result of this model stale."""
        if self.kind == "run":
            from tapetrain.checkpoint.run_loader import resolve_checkpoint

            ckpt, _ = resolve_checkpoint(self.path, verify=False)
            state = ckpt / "trainer_state.json"
            return {"kind": "run", "checkpoint": str(ckpt.resolve()), "trainer_state": _stamp(state)}
        root = Path(self.path).resolve()
        config = hashlib.sha256((root / "config.json").read_bytes()).hexdigest()
        weights = sorted([p.name, *_stamp(p)] for p in root.iterdir() if p.name.endswith(WEIGHT_SUFFIXES))
        return {"kind": "hf", "path": str(root), "config_sha256": config, "weights": weights}

    def tokenizer(self) -> str | None:
        """The tokenizer file of this model (an export's tokenizer.model or tokenizer.json, a run's
        data.tokenizer), if known."""
        if self.kind == "run":
            from tapetrain.checkpoint.run_loader import run_tokenizer

            return run_tokenizer(self.path)
        from tapetrain.data.tokenizer import tokenizer_in

        return tokenizer_in(self.path)

    def training_run(self, known_runs: list[Path]) -> ExportRun | None:
        """The training run behind this model (None when it has none: an export not made by tapetrain, a lone
        checkpoint): the run directory itself, or the run an export was made from, found by its recorded identity
        wherever it is now, `known_runs` included (the run directories being compared), or why it was not found."""
        from tapetrain.checkpoint.export_source import ExportRun, find_export_run
        from tapetrain.checkpoint.run_loader import resolve_checkpoint

        if self.kind == "hf":
            return find_export_run(Path(self.path).resolve(), known_runs)
        _, run_dir = resolve_checkpoint(self.path, verify=False)
        return ExportRun(run_dir.resolve()) if run_dir is not None else None


def _stamp(path: Path) -> list[int]:
    stat = path.stat()
    return [stat.st_size, stat.st_mtime_ns]


@dataclass(frozen=True)
class ModelEntry:
    """One row of every table: a model, or a group of seed runs of one model."""

    label: str
    path: str
    runs: tuple[ModelRun, ...]

    @property
    def is_group(self) -> bool:
        return self.runs[0].seed is not None


def _kind(path: Path) -> str:
    return "hf" if is_export(path) else "run"


def resolve_entries(paths: list[str], labels: list[str] | None = None) -> list[ModelEntry]:
    """One entry per MODEL argument, checked before anything is computed."""
    if not paths:
        raise InputError("pass at least one MODEL (run directory, `tapetrain export hf` output or a directory of seed "
                         "runs seed-S/)")
    if labels is not None and len(labels) != len(paths):
        raise InputError(f"--labels names {len(labels)} models but {len(paths)} MODEL arguments were given; give one "
                         "label per model, in the same order")
    names = labels or [os.path.basename(os.path.abspath(p)) for p in paths]
    bad = [n for n in names if not n or LABEL_CHARS.search(n) or n in (".", "..")]
    if bad:
        raise InputError(f"model label(s) {', '.join(map(repr, bad))} must be non-empty and use only letters, "
                         "digits and . _ + - (they name result directories); pass --labels")
    duplicates = sorted({n for n in names if names.count(n) > 1})
    if duplicates:
        raise InputError(f"two models would share the label {', '.join(duplicates)}; pass --labels with one distinct "
                         "name per model")
    entries = []
    for given, label in zip(paths, names, strict=True):
        path = Path(given).resolve()
        if not path.exists():
            raise MissingInputError(f"model {given} does not exist; pass run directories, `tapetrain export hf` "
                                    "outputs, or directories of seed runs (NAME/seed-0, NAME/seed-1, ...)")
        if is_model(path):
            entries.append(ModelEntry(label, given, (ModelRun(given, _kind(path), label),)))
            continue
        seeds = sorted((int(m.group(1)), child.name) for child in path.iterdir()
                       if child.is_dir() and (m := SEED_DIR.match(child.name)) and is_model(child))
        if not seeds:
            raise InputError(f"{given} is neither a run directory (checkpoints/), a Hugging Face export (config.json) "
                             "nor a directory of seed runs (seed-0/, seed-1/, ... each a run or an export)")
        runs = tuple(ModelRun(os.path.join(given, name), _kind(path / name), f"{label}/seed-{seed}", seed)
                     for seed, name in seeds)
        entries.append(ModelEntry(label, given, runs))
    return entries
