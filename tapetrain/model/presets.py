"""Named model shapes. `get_preset(name)` returns ModelConfig field values to build on."""

from __future__ import annotations

from tapetrain.errors import ConfigError
from tapetrain.model.config import ModelConfig

PRESETS: dict[str, dict] = {
    # Seconds per step on a laptop CPU; used by tests, the demo and the CPU benchmark.
    "tiny": dict(vocab_size=512, d_model=64, n_layers=2, n_heads=4, n_kv_heads=2, ffn_hidden=176, max_seq_len=128),
    # The paper's from-scratch model: 12 layers, 768 hidden, 12 heads (D = 64), SwiGLU 3072, Llama tokenizer,
    # untied embeddings, 1024 context; TAPE adds 4·12 = 48 MLP-update channels per layer.
    "paper-155m": dict(
        vocab_size=32000, d_model=768, n_layers=12, n_heads=12, ffn_hidden=3072, max_seq_len=1024, norm_eps=1e-5
    ),
    # ~1B Llama-style model for throughput measurements at 2048 context: 16 layers, 2048 hidden, 16 heads of
    # D = 128 (the Llama-2-7B head size), SwiGLU 5632; 0.953B parameters with untied embeddings (TAPE: 0.955B).
    "llama-1b": dict(
        vocab_size=32000, d_model=2048, n_layers=16, n_heads=16, ffn_hidden=5632, max_seq_len=2048, norm_eps=1e-5
    ),
    # Llama-2-7B's shape (meta-llama/Llama-2-7b-hf config.json).
    "llama2-7b": dict(
        vocab_size=32000,
        d_model=4096,
        n_layers=32,
        n_heads=32,
        n_kv_heads=32,
        ffn_hidden=11008,
        max_seq_len=4096,
        norm_eps=1e-5,
        rope_theta=10000.0,
    ),
    # Llama-3.1-8B's shape (meta-llama/Llama-3.1-8B config.json): GQA 32/8, 8.03B parameters, untied embeddings.
    # Its RoPE (theta 500000, llama3 ×8 from 8192) comes with model.init_from: a preset carrying RoPE settings would
    # count as the run config's own and replace another checkpoint's (model_init.inherited_rope).
    "llama3.1-8b": dict(
        vocab_size=128256,
        d_model=4096,
        n_layers=32,
        n_heads=32,
        n_kv_heads=8,
        ffn_hidden=14336,
        max_seq_len=131072,
        norm_eps=1e-5,
    ),
}


def get_preset(name: str) -> dict:
    if name not in PRESETS:
        raise ConfigError(f"model.preset: unknown preset {name!r}; choose one of {', '.join(PRESETS)}")
    return dict(PRESETS[name])


def preset_config(name: str, **overrides) -> ModelConfig:
    return ModelConfig.from_dict({**get_preset(name), **overrides})
