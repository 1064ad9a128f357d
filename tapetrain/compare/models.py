"""A model of the comparison as the evaluations need it: loaded once and only when some result must be computed,
or exported once when an evaluation runs on Hugging Face exports (RULER through lm-eval)."""

from __future__ import annotations

import gc
import hashlib
import json
import logging
import os
from pathlib import Path

import torch

from tapetrain.compare.entries import ModelRun
from tapetrain.eval.models import EvalModel, load_eval_model, seed_eval

log = logging.getLogger("tapetrain.compare")

EXPORTS_DIR = "exports"


def data_identity(path: str | None) -> dict | None:
    """What the eval data is, for the cache key: a shard directory by its manifest's checksum, a file by its size
    and modification time."""
    if not path:
        return None
    p = Path(path).resolve()
    if p.is_dir():
        manifest = p / "manifest.json"
        digest = hashlib.sha256(manifest.read_bytes()).hexdigest() if manifest.is_file() else None
        return {"path": str(p), "manifest_sha256": digest}
    stat = p.stat()
    return {"path": str(p), "size": stat.st_size, "mtime_ns": stat.st_mtime_ns}


class ModelHandle:
    """One ModelRun during a compare: `model()` loads it on first use (seeding torch before every evaluation, as
    the `tapetrain eval` commands do), `export_dir()` gives a Hugging Face directory (a run directory is exported
    into OUT/exports/<label> once, and re-exported when its checkpoint changes)."""

    def __init__(self, run: ModelRun, dtype: str, out_dir: str):
        self.run, self.dtype, self.out_dir = run, dtype, out_dir
        self._model: EvalModel | None = None

    def model(self) -> EvalModel:
        if self._model is None:
            self._model = load_eval_model(self.run.path, self.dtype)
        seed_eval()
        return self._model

    def export_dir(self) -> str:
        if self.run.kind == "hf":
            return self.run.path
        from tapetrain.checkpoint.hf_export import export_hf
        from tapetrain.checkpoint.run_loader import resolve_checkpoint

        out = Path(self.out_dir) / EXPORTS_DIR / self.run.key
        ckpt, _ = resolve_checkpoint(self.run.path, verify=False)
        info = out / "tapetrain_export.json"
        if info.is_file() and Path(json.loads(info.read_text()).get("checkpoint", "")).resolve() == ckpt.resolve():
            return str(out)
        log.info("compare: exporting %s to %s (lm-eval runs Hugging Face models)", ckpt, out)
        os.makedirs(out.parent, exist_ok=True)
        export_hf(str(ckpt), str(out), overwrite=True)
        return str(out)

    def close(self) -> None:
        if self._model is not None:
            self._model = None
            gc.collect()
            if torch.cuda.is_available():
                torch.cuda.empty_cache()
