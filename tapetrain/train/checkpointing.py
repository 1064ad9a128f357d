"""A run's checkpoints behind one object: which checkpoint a start resumes from and whether it may (check), its
state put back into the model, engine, LR schedule and data order (restore), and writing one (save).

A start calls it in this order (tapetrain.train.build.build_components); every call is collective:

    checkpoints = CheckpointManager(cfg, env, model_config)
    checkpoints.check()                               # before anything is written: the checkpoint, its model,
    checkpoints.check_training_setup(tokenizer_sha)   # its trainable set, LoRA adapters and tokenizer
    ds_config = checkpoints.prepare(model, ds_config, total_params=..., trainable_params=...)
    engine = deepspeed.initialize(..., config=ds_config)
    start = checkpoints.restore(engine, scheduler, batches)   # -> TrainingProgress to continue from
    ...
    checkpoints.save(engine, batches, progress)       # the Trainer, every train.save_interval steps

Resuming on another number of ranks: ZeRO partitions are tied to the data-parallel size. ZeRO-1/2 go through
DeepSpeed's universal format, which re-partitions weights and Adam moments (verified exact in tests/distributed);
for ZeRO-3, DeepSpeed 0.19.8's conversion restored the moments only approximately in our tests, so the weights are
restored and the moments reset (the log says so).

The directory format (atomic saves, the newest complete checkpoint, keep-last-K, RNG files) is
tapetrain.checkpoint.store's; what a resume may change is decided by tapetrain.train.resume_checks.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

import torch

from tapetrain.checkpoint import disk, store
from tapetrain.errors import ConfigError, DiskSpaceError, RunError
from tapetrain.model import ModelConfig
from tapetrain.train import resume_checks
from tapetrain.train.collective import agree
from tapetrain.train.distributed import DistEnv, barrier
from tapetrain.train.schedule import param_group_lists, set_schedule_position

if TYPE_CHECKING:
    from deepspeed import DeepSpeedEngine

    from tapetrain.config import RunConfig
    from tapetrain.data.prefetch import PrefetchingBatches
    from tapetrain.data.stream import BatchIterator

log = logging.getLogger("tapetrain.train")

CONFIG_HISTORY = "config_history"
UNIVERSAL_SCRATCH = "universal.tmp"  # under checkpoints/; removed by remove_incomplete like any *.tmp

# How a checkpoint reaches this start's partitioning: loaded as saved (same rank count, or ZeRO-0), through
# DeepSpeed's universal format (ZeRO-1/2 on another rank count), or its weights alone (ZeRO-3 on another count).
Reshard = Literal["none", "universal", "weights"]


@dataclass(frozen=True)
class TrainingProgress:
    """Where training stands: optimizer steps taken, tokens trained on, updates skipped for non-finite values."""

    step: int = 0
    tokens: int = 0
    skipped_steps: int = 0


@dataclass(frozen=True)
class ResumePoint:
    """The complete checkpoint a start resumes from and its trainer_state.json."""

    checkpoint: Path
    state: dict[str, Any]

    @property
    def progress(self) -> TrainingProgress:
        return TrainingProgress(self.state["step"], self.state["tokens"], int(self.state.get("skipped_steps", 0)))


class CheckpointManager:
    """check() / check_training_setup() before the first write, prepare() before and restore() after the engine is
    built, save() while training. Holds what a later call needs: the resume point, the expected checkpoint size,
    the data's tokenizer and, between prepare() and restore(), the converted universal checkpoint."""

    def __init__(self, cfg: RunConfig, env: DistEnv, model_config: ModelConfig):
        self.cfg = cfg
        self.env = env
        self.model_config = model_config
        self.run_dir = Path(cfg.run.out_dir)
        self.resume: ResumePoint | None = None
        self.tokenizer_sha256: str | None = None  # recorded in every checkpoint, compared at the next resume
        self.checkpoint_bytes = 0  # expected size of one checkpoint (checked against free space before each save)
        self._universal: Path | None = None

    # ---- check: on every rank, before anything is written -------------------------------------------------------

    def check(self) -> ResumePoint | None:
        """The checkpoint train.resume names (None for a fresh start), which must hold the model of the config;
        train.resume=none must not start among an earlier run's checkpoints. Raises ConfigError."""
        resume_checks.check_fresh_start(self.cfg, self.run_dir)
        checkpoint = self._find()
        self.resume = ResumePoint(checkpoint, store.read_trainer_state(checkpoint)) if checkpoint else None
        if checkpoint:
            resume_checks.check_same_model(checkpoint, self.model_config, self.run_dir)
        return self.resume

    def check_training_setup(self, tokenizer_sha256: str | None) -> None:
        """The trainable set, LoRA adapters and the data's tokenizer must be the checkpoint's (after check())."""
        self.tokenizer_sha256 = tokenizer_sha256
        if self.resume:
            resume_checks.check_same_training_setup(self.resume.checkpoint, self.resume.state, self.cfg,
                                                    tokenizer_sha256)

    def _find(self) -> Path | None:
        resume = self.cfg.train.resume
        if resume == "none":
            return None
        if resume == "auto":
            return store.find_checkpoint(self.run_dir)
        path = Path(resume)
        if not (path / store.STATE_FILE).is_file():
            raise ConfigError(
                f"train.resume={resume!r} is not a complete checkpoint directory (no {store.STATE_FILE}); "
                "point it at RUN_DIR/checkpoints/step_XXXXXXXX or use 'auto'"
            )
        return path

    def _reshard(self) -> Reshard:
        point = self.resume
        if point is None or point.state["world_size"] == self.env.world_size or point.state["zero_stage"] < 1:
            return "none"
        return "universal" if point.state["zero_stage"] <= 2 else "weights"

    # ---- restore ------------------------------------------------------------------------------------------------

    def prepare(self, model: torch.nn.Module, ds_config: dict, *, total_params: int, trainable_params: int) -> dict:
        """The part of a restore that comes before the engine exists; returns the DeepSpeed config to build it with.

        Free space for one checkpoint (or the universal conversion), interrupted saves of an earlier job removed,
        the conversion for another rank count, then the run's files (config.yaml, config_history/, ds_config.json:
        the start can no longer be refused) and, for ZeRO-3 on another rank count, the checkpoint's weights."""
        d, env, point = self.cfg.deepspeed, self.env, self.resume
        self.checkpoint_bytes = disk.checkpoint_bytes(total_params, trainable_params, d.precision, d.zero_stage,
                                                      env.world_size, d.stage3_gather_16bit_weights_on_model_save)
        reshard = self._reshard()
        needed, what = self.checkpoint_bytes, "one checkpoint"
        if reshard == "universal":
            needed = max(needed, disk.universal_conversion_bytes(total_params, trainable_params, d.precision))
            what = f"converting {point.checkpoint.name} for {env.world_size} rank(s) (DeepSpeed's universal format)"
        agree(env, lambda: disk.require_free_space(self.run_dir, needed, what), on_main_only=True)

        if env.is_main:  # interrupted saves and conversions of an earlier job (we hold the lock)
            store.remove_incomplete(self.run_dir)
        barrier()
        if reshard == "universal":
            self._universal = _convert_to_universal(point.checkpoint, env, point.state["world_size"])
        self._write_run_files(ds_config, point.state["step"] if point else 0)
        if reshard == "universal":
            ds_config = {**ds_config, "checkpoint": {"load_universal": True}}
            log.warning(
                "resuming %s on %d ranks (saved on %d) with ZeRO-%d through a universal checkpoint: weights, optimizer "
                "moments, LR schedule, step and data position are restored",
                point.checkpoint, env.world_size, point.state["world_size"], point.state["zero_stage"],
            )
        elif reshard == "weights":
            from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

            weights = get_fp32_state_dict_from_zero_checkpoint(str(point.checkpoint.parent), tag=point.checkpoint.name)
            _load_full_weights(model, weights, env)
            log.warning(
                "resuming %s on %d ranks (saved on %d) with ZeRO-%d: weights, step, LR schedule and data position are "
                "restored; optimizer moments are reset (no verified universal conversion for this stage)",
                point.checkpoint, env.world_size, point.state["world_size"], point.state["zero_stage"],
            )
        return ds_config

    def restore(self, engine: DeepSpeedEngine, scheduler: torch.optim.lr_scheduler.LambdaLR,
                batches: BatchIterator) -> TrainingProgress:
        """The checkpoint's engine state (unless prepare() restored the weights alone), data position and RNG
        states; the config's LR schedule, AdamW hyperparameters and clipping win from the resumed step on (the
        log lists what changed). Returns where training continues (a fresh start: step 0)."""
        point = self.resume
        if point is None:
            return TrainingProgress()
        cfg, env = self.cfg, self.env
        hyperparameters = group_hyperparameters(engine.basic_optimizer)  # the config's, before the load
        load = dict(load_optimizer_states=True, load_lr_scheduler_states=False)
        if self._universal is not None:
            engine.load_checkpoint(str(self._universal.parent), tag=self._universal.name, **load)
            barrier()
            if env.is_main:
                shutil.rmtree(self._universal.parent, ignore_errors=True)
            self._universal = None
        elif self._reshard() == "none":
            engine.load_checkpoint(str(point.checkpoint.parent), tag=point.checkpoint.name, **load)
        start = point.progress
        apply_config_settings(engine, scheduler, cfg, start.step, hyperparameters)
        changes = resume_checks.setting_changes(point.state, cfg, self.run_dir)
        if changes:
            log.warning("resuming with changed settings, applied from step %d on: %s", start.step + 1,
                        "; ".join(changes))
        batch_change = resume_checks.batch_size_change(point.state, cfg.train.global_batch_size)
        if batch_change:
            log.warning("%s", batch_change)
        batches.load_state_dict(point.state["data"])
        store.load_rng(point.checkpoint, env.rank)
        log.info("resumed from %s at step %d (lr %.3g)", point.checkpoint, start.step, engine.get_lr()[0])
        return start

    def _write_run_files(self, ds_config: dict, start_step: int) -> None:
        """config.yaml (this start's resolved config), one copy per start in config_history/, ds_config.json."""
        from tapetrain.config import save_resolved

        if self.env.is_main:
            self.run_dir.mkdir(parents=True, exist_ok=True)
            history = self.run_dir / CONFIG_HISTORY
            history.mkdir(exist_ok=True)
            number = len(list(history.glob("start_*.yaml"))) + 1
            save_resolved(self.cfg, history / f"start_{number:03d}_from_{store.step_tag(start_step)}.yaml")
            save_resolved(self.cfg, self.run_dir / "config.yaml")
            tmp = self.run_dir / "ds_config.json.tmp"
            tmp.write_text(json.dumps(ds_config, indent=2))
            os.replace(tmp, self.run_dir / "ds_config.json")
        barrier()

    # ---- save ---------------------------------------------------------------------------------------------------

    def save(self, engine: DeepSpeedEngine, batches: BatchIterator | PrefetchingBatches,
             progress: TrainingProgress) -> Path:
        """Checkpoint `progress.step` after checking free space; a full disk mid-save is a DiskSpaceError (the
        incomplete checkpoint is removed and never resumed from). Returns the checkpoint directory."""
        from tapetrain.config import dump_run_config

        cfg, env, step = self.cfg, self.env, progress.step
        needed = self.checkpoint_bytes
        agree(env, lambda: disk.require_free_space(self.run_dir, needed, f"the checkpoint of step {step}"),
              on_main_only=True)
        state = {
            "step": step,
            "tokens": progress.tokens,
            "data": batches.state_dict(),
            "world_size": env.world_size,
            "zero_stage": cfg.deepspeed.zero_stage,
            "seed": cfg.run.seed,
            "skipped_steps": progress.skipped_steps,
            "tokenizer_sha256": self.tokenizer_sha256,
            **resume_checks.training_settings(cfg),
        }
        try:
            return store.save_checkpoint(engine, self.run_dir, step, state, self.model_config.to_dict(), env,
                                         cfg.train.keep_last, run_config_yaml=dump_run_config(cfg))
        except Exception as err:  # DeepSpeed/torch report a full disk as a generic write failure
            free = disk.free_bytes(self.run_dir)
            if free >= needed and "No space left" not in str(err):
                raise
            if env.is_main:
                store.remove_incomplete(self.run_dir)
            raise DiskSpaceError(
                f"no space left on the device while saving the checkpoint of step {step} in "
                f"{self.run_dir / store.CHECKPOINTS} ({disk.human(free)} free, about {disk.human(needed)} needed): "
                f"{err}. The incomplete checkpoint is never resumed from. Free disk space or move run.out_dir, then "
                "start the same command again"
            ) from err


