"""Shared builders for model tests."""

import torch

from tapetrain.model import Transformer, preset_config


def build(pe: str = "tape", seed: int = 0, **overrides) -> Transformer:
    # A larger init than training uses: sharper attention and O(1) logits make every comparison sensitive.
    overrides.setdefault("init_std", 0.15)
    torch.manual_seed(seed)
    return Transformer(preset_config("tiny", pe=pe, **overrides)).eval()


def randomize_tape(model: Transformer, std: float = 0.2, seed: int = 1) -> None:
    """Give every TAPE parameter (W_A, W_x, W_up, W_down) a non-zero random value so the updates are active."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "tape" in name:
                param.copy_(torch.randn(param.shape, generator=gen) * std)


def randomize_fire(model: Transformer, std: float = 0.3) -> None:
    """Move FIRE's parameters off their initial values (global RNG) so its MLP, c and threshold all matter."""
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "fire" in name:
                param.add_(torch.randn_like(param) * std)
