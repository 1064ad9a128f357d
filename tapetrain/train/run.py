"""`tapetrain train` / `python -m tapetrain.train`: load the config, lock the run directory, build, run the loop."""

from __future__ import annotations

import logging
import os

from tapetrain.train.distributed import init_distributed

log = logging.getLogger("tapetrain.train")


def train_from_args(config_path: str, overrides: list[str]) -> int:
    """Exit code 0 when training finished or stopped cleanly (signal), 1 when it refused to start or had to stop;
    expected failures print their message once (no traceback: it names the problem and the fix)."""
    from tapetrain.train.collective import EXPECTED_ERRORS

    try:
        return _train(config_path, overrides)
    except EXPECTED_ERRORS as err:
        if not getattr(err, "reported_elsewhere", False):
            rank = os.environ.get("RANK", "0")
            log.error("%s%s", f"[rank {rank}] " if rank != "0" else "", err)
        return 1


def _train(config_path: str, overrides: list[str]) -> int:
    from tapetrain.config import load_run_config
    from tapetrain.train.build import build_components
    from tapetrain.train.collective import agree
    from tapetrain.train.run_lock import RunLock
    from tapetrain.train.trainer import Trainer

    cfg = load_run_config(config_path, list(overrides))  # fails fast, before any process group exists
    env = init_distributed()
    cfg = cfg.resolve(world_size=env.world_size, device_type=env.device.type)
    if not env.is_main:
        logging.getLogger().setLevel(logging.WARNING)  # one console voice
    lock = RunLock(cfg.run.out_dir)
    agree(env, lock.acquire, on_main_only=True)  # one job per run directory, held until this process ends
    started = False
    try:
        components = build_components(cfg, env)
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
        return Trainer(cfg, env, components).fit()
    finally:
        lock.release(failed_start=not started)
