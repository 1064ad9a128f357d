"""Tiny randomly initialised transformers models of every family tapetrain imports, built from config (no
downloads), each with grouped-query attention (4 query heads, 2 key/value heads) and its family's RoPE scaling:

    llama3   Llama-3.x: rope llama3 (theta 500000), tied embeddings (as Llama-3.2 1B/3B)
    qwen2    Qwen2.5: q/k/v biases, rope yarn (as Qwen2.5's long-context setting)
    qwen3    Qwen3: per-head q/k RMSNorm, head_dim 32 apart from hidden/heads = 16, rope dynamic
    mistral  Mistral: sliding_window 4096 (longer than any length used here), theta 1e6

Biases and norm gains are moved off their init (zeros / ones), so a weight that failed to load would show.
"""

from __future__ import annotations

import torch

VOCAB = 101
COMMON = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, max_position_embeddings=128, rms_norm_eps=1e-5, initializer_range=0.1)
FAMILIES: dict[str, tuple[str, str, dict]] = {
    "llama3": ("LlamaConfig", "LlamaForCausalLM", dict(
        rope_parameters={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                         "original_max_position_embeddings": 32, "rope_theta": 500000.0},
        tie_word_embeddings=True)),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM", dict(
        rope_parameters={"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32,
                         "rope_theta": 1e6})),
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM", dict(
        head_dim=32, max_position_embeddings=32, rope_parameters={"rope_type": "dynamic", "factor": 2.0,
                                                                  "rope_theta": 1e6})),
    "mistral": ("MistralConfig", "MistralForCausalLM", dict(sliding_window=4096,
                                                            rope_parameters={"rope_type": "default",
                                                                             "rope_theta": 1e6})),
}
FAMILY_OF = {"llama3": "llama", "qwen2": "qwen2", "qwen3": "qwen3", "mistral": "mistral"}  # tapetrain's family


def tiny_hf_model(name: str, seed: int = 0, **overrides):
    """A transformers model of family `name` (eval mode, fp32)."""
    import transformers

    config_class, model_class, extra = FAMILIES[name]
    torch.manual_seed(seed)
    config = getattr(transformers, config_class)(**{**COMMON, **extra, **overrides})
    model = getattr(transformers, model_class)(config).eval()
    with torch.no_grad():
        for param in model.parameters():
            if param.ndim == 1:
                param.add_(torch.randn_like(param) * 0.2)
    return model
