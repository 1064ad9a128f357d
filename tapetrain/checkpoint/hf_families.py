"""The transformers model families tapetrain imports and exports, and how their config.json maps onto ModelConfig.

    model_type   family            what differs from Llama                       RoPE twin exports as
    llama        Llama-2, 3.x      (rope llama3 from 3.1 on; tied embeddings in 3.2 1B/3B)   LlamaForCausalLM
    mistral      Mistral           sliding_window: refused where shorter than the length used  MistralForCausalLM
    qwen2        Qwen2, Qwen2.5    q/k/v projections with biases                 Qwen2ForCausalLM
    qwen3        Qwen3 (dense)     per-head RMSNorm of q and k before RoPE; head_dim set apart  Qwen3ForCausalLM
    tapetrain    tapetrain exports (`tapetrain export hf` of a non-RoPE model)

config.json is read as transformers 5 writes it (`rope_parameters` holding rope_type and rope_theta) and as 4.x
wrote it (`rope_scaling` with `type` or `rope_type`, `rope_theta` beside it), with transformers' precedence and
defaults. Everything a family has that tapetrain's decoder does not compute (mixture of experts, multi-head latent
attention, a sliding window shorter than the context, partial rotary, extra biases, another activation) is refused
with an InputError (a ValueError) that names the family and the field; a missing field is named too, never a
KeyError.
"""

from __future__ import annotations

import logging

from tapetrain.errors import ConfigError, InputError
from tapetrain.model import ModelConfig
from tapetrain.model.config import ROTARY_ENCODINGS
from tapetrain.model.rope_scaling import OPTIONAL, REQUIRED, ROPE_TYPES, RopeScaling

log = logging.getLogger("tapetrain.checkpoint")

FAMILY_LABELS = {"llama": "Llama", "mistral": "Mistral", "qwen2": "Qwen2", "qwen3": "Qwen3"}
# transformers' config and causal-LM class of each family (the RoPE twin's export)
HF_CLASSES = {
    "llama": ("LlamaConfig", "LlamaForCausalLM"),
    "mistral": ("MistralConfig", "MistralForCausalLM"),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM"),
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM"),
}
# transformers' defaults for fields a config.json may leave out
DEFAULT_MAX_POSITIONS = {"llama": 2048, "mistral": 131072, "qwen2": 32768, "qwen3": 32768}
DEFAULT_THETA = 10000.0
SUPPORTED = "llama (Llama-2, Llama-3.x), mistral, qwen2 (Qwen2, Qwen2.5), qwen3 (dense Qwen3)"
MOE_FIELDS = ("num_experts", "num_local_experts", "n_routed_experts", "moe_intermediate_size")
MLA_FIELDS = ("kv_lora_rank", "q_lora_rank")


def refuse(label: str, problem: str, fix: str) -> InputError:
    return InputError(f"{label} config.json: {problem}; {fix}")


def need(hf: dict, key: str, label: str):
    if hf.get(key) is None:
        raise refuse(label, f"has no {key!r}", "the checkpoint's config.json is incomplete; copy it again")
    return hf[key]


def check_family(hf: dict) -> tuple[str, str]:
    """(family, label) of a config.json, or the error naming what tapetrain does not implement."""
    model_type = hf.get("model_type")
    label = FAMILY_LABELS.get(model_type, f"model_type {model_type!r}")
    for key in MOE_FIELDS:
        if hf.get(key):
            raise refuse(label, f"mixture-of-experts layers ({key}={hf[key]!r}) are not supported",
                         f"tapetrain's decoder has one dense SwiGLU MLP per layer; it imports {SUPPORTED}")
    for key in MLA_FIELDS:
        if hf.get(key):
            raise refuse(label, f"multi-head latent attention ({key}={hf[key]!r}) is not supported",
                         f"tapetrain's attention is multi-head/grouped-query; it imports {SUPPORTED}")
    if model_type not in FAMILY_LABELS and model_type != "tapetrain":
        raise refuse(label, "this model family is not supported", f"tapetrain imports {SUPPORTED} checkpoints "
                     "and its own exports (model_type 'tapetrain')")
    return model_type, label


