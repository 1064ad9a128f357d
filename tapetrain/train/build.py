"""Builds what the trainer needs from a resolved RunConfig: model, DeepSpeed engine, data, resume state.

Order matters: everything that can be checked is checked before the run directory is written to (the resume
checkpoint against the model, data and tokenizer, free disk space), so a start that fails leaves an existing run
exactly as it was. Only then are config.yaml / ds_config.json written and a checkpoint converted or loaded.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import torch

from tapetrain.checkpoint import disk, store
from tapetrain.errors import ConfigError, RunError
from tapetrain.model import ModelConfig, Transformer
from tapetrain.train import resume_checks
from tapetrain.train.collective import agree
from tapetrain.train.distributed import DistEnv, barrier
from tapetrain.train.model_init import CHECKPOINT_SHAPE_FIELDS, build_model, resolve_model_config

log = logging.getLogger("tapetrain.train")

CONFIG_HISTORY = "config_history"
UNIVERSAL_SCRATCH = "universal.tmp"  # under checkpoints/; removed by remove_incomplete like any *.tmp


@dataclass
class Components:
    engine: object  # deepspeed.DeepSpeedEngine
    model: Transformer
    model_config: ModelConfig
    train_batches: object  # tapetrain.data.stream.BatchIterator (or its PrefetchingBatches)
    val_dataset: object  # the validation split (None without data.val); see tapetrain.train.validation
    has_val: bool
    start_step: int
    start_tokens: int
    scheduler: object = None  # the LambdaLR DeepSpeed steps
    checkpoint_bytes: int = 0  # expected size of one checkpoint (checked against free space before each save)
    tokenizer_sha256: str | None = None
    skipped_steps: int = 0  # optimizer steps skipped for non-finite values before this start
    startup: object = None  # tapetrain.train.startup.StartupClock: the trainer logs the first step's time
    run_config: object = None  # the RunConfig as written to config.yaml (init_from shape, example-store tokenizer)


@dataclass
class StartChecks:
    """What the checks before the first write found (every rank has the same)."""

    checkpoint: Path | None
    state: dict | None
    train_dataset: object
    val_dataset: object
    tokenizer_sha256: str | None


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


def _data_spec(sources) -> list[dict]:
    return [{"path": s.path, "weight": s.weight} for s in sources]


def check_before_start(cfg, env: DistEnv, model_config: ModelConfig) -> StartChecks:
    """Resume compatibility, data manifests and tokenizer, then (rank 0) data.verify: on every rank, collectively,
    before anything is written."""
    from tapetrain.data.provenance import common_tokenizer
    from tapetrain.data.stream import open_dataset

    run_dir = Path(cfg.run.out_dir)
    found: dict = {}

    def check() -> None:
        resume_checks.check_fresh_start(cfg, run_dir)
        checkpoint = _resume_checkpoint(cfg)
        state = store.read_trainer_state(checkpoint) if checkpoint else None
        if checkpoint:
            resume_checks.check_same_model(checkpoint, model_config, run_dir)
        if not cfg.data.train:
            raise ConfigError("data.train is empty; point it at a directory written by `tapetrain data prepare`")
        seq_len, vocab = cfg.data.seq_len, model_config.vocab_size
        train = open_dataset(_data_spec(cfg.data.train), seq_len, "train", expected_vocab_size=vocab, seed=cfg.run.seed,
                             packing=cfg.data.packing)
        val = None
        if cfg.data.val:
            val = open_dataset(_data_spec(cfg.data.val), seq_len, "val", expected_vocab_size=vocab,
                               packing=cfg.data.packing)
        paths = [s.path for s in [*cfg.data.train, *cfg.data.val]]
        sha = common_tokenizer(paths, cfg.data.tokenizer)
        if checkpoint:
            resume_checks.check_same_training_setup(checkpoint, state, cfg, sha)
        found.update(checkpoint=checkpoint, state=state, train_dataset=train, val_dataset=val, tokenizer_sha256=sha)

    agree(env, check)
    if cfg.data.verify:
        from tapetrain.data.verify import require_verified

        paths = sorted({s.path for s in [*cfg.data.train, *cfg.data.val]})
        agree(env, lambda: require_verified(paths, progress=env.is_main), on_main_only=True)
        log.info("data.verify: every shard of %s matches its manifest", ", ".join(paths))
    return StartChecks(**found)


def _parameter_counts(model: torch.nn.Module) -> tuple[int, int]:
    """(total, trainable) parameters; ZeRO-3 partitioned parameters count with their full size."""
    total = trainable = 0
    for p in model.parameters():
        n = int(getattr(p, "ds_numel", p.numel()))
        total += n
        trainable += n if p.requires_grad else 0
    return total, trainable


def _write_run_files(cfg, ds_config: dict, env: DistEnv, start_step: int) -> None:
    """config.yaml (this start's resolved config), one copy per start in config_history/, ds_config.json."""
    from tapetrain.config import save_resolved

    run_dir = Path(cfg.run.out_dir)
    if env.is_main:
        run_dir.mkdir(parents=True, exist_ok=True)
        history = run_dir / CONFIG_HISTORY
        history.mkdir(exist_ok=True)
        number = len(list(history.glob("start_*.yaml"))) + 1
        save_resolved(cfg, history / f"start_{number:03d}_from_{store.step_tag(start_step)}.yaml")
        save_resolved(cfg, run_dir / "config.yaml")
        tmp = run_dir / "ds_config.json.tmp"
        tmp.write_text(json.dumps(ds_config, indent=2))
        os.replace(tmp, run_dir / "ds_config.json")
    barrier()


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


def _discard_universal(universal: Path, env: DistEnv) -> None:
    barrier()
    if env.is_main:
        shutil.rmtree(universal.parent, ignore_errors=True)


def _with_example_tokenizer(cfg):
    """data.tokenizer defaults to the tokenizer.model inside an example store (data arith/scrolls), so the run's
    config.yaml names it and `tapetrain export hf` / the eval tools decode without being told."""
    from tapetrain.data.examples import tokenizer_of

    if cfg.data.tokenizer or not cfg.data.train:
        return cfg
    tokenizer = tokenizer_of(cfg.data.train[0].path)
    return dataclasses.replace(cfg, data=dataclasses.replace(cfg.data, tokenizer=tokenizer)) if tokenizer else cfg


def resolve_model_config_agreed(cfg, env: DistEnv) -> ModelConfig:
    """resolve_model_config on every rank, collectively: a missing init_from checkpoint is one clean message."""
    found: dict = {}

    def resolve() -> None:
        try:
            found["config"] = resolve_model_config(cfg)
        except FileNotFoundError as err:
            raise ConfigError(f"model.init_from={cfg.model.init_from!r}: {err}") from err

    agree(env, resolve)
    return found["config"]


def data_summary(start: StartChecks) -> str:
    val = f"{start.val_dataset.num_samples:,} validation samples" if start.val_dataset is not None else "no data.val"
    resume = f"resuming from {start.checkpoint}" if start.checkpoint else "fresh start"
    return f"{start.train_dataset.num_samples:,} training samples, {val}; {resume}"


def build_components(cfg, env: DistEnv, clock=None) -> Components:
    import deepspeed

    from tapetrain.config import build_deepspeed_config
    from tapetrain.data.prefetch import PrefetchingBatches
    from tapetrain.data.stream import BatchIterator
    from tapetrain.train.optim import apply_trainable, build_optimizer
    from tapetrain.train.optim_settings import apply_config_settings, group_hyperparameters
    from tapetrain.train.schedule import build_scheduler
    from tapetrain.train.startup import StartupClock

    clock = clock or StartupClock()
    model_config = resolve_model_config_agreed(cfg, env)
    if cfg.model.init_from:  # the resolved config.yaml records the checkpoint's shape
        shape = {k: getattr(model_config, k) for k in CHECKPOINT_SHAPE_FIELDS}
        cfg = dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, **shape))
    cfg = _with_example_tokenizer(cfg)
    ds_config = build_deepspeed_config(cfg, env.world_size)
    start = check_before_start(cfg, env, model_config)
    checkpoint, state = start.checkpoint, start.state
    run_dir = Path(cfg.run.out_dir)
    clock.done("data", data_summary(start))

    source = f"loading {cfg.model.init_from}" if cfg.model.init_from else "random init"
    clock.begin("model", f"{cfg.model.preset or 'custom'} pe={model_config.pe}, {source}")
    model = build_model(cfg, model_config, env, ds_config)
    if cfg.train.lora is not None:
        from tapetrain.train.lora import apply_lora

        lora = cfg.train.lora
        model = apply_lora(model, lora.r, lora.alpha, lora.dropout, lora.targets)
    apply_trainable(model, cfg.train.trainable)

    total, trainable = _parameter_counts(model)
    clock.done("model", f"{total / 1e6:.2f}M parameters ({trainable / 1e6:.2f}M trainable)")
    d = cfg.deepspeed
    checkpoint_bytes = disk.checkpoint_bytes(total, trainable, d.precision, d.zero_stage, env.world_size,
                                             d.stage3_gather_16bit_weights_on_model_save)
    reshard = bool(state) and state["world_size"] != env.world_size and state["zero_stage"] >= 1
    # Universal checkpoints are verified exact for ZeRO-1/2 (tests/distributed); for ZeRO-3 DeepSpeed 0.19.8's
    # conversion restored the moments only approximately in our tests, so ZeRO-3 keeps weights and resets them.
    use_universal = reshard and state["zero_stage"] <= 2
    needed, what = checkpoint_bytes, "one checkpoint"
    if use_universal:
        needed = max(needed, disk.universal_conversion_bytes(total, trainable, d.precision))
        what = f"converting {checkpoint.name} for {env.world_size} rank(s) (DeepSpeed's universal format)"
    agree(env, lambda: disk.require_free_space(run_dir, needed, what), on_main_only=True)

    if env.is_main:
        store.remove_incomplete(run_dir)  # interrupted saves and conversions of an earlier job (we hold the lock)
    barrier()
    universal = _convert_to_universal(checkpoint, env, state["world_size"]) if use_universal else None
    _write_run_files(cfg, ds_config, env, state["step"] if state else 0)  # the start can no longer be refused
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

    clock.begin("engine", f"DeepSpeed ZeRO-{d.zero_stage} {d.precision} on {env.world_size} rank(s)"
                + (f", loading {checkpoint.name}" if state else ""))
    optimizer = build_optimizer(model, cfg.optim)
    scheduler = build_scheduler(optimizer, cfg.optim, cfg.train.steps)
    engine, _, _, _ = deepspeed.initialize(
        model=model, optimizer=optimizer, lr_scheduler=scheduler, config=ds_config, dist_init_required=False
    )
    hyperparameters = group_hyperparameters(optimizer)  # the config's, before a checkpoint overwrites them
    start_step, start_tokens = 0, 0
    batch_args = dict(
        global_batch_size=cfg.train.global_batch_size,
        micro_batch_size=cfg.train.micro_batch_size,
        rank=env.rank,
        world_size=env.world_size,
    )
    train_batches = BatchIterator(start.train_dataset, seed=cfg.run.seed, **batch_args)
    if state:
        if universal is not None:
            engine.load_checkpoint(
                str(universal.parent), tag=universal.name, load_optimizer_states=True, load_lr_scheduler_states=False
            )
            _discard_universal(universal, env)
        elif not reshard:
            engine.load_checkpoint(
                str(checkpoint.parent), tag=checkpoint.name, load_optimizer_states=True, load_lr_scheduler_states=False
            )
        apply_config_settings(engine, scheduler, cfg, state["step"], hyperparameters)
        changes = resume_checks.setting_changes(state, cfg, run_dir)
        if changes:
            log.warning("resuming with changed settings, applied from step %d on: %s", state["step"] + 1,
                        "; ".join(changes))
        batch_change = resume_checks.batch_size_change(state, cfg.train.global_batch_size)
        if batch_change:
            log.warning("%s", batch_change)
        train_batches.load_state_dict(state["data"])
        store.load_rng(checkpoint, env.rank)
        start_step, start_tokens = state["step"], state["tokens"]
        log.info("resumed from %s at step %d (lr %.3g)", checkpoint, start_step, engine.get_lr()[0])
    clock.done("engine", "ready" + (f", resumed at step {start_step}" if state else ""))
    _log_epochs(train_batches, cfg.train.steps - start_step)
    if cfg.data.num_workers > 0:
        train_batches = PrefetchingBatches(train_batches, cfg.data.num_workers)

    val_dataset = start.val_dataset
    return Components(
        engine=engine,
        model=model,
        model_config=model_config,
        train_batches=train_batches,
        val_dataset=val_dataset,
        has_val=val_dataset is not None,
        start_step=start_step,
        start_tokens=start_tokens,
        scheduler=scheduler,
        checkpoint_bytes=checkpoint_bytes,
        tokenizer_sha256=start.tokenizer_sha256,
        skipped_steps=int((state or {}).get("skipped_steps", 0)),
        startup=clock,
        run_config=cfg,
    )


def _log_epochs(batches, steps_left: int) -> None:
    """Say up front when the run will read its data more than once."""
    end = batches.consumed_samples + steps_left * batches.global_batch_size
    if end > batches.num_samples:
        log.warning(
            "data: the run draws %d samples by its last step but the training data holds %d (windows of seq_len "
            "tokens), so it reads the data %.2f times; every new epoch is a new shuffle of the same samples",
            end, batches.num_samples, end / batches.num_samples,
        )
