"""`tapetrain train` / `python -m tapetrain.train`: load the config, build the components, run the loop."""

from __future__ import annotations

import logging

from tapetrain.train.distributed import init_distributed

log = logging.getLogger("tapetrain.train")


def train_from_args(config_path: str, overrides: list[str]) -> int:
    from tapetrain.config import load_run_config
    from tapetrain.train.build import build_components
    from tapetrain.train.trainer import Trainer

    cfg = load_run_config(config_path, list(overrides))  # fails fast, before any process group exists
    env = init_distributed()
    cfg = cfg.resolve(world_size=env.world_size, device_type=env.device.type)
    if not env.is_main:
        logging.getLogger().setLevel(logging.WARNING)  # one console voice
    components = build_components(cfg, env)
    log.info(
        "model: %s pe=%s, %.2fM parameters (%.2fM trainable); %d rank(s), grad accumulation %d",
        cfg.model.preset or "custom",
        cfg.model.pe,
        components.model.num_params() / 1e6,
        components.model.num_params(trainable_only=True) / 1e6,
        env.world_size,
        components.train_batches.grad_accum_steps,
    )
    return Trainer(cfg, env, components).fit()
