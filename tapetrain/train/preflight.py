"""`tapetrain train CONFIG --print-config` and `--dry-run`: see what a config resolves to, and check a start,
without training or writing anything."""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path
from typing import TYPE_CHECKING

import torch
from torch import nn

from tapetrain.distributed import DistEnv
from tapetrain.errors import ConfigError
from tapetrain.parallel import ParallelLayout

if TYPE_CHECKING:
    from tapetrain.config import RunConfig
    from tapetrain.model import ModelConfig
    from tapetrain.model.execution_plan import ExecutionPlan

log = logging.getLogger("tapetrain.train")


def _meta_model(model_config: ModelConfig) -> nn.Module:
    """The model this config builds, on the meta device (no memory, no weights): what the counts and float8's
    conversion are read from."""
    from tapetrain.model import Transformer

    with torch.device("meta"):
        return Transformer(model_config)


def _parameter_counts(cfg: RunConfig, model: nn.Module) -> tuple[int, int]:
    """(total, trainable) of the meta model with train.trainable applied (it sets requires_grad, nothing else).
    LoRA adapters are not added: they are small next to what the estimate is for."""
    from tapetrain.train.optim import apply_trainable

    if cfg.train.trainable.startswith("lora"):
        return model.num_params(), 0
    trainable, total = apply_trainable(model, cfg.train.trainable)
    return total, trainable


def _memory_lines(cfg: RunConfig, model_config: ModelConfig, world_size: int, total: int,
                  trainable: int, plan: ExecutionPlan | None) -> list[str]:
    from tapetrain.train.memory import estimate_run_memory

    est, _ = estimate_run_memory(cfg, model_config, world_size, plan=plan)
    parts = [("weights", est.weights_gb), ("gradients", est.grads_gb), ("optimizer", est.optimizer_gb),
             ("ZeRO buffers", est.buffers_gb), ("activations", est.activations_gb), ("logits", est.logits_gb),
             ("CUDA context", est.context_gb), ("total", est.total_gpu_gb)]
    weights = "fp32 weights and Adam" if cfg.deepspeed.precision == "fp32" else \
        f"{cfg.deepspeed.precision} weights, fp32 master and Adam"  # fmt: skip
    return [
        f"parameters: {total / 1e6:.2f}M ({trainable / 1e6:.2f}M trainable)",
        f"memory estimate per GPU (the memory model of docs/performance.md: {weights}): "
        + ", ".join(f"{name} {_size(gib)}" for name, gib in parts) + f"; host (offload) {_size(est.host_offload_gb)}",
    ]


def _size(gib: float) -> str:
    return f"{gib:.2f} GiB" if gib >= 0.1 or gib == 0 else f"{gib * 1024:.1f} MiB"


def print_resolved(config_path: str, overrides: list[str], world_size: int | None) -> int:
    """Print the resolved YAML, the DeepSpeed JSON, the derived batch figures and the memory estimate."""
    from tapetrain.config import build_deepspeed_config, dump_run_config, load_run_config
    from tapetrain.train.model_init import resolve_model_config

    world = world_size or int(os.environ.get("WORLD_SIZE", "1"))
    cfg = load_run_config(config_path, list(overrides)).resolve(world_size=world)
    try:
        model_config = resolve_model_config(cfg)
    except FileNotFoundError as err:
        raise ConfigError(f"model.init_from={cfg.model.init_from!r}: {err}") from err
    if cfg.data.document_mask and model_config.s2_attn:  # as a start refuses it (tapetrain.train.build)
        raise ConfigError("data.document_mask with model.s2_attn: shifted sparse attention has no document mask; set "
                          "model.s2_attn=false or data.document_mask=false")
    meta_model = _meta_model(model_config)
    total, trainable = _parameter_counts(cfg, meta_model)
    plan, refusal = run_plan_or_refusal(cfg, model_config)
    accum = cfg.grad_accum_steps(world)
    layout = ParallelLayout(world, cfg.parallel.sequence_parallel, cfg.parallel.context_parallel)
    print(dump_run_config(cfg), end="")
    print(f"\n# DeepSpeed JSON ({world} rank(s))")
    print(json.dumps(build_deepspeed_config(cfg, world), indent=2))
    print("\n# derived")
    dp = layout.data_parallel
    ranks = f"{world} rank(s)" if dp == world else f"{dp} data-parallel rank(s)"
    lines = [
        f"ranks: {world}",
        *(layout.describe(cfg.data.seq_len) if layout.sequence_ranks > 1 else []),
        f"gradient accumulation: {accum} (global batch {cfg.train.global_batch_size} = micro batch "
        f"{cfg.train.micro_batch_size} x {ranks} x {accum})",
        f"tokens per step: {cfg.tokens_per_step(world):,} ({cfg.train.global_batch_size} x {cfg.data.seq_len})",
        f"tokens in the run: {cfg.tokens_per_step(world) * cfg.train.steps:,} ({cfg.train.steps} steps)",
        *_memory_lines(cfg, model_config, world, total, trainable, plan),
        *(plan.lines(cfg.data.document_mask) if plan is not None else [refusal]),
        *_float8_lines(cfg, model_config, meta_model),
    ]
    print("\n".join(lines))
    return 0


