"""The config wins over what a checkpoint restores: learning rate, schedule and AdamW hyperparameters.

DeepSpeed's load_checkpoint restores the optimizer's param groups (lr, betas, eps, weight decay) and ZeRO-1/2
restore their clipping threshold from the checkpoint. But the LR is a function of (config, step) (see
`tapetrain.train.schedule.lr_at`), and a resume with a new optimizer section or train.grad_clip must train with
the new values from the resumed step on. So after every load (and after every skipped step, which DeepSpeed's
scheduler does not count) these helpers put the config's values back.
"""

from __future__ import annotations

import torch

from tapetrain.train.schedule import lr_at

HYPERPARAMETERS = ("betas", "eps", "weight_decay")


def group_hyperparameters(optimizer: torch.optim.Optimizer) -> list[dict]:
    """The config's betas/eps/weight_decay per param group, read before a checkpoint overwrites them (the
    no-decay group carries weight_decay 0, so the groups are told apart by position)."""
    return [{k: group[k] for k in HYPERPARAMETERS} for group in optimizer.param_groups]


def _param_group_lists(engine) -> list[list[dict]]:
    """The param-group lists the engine reads (the client AdamW's, and a wrapper's if it keeps its own list)."""
    lists, seen = [], set()
    for opt in (getattr(engine, "basic_optimizer", None), getattr(engine, "optimizer", None)):
        groups = getattr(opt, "param_groups", None)
        if groups is not None and id(groups) not in seen:
            seen.add(id(groups))
            lists.append(groups)
    return lists


def set_schedule_position(engine, scheduler, optim, total_steps: int, step: int) -> float:
    """Put the LambdaLR and every param group at the LR for update number `step` (0-based); returns that LR."""
    lr = lr_at(step, optim, total_steps)
    for groups in _param_group_lists(engine):
        for group in groups:
            group["lr"] = lr
            group["initial_lr"] = optim.lr
    scheduler.base_lrs = [optim.lr] * len(scheduler.base_lrs)
    scheduler.last_epoch = step
    scheduler._last_lr = [lr] * len(scheduler.base_lrs)
    return lr


def apply_config_settings(engine, scheduler, cfg, step: int, hyperparameters: list[dict]) -> None:
    """After loading a checkpoint: the config's LR schedule position, AdamW hyperparameters and clipping."""
    for groups in _param_group_lists(engine):
        if len(groups) != len(hyperparameters):
            raise RuntimeError(f"optimizer has {len(groups)} param groups, expected {len(hyperparameters)}")
        for group, values in zip(groups, hyperparameters, strict=True):
            group.update({k: (tuple(v) if k == "betas" else v) for k, v in values.items()})
    set_schedule_position(engine, scheduler, cfg.optim, cfg.train.steps, step)
    if hasattr(engine.optimizer, "clip_grad"):  # ZeRO-1/2 and the bf16 optimizer restore it from the checkpoint
        engine.optimizer.clip_grad = cfg.train.grad_clip
