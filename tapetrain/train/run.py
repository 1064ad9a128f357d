"""`tapetrain train` / `python -m tapetrain.train`: load the config, lock the run directory, build, run the loop."""

from __future__ import annotations

import logging
import os
from typing import TYPE_CHECKING

import torch

from tapetrain.distributed import EXPECTED_ERRORS, agree, collective_timeout_minutes, init_distributed, under_launcher

if TYPE_CHECKING:
    from tapetrain.config import RunConfig

log = logging.getLogger("tapetrain.train")


def train(config: str, overrides: list[str] | None = None, print_config: bool = False, world_size: int | None = None,
          dry_run: bool = False) -> int:
    """Train from a YAML run config (one process or any launcher rank).

    One process, or one rank of a launcher: rank and world size come from the environment, and the launcher's
    --local_rank is accepted and ignored. Overrides may come before or after the options.

      tapetrain train configs/tiny-cpu.yaml train.steps=20
      deepspeed --num_gpus 8 --module tapetrain.train configs/paper-155m-tape.yaml train.steps=2000
      torchrun --nproc_per_node 8 -m tapetrain.train configs/paper-155m-tape.yaml
      launch/single_node.sh | launch/multi_node.sh | launch/slurm.sbatch (stop them cleanly with SIGTERM)

    Every config key, its default and meaning: docs/config-reference.md.

    Args:
        config: run config (may start with `base: other.yaml`; see configs/ for examples)
        overrides: dotted overrides, parsed as YAML: train.steps=20 'data.train=[a, b]' optim.lr=1e-4
        print_config: print the resolved config, the DeepSpeed JSON, gradient accumulation, tokens per step and the
            memory estimate per GPU, then exit (reads no data, starts nothing)
        world_size: with --print-config: derive for N ranks (default: $WORLD_SIZE, else 1)
        dry_run: check config, data, tokenizer, resume compatibility, the attention backend and free disk space
            as a start would, and for remote data the cache directory, data.cache_limit_gb against the shard sizes
            and every shard's presence (HEAD); write nothing and exit before training (works under a launcher too)
    """
    caller_had_a_group = torch.distributed.is_available() and torch.distributed.is_initialized()
    code = train_from_args(config, overrides or [], print_config=print_config, dry_run=dry_run,
                           world_size=world_size)
    # The process exits next, after a finished run too (gloo's threads left to interpreter shutdown aborted a rank
    # after "done:" now and then). A group the caller started (in-process use) stays theirs.
    if not caller_had_a_group:
        leave_process_group()
    return code


def train_from_args(config_path: str, overrides: list[str], *, print_config: bool = False, dry_run: bool = False,
                    world_size: int | None = None) -> int:
    """Exit code 0 when training finished or stopped cleanly (signal), 1 when it refused to start or had to stop;
    expected failures print their message once, on the lowest rank that saw them (no traceback: it names the
    problem and the fix). `print_config`: print what the config resolves to (for `world_size` ranks) and stop;
    `dry_run`: run every start-up check, write nothing, stop before training."""
    try:
        if print_config:
            from tapetrain.train.preflight import print_resolved

            return print_resolved(config_path, overrides, world_size)
        return _train(config_path, overrides, dry_run=dry_run)
    except EXPECTED_ERRORS as err:
        if not getattr(err, "reported_elsewhere", False):
            rank = os.environ.get("RANK", "0")
            log.error("%s%s", f"[rank {rank}] " if rank != "0" else "", err)
        return 1


def leave_process_group() -> None:
    """Tear the process group down before a process exits with an error: left to interpreter shutdown, gloo's
    worker threads can be destroyed unjoined ("terminate called without an active exception", SIGABRT). Only at
    exit or when a run returns; DeepSpeed's cached groups go with it, so a later start in the same process works."""
    from tapetrain.distributed import destroy_process_group

    if torch.distributed.is_available() and torch.distributed.is_initialized():
        try:
            destroy_process_group()
        except Exception:  # noqa: BLE001 - exiting anyway; the error above is what matters
            pass


