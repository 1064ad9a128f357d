"""Builds what the trainer needs from a resolved RunConfig: model, DeepSpeed engine, data, resume state.

`build_components` is a list of labelled blocks, each calling one builder. Order matters: everything that can be
checked is checked before the run directory is written to (the resume checkpoint against the model, data and
tokenizer, free disk space), so a start that fails leaves an existing run exactly as it was. Only then are
config.yaml / ds_config.json written and a checkpoint converted or loaded (tapetrain.train.checkpointing).
"""

from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from tapetrain.distributed import DistEnv, agree
from tapetrain.errors import ConfigError
from tapetrain.model import ModelConfig, Transformer
from tapetrain.model.execution_plan import ExecutionPlan, resolve_plan
from tapetrain.parallel import ParallelLayout
from tapetrain.train import resume_checks
from tapetrain.train.checkpointing import CheckpointManager, ResumePoint, TrainingProgress
from tapetrain.train.float8 import apply_float8
from tapetrain.train.model_init import (
    CHECKPOINT_SHAPE_FIELDS,
    DTYPES,
    ROPE_FIELDS,
    build_model,
    resolve_model_config,
)
from tapetrain.train.startup import StartupClock

if TYPE_CHECKING:
    from deepspeed import DeepSpeedEngine

    from tapetrain.config import RunConfig
    from tapetrain.config.sections import DataSource
    from tapetrain.data.mixture import MixedDataset
    from tapetrain.data.packed import PackedDataset
    from tapetrain.data.prefetch import PrefetchingBatches
    from tapetrain.data.stream import BatchIterator
    from tapetrain.data.supervised import SupervisedDataset
    from tapetrain.parallel.ulysses import SequenceParallel

    Dataset = PackedDataset | SupervisedDataset | MixedDataset  # what open_dataset returns

log = logging.getLogger("tapetrain.train")


@dataclass
class Components:
    engine: DeepSpeedEngine
    model: Transformer
    model_config: ModelConfig
    train_batches: BatchIterator | PrefetchingBatches
    val_dataset: Dataset | None  # the validation split (None without data.val); see tapetrain.train.validation
    has_val: bool
    start: TrainingProgress  # where this start continues (step 0 for a fresh run)
    scheduler: torch.optim.lr_scheduler.LambdaLR  # the one DeepSpeed steps
    checkpoints: CheckpointManager  # the Trainer saves through it
    startup: StartupClock  # the trainer logs the first step's time
    run_config: RunConfig  # as written to config.yaml (init_from shape, example-store tokenizer)
    sequence_parallel: SequenceParallel | None = None  # parallel.sequence_parallel > 1: groups, shard, slicing


@dataclass
class StartChecks:
    """What the checks before the first write found (every rank has the same)."""

    resume: ResumePoint | None
    train_dataset: Dataset
    val_dataset: Dataset | None
    plan: ExecutionPlan  # what every layer runs on this device (model/execution_plan.py)


def _data_spec(sources: list[DataSource]) -> list[dict]:
    return [{"path": s.path, "weight": s.weight} for s in sources]


def resolve_run_plan(cfg: RunConfig, model_config: ModelConfig, device: torch.device,
                     warn: bool = True) -> ExecutionPlan:
    """The run's execution plan: model settings × this device × deepspeed.precision × the kernel record, and
    train.float8's recipe (train/float8.py), decided once (training, --print-config and --dry-run read it). Raises
    ConfigError for a setting that cannot run here."""
    from tapetrain.train.float8 import resolve_float8

    plan = resolve_plan(model_config, device, DTYPES[cfg.deepspeed.precision], documents=cfg.data.document_mask,
                        warn=warn)
    return dataclasses.replace(plan, float8=resolve_float8(cfg.train.float8, device))


