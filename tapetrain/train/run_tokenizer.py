"""Which tokenizer a run uses, and the copy of it the run directory keeps.

data.tokenizer, when null, is adopted: from model.init_from (a Hugging Face checkpoint, an export or a run: the
model continues with its own tokenizer), else from what the training data recorded (its manifest's path when that
file still has the recorded sha256, else the copy `data prepare` put beside the shards, else the copy an earlier
start of this run kept). The start's checks then compare it with every data source by sha256
(data.provenance.common_tokenizer), naming where the tokenizer came from.

The run directory keeps tokenizer/ (the tokenizer file and its config files) and config.yaml names that copy, so
`export hf`, `compare` and `eval` find it from any working directory, and after the run directory moved.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import shutil
from pathlib import Path
from typing import TYPE_CHECKING

from tapetrain import atomic_io
from tapetrain.data.format import file_sha256
from tapetrain.data.remote import is_remote

if TYPE_CHECKING:
    from tapetrain.config import RunConfig

log = logging.getLogger("tapetrain.train")

RUN_TOKENIZER_DIR = "tokenizer"
GIVEN = "data.tokenizer"


def init_from_tokenizer(init_from: str) -> str | None:
    """The tokenizer file of a model.init_from source, when it has one."""
    from tapetrain.checkpoint.run_loader import is_run_or_checkpoint, run_tokenizer
    from tapetrain.data.tokenizer import tokenizer_in

    if not os.path.isdir(init_from):
        return None
    if is_run_or_checkpoint(init_from):
        found = run_tokenizer(init_from)
        return found if found and os.path.isfile(found) else None
    return tokenizer_in(init_from)


def data_tokenizer(data_path: str, run_dir: str | None = None) -> str | None:
    """A local tokenizer file with the sha256 the dataset at `data_path` recorded (or an example store's own)."""
    from tapetrain.data.examples import tokenizer_of
    from tapetrain.data.provenance import manifest_tokenizer

    if is_remote(data_path):
        return None
    store = tokenizer_of(data_path)
    if store:
        return store
    recorded = manifest_tokenizer(data_path)
    if not recorded:
        return None
    candidates = [recorded.get("path")]
    if recorded.get("copy"):
        candidates.append(os.path.join(data_path, recorded["copy"]))
    if run_dir and recorded.get("path"):
        candidates.append(os.path.join(run_dir, RUN_TOKENIZER_DIR, os.path.basename(recorded["path"])))
    for path in candidates:
        if path and os.path.isfile(path) and file_sha256(path) == recorded["sha256"]:
            return os.path.abspath(path)
    return None


def choose_tokenizer(cfg: RunConfig) -> tuple[RunConfig, str]:
    """(cfg with data.tokenizer set when it can be adopted, what names it in messages)."""
    if cfg.data.tokenizer:
        return cfg, GIVEN
    path, what = None, GIVEN
    if cfg.model.init_from:
        path = init_from_tokenizer(cfg.model.init_from)
        what = f"the tokenizer of model.init_from={cfg.model.init_from} ({path})"
    if path is None and cfg.data.train:
        path = data_tokenizer(cfg.data.train[0].path, cfg.run.out_dir)
        what = GIVEN
    if path is None:
        return cfg, GIVEN
    log.info("data.tokenizer: %s (%s)", path, "model.init_from's" if what != GIVEN else "the training data's")
    return dataclasses.replace(cfg, data=dataclasses.replace(cfg.data, tokenizer=os.path.abspath(path))), what


def keep_copy(cfg: RunConfig, run_dir: Path, write: bool) -> RunConfig:
    """cfg naming the copy of data.tokenizer in run_dir/tokenizer/; `write` (rank 0) copies its files there."""
    from tapetrain.data.tokenizer import open_tokenizer, resolve_tokenizer_file

    if not cfg.data.tokenizer or is_remote(cfg.data.tokenizer) or not os.path.exists(cfg.data.tokenizer):
        return cfg
    source = resolve_tokenizer_file(cfg.data.tokenizer)
    target = (run_dir / RUN_TOKENIZER_DIR).resolve()
    if write:
        target.mkdir(parents=True, exist_ok=True)
        for path in open_tokenizer(source).files:
            dest = target / os.path.basename(path)
            if Path(path).resolve() != dest:
                atomic_io.write_via(dest, lambda tmp, src=path: shutil.copyfile(src, tmp))
    copy = str(target / os.path.basename(source))
    return dataclasses.replace(cfg, data=dataclasses.replace(cfg.data, tokenizer=copy))