def _load_config_on_every_rank(config_path: str, overrides: list[str]):
    """(config, None) or (None, the config error). Under a launcher a config error is held until the process
    group exists, so that the ranks can agree and one of them prints it; a lone process raises at once."""
    from tapetrain.config import load_run_config

    try:
        return load_run_config(config_path, list(overrides)), None
    except EXPECTED_ERRORS as err:
        if not under_launcher():
            raise
        return None, err


def _train(config_path: str, overrides: list[str], *, dry_run: bool = False) -> int:
    from tapetrain.errors import RunError
    from tapetrain.output_paths import check_output_dir
    from tapetrain.train.build import build_components
    from tapetrain.train.heartbeat import supervising_launchers
    from tapetrain.train.run_lock import RunLock
    from tapetrain.train.startup import StartupClock
    from tapetrain.train.trainer import Trainer
    from tapetrain.train.wandb_mirror import require_wandb

    clock = StartupClock()
    launchers = supervising_launchers()  # now, before a launcher can have gone (its ranks would be handed to init)
    cfg, config_error = _load_config_on_every_rank(config_path, overrides)
    env = init_distributed(cfg.deepspeed.timeout_minutes if cfg is not None else None)
    if not env.is_main:
        logging.getLogger().setLevel(logging.WARNING)  # one console voice

    def raise_config_error() -> None:
        if config_error is not None:
            raise config_error

    agree(env, raise_config_error)  # every rank stops; the lowest failing rank says why
    agree(env, lambda: require_wandb(cfg.logging.wandb), on_main_only=True)
    cfg = cfg.resolve(world_size=env.world_size, device_type=env.device.type)
    timeout = collective_timeout_minutes() or cfg.deepspeed.timeout_minutes
    clock.done("config", f"{_config_summary(config_path, cfg, env.world_size)}; process group "
               f"{torch.distributed.get_backend()}, collective timeout {timeout:g} min")
    # before the lock, whose mkdir is the run's first write; a dry run checks it too
    agree(env, lambda: check_output_dir(cfg.run.out_dir, "run.out_dir", error=RunError), on_main_only=True)
    if dry_run:
        from tapetrain.train.preflight import dry_run as check_only

        return check_only(cfg, env)
    lock = RunLock(cfg.run.out_dir)
    agree(env, lock.acquire, on_main_only=True)  # one job per run directory, held until this process ends
    started = False
    try:
        components = build_components(cfg, env, clock=clock)
        started = True
        log.info(
            "run %s: model %s pe=%s, %.2fM parameters (%.2fM trainable); %d rank(s), grad accumulation %d",
            cfg.run.name or os.path.basename(os.path.abspath(cfg.run.out_dir)),
            cfg.model.preset or "custom",
            cfg.model.pe,
            components.model.num_params() / 1e6,
            components.model.num_params(trainable_only=True) / 1e6,
            env.world_size,
            components.train_batches.grad_accum_steps,
        )
        # each checkpoint's config.yaml = the run's
        return Trainer(components.run_config, env, components, launchers).fit()
    finally:
        lock.release(failed_start=not started)


def _config_summary(config_path: str, cfg: RunConfig, world_size: int) -> str:
    accum = cfg.grad_accum_steps(world_size)
    n, r = cfg.parallel.sequence_parallel, cfg.parallel.context_parallel
    split = f"sequence parallel {n}" if r == 1 else f"context parallel {r} x sequence parallel {n}"
    ranks = f"{world_size} rank(s)" if n * r == 1 else (
        f"{cfg.data_parallel(world_size)} data-parallel rank(s) ({split} on {world_size} ranks)")
    return (f"{config_path}: {world_size} rank(s), global batch {cfg.train.global_batch_size} = micro batch "
            f"{cfg.train.micro_batch_size} x {ranks} x {accum} accumulation, "
            f"{cfg.tokens_per_step(world_size):,} tokens per step")
