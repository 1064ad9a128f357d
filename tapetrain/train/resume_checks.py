"""What a resume may and may not change, decided before anything is built or written.

A run directory holds one model: its checkpoints are only resumable by the architecture that wrote them, so a
resume compares the resolved model config with the checkpoint's model_config.json and refuses any difference
except in EXECUTION_ONLY_MODEL_FIELDS (how the same function is computed). The trainable parameter set, the LoRA
adapters and the tokenizer are part of what a checkpoint means too. Optimizer settings, the schedule and the
batch size may change: the config wins from the resumed step on, and these helpers describe what changed so the
log says it. So may the data settings that decide what a step trains on (the mixture and its weights, seq_len,
packing, the document mask, answer-only loss): a resume accepts them and names each change, old -> new.
tapetrain.train.checkpointing.CheckpointManager applies these rules; nothing else calls them.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import TYPE_CHECKING, Any

import yaml

from tapetrain.checkpoint import store
from tapetrain.config.typed import to_plain
from tapetrain.errors import ConfigError
from tapetrain.model import ModelConfig

if TYPE_CHECKING:
    from tapetrain.config import RunConfig

log = logging.getLogger("tapetrain.train")

# Fields that change how the same model is computed, never its parameters or its function.
EXECUTION_ONLY_MODEL_FIELDS = ("attn_backend", "activation_checkpointing", "compile", "loss_backend", "loss_chunk_mib",
                               "tiled_mlp", "tape_fused_updates")
# Settings a resume applies from the resumed step on (the log lists the ones that changed).
RESUMABLE_SETTINGS = ("optim", "train.grad_clip", "train.steps", "train.float8")


def _ways_out(run_dir: Path) -> str:
    return (f"A run directory holds one model. To train the changed model, set run.out_dir to a new directory; to "
            f"warm-start it from these weights on purpose, do that with model.init_from pointing at a Hugging Face "
            f"export of them (`tapetrain export hf {run_dir} --out DIR`); to continue this run, restore the values "
            "above")


def check_same_model(checkpoint: Path, model_config: ModelConfig, run_dir: Path) -> None:
    """Raise ConfigError naming every model key on which `model_config` differs from the checkpoint's."""
    path = checkpoint / "model_config.json"
    if not path.is_file():
        log.warning("%s has no model_config.json (written by an older tapetrain): the model cannot be compared "
                    "with the config", checkpoint)
        return
    saved = json.loads(path.read_text())
    known = {k: v for k, v in saved.items() if k in ModelConfig.__dataclass_fields__}
    ignored = sorted(set(saved) - set(known))
    if ignored:
        log.warning("%s records model keys this tapetrain does not know (%s); they are not compared",
                    path, ", ".join(ignored))
    before = ModelConfig.from_dict(known).to_dict()  # defaults filled in like any loaded config
    now = model_config.to_dict()
    changed = [k for k in now if k not in EXECUTION_ONLY_MODEL_FIELDS and before.get(k) != now[k]]
    if changed:
        rows = "; ".join(f"model.{k}: checkpoint {before.get(k)!r}, config {now[k]!r}" for k in changed)
        raise ConfigError(
            f"cannot resume from {checkpoint}: it holds a different model than the config describes ({rows}). "
            f"{_ways_out(run_dir)}"
        )


def check_same_training_setup(checkpoint: Path, state: dict, cfg: RunConfig, tokenizer_sha256: str | None) -> None:
    """The trainable set, LoRA adapters and tokenizer must match what the checkpoint recorded (if it did)."""
    problems = []
    if "trainable" in state and state["trainable"] != cfg.train.trainable:
        problems.append(f"train.trainable: checkpoint {state['trainable']!r}, config {cfg.train.trainable!r}")
    lora = to_plain(cfg.train.lora)
    if "lora" in state and state["lora"] != lora:
        problems.append(f"train.lora: checkpoint {state['lora']!r}, config {lora!r}")
    saved_tok = state.get("tokenizer_sha256")
    if saved_tok and tokenizer_sha256 and saved_tok != tokenizer_sha256:
        problems.append(f"tokenizer: the checkpoint was trained on data tokenized by sha256 {saved_tok[:12]}…, "
                        f"data.train now has {tokenizer_sha256[:12]}…")
    if problems:
        raise ConfigError(
            f"cannot resume from {checkpoint}: {'; '.join(problems)}. These decide what the checkpoint's parameters "
            "and token ids mean; restore them to continue this run, or set run.out_dir to a new directory"
        )


