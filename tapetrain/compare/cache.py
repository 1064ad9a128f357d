"""Results of `tapetrain compare` on disk: OUT/results/<label>[/seed-S]/<evaluation>.json.

Each file is the evaluation's own result dict (what `tapetrain eval ppl/passkey/ruler --out` writes) plus the
settings it was computed with under "compare_settings": the model's identity (checkpoint or export files), the
data, lengths, seeds and protocol. A later compare whose settings for that model and evaluation are identical
reads the file instead of evaluating, so adding a model (or an evaluation) to a comparison only computes what is
new; any change of setting or model recomputes that result.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

from tapetrain.atomic_io import write_json

log = logging.getLogger("tapetrain.compare")

RESULTS_DIR = "results"
SETTINGS_KEY = "compare_settings"


def result_path(out_dir: str, key: str, evaluation: str) -> Path:
    return Path(out_dir) / RESULTS_DIR / key / f"{evaluation}.json"


def normalized(settings: dict) -> dict:
    """As JSON reads it back (tuples become lists), so that a stored and a fresh settings dict compare equal."""
    return json.loads(json.dumps(settings))


def load_cached(path: Path, settings: dict) -> dict | None:
    """The stored result when its settings equal `settings`, else None (with a line saying what changed)."""
    if not path.is_file():
        return None
    try:
        report = json.loads(path.read_text())
    except json.JSONDecodeError:
        log.warning("compare: %s is not valid JSON (an interrupted write?); computing it again", path)
        return None
    stored = report.get(SETTINGS_KEY) if isinstance(report, dict) else None
    fresh = normalized(settings)
    if stored == fresh:
        return report
    stored = stored or {}
    changed = sorted(k for k in set(stored) | set(fresh) if stored.get(k) != fresh.get(k))
    log.info("compare: %s was computed with other settings (%s); computing it again", path, ", ".join(changed))
    return None


def store(path: Path, settings: dict, report: dict) -> dict:
    report = {**report, SETTINGS_KEY: normalized(settings)}
    write_json(path, report, parents=True)
    return report
