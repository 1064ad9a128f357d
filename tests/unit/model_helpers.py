"""Shared builders for model tests."""

from collections.abc import Iterable, Mapping

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


def assert_reference_grads_nonzero(grads: Mapping[str, torch.Tensor | None], should_train: Iterable[str],
                                   allowed_zero: Mapping[str, str] | None = None) -> None:
    """Before comparing gradients: every parameter that should train has a reference gradient with a non-zero entry,
    so no comparison is 0 against 0 (TAPE's zero-initialised projections: randomize_tape first). A parameter that may
    legitimately get a zero gradient is listed in `allowed_zero` with the reason."""
    allowed_zero = allowed_zero or {}
    dead = [name for name in should_train if name not in allowed_zero
            and (grads.get(name) is None or not bool((grads[name] != 0).any()))]
    assert not dead, (f"reference gradient missing or all zero for {dead}: comparing it would compare nothing; "
                      "randomise zero-initialised weights or list the parameter in allowed_zero with its reason")


def trainable_names(model: torch.nn.Module) -> list[str]:
    return [name for name, param in model.named_parameters() if param.requires_grad]


def randomize_fire(model: Transformer, std: float = 0.3) -> None:
    """Move FIRE's parameters off their initial values (global RNG) so its MLP, c and threshold all matter."""
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "fire" in name:
                param.add_(torch.randn_like(param) * std)


# Every RoPE scaling type, for a head dim of 16 (the tiny preset) and L₀ = 16 positions (llama3: 32), so that
# sequences of a few dozen tokens reach past L₀ (dynamic grows, longrope switches to its long factors) and with
# theta 500 every band of llama3 (kept, smoothed, divided) and of yarn's ramp holds some frequencies.
SCALINGS: dict[str, dict | None] = {
    "default": None,
    "linear": {"rope_type": "linear", "factor": 2.0},
    "dynamic": {"rope_type": "dynamic", "factor": 3.0, "original_max_position_embeddings": 16},
    "yarn": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 16, "beta_fast": 8.0},
    "llama3": {"rope_type": "llama3", "factor": 8.0, "original_max_position_embeddings": 32,
               "low_freq_factor": 1.0, "high_freq_factor": 4.0},
    "longrope": {"rope_type": "longrope", "factor": 4.0, "original_max_position_embeddings": 16,
                 "short_factor": [1.0 + 0.1 * i for i in range(8)], "long_factor": [1.0 + 0.7 * i for i in range(8)]},
}
SCALING_THETA = 500.0
