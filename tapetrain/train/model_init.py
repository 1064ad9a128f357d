"""Build the model for a run: from scratch, or from `model.init_from`: a Hugging Face Llama checkpoint, a tapetrain
export (tapetrain export hf) or a tapetrain run directory / checkpoint (tapetrain.checkpoint.init_source).

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

if TYPE_CHECKING:
    from tapetrain.config import RunConfig

log = logging.getLogger("tapetrain.train")

# Architecture fields a checkpoint dictates; everything else (pe, pi_factor, rope_theta, max_seq_len, TAPE and
# attention settings) comes from the run config, so PI and theta scaling apply on top of the checkpoint.
CHECKPOINT_SHAPE_FIELDS = (
    "vocab_size",
    "d_model",
    "n_layers",
    "n_heads",
    "n_kv_heads",
    "ffn_hidden",
    "norm_eps",
    "tie_embeddings",
)
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def resolve_model_config(cfg: RunConfig) -> ModelConfig:
    """The run's ModelConfig; with model.init_from, the shape fields are taken from its config.json."""
    model_config = cfg.model.model_config()
    if not cfg.model.init_from:
        return model_config
    from tapetrain.checkpoint.init_source import init_model_config

    hf = init_model_config(cfg.model.init_from, cfg.model.pe)
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
    return dataclasses.replace(model_config, **{k: getattr(hf, k) for k in CHECKPOINT_SHAPE_FIELDS}).validate()


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
