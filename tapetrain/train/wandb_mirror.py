"""Weights & Biases (`logging.wandb`): the scalars of metrics.jsonl, under TensorBoard's names, on rank 0.

Optional: wandb is imported only when the section is set, and a missing package is a start-up error that names
the extra to install. The W&B run id is kept in RUN_DIR/wandb/run_id, so a resumed run continues the same W&B run.
"""

from __future__ import annotations

import math
import secrets
from pathlib import Path

from tapetrain.errors import ConfigError

RUN_ID_FILE = "run_id"


def require_wandb(settings) -> None:
    """Raise ConfigError when logging.wandb is set but wandb is not installed (checked before anything is written)."""
    if settings is None:
        return
    try:
        import wandb  # noqa: F401
    except ImportError as err:
        raise ConfigError(
            f"logging.wandb is set but wandb cannot be imported ({err}); install it with "
            "`pip install \"tapetrain[wandb]\"` (or `pip install wandb`), or set logging.wandb: null"
        ) from err


def scalar_name(key: str) -> str:
    """metrics.jsonl key -> the name TensorBoard and W&B show: loss -> train/loss, val_ppl -> val/ppl."""
    return f"val/{key[4:]}" if key.startswith("val_") else f"train/{key}"


def _run_id(wandb_dir: Path) -> str:
    path = wandb_dir / RUN_ID_FILE
    if path.is_file():
        return path.read_text().strip()
    run_id = secrets.token_hex(4)
    path.write_text(run_id + "\n")
    return run_id


class WandbMirror:
    """One W&B run per run directory; `log(record)` sends a metrics.jsonl record's finite numbers at its step."""

    def __init__(self, settings, run_dir: Path, run_name: str, config: dict):
        import wandb

        wandb_dir = run_dir / "wandb"
        wandb_dir.mkdir(parents=True, exist_ok=True)
        self.run = wandb.init(
            project=settings.project,
            entity=settings.entity,
            name=settings.name or run_name,
            tags=list(settings.tags),
            mode=settings.mode,
            dir=str(run_dir),  # wandb writes its files to DIR/wandb/
            id=_run_id(wandb_dir),
            resume="allow",
            config=config,
        )

    def log(self, record: dict) -> None:
        values = {scalar_name(k): v for k, v in record.items()
                  if k != "step" and isinstance(v, (int, float)) and math.isfinite(v)}
        if values:
            self.run.log(values, step=record["step"])

    def close(self) -> None:
        self.run.finish()
