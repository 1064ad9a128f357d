"""Builds what the trainer needs from a resolved RunConfig: model, DeepSpeed engine, data, resume state."""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import shutil
import subprocess
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from tapetrain.checkpoint import store
from tapetrain.errors import ConfigError
from tapetrain.model import ModelConfig, Transformer
from tapetrain.train.distributed import DistEnv, all_reduce_sum, barrier
from tapetrain.train.model_init import CHECKPOINT_SHAPE_FIELDS, build_model, resolve_model_config

log = logging.getLogger("tapetrain.train")


@dataclass
class Components:
    engine: object  # deepspeed.DeepSpeedEngine
    model: Transformer
    model_config: ModelConfig
    train_batches: object  # tapetrain.data.stream.BatchIterator
    make_val_batches: Callable[[], object]
    has_val: bool
    start_step: int
    start_tokens: int


def _write_run_files(cfg, ds_config: dict, env: DistEnv) -> None:
    from tapetrain.config import save_resolved

    run_dir = Path(cfg.run.out_dir)
    if env.is_main:
        run_dir.mkdir(parents=True, exist_ok=True)
        store.remove_incomplete(run_dir)
        save_resolved(cfg, run_dir / "config.yaml")
        tmp = run_dir / "ds_config.json.tmp"
        tmp.write_text(json.dumps(ds_config, indent=2))
        os.replace(tmp, run_dir / "ds_config.json")
    barrier()


def _resume_checkpoint(cfg) -> Path | None:
    resume = cfg.train.resume
    if resume == "none":
        return None
    if resume == "auto":
        return store.find_checkpoint(Path(cfg.run.out_dir))
    path = Path(resume)
    if not (path / store.STATE_FILE).is_file():
        raise ConfigError(
            f"train.resume={resume!r} is not a complete checkpoint directory (no {store.STATE_FILE}); "
            "point it at RUN_DIR/checkpoints/step_XXXXXXXX or use 'auto'"
        )
    return path


def _load_full_weights(model: torch.nn.Module, weights: dict, env: DistEnv) -> None:
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


def _convert_to_universal(checkpoint: Path, env: DistEnv) -> Path | None:
    """Rank 0 converts a ZeRO checkpoint to DeepSpeed's universal format (into a .tmp directory that an
    interrupted run leaves for remove_incomplete); None on every rank if the conversion fails."""
    out = checkpoint.parent / f"{checkpoint.name}.universal.tmp"
    ok = 0.0  # only rank 0 votes
    if env.is_main:
        shutil.rmtree(out, ignore_errors=True)
        cmd = [sys.executable, "-m", "deepspeed.checkpoint.ds_to_universal", "--input_folder", str(checkpoint),
               "--output_folder", str(out), "--num_extract_workers", "1", "--num_merge_workers", "1",
               "--inject_missing_state"]  # checkpoints written before tapetrain recorded the universal info
        proc = subprocess.run(cmd, capture_output=True, text=True)
        if proc.returncode == 0:
            ok = 1.0
        else:
            log.warning("universal checkpoint conversion failed:\n%s", proc.stderr[-2000:])
    ok = all_reduce_sum([ok], env.device)[0] > 0  # rank 0's verdict, on every rank
    return out if ok else None


def _with_example_tokenizer(cfg):
    """data.tokenizer defaults to the tokenizer.model inside an example store (arith/scrolls data), so the run's
    config.yaml names it and export-hf / the eval tools decode without being told."""
    from tapetrain.data.examples import tokenizer_of

    if cfg.data.tokenizer or not cfg.data.train:
        return cfg
    tokenizer = tokenizer_of(cfg.data.train[0].path)
    return dataclasses.replace(cfg, data=dataclasses.replace(cfg.data, tokenizer=tokenizer)) if tokenizer else cfg


def _data_spec(sources) -> list[dict]:
    return [{"path": s.path, "weight": s.weight} for s in sources]