def sliding_window_in_use(hf: dict, family: str) -> int | None:
    """The attention window of a config.json if any layer uses one (as transformers decides), else None."""
    window = hf.get("sliding_window")
    if family == "mistral":
        return window
    if family in ("qwen2", "qwen3") and hf.get("use_sliding_window") and window is not None:
        types = hf.get("layer_types")
        if types is None:
            first = hf.get("max_window_layers", 28)
            types = ["sliding_attention" if i >= first else "full_attention" for i in range(hf["num_hidden_layers"])]
        return window if "sliding_attention" in types else None
    return None


def rope_from_hf(hf: dict, label: str, head_dim: int) -> tuple[float, RopeScaling | None]:
    """(rope_theta, RopeScaling or None) from config.json, read as transformers 5.x reads it: `rope_scaling` (4.x)
    before `rope_parameters` (5.x); rope_theta and the type inside it before the top-level ones; the lengths made
    explicit (dynamic: max_position_embeddings; yarn, llama3, longrope: original_max_position_embeddings, else
    max_position_embeddings; a missing yarn/longrope factor = their ratio)."""
    spelled = "rope_scaling" if hf.get("rope_scaling") else "rope_parameters"
    params = hf.get("rope_scaling") or hf.get("rope_parameters") or {}
    if not isinstance(params, dict) or any(isinstance(v, dict) for v in params.values()):
        raise refuse(label, f"{spelled} gives each layer type its own RoPE ({params!r})",
                     "tapetrain has one RoPE setting for all layers")
    theta = float(params.get("rope_theta") or hf.get("rope_theta") or DEFAULT_THETA)
    partial = params.get("partial_rotary_factor", hf.get("partial_rotary_factor"))
    if partial not in (None, 1, 1.0):
        raise refuse(label, f"partial_rotary_factor={partial} (RoPE on part of each head) is not supported",
                     "tapetrain rotates the whole head")
    kind = params.get("rope_type") or params.get("type") or "default"
    if kind not in ROPE_TYPES:
        raise refuse(label, f"{spelled} rope_type {kind!r} is not supported",
                     f"tapetrain implements {', '.join(ROPE_TYPES)}")
    if kind == "default":
        return theta, None
    known = set(REQUIRED[kind]) | set(OPTIONAL.get(kind, ()))
    values = {k: params[k] for k in known if params.get(k) is not None}
    ignored = sorted(set(params) - known - {"rope_type", "type", "rope_theta", "partial_rotary_factor"})
    if ignored:
        log.warning("%s config.json: %s keys %s are not used by rope_type %s (transformers ignores them too)",
                    label, spelled, ", ".join(ignored), kind)
    max_positions = hf.get("max_position_embeddings")
    if kind == "dynamic":  # transformers' dynamic NTK grows past max_position_embeddings
        values["original_max_position_embeddings"] = need(hf, "max_position_embeddings", label)
    elif kind in ("yarn", "llama3", "longrope"):
        original = values.get("original_max_position_embeddings") or max_positions
        if kind == "longrope" and hf.get("original_max_position_embeddings"):  # Phi-3 keeps it at the top level
            original = hf["original_max_position_embeddings"]
        if original is None:
            raise refuse(label, f"{spelled} rope_type {kind} without original_max_position_embeddings or "
                         "max_position_embeddings", "add the pretraining length to config.json")
        values["original_max_position_embeddings"] = int(original)
        if kind in ("yarn", "longrope") and values.get("factor") is None and max_positions:
            values["factor"] = max_positions / values["original_max_position_embeddings"]
    scaling = RopeScaling(rope_type=kind, **values)
    try:
        scaling.validate(head_dim, key=spelled)
    except ConfigError as err:
        raise refuse(label, str(err), "fix the RoPE settings in config.json") from None
    return theta, scaling


