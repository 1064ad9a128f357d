"""The key table between tapetrain parameter names and Hugging Face names, as data, usable in both directions.

The shared part maps onto transformers' `LlamaForCausalLM` (and `MistralForCausalLM`; Qwen2's q/k/v biases and
Qwen3's q/k norms are the extra rows); the positional extras (TAPE's head mix and MLP update, FIRE's
bias MLP) keep a `model.`-prefixed name in the remote-code model (`hf_modeling/modeling_tapetrain.py`). Our
rotate-half pairing is Llama's, so q/k weights need no permutation.

Placeholders: `{layer}` is a layer index; any other `{name}` takes one of the alternatives in PLACEHOLDERS. A
placeholder is captured on one side and substituted on the other.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping
from functools import cache

PLACEHOLDERS: dict[str, str] = {
    "layer": r"\d+",
    "attn_proj": r"q_proj|k_proj|v_proj|o_proj",
    "qkv_proj": r"q_proj|k_proj|v_proj",
    "qk_norm": r"q_norm|k_norm",
    "mlp_proj": r"gate_proj|up_proj|down_proj",
    "tape_proj": r"x_proj|up_proj|down_proj",
    "fire_param": r"mlp\.\d+\.weight|mlp\.\d+\.bias|c|threshold_scale",
}

# (tapetrain name, Hugging Face name)
KEY_TABLE: list[tuple[str, str]] = [
    ("embed.weight", "model.embed_tokens.weight"),
    ("layers.{layer}.attn_norm.weight", "model.layers.{layer}.input_layernorm.weight"),
    ("layers.{layer}.attn.{attn_proj}.weight", "model.layers.{layer}.self_attn.{attn_proj}.weight"),
    ("layers.{layer}.attn.{qkv_proj}.bias", "model.layers.{layer}.self_attn.{qkv_proj}.bias"),  # Qwen2
    ("layers.{layer}.attn.{qk_norm}.weight", "model.layers.{layer}.self_attn.{qk_norm}.weight"),  # Qwen3
    ("layers.{layer}.mlp_norm.weight", "model.layers.{layer}.post_attention_layernorm.weight"),
    ("layers.{layer}.mlp.{mlp_proj}.weight", "model.layers.{layer}.mlp.{mlp_proj}.weight"),
    ("norm.weight", "model.norm.weight"),
    ("lm_head.weight", "lm_head.weight"),
    # Positional extras (remote-code model only).
    ("abacus.embed.weight", "model.abacus.embed.weight"),  # model.abacus digit places
    ("layers.{layer}.attn.tape_mix.weight", "model.layers.{layer}.self_attn.tape_mix.weight"),
    ("layers.{layer}.tape_mlp.{tape_proj}.weight", "model.layers.{layer}.tape_mlp.{tape_proj}.weight"),
    ("pe.fire.{fire_param}", "model.pe.fire.{fire_param}"),  # fire_shared
    ("layers.{layer}.fire.{fire_param}", "model.layers.{layer}.fire.{fire_param}"),  # FIRE per layer
]

# HF keys that carry no weights of ours (old Llama checkpoints saved the rotary buffer).
IGNORED_HF_KEYS = re.compile(r"^model\.layers\.\d+\.self_attn\.rotary_emb\.inv_freq$")


@cache
def _compiled(direction: str) -> list[tuple[re.Pattern, str]]:
    """[(regex matching a source name, target template)] for direction 'to_hf' or 'from_hf'."""
    rules = []
    for ours, theirs in KEY_TABLE:
        source, target = (ours, theirs) if direction == "to_hf" else (theirs, ours)
        parts = re.split(r"(\{\w+\})", source)
        regex = "".join(
            f"(?P<{p[1:-1]}>{PLACEHOLDERS[p[1:-1]]})" if p.startswith("{") else re.escape(p) for p in parts
        )
        rules.append((re.compile(f"^{regex}$"), target))
    return rules


def _convert(name: str, direction: str) -> str | None:
    for regex, target in _compiled(direction):
        match = regex.match(name)
        if match:
            return target.format(**match.groupdict())
    return None


def to_hf_key(name: str) -> str | None:
    """tapetrain name -> Hugging Face name (None when the table has no rule for it)."""
    return _convert(name, "to_hf")


def from_hf_key(name: str) -> str | None:
    """Hugging Face name -> tapetrain name (None when the table has no rule for it)."""
    return _convert(name, "from_hf")


def _rename(names: Iterable[str], convert, what: str) -> dict[str, str]:
    mapping, unknown = {}, []
    for name in names:
        new = convert(name)
        if new is None:
            unknown.append(name)
        else:
            mapping[name] = new
    if unknown:
        raise ValueError(
            f"no {what} key-table rule for: {', '.join(sorted(unknown))}; add a rule to "
            "tapetrain/checkpoint/hf_keys.py KEY_TABLE (or drop these tensors before converting)"
        )
    return mapping


def to_hf_state_dict(state: Mapping[str, object]) -> dict[str, object]:
    """Rename a tapetrain state dict to Hugging Face names; unknown keys are an error listing them."""
    mapping = _rename(state, to_hf_key, "tapetrain->HF")
    return {mapping[k]: v for k, v in state.items()}


def from_hf_state_dict(state: Mapping[str, object]) -> dict[str, object]:
    """Rename a Hugging Face state dict to tapetrain names (ignorable buffers dropped); unknown keys are an error."""
    kept = {k: v for k, v in state.items() if not IGNORED_HF_KEYS.match(k)}
    mapping = _rename(kept, from_hf_key, "HF->tapetrain")
    return {mapping[k]: v for k, v in kept.items()}
