"""Pure single-device PyTorch model code (never imports deepspeed)."""

from tapetrain.model.cache import KVCache
from tapetrain.model.config import POSITIONAL_ENCODINGS, ModelConfig
from tapetrain.model.presets import PRESETS, get_preset, preset_config
from tapetrain.model.transformer import ModelOutput, Transformer, estimate_mfu

__all__ = [
    "KVCache",
    "ModelConfig",
    "ModelOutput",
    "POSITIONAL_ENCODINGS",
    "PRESETS",
    "Transformer",
    "estimate_mfu",
    "get_preset",
    "preset_config",
]
