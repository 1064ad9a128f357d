"""Build the model for a run: from scratch, or from `model.init_from`: a Hugging Face checkpoint (Llama-2/3.x,
Mistral, Qwen2/2.5, Qwen3), a tapetrain export (tapetrain export hf) or a tapetrain run directory / checkpoint
(tapetrain.checkpoint.init_source).

For a checkpoint the model never exists in fp32 on the host:
  ZeRO-3     constructed under deepspeed.zero.Init, so each rank holds 1/N of every parameter; modules are
             initialised one at a time while gathered, and each checkpoint tensor is copied into its gathered
             parameter by rank 0 and re-partitioned. Peak per rank: the shards + one full tensor.
  ZeRO-0/1/2 constructed on the meta device and materialised directly on the training device in the training
             dtype (bf16: 2 bytes/parameter), then filled tensor by tensor from the memory-mapped checkpoint.
"""

from __future__ import annotations

import dataclasses
import logging
from typing import TYPE_CHECKING

import torch

from tapetrain.distributed import DistEnv
from tapetrain.model import ModelConfig, Transformer
from tapetrain.model.config import ROTARY_ENCODINGS

if TYPE_CHECKING:
    from tapetrain.config import RunConfig

log = logging.getLogger("tapetrain.train")

# Architecture fields a checkpoint dictates; everything else (pe, max_seq_len, TAPE and attention settings) comes
# from the run config. The RoPE (ROPE_FIELDS) is the checkpoint's unless the run config writes its own, so PI, theta
# scaling, YaRN ... apply on top of the checkpoint (inherited_rope).
CHECKPOINT_SHAPE_FIELDS = (
    "vocab_size",
    "d_model",
    "n_layers",
    "n_heads",
    "n_kv_heads",
    "head_size",
    "family",
    "ffn_hidden",
    "norm_eps",
    "tie_embeddings",
)
ROPE_FIELDS = ("rope_theta", "pi_factor", "rope_scaling")
DEFAULT_ROPE = ModelConfig()
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def inherited_rope(run: ModelConfig, source: ModelConfig, init_from: str) -> dict:
    """The RoPE fields a run takes from its init_from source: rope_theta unless the run config sets one, and the
    scaling (pi_factor, rope_scaling) unless it sets either (`rope_scaling: {rope_type: default}` drops the
    source's). Left at their defaults, a Llama-3.1 continuation would silently lose its theta 500000 and llama3."""
    if run.pe not in ROTARY_ENCODINGS:
        return {}
    taken = {}
    if run.rope_theta == DEFAULT_ROPE.rope_theta:
        taken["rope_theta"] = source.rope_theta
    if run.pi_factor == 1.0 and run.rope_scaling is None:
        taken.update(pi_factor=source.pi_factor, rope_scaling=source.rope_scaling)
    source_rope, run_rope = source.rope_parameters, dataclasses.replace(run, **taken).rope_parameters
    if source_rope != run_rope:
        log.warning("model.init_from=%s: the run config's RoPE %s replaces the checkpoint's %s", init_from,
                    run_rope, source_rope)
    elif any(getattr(run, k) != v for k, v in taken.items()):
        log.info("model.init_from=%s: using its RoPE %s", init_from, source_rope)
    return taken


def resolve_model_config(cfg: RunConfig) -> ModelConfig:
    """The run's ModelConfig; with model.init_from, the shape fields are taken from its config.json and the RoPE
    settings too unless the run config sets them (inherited_rope)."""
    model_config = cfg.model.model_config()
    if not cfg.model.init_from:
        return model_config
    from tapetrain.checkpoint.init_source import init_model_config

    hf = init_model_config(cfg.model.init_from, cfg.model.pe, model_config.max_seq_len)
    changed = {
        key: (getattr(model_config, key), getattr(hf, key))
        for key in CHECKPOINT_SHAPE_FIELDS
        if getattr(model_config, key) != getattr(hf, key)
    }
    if changed:
        log.warning(
            "model.init_from=%s: taking %s from its config.json",
            cfg.model.init_from,
            ", ".join(f"{k}={new} (config said {old})" for k, (old, new) in changed.items()),
        )
    rope = inherited_rope(model_config, hf, cfg.model.init_from)
    return dataclasses.replace(model_config, **{k: getattr(hf, k) for k in CHECKPOINT_SHAPE_FIELDS}, **rope).validate()


def build_model(cfg: RunConfig, model_config: ModelConfig, env: DistEnv, ds_config: dict) -> Transformer:
    torch.manual_seed(cfg.run.seed)  # the same init on every rank
    if not cfg.model.init_from:
        return Transformer(model_config)
    from tapetrain.checkpoint.init_source import copy_init_weights

    if cfg.deepspeed.zero_stage == 3 and not model_config.tie_embeddings:
        import deepspeed

        # No `dtype=`: DeepSpeed 0.19.8 then follows the config's precision. An explicit dtype is overridden by
        # an operator-precedence slip in Init._set_dtype wherever fp16 is unsupported (CPU gets bf16).
        with deepspeed.zero.Init(config_dict_or_path=ds_config):
            model = Transformer(model_config)
        for module in model.modules():
            own = list(module.parameters(recurse=False))
            if own:
                with deepspeed.zero.GatheredParameters(own, modifier_rank=0):
                    if env.is_main:
                        model.init_module(module)

        def gathered_copy(param: torch.nn.Parameter, tensor: torch.Tensor) -> None:
            with deepspeed.zero.GatheredParameters([param], modifier_rank=0):
                if env.is_main:
                    param.data.copy_(tensor.to(param.dtype))

        copy_init_weights(model, cfg.model.init_from, gathered_copy, progress=env.is_main)
        return model
    with torch.device("meta"):
        model = Transformer(model_config)
    model = model.to_empty(device=env.device).to(DTYPES[cfg.deepspeed.precision])
    if model_config.tie_embeddings:
        model.lm_head.weight = model.embed.weight  # to_empty gives each reference its own storage
    model.reset_parameters()
    copy_init_weights(model, cfg.model.init_from, progress=env.is_main)
    return model