def _float8_lines(cfg: RunConfig, model_config: ModelConfig, model: nn.Module) -> list[str]:
    """train.float8: the conversion rule and what it converts in this (meta-device) model, on this device."""
    from tapetrain.train.float8 import plan_lines

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return plan_lines(cfg.train.float8, model, device, compiled=model_config.compile)


def run_plan_or_refusal(cfg: RunConfig, model_config: ModelConfig,
                        device: torch.device | None = None) -> tuple[ExecutionPlan | None, str]:
    """The run's execution plan on this machine's device (model/execution_plan.py), or None and why it is refused."""
    from tapetrain.train.build import resolve_run_plan

    device = device or torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        return resolve_run_plan(cfg, model_config, device, warn=False), ""
    except ConfigError as err:
        return None, f"attention and kernels ({model_config.attn_backend!r} on {device.type}): refused ({err})"


def dry_run(cfg: RunConfig, env: DistEnv) -> int:
    """Every check of a real start (collectively, on every rank), then stop: nothing is written or locked."""
    from tapetrain.checkpoint import disk
    from tapetrain.config import build_deepspeed_config
    from tapetrain.distributed import agree
    from tapetrain.train.build import (
        check_before_start,
        data_summary,
        resolve_model_config_agreed,
        resolve_run_plan,
        run_config_as_written,
    )
    from tapetrain.train.checkpointing import CheckpointManager
    from tapetrain.train.start_checks import check_remote_data

    model_config = resolve_model_config_agreed(cfg, env)
    plan = resolve_run_plan(cfg, model_config, env.device)  # what this device cannot run is refused before data
    cfg, tokenizer_origin = run_config_as_written(cfg, model_config)  # the tokenizer a start would adopt
    build_deepspeed_config(cfg, env.world_size)
    start = check_before_start(cfg, env, model_config, CheckpointManager(cfg, env, model_config), tokenizer_origin,
                               plan=plan)
    agree(env, lambda: check_remote_data(cfg, start.train_dataset, start.val_dataset), on_main_only=True)
    total, trainable = _parameter_counts(cfg, _meta_model(model_config))
    d = cfg.deepspeed
    needed = disk.checkpoint_bytes(total, trainable, d.precision, d.zero_stage, env.world_size,
                                   d.stage3_gather_16bit_weights_on_model_save)
    run_dir = Path(cfg.run.out_dir)
    agree(env, lambda: disk.require_free_space(run_dir, needed, "one checkpoint"), on_main_only=True)
    log.info(
        "dry run OK, nothing written: config, data (%s), tokenizer, model (%.2fM parameters) and free space for a "
        "checkpoint (%s) checked; drop --dry-run to train", data_summary(start), total / 1e6, disk.human(needed),
    )
    return 0
