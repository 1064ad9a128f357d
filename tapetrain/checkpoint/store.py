"""Checkpoint directories: atomic save, discovery of the newest complete one, keep-last-K, RNG state.

Layout: RUN_DIR/checkpoints/step_XXXXXXXX/ holds DeepSpeed's files for that tag, rng_rankNNNNN.pt per rank,
model_config.json, trainer_state.json and, written last, manifest.json (every file's size and checksum:
tapetrain.checkpoint.manifest, hashed off the training thread: tapetrain.checkpoint.completion). Everything is
first written under step_XXXXXXXX.tmp/ and renamed by rank 0 once every rank has hashed its share, so a process
killed mid-save (or while hashing) leaves only a .tmp directory, which is never resumed from and is removed at the
next start. Assumes the run directory is on a
filesystem shared by all nodes (as DeepSpeed's own checkpointing does).
"""

from __future__ import annotations

import json
import logging
import random
import re
import shutil
import time
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
import torch

from tapetrain import atomic_io
from tapetrain.checkpoint import disk, manifest
from tapetrain.checkpoint.completion import Completion, PendingCheckpoint
from tapetrain.distributed import DistEnv, barrier

if TYPE_CHECKING:
    from deepspeed import DeepSpeedEngine

log = logging.getLogger("tapetrain.checkpoint")

CHECKPOINTS = "checkpoints"
CONFIG_HISTORY = "config_history"  # RUN_DIR/config_history/: the resolved config of every start, one file each
STATE_FILE = manifest.STATE_FILE
DAMAGED_SUFFIX = ".damaged"
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
    keep_last: int | None, run_config_yaml: str | None = None, hash_timeout_s: float = 1800.0,
) -> PendingCheckpoint:
    """Collective: every rank calls it. Writes the checkpoint's files into step_XXXXXXXX.tmp/ on the training
    thread, then leaves hashing them for the manifest, the rename to complete and the pruning to a background
    thread per rank (tapetrain.checkpoint.completion); join the returned PendingCheckpoint before the next save.

    `run_config_yaml` (the resolved run config that produced this checkpoint) is stored next to it as config.yaml.
    `hash_timeout_s`: how long rank 0's thread waits for the other ranks' shares of the hashing.
    """
    root = Path(run_dir) / CHECKPOINTS
    tag = step_tag(step)
    tmp = root / (tag + ".tmp")
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
    engine.save_checkpoint(str(root), tag=tmp.name, client_state=client_state, save_latest=False)
    torch.save(rng_state(), tmp / f"rng_rank{env.rank:05d}.pt")
    barrier()
    if env.is_main:
        atomic_io.write_json(tmp / "model_config.json", model_config, newline=False)
        if run_config_yaml is not None:
            (tmp / "config.yaml").write_text(run_config_yaml)
        atomic_io.write_json(tmp / STATE_FILE, {**trainer_state, "manifest": manifest.MANIFEST}, newline=False)
    barrier()  # every file is written: the ranks now hash them off the training thread
    publish = (lambda: _publish(tmp, root / tag, run_dir, keep_last, started)) if env.is_main else None
    pending = PendingCheckpoint(Completion(tmp, step, env.rank, env.world_size, hash_timeout_s, publish))
    if env.is_main:
        log.info("wrote the files of step %d in %.1f s; hashing them for the manifest in the background", step,
                 time.perf_counter() - started)
    return pending


def _publish(tmp: Path, final: Path, run_dir: Path, keep_last: int | None, started: float) -> None:
    """Rank 0, once manifest.json is written: rename the .tmp directory complete, then prune to keep_last."""
    # re-saving a step (e.g. SIGTERM right after a periodic save) sets the old copy aside as .old, then removes it
    atomic_io.publish_dir(tmp, final, final.with_name(final.name + ".old"))
    if keep_last:
        for _, old in complete_checkpoints(run_dir)[:-keep_last]:
            shutil.rmtree(old, ignore_errors=True)
    size = sum(f.stat().st_size for f in final.rglob("*") if f.is_file())
    log.info("saved checkpoint %s (%s in %.1f s)", final, disk.human(size), time.perf_counter() - started)


def step_directories(run_dir: Path) -> list[tuple[int, Path]]:
    """(step, path) of every step_XXXXXXXX directory, complete or not (.tmp/.damaged excluded), newest first."""
    root = Path(run_dir) / CHECKPOINTS
    if not root.is_dir():
        return []
    found = [(int(m.group(1)), child) for child in root.iterdir() if (m := _TAG.match(child.name)) and child.is_dir()]
    return sorted(found, reverse=True)


def set_aside(checkpoint: Path) -> Path:
    """Rename a damaged or incomplete checkpoint to step_XXXXXXXX.damaged (kept for inspection, never resumed,
    exported or counted by keep_last; a later save of the same step no longer meets it)."""
    target = checkpoint.with_name(checkpoint.name + DAMAGED_SUFFIX)
    shutil.rmtree(target, ignore_errors=True)
    checkpoint.rename(target)
    return target


def read_trainer_state(checkpoint: Path) -> dict:
    return json.loads((checkpoint / STATE_FILE).read_text())


def load_rng(checkpoint: Path, rank: int) -> bool:
    path = checkpoint / f"rng_rank{rank:05d}.pt"
    if not path.exists():
        return False
    restore_rng(torch.load(path, weights_only=False))
    return True