def check_before_start(cfg: RunConfig, env: DistEnv, model_config: ModelConfig,
                       checkpoints: CheckpointManager, tokenizer_origin: str = "data.tokenizer",
                       plan: ExecutionPlan | None = None) -> StartChecks:
    """Resume compatibility, data manifests and tokenizer, then (rank 0) data.verify: on every rank, collectively,
    before anything is written. `plan`: the run's execution plan where the caller resolved it already."""
    from tapetrain.data.cache import ShardCache
    from tapetrain.data.provenance import common_tokenizer
    from tapetrain.data.stream import open_dataset

    found: dict = {}
    cache = ShardCache(cfg.data.cache_dir, cfg.data.cache_limit_gb)  # created lazily: only remote data uses it

    def check() -> None:
        resume = checkpoints.check()  # the checkpoint to resume from, and that it holds this model
        if not cfg.data.train:
            raise ConfigError("data.train is empty; point it at a directory written by `tapetrain data prepare`")
        seq_len, vocab = cfg.data.seq_len, model_config.vocab_size
        # A checkpoint's embedding may have more rows than its tokenizer has tokens (Qwen2.5: 151936 for
        # 151665): with model.init_from the data's vocabulary need only fit; from scratch it must be equal.
        expected = None if cfg.model.init_from else vocab
        train = open_dataset(_data_spec(cfg.data.train), seq_len, "train", expected_vocab_size=expected,
                             seed=cfg.run.seed, packing=cfg.data.packing, document_mask=cfg.data.document_mask,
                             cache=cache)
        val = None
        if cfg.data.val:
            val = open_dataset(_data_spec(cfg.data.val), seq_len, "val", expected_vocab_size=expected,
                               packing=cfg.data.packing, document_mask=cfg.data.document_mask, cache=cache)
        for dataset in (train, val):
            if dataset is not None and dataset.vocab_size > vocab:
                raise ConfigError(f"the data was tokenized with vocab {dataset.vocab_size} but model.init_from="
                                  f"{cfg.model.init_from} has vocab_size={vocab}; prepare the data with the "
                                  "checkpoint's tokenizer (`tapetrain data prepare --tokenizer CHECKPOINT_DIR`)")
        run_plan = plan or resolve_run_plan(cfg, model_config, env.device)
        if train.document_mask and model_config.s2_attn:
            raise ConfigError("data.document_mask with model.s2_attn: shifted sparse attention has no document "
                              "mask; set model.s2_attn=false or data.document_mask=false")
        paths = [s.path for s in [*cfg.data.train, *cfg.data.val]]
        checkpoints.check_training_setup(common_tokenizer(paths, cfg.data.tokenizer, tokenizer_origin),
                                         resume_checks.data_settings(cfg, train))
        found.update(resume=resume, train_dataset=train, val_dataset=val, plan=run_plan)

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


def run_config_as_written(cfg: RunConfig, model_config: ModelConfig) -> tuple[RunConfig, str]:
    """The config the run records: with model.init_from, the checkpoint's shape and the RoPE in use; the adopted
    tokenizer (run_tokenizer.choose_tokenizer; also returns what names it); every local path absolute."""
    from tapetrain.config.run_config import with_absolute_paths
    from tapetrain.train.run_tokenizer import choose_tokenizer

    if cfg.model.init_from:
        shape = {k: getattr(model_config, k) for k in CHECKPOINT_SHAPE_FIELDS + ROPE_FIELDS}
        cfg = dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, **shape))
    return choose_tokenizer(with_absolute_paths(cfg))


def resolve_model_config_agreed(cfg: RunConfig, env: DistEnv) -> ModelConfig:
    """resolve_model_config on every rank, collectively: a missing init_from checkpoint is one clean message."""
    found: dict = {}

    def resolve() -> None:
        from tapetrain.config.checks import sequence_parallel_heads_problem

        try:
            found["config"] = resolve_model_config(cfg)
        except FileNotFoundError as err:
            raise ConfigError(f"model.init_from={cfg.model.init_from!r}: {err}") from err
        heads = sequence_parallel_heads_problem(found["config"].n_heads, cfg.parallel.sequence_parallel)
        if heads:  # model.init_from set the head count
            problem, fix = heads
            raise ConfigError(f"parallel.sequence_parallel: {problem}, as model.init_from={cfg.model.init_from} "
                              f"has it; {fix}")

    agree(env, resolve)
    return found["config"]


def data_summary(start: StartChecks) -> str:
    val = f"{start.val_dataset.num_samples:,} validation samples" if start.val_dataset is not None else "no data.val"
    resume = f"resuming from {start.resume.checkpoint}" if start.resume else "fresh start"
    return f"{start.train_dataset.num_samples:,} training samples, {val}; {resume}"


def _training_model(cfg: RunConfig, model_config: ModelConfig, env: DistEnv, ds_config: dict,
                    clock: StartupClock) -> tuple[Transformer, int, int]:
    """The model with its LoRA adapters and trainable set; (model, total parameters, trainable parameters)."""
    from tapetrain.train.optim import apply_trainable

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
    return model, total, trainable