def config_from_hf(hf: dict, pe: str = "rope", **model_overrides) -> ModelConfig:
    """A ModelConfig for a transformers config.json dict; `model_overrides` are ModelConfig fields (max_seq_len:
    the length the model will be used at, checked against a sliding window)."""
    family, label = check_family(hf)
    if family == "tapetrain":
        return _config_from_export(hf, pe, model_overrides)
    if hf.get("hidden_act", "silu") != "silu":
        raise refuse(label, f"hidden_act={hf['hidden_act']!r} is not supported", "tapetrain's MLP is SwiGLU (silu)")
    biases = {"llama": ("attention_bias", "mlp_bias"), "qwen3": ("attention_bias",)}.get(family, ())
    for key in biases:
        if hf.get(key):
            raise refuse(label, f"{key}={hf[key]!r} is not supported",
                         "tapetrain's projections have no biases here (only Qwen2's q/k/v biases)")
    heads = need(hf, "num_attention_heads", label)
    hidden = need(hf, "hidden_size", label)
    head_dim = hf.get("head_dim") or (128 if family == "qwen3" else hidden // heads)  # transformers' defaults
    theta, scaling = rope_from_hf(hf, label, head_dim)
    max_positions = hf.get("max_position_embeddings") or DEFAULT_MAX_POSITIONS[family]
    window = sliding_window_in_use(hf, family)
    max_seq_len = model_overrides.pop("max_seq_len", None) or (min(max_positions, window) if window else max_positions)
    if window is not None and window < max_seq_len:
        raise refuse(label, f"sliding_window={window} is shorter than the length used (max_seq_len={max_seq_len}); "
                     "tapetrain attends to the whole context, so it would compute another model",
                     f"use model.max_seq_len <= {window}, or a checkpoint without a sliding window")
    kv_heads = hf.get("num_key_value_heads") or heads
    values = dict(
        vocab_size=need(hf, "vocab_size", label),
        d_model=hidden,
        n_layers=need(hf, "num_hidden_layers", label),
        n_heads=heads,
        n_kv_heads=None if kv_heads == heads else kv_heads,
        head_size=None if head_dim * heads == hidden else head_dim,
        family=family,
        ffn_hidden=need(hf, "intermediate_size", label),
        max_seq_len=max_seq_len,
        norm_eps=float(hf.get("rms_norm_eps") or 1e-6),
        rope_theta=theta,
        rope_scaling=scaling if pe in ROTARY_ENCODINGS else None,
        tie_embeddings=bool(hf.get("tie_word_embeddings", False)),
        pe=pe,
    )
    values.update(model_overrides)
    try:
        return ModelConfig.from_dict(values)
    except ConfigError as err:
        raise refuse(label, str(err), "this checkpoint's shape is not one tapetrain can build") from None


def _config_from_export(hf: dict, pe: str, overrides: dict) -> ModelConfig:
    """Our own remote-code export (model_type 'tapetrain')."""
    label = "tapetrain export"
    heads, hidden = need(hf, "num_attention_heads", label), need(hf, "hidden_size", label)
    head_dim = hf.get("head_dim") or hidden // heads
    rotary = pe in ROTARY_ENCODINGS
    values = dict(
        vocab_size=need(hf, "vocab_size", label),
        d_model=hidden,
        n_layers=need(hf, "num_hidden_layers", label),
        n_heads=heads,
        n_kv_heads=None if hf.get("num_key_value_heads") in (None, heads) else hf["num_key_value_heads"],
        head_size=None if head_dim * heads == hidden else head_dim,
        family=hf.get("family", "llama"),
        ffn_hidden=need(hf, "intermediate_size", label),
        max_seq_len=hf.get("max_position_embeddings", 2048),
        norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
        rope_theta=float(hf.get("rope_theta", DEFAULT_THETA)),
        pi_factor=float(hf.get("pi_factor", 1.0)) if rotary else 1.0,
        rope_scaling=hf.get("rotary_scaling") if rotary else None,
        tie_embeddings=bool(hf.get("tie_word_embeddings", False)),
        pe=pe,
    )
    values.update(overrides)
    return ModelConfig.from_dict(values)


def hf_rope_parameters(cfg: ModelConfig) -> tuple[dict, int]:
    """(rope_parameters, max_position_embeddings) for a RoPE twin's transformers config: transformers' dynamic NTK
    grows past max_position_embeddings, so that carries L₀ there (and L₀ leaves the dict, which takes no such key)."""
    params = dict(cfg.rope_parameters)
    if params["rope_type"] == "dynamic":
        return params, params.pop("original_max_position_embeddings")
    return params, cfg.max_seq_len
