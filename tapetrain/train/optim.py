"""AdamW with weight-decay groups, and freezing by `train.trainable`.

Weight decay applies to parameters with ≥ 2 dimensions (projection matrices, the LM head, TAPE's W_A/W_x/
W_up/W_down) except embeddings; biases, norm gains, 1-D TAPE gains and embeddings are not decayed. Only
parameters with `requires_grad` enter the optimizer.

Trainable modes (parameter names are the model's qualified names, e.g. `layers.0.attn.tape_mix.weight`):
  all              every parameter
  tape             TAPE parameters (a name containing "tape") and learned positional-encoding parameters
                   (under the model's `pe.` module)
  tape+embed+norm  the above plus embeddings (a name containing "embed") and norms (a name containing "norm")
  lora             LoRA adapter matrices (names containing "lora_"; see tapetrain.train.lora)
  lora+embed+norm  adapters plus embeddings and norms (LongLoRA's trainable set)
"""

from __future__ import annotations

import torch
from torch import nn

from tapetrain.config.sections import OptimSection
from tapetrain.errors import ConfigError

TRAINABLE_MODES = ("all", "tape", "tape+embed+norm", "lora", "lora+embed+norm")


def _is_positional(name: str) -> bool:
    return "tape" in name or name.startswith("pe.") or ".pe." in name


def is_trainable(name: str, mode: str) -> bool:
    """Whether the parameter called `name` trains under `mode`."""
    if mode == "all":
        return True
    if mode == "tape":
        return _is_positional(name)
    if mode == "tape+embed+norm":
        return _is_positional(name) or "embed" in name or "norm" in name
    if mode == "lora":
        return "lora_" in name
    if mode == "lora+embed+norm":
        return "lora_" in name or "embed" in name or "norm" in name
    raise ConfigError(f"train.trainable: unknown mode {mode!r}; choose one of {', '.join(TRAINABLE_MODES)}")


def apply_trainable(model: nn.Module, mode: str) -> tuple[int, int]:
    """Set requires_grad by `mode`; returns (trainable, total) parameter counts (shared weights once)."""
    selected = {}
    everything = {}
    for name, param in model.named_parameters():
        keep = is_trainable(name, mode)
        param.requires_grad_(keep)
        everything[id(param)] = param.numel()
        if keep:
            selected[id(param)] = param.numel()
    if not selected:
        raise ConfigError(
            f"train.trainable={mode!r} selects no parameter of this model (no name contains 'tape'); "
            "set model.pe=tape or train.trainable=all"
        )
    return sum(selected.values()), sum(everything.values())


def uses_weight_decay(name: str, param: nn.Parameter) -> bool:
    """≥2-D weights decay, except embeddings."""
    return param.ndim >= 2 and "embed" not in name


def param_groups(model: nn.Module, weight_decay: float) -> list[dict]:
    """[{params, weight_decay}, {params, weight_decay: 0}] over trainable parameters; empty groups dropped."""
    decay, no_decay = [], []
    for name, param in model.named_parameters():  # shared (tied) parameters appear once
        if not param.requires_grad:
            continue
        (decay if uses_weight_decay(name, param) else no_decay).append(param)
    groups = [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
    return [g for g in groups if g["params"]]


def build_optimizer(model: nn.Module, optim: OptimSection, trainable: str | None = None) -> torch.optim.AdamW:
    """AdamW over the model's trainable parameters; applies `trainable` (train.trainable) first if given."""
    if trainable is not None:
        apply_trainable(model, trainable)
    groups = param_groups(model, optim.weight_decay)
    if not groups:
        raise ConfigError("no trainable parameters (every requires_grad is False); check train.trainable")
    return torch.optim.AdamW(groups, lr=optim.lr, betas=tuple(optim.betas), eps=optim.eps)