# ---- the config wins over the optimizer settings a load restores ---------------------------------------------------
# DeepSpeed's load_checkpoint restores the param groups (lr, betas, eps, weight decay) and ZeRO-1/2 their clipping
# threshold. But the LR is a function of (config, step) (tapetrain.train.schedule.lr_at), and a resume with a new
# optimizer section or train.grad_clip must train with the new values from the resumed step on.

HYPERPARAMETERS = ("betas", "eps", "weight_decay")


def group_hyperparameters(optimizer: torch.optim.Optimizer) -> list[dict]:
    """The config's betas/eps/weight_decay per param group, read before a checkpoint overwrites them (the
    no-decay group carries weight_decay 0, so the groups are told apart by position)."""
    return [{k: group[k] for k in HYPERPARAMETERS} for group in optimizer.param_groups]


def apply_config_settings(engine: DeepSpeedEngine, scheduler: torch.optim.lr_scheduler.LambdaLR, cfg: RunConfig,
                          step: int, hyperparameters: list[dict]) -> None:
    """After loading a checkpoint: the config's LR schedule position, AdamW hyperparameters and clipping."""
    for groups in param_group_lists(engine):
        if len(groups) != len(hyperparameters):
            raise RuntimeError(f"optimizer has {len(groups)} param groups, expected {len(hyperparameters)}")
        for group, values in zip(groups, hyperparameters, strict=True):
            group.update({k: (tuple(v) if k == "betas" else v) for k, v in values.items()})
    set_schedule_position(engine, scheduler, cfg.optim, cfg.train.steps, step)
    if hasattr(engine.optimizer, "clip_grad"):  # ZeRO-1/2 and the bf16 optimizer restore it from the checkpoint
        engine.optimizer.clip_grad = cfg.train.grad_clip


