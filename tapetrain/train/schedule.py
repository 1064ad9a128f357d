"""Learning-rate schedules: linear warmup, then cosine / linear / polynomial / constant / warmup-stable-decay.

`step` counts optimizer steps already taken, so step 0 is the lr of the first update. With W warmup steps and
T = train.steps in total:

    warmup     s < W:          lr · (s + 1) / W          (ramps linearly from 0; reaches lr at s = W - 1)
    cosine     W <= s:         min_lr + (lr - min_lr) · (1 + cos(π·p)) / 2,   p = (s - W) / (T - W)
    linear                     min_lr + (lr - min_lr) · (1 - p)
    polynomial                 min_lr + (lr - min_lr) · (1 - p) ** power
    constant                   lr
    wsd        s < T - D:      lr
               T - D <= s:     min_lr + (lr - min_lr) · (1 - (s - (T - D)) / D),   D = round(decay_ratio · T)

p is clamped to [0, 1], so steps past T stay at min_lr (constant: lr). `set_schedule_position` moves a running
schedule (the LambdaLR and the engine's param groups) to any step.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

import torch

from tapetrain.config.sections import OptimSection

if TYPE_CHECKING:
    from deepspeed import DeepSpeedEngine


def lr_at(step: int, optim: OptimSection, total_steps: int) -> float:
    """Learning rate for the update made at optimizer step `step` (0-based) of a `total_steps` run."""
    peak, floor = optim.lr, optim.min_lr
    warmup = optim.warmup_for(total_steps)
    if step < warmup:
        return peak * (step + 1) / warmup
    if optim.schedule == "constant":
        return peak
    if optim.schedule == "wsd":
        decay = max(optim.decay_steps_for(total_steps), 1)
        start = total_steps - decay
        if step < start:
            return peak
        return floor + (peak - floor) * (1.0 - min((step - start) / decay, 1.0))
    span = max(total_steps - warmup, 1)
    progress = min(max((step - warmup) / span, 0.0), 1.0)
    if optim.schedule == "cosine":
        return floor + (peak - floor) * 0.5 * (1.0 + math.cos(math.pi * progress))
    if optim.schedule == "linear":
        return floor + (peak - floor) * (1.0 - progress)
    if optim.schedule == "polynomial":
        return floor + (peak - floor) * (1.0 - progress) ** optim.power
    raise ValueError(f"optim.schedule: unknown schedule {optim.schedule!r}")


def build_scheduler(
    optimizer: torch.optim.Optimizer, optim: OptimSection, total_steps: int
) -> torch.optim.lr_scheduler.LambdaLR:
    """A LambdaLR following `lr_at`; the optimizer's param groups must start at lr = optim.lr.

    Step it once per optimizer step (DeepSpeed does this when it is passed as `lr_scheduler`).
    """

    def factor(step: int) -> float:
        return lr_at(step, optim, total_steps) / optim.lr

    return torch.optim.lr_scheduler.LambdaLR(optimizer, factor)


def param_group_lists(engine: DeepSpeedEngine) -> list[list[dict]]:
    """The param-group lists the engine reads (the client AdamW's, and a wrapper's if it keeps its own list)."""
    lists, seen = [], set()
    for opt in (getattr(engine, "basic_optimizer", None), getattr(engine, "optimizer", None)):
        groups = getattr(opt, "param_groups", None)
        if groups is not None and id(groups) not in seen:
            seen.add(id(groups))
            lists.append(groups)
    return lists


def set_schedule_position(engine: DeepSpeedEngine, scheduler: torch.optim.lr_scheduler.LambdaLR,
                          optim: OptimSection, total_steps: int, step: int) -> float:
    """Put the LambdaLR and every param group at the LR for update number `step` (0-based); returns that LR.
    Needed after a checkpoint load (which restores the saved LRs) and after a skipped step (which DeepSpeed's
    scheduler does not count)."""
    lr = lr_at(step, optim, total_steps)
    for groups in param_group_lists(engine):
        for group in groups:
            group["lr"] = lr
            group["initial_lr"] = optim.lr
    scheduler.base_lrs = [optim.lr] * len(scheduler.base_lrs)
    scheduler.last_epoch = step
    scheduler._last_lr = [lr] * len(scheduler.base_lrs)
    return lr