def check_fresh_start(cfg: RunConfig, run_dir: Path) -> None:
    """train.resume=none must not write a second run's checkpoints among the first one's."""
    existing = store.complete_checkpoints(run_dir)
    if cfg.train.resume == "none" and existing:
        raise ConfigError(
            f"train.resume=none but {run_dir}/{store.CHECKPOINTS} already holds checkpoints (newest: step "
            f"{existing[-1][0]}); a fresh run would mix its checkpoints with them. Set run.out_dir to a new "
            "directory, delete the old run, or use train.resume=auto to continue it"
        )


def training_settings(cfg: RunConfig) -> dict:
    """What a checkpoint records about the settings that produced it (compared at the next resume)."""
    return {
        "optim": to_plain(cfg.optim),
        "grad_clip": cfg.train.grad_clip,
        "steps": cfg.train.steps,
        "trainable": cfg.train.trainable,
        "lora": to_plain(cfg.train.lora),
        "float8": cfg.train.float8,
    }


def data_settings(cfg: RunConfig, train: Any) -> dict:
    """What a training step trains on, as the opened training dataset resolved it (null config values filled in):
    recorded in every checkpoint, and a resume names each one that changed."""
    from tapetrain.data.supervised import SupervisedDataset

    first = train.datasets[0] if hasattr(train, "datasets") else train  # a mixture's sources are of one kind
    supervised = isinstance(first, SupervisedDataset)
    return {
        "train": [{"path": s.path, "weight": float(s.weight)} for s in cfg.data.train],
        "seq_len": int(train.seq_len),
        "packing": bool(cfg.data.packing) if supervised else False,  # token shards are always packed
        "document_mask": bool(train.document_mask),
        "answer_only": supervised,  # example stores: the loss is on the answers only
    }


# How each data setting is named in the resume's changed-settings line.
DATA_SETTING_NAMES = {"train": "data.train", "seq_len": "data.seq_len", "packing": "data.packing",
                      "document_mask": "data.document_mask",
                      "answer_only": "answer-only loss (example stores in data.train)"}


def _mixture(value: list[dict]) -> str:
    return "[" + ", ".join(f"{s['path']} (weight {s['weight']})" for s in value) + "]"


def data_setting_changes(state: dict, now: dict | None) -> list[str]:
    """'data.document_mask: True -> False'-style lines for every data setting that differs from the checkpoint's
    (checkpoints written before these were recorded: none)."""
    saved = state.get("data_settings")
    if not saved or now is None:
        return []
    changes = []
    for key, name in DATA_SETTING_NAMES.items():
        if key in saved and saved[key] != now[key]:
            old, new = (_mixture(saved[key]), _mixture(now[key])) if key == "train" else (saved[key], now[key])
            changes.append(f"{name}: {old} -> {new}")
    return changes


def _saved_settings(state: dict, run_dir: Path) -> dict | None:
    if "optim" in state:
        return state
    config = run_dir / "config.yaml"  # checkpoints written before trainer_state recorded the settings
    if not config.is_file():
        return None
    raw = yaml.safe_load(config.read_text()) or {}
    train = raw.get("train") or {}
    return {"optim": raw.get("optim"), "grad_clip": train.get("grad_clip"), "steps": train.get("steps")}


def setting_changes(state: dict, cfg: RunConfig, run_dir: Path) -> list[str]:
    """'optim.lr: 0.001 -> 0.0005'-style lines for every resumable setting that differs from the checkpoint's."""
    saved = _saved_settings(state, run_dir)
    if saved is None:
        return []
    now = training_settings(cfg)
    changes = []
    for key, value in sorted((saved.get("optim") or {}).items()):
        if key in now["optim"] and _norm(value) != _norm(now["optim"][key]):
            changes.append(f"optim.{key}: {value!r} -> {now['optim'][key]!r}")
    for key in ("grad_clip", "steps"):
        if saved.get(key) is not None and saved[key] != now[key]:
            changes.append(f"train.{key}: {saved[key]!r} -> {now[key]!r}")
    # train.float8 changes how the matmuls round, never the parameters (dynamic scaling keeps no state); checkpoints
    # from before the setting ran without it
    if saved.get("float8", "off") != now["float8"]:
        changes.append(f"train.float8: {saved.get('float8', 'off')!r} -> {now['float8']!r}")
    return changes


def _norm(value):
    return list(value) if isinstance(value, tuple) else value


def batch_size_change(state: dict, global_batch_size: int) -> str | None:
    saved = (state.get("data") or {}).get("global_batch_size")
    if saved is None or saved == global_batch_size:
        return None
    consumed = state["data"].get("consumed_samples", 0)
    return (f"train.global_batch_size changed on resume: {saved} -> {global_batch_size} sequences per step. The "
            f"data position carries over ({consumed} samples consumed; the global sample order continues), but "
            f"from step {state['step'] + 1} on each step draws {global_batch_size} samples, so steps and tokens per "
            "step no longer match the original run")
