"""Where `model.init_from` weights come from: a Hugging Face checkpoint (hf_families.py), a tapetrain export
(`tapetrain export hf`), or a tapetrain run directory / one checkpoint in it. All three stream through the same key
table and checks (hf_import.copy_named_weights): every non-positional parameter must be present with its shape, and
positional extras absent from the source (TAPE's updates when starting a TAPE model from a RoPE one) keep their zero
init.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import torch

from tapetrain.model import ModelConfig, Transformer


def is_run_source(path: str) -> bool:
    from tapetrain.checkpoint.run_loader import is_run_or_checkpoint

    return is_run_or_checkpoint(path)


def init_model_config(path: str, pe: str, max_seq_len: int | None = None) -> ModelConfig:
    """The architecture the source dictates (its shape and RoPE; `pe` is the run's). `max_seq_len`: the length the
    run uses (a checkpoint with a shorter sliding window is refused)."""
    if is_run_source(path):
        from tapetrain.checkpoint.run_loader import read_run_model_config

        return dataclasses.replace(read_run_model_config(path), pe=pe)
    from tapetrain.checkpoint.hf_import import config_from_hf, read_hf_config

    return config_from_hf(read_hf_config(path), pe, **({"max_seq_len": max_seq_len} if max_seq_len else {}))


def copy_init_weights(
    model: Transformer, path: str, copy: Callable[[torch.nn.Parameter, torch.Tensor], None] | None = None,
    progress: bool = False,
) -> int:
    """Copy the source's tensors into `model` (one at a time through `copy`); returns how many. `progress`: a bar
    over a Hugging Face checkpoint's weight shards."""
    from tapetrain.checkpoint.hf_import import copy_hf_weights, copy_named_weights

    if not is_run_source(path):
        return copy_hf_weights(model, path, copy, progress=progress)
    from tapetrain.checkpoint.hf_keys import to_hf_state_dict
    from tapetrain.checkpoint.run_loader import read_run_state

    _, state, info = read_run_state(path)
    if model.cfg.tie_embeddings:
        state.pop("lm_head.weight", None)  # one tensor, copied as the embedding
    return copy_named_weights(model, to_hf_state_dict(state).items(), info["checkpoint"], copy)
