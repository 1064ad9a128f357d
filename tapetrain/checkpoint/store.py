"""Checkpoint directories: atomic save, discovery of the newest complete one, keep-last-K, RNG state.

Layout: RUN_DIR/checkpoints/step_XXXXXXXX/ holds DeepSpeed's files for that tag, rng_rankNNNNN.pt per rank,
model_config.json and, written last, trainer_state.json. Everything is first written under
step_XXXXXXXX.tmp/ and renamed by rank 0 after every rank has finished, so a process killed mid-save leaves only a
.tmp directory, which is never resumed from and is removed at the next start. Assumes the run directory is on a
filesystem shared by all nodes (as DeepSpeed's own checkpointing does).
"""

from __future__ import annotations

import json
import logging
import os
import random
import re
import shutil
import time
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
import torch

from tapetrain.checkpoint import disk
from tapetrain.distributed import DistEnv, barrier

if TYPE_CHECKING:
    from deepspeed import DeepSpeedEngine

log = logging.getLogger("tapetrain.checkpoint")

CHECKPOINTS = "checkpoints"
STATE_FILE = "trainer_state.json"
_TAG = re.compile(r"^step_(\d{8})$")


def step_tag(step: int) -> str:
    return f"step_{step:08d}"


def complete_checkpoints(run_dir: Path) -> list[tuple[int, Path]]:
    """(step, path) of every complete checkpoint, oldest first."""
    root = Path(run_dir) / CHECKPOINTS
    found = []
    if root.is_dir():
        for child in root.iterdir():
            match = _TAG.match(child.name)
            if match and (child / STATE_FILE).is_file():
                found.append((int(match.group(1)), child))
    return sorted(found)


def find_checkpoint(run_dir: Path, step: int | None = None) -> Path | None:
    checkpoints = complete_checkpoints(run_dir)
    if step is None:
        return checkpoints[-1][1] if checkpoints else None
    for found_step, path in checkpoints:
        if found_step == step:
            return path
    available = ", ".join(str(s) for s, _ in checkpoints) or "none"
    raise FileNotFoundError(
        f"no complete checkpoint for step {step} in {run_dir}/{CHECKPOINTS} (available: {available})"
    )


def remove_incomplete(run_dir: Path) -> None:
    root = Path(run_dir) / CHECKPOINTS
    if not root.is_dir():
        return
    for child in root.iterdir():
        if child.name.endswith(".tmp") or child.name.endswith(".old"):
            log.warning("removing incomplete checkpoint %s (a save was interrupted)", child)
            shutil.rmtree(child, ignore_errors=True)
        elif child.name == "latest_universal":  # left by a universal conversion of an older tapetrain
            child.unlink()


def _write_json_atomic(path: Path, payload: dict) -> None:
    tmp = path.with_name(path.name + ".tmp")
    with tmp.open("w") as f:
        json.dump(payload, f, indent=2)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def rng_state() -> dict:
    state = {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def restore_rng(state: dict) -> None:
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])


def save_checkpoint(
    engine: DeepSpeedEngine, run_dir: Path, step: int, trainer_state: dict, model_config: dict, env: DistEnv,
    keep_last: int | None, run_config_yaml: str | None = None,
) -> Path:
    """Collective: every rank calls it. Returns the final checkpoint directory.

    `run_config_yaml` (the resolved run config that produced this checkpoint) is stored next to it as config.yaml.
    """
    root = Path(run_dir) / CHECKPOINTS
    tag = step_tag(step)
    tmp_tag = tag + ".tmp"
    started = time.perf_counter()
    if env.is_main:
        log.info("saving checkpoint of step %d to %s ...", step, root / tag)
    from deepspeed.checkpoint.constants import (
        UNIVERSAL_CHECKPOINT_INFO,
        UNIVERSAL_CHECKPOINT_VERSION_KEY,
        UNIVERSAL_CHECKPOINT_VERSION_VALUE,
    )

    # Pure data parallelism needs no tensor-parallel merge patterns: the version alone lets DeepSpeed convert the
    # checkpoint to its universal format when resuming on another number of ranks.
    client_state = {UNIVERSAL_CHECKPOINT_INFO: {UNIVERSAL_CHECKPOINT_VERSION_KEY: UNIVERSAL_CHECKPOINT_VERSION_VALUE}}
    engine.save_checkpoint(str(root), tag=tmp_tag, client_state=client_state, save_latest=False)
    torch.save(rng_state(), root / tmp_tag / f"rng_rank{env.rank:05d}.pt")
    barrier()
    final = root / tag
    if env.is_main:
        tmp = root / tmp_tag
        _write_json_atomic(tmp / "model_config.json", model_config)
        if run_config_yaml is not None:
            (tmp / "config.yaml").write_text(run_config_yaml)
        _write_json_atomic(tmp / STATE_FILE, trainer_state)  # last: marks the directory complete
        if final.exists():  # re-saving a step (e.g. SIGTERM right after a periodic save)
            final.rename(root / (tag + ".old"))
            shutil.rmtree(root / (tag + ".old"))
        os.replace(tmp, final)
        if keep_last:
            for _, old in complete_checkpoints(run_dir)[:-keep_last]:
                shutil.rmtree(old, ignore_errors=True)
        size = sum(f.stat().st_size for f in final.rglob("*") if f.is_file())
        log.info("saved checkpoint %s (%s in %.1f s)", final, disk.human(size), time.perf_counter() - started)
    barrier()
    return final


def read_trainer_state(checkpoint: Path) -> dict:
    return json.loads((checkpoint / STATE_FILE).read_text())


def load_rng(checkpoint: Path, rank: int) -> bool:
    path = checkpoint / f"rng_rank{rank:05d}.pt"
    if not path.exists():
        return False
    restore_rng(torch.load(path, weights_only=False))
    return True