def build_components(cfg, env: DistEnv) -> Components:
    import deepspeed

    from tapetrain.config import build_deepspeed_config
    from tapetrain.data.stream import BatchIterator, open_dataset
    from tapetrain.train.optim import apply_trainable, build_optimizer
    from tapetrain.train.schedule import build_scheduler

    if cfg.train.on_nan == "skip" and cfg.deepspeed.zero_stage == 3:
        raise ConfigError(
            "train.on_nan=skip is not supported with deepspeed.zero_stage=3 (parameters are partitioned outside "
            "forward, so a bad micro-batch cannot be replaced by a zero gradient); use train.on_nan=stop"
        )
    model_config = resolve_model_config(cfg)
    if cfg.model.init_from:  # the resolved config.yaml records the checkpoint's shape
        shape = {k: getattr(model_config, k) for k in CHECKPOINT_SHAPE_FIELDS}
        cfg = dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, **shape))
    cfg = _with_example_tokenizer(cfg)
    ds_config = build_deepspeed_config(cfg, env.world_size)
    _write_run_files(cfg, ds_config, env)
    model = build_model(cfg, model_config, env, ds_config)
    if cfg.train.lora is not None:
        from tapetrain.train.lora import apply_lora

        lora = cfg.train.lora
        model = apply_lora(model, lora.r, lora.alpha, lora.dropout, lora.targets)
    apply_trainable(model, cfg.train.trainable)

    checkpoint = _resume_checkpoint(cfg)
    state = store.read_trainer_state(checkpoint) if checkpoint else None
    reshard = bool(state) and state["world_size"] != env.world_size and state["zero_stage"] >= 1
    # Universal checkpoints are verified exact for ZeRO-1/2 (tests/distributed); for ZeRO-3 DeepSpeed 0.19.8's
    # conversion restored the moments only approximately in our tests, so ZeRO-3 keeps weights and resets them.
    universal = _convert_to_universal(checkpoint, env) if reshard and state["zero_stage"] <= 2 else None
    if universal is not None:
        # ZeRO partitions are tied to the data-parallel size; the universal format re-partitions weights and
        # optimizer moments for the new one.
        ds_config = {**ds_config, "checkpoint": {"load_universal": True}}
        log.warning(
            "resuming %s on %d ranks (saved on %d) with ZeRO-%d through a universal checkpoint: weights, optimizer "
            "moments, LR schedule, step and data position are restored",
            checkpoint, env.world_size, state["world_size"], state["zero_stage"],
        )
    elif reshard:
        from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

        weights = get_fp32_state_dict_from_zero_checkpoint(str(checkpoint.parent), tag=checkpoint.name)
        _load_full_weights(model, weights, env)
        log.warning(
            "resuming %s on %d ranks (saved on %d) with ZeRO-%d: weights, step, LR schedule and data position are "
            "restored; optimizer moments are reset (no verified universal conversion for this stage)",
            checkpoint, env.world_size, state["world_size"], state["zero_stage"],
        )

    optimizer = build_optimizer(model, cfg.optim)
    scheduler = build_scheduler(optimizer, cfg.optim, cfg.train.steps)
    engine, _, _, _ = deepspeed.initialize(
        model=model, optimizer=optimizer, lr_scheduler=scheduler, config=ds_config, dist_init_required=False
    )
    start_step, start_tokens = 0, 0
    seq_len = cfg.data.seq_len
    if not cfg.data.train:
        raise ConfigError("data.train is empty; point it at a directory written by `tapetrain prepare`")
    dataset = open_dataset(
        _data_spec(cfg.data.train), seq_len, "train", expected_vocab_size=model_config.vocab_size, seed=cfg.run.seed,
        packing=cfg.data.packing,
    )
    batch_args = dict(
        global_batch_size=cfg.train.global_batch_size,
        micro_batch_size=cfg.train.micro_batch_size,
        rank=env.rank,
        world_size=env.world_size,
    )
    train_batches = BatchIterator(dataset, seed=cfg.run.seed, **batch_args)
    if state:
        if universal is not None:
            engine.load_checkpoint(
                str(universal.parent), tag=universal.name, load_optimizer_states=True, load_lr_scheduler_states=True
            )
            barrier()
            if env.is_main:
                shutil.rmtree(universal, ignore_errors=True)
        elif not reshard:
            engine.load_checkpoint(
                str(checkpoint.parent), tag=checkpoint.name, load_optimizer_states=True, load_lr_scheduler_states=True
            )
        else:
            for _ in range(state["step"]):
                scheduler.step()
        train_batches.load_state_dict(state["data"])
        store.load_rng(checkpoint, env.rank)
        start_step, start_tokens = state["step"], state["tokens"]
        log.info("resumed from %s at step %d", checkpoint, start_step)

    has_val = bool(cfg.data.val)
    val_dataset = (
        open_dataset(_data_spec(cfg.data.val), seq_len, "val", expected_vocab_size=model_config.vocab_size,
                     packing=cfg.data.packing)
        if has_val
        else None
    )

    def make_val_batches():
        # The same fixed, unshuffled validation batches at every evaluation.
        return BatchIterator(
            val_dataset,
            global_batch_size=cfg.train.micro_batch_size * env.world_size,
            micro_batch_size=cfg.train.micro_batch_size,
            rank=env.rank,
            world_size=env.world_size,
            seed=0,
            shuffle=False,
        )

    return Components(
        engine=engine,
        model=model,
        model_config=model_config,
        train_batches=train_batches,
        make_val_batches=make_val_batches,
        has_val=has_val,
        start_step=start_step,
        start_tokens=start_tokens,
    )
