"""LoRA adapters on tapetrain's plain-PyTorch decoder, through peft (the LoRA / LongLoRA baselines).

peft wraps each targeted Linear: its weight moves to `<name>.base_layer.weight` and the adapters are
`<name>.lora_A.default.weight` (r × in) and `<name>.lora_B.default.weight` (out × r, zero-initialised, so the
model is unchanged at step 0). `merge_lora_state_dict` folds them back into plain weights for export.
"""

from __future__ import annotations

import re

import torch
from torch import nn

from tapetrain.errors import ConfigError


def apply_lora(model: nn.Module, r: int, alpha: float, dropout: float, targets: list[str]) -> nn.Module:
    from peft import LoraConfig, inject_adapter_in_model

    config = LoraConfig(r=r, lora_alpha=alpha, lora_dropout=dropout, target_modules=list(targets), bias="none")
    model = inject_adapter_in_model(config, model)
    if not any("lora_" in name for name, _ in model.named_parameters()):
        raise ConfigError(f"train.lora.targets={targets} matched no Linear layer; use names like q_proj, v_proj")
    return model


_LORA_A = re.compile(r"^(?P<prefix>.+)\.lora_A(?:\.[^.]+)?\.weight$")


def merge_lora_state_dict(state: dict[str, torch.Tensor], r: int, alpha: float) -> dict[str, torch.Tensor]:
    """W = W_base + (alpha / r) · B·A for every adapted layer; returns a state dict with plain names."""
    merged: dict[str, torch.Tensor] = {}
    adapters: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
    for key, value in state.items():
        match = _LORA_A.match(key)
        if match:
            prefix = match.group("prefix")
            b_key = key.replace(".lora_A", ".lora_B")
            adapters[prefix] = (value, state[b_key])
    for key, value in state.items():
        if ".lora_A" in key or ".lora_B" in key:
            continue
        merged[key.replace(".base_layer.", ".")] = value
    for prefix, (a, b) in adapters.items():
        weight = merged[f"{prefix}.weight"]
        merged[f"{prefix}.weight"] = (weight.float() + (alpha / r) * (b.float() @ a.float())).to(weight.dtype)
    return merged
