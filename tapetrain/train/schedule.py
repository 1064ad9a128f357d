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

p is clamped to [0, 1], so steps past T stay at min_lr (constant: lr).
"""

from __future__ import annotations

import math

import torch

from tapetrain.config.sections import OptimSection


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