def _engine(cfg: RunConfig, model: Transformer, ds_config: dict,
            sp: SequenceParallel | None) -> tuple[DeepSpeedEngine, torch.optim.lr_scheduler.LambdaLR]:
    """DeepSpeed's engine around our AdamW and LR schedule (DeepSpeed steps the scheduler). With sequence
    parallelism its groups are the engine's mpu: ZeRO and gradient averaging over data × sequence parallel."""
    import deepspeed

    from tapetrain.train.optim import build_optimizer
    from tapetrain.train.schedule import build_scheduler

    optimizer = build_optimizer(model, cfg.optim)
    scheduler = build_scheduler(optimizer, cfg.optim, cfg.train.steps)
    engine, _, _, _ = deepspeed.initialize(
        model=model, optimizer=optimizer, lr_scheduler=scheduler, config=ds_config, dist_init_required=False,
        mpu=sp.mpu if sp is not None else None,
    )
    return engine, scheduler


def build_components(cfg: RunConfig, env: DistEnv, clock: StartupClock | None = None) -> Components:
    from tapetrain.config import build_deepspeed_config
    from tapetrain.data.prefetch import PrefetchingBatches
    from tapetrain.data.stream import BatchIterator

    clock = clock or StartupClock()

    # config: the model's shape (init_from), the example store's tokenizer, DeepSpeed's JSON
    model_config = resolve_model_config_agreed(cfg, env)
    cfg, tokenizer_origin = run_config_as_written(cfg, model_config)
    ds_config = build_deepspeed_config(cfg, env.world_size)

    # sequence parallelism: DeepSpeed's groups (collective), the model's shard, which samples this rank reads
    layout = ParallelLayout(env.world_size, cfg.parallel.sequence_parallel, cfg.parallel.context_parallel)
    sp = _sequence_parallel(layout, env, cfg.data.seq_len)

    # checks before anything is written: the checkpoint to resume from, data, tokenizer
    checkpoints = CheckpointManager(cfg, env, model_config)
    start = check_before_start(cfg, env, model_config, checkpoints, tokenizer_origin)
    clock.done("data", data_summary(start))

    # model
    model, total, trainable = _training_model(cfg, model_config, env, ds_config, clock)
    model.use_plan(start.plan)
    apply_float8(model, start.plan.float8)  # torchao's FP8 linears, before DeepSpeed wraps them
    if sp is not None:
        model.shard_sequence(sp.shard)

    # resume, before the engine: free space, the conversion for another rank count, the run's files (committed)
    ds_config = checkpoints.prepare(model, ds_config, total_params=total, trainable_params=trainable)

    # engine
    d = cfg.deepspeed
    clock.begin("engine", f"DeepSpeed ZeRO-{d.zero_stage} {d.precision} on {env.world_size} rank(s)"
                + (f", loading {start.resume.checkpoint.name}" if start.resume else ""))
    engine, scheduler = _engine(cfg, model, ds_config, sp)

    # data order: the ranks of a sequence-parallel group read the same samples (their data-parallel rank's)
    train_batches = BatchIterator(start.train_dataset, seed=cfg.run.seed, global_batch_size=cfg.train.global_batch_size,
                                  micro_batch_size=cfg.train.micro_batch_size,
                                  rank=layout.data_parallel_rank(env.rank), world_size=layout.data_parallel)

    # resume: the checkpoint's state into the engine, LR schedule and data order (the config's settings win)
    progress = checkpoints.restore(engine, scheduler, train_batches)
    clock.done("engine", "ready" + (f", resumed at step {progress.step}" if start.resume else ""))
    _log_epochs(train_batches, cfg.train.steps - progress.step)
    if cfg.data.num_workers > 0:
        train_batches = PrefetchingBatches(train_batches, cfg.data.num_workers)

    return Components(
        engine=engine,
        model=model,
        model_config=model_config,
        train_batches=train_batches,
        val_dataset=start.val_dataset,
        has_val=start.val_dataset is not None,
        start=progress,
        scheduler=scheduler,
        checkpoints=checkpoints,
        startup=clock,
        run_config=cfg,
        sequence_parallel=sp,
    )


def _sequence_parallel(layout: ParallelLayout, env: DistEnv, seq_len: int | None) -> SequenceParallel | None:
    from tapetrain.parallel.ulysses import init_sequence_parallel

    sp = init_sequence_parallel(layout, env)
    if sp is not None:
        log.info("%s", "; ".join(layout.describe(seq_len or 0)))
    return sp


def _log_epochs(batches: BatchIterator, steps_left: int) -> None:
    """Say up front when the run will read its data more than once."""
    end = batches.consumed_samples + steps_left * batches.global_batch_size
    if end > batches.num_samples:
        log.warning(
            "data: the run draws %d samples by its last step but the training data holds %d (windows of seq_len "
            "tokens), so it reads the data %.2f times; every new epoch is a new shuffle of the same samples",
            end, batches.num_samples, end / batches.num_samples,
        )