# ---- another rank count --------------------------------------------------------------------------------------------


def _convert_to_universal(checkpoint: Path, env: DistEnv, saved_world_size: int) -> Path:
    """Rank 0 converts a ZeRO checkpoint to DeepSpeed's universal format into checkpoints/universal.tmp/ (which
    also catches the `latest_universal` file the converter writes next to its output); any failure stops every
    rank with the converter's own error instead of silently resuming with fresh optimizer moments."""
    scratch = checkpoint.parent / UNIVERSAL_SCRATCH
    out = scratch / checkpoint.name

    def convert() -> None:
        shutil.rmtree(scratch, ignore_errors=True)
        scratch.mkdir()
        cmd = [sys.executable, "-m", "deepspeed.checkpoint.ds_to_universal", "--input_folder", str(checkpoint),
               "--output_folder", str(out), "--num_extract_workers", "1", "--num_merge_workers", "1",
               "--inject_missing_state"]  # checkpoints written before tapetrain recorded the universal info
        proc = subprocess.run(cmd, capture_output=True, text=True)
        if proc.returncode != 0:
            shutil.rmtree(scratch, ignore_errors=True)
            tail = (proc.stderr.strip() or proc.stdout.strip())[-1500:]
            hint = " (no space left on the device)" if "No space left" in proc.stderr + proc.stdout else ""
            raise RunError(
                f"could not convert {checkpoint} (saved on {saved_world_size} ranks) for {env.world_size} rank(s)"
                f"{hint}: DeepSpeed's ds_to_universal failed:\n{tail}\nNothing was resumed or written. Resume on "
                f"{saved_world_size} ranks (no conversion needed), or fix the cause above and start again"
            )

    agree(env, convert, on_main_only=True)
    return out


def _load_full_weights(model: torch.nn.Module, weights: dict[str, torch.Tensor], env: DistEnv) -> None:
    """Load a full state dict; parameters partitioned by zero.Init are gathered one at a time."""
    params = dict(model.named_parameters())
    if not any(hasattr(p, "ds_id") for p in params.values()):
        model.load_state_dict(weights, strict=False)
        return
    import deepspeed

    with torch.no_grad():
        for name, param in params.items():
            if name in weights:
                with deepspeed.zero.GatheredParameters([param], modifier_rank=0):
                    if env.is_main:
                        param.data.copy_(weights[name].to(param.dtype))
