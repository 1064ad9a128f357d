"""Import a Hugging Face checkpoint (Llama-2/3.x, Mistral, Qwen2/2.5, Qwen3; hf_families.py) into tapetrain's
Transformer, with any positional encoding.

`load_hf_llama(dir, pe="tape")` is the TAPE retrofit: the weights load by the key table, TAPE's own parameters keep
their init (W_A = W_down = 0), so the TAPE model reproduces the original logits at step 0, RoPE scaling included.
"""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Callable, Iterable, Iterator

import torch

from tapetrain.checkpoint.hf_families import config_from_hf
from tapetrain.checkpoint.hf_keys import IGNORED_HF_KEYS, from_hf_key
from tapetrain.errors import InputError, MissingInputError
from tapetrain.model import Transformer

__all__ = ["config_from_hf", "copy_hf_weights", "copy_named_weights", "load_hf_llama", "read_hf_config"]

log = logging.getLogger("tapetrain.checkpoint")

WEIGHT_FILES = (  # in order of preference; an index names the shards
    "model.safetensors.index.json",
    "model.safetensors",
    "pytorch_model.bin.index.json",
    "pytorch_model.bin",
)


def find_weight_files(hf_dir: str) -> list[str]:
    """The weight files of a checkpoint directory (several when sharded), in load order."""
    for name in WEIGHT_FILES:
        path = os.path.join(hf_dir, name)
        if not os.path.isfile(path):
            continue
        if name.endswith(".index.json"):
            with open(path) as f:
                shards = sorted(set(json.load(f)["weight_map"].values()))
            missing = [s for s in shards if not os.path.isfile(os.path.join(hf_dir, s))]
            if missing:
                raise MissingInputError(f"{path} names shard(s) that do not exist: {', '.join(missing)}; "
                                        "copy the complete checkpoint")
            return [os.path.join(hf_dir, s) for s in shards]
        return [path]
    raise MissingInputError(f"no weights in {hf_dir}: expected one of {', '.join(WEIGHT_FILES)}")


def iter_weights(files: list[str], progress: bool = False) -> Iterator[tuple[str, torch.Tensor]]:
    """(name, tensor) over every weight file, one file in memory at a time; `progress`: a bar over the files."""
    from tapetrain.progress import progress as progress_bar

    for path in progress_bar(files, desc="loading weight shards", unit="shard", disable=not progress):
        if path.endswith(".safetensors"):
            from safetensors import safe_open

            with safe_open(path, framework="pt") as f:
                for name in f.keys():
                    yield name, f.get_tensor(name)
        else:
            state = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
            yield from state.items()
            del state


def read_hf_config(hf_dir: str) -> dict:
    config_path = os.path.join(hf_dir, "config.json")
    if not os.path.isfile(config_path):
        raise MissingInputError(f"{config_path} does not exist; model.init_from must be a Hugging Face "
                                "checkpoint directory (config.json + safetensors or .bin weights)")
    with open(config_path) as f:
        return json.load(f)


def copy_hf_weights(
    model: Transformer, hf_dir: str, copy: Callable[[torch.nn.Parameter, torch.Tensor], None] | None = None,
    progress: bool = False,
) -> int:
    """Stream a checkpoint's tensors (one at a time) into `model` by the key table; returns how many.

    `copy(param, tensor)` does the assignment (default: param.copy_); ZeRO-3 passes one that gathers the
    partitioned parameter first, so `param.shape` is checked against `ds_shape` when present. Missing,
    unexpected or mis-shaped tensors are one error that lists them; TAPE/FIRE parameters are new and keep their
    init (zero W_A and W_down: the retrofitted model computes what the Llama model computes).
    """
    return copy_named_weights(model, iter_weights(find_weight_files(hf_dir), progress=progress), hf_dir, copy)


def copy_named_weights(
    model: Transformer,
    named: Iterable[tuple[str, torch.Tensor]],
    source: str,
    copy: Callable[[torch.nn.Parameter, torch.Tensor], None] | None = None,
) -> int:
    """copy_hf_weights' work on (Hugging Face name, tensor) pairs from any source (named in errors as `source`)."""
    cfg = model.cfg
    params = dict(model.named_parameters(remove_duplicate=False))
    copy = copy or (lambda param, tensor: param.copy_(tensor))
    loaded: set[str] = set()
    unexpected: list[str] = []
    shape_errors: list[str] = []
    with torch.no_grad():
        for hf_name, tensor in named:
            if IGNORED_HF_KEYS.match(hf_name):
                continue
            name = from_hf_key(hf_name)
            if name is None or name not in params:
                unexpected.append(hf_name)
                continue
            param = params[name]
            shape = tuple(getattr(param, "ds_shape", param.shape))
            if tuple(tensor.shape) != shape:
                shape_errors.append(f"{hf_name}: checkpoint {tuple(tensor.shape)} vs model {shape}")
                continue
            copy(param, tensor)
            loaded.add(name)
    if cfg.tie_embeddings and "embed.weight" in loaded:
        loaded.add("lm_head.weight")  # one tensor, saved once
    # Positional extras are new in the retrofit; everything else must come from the checkpoint.
    missing = [n for n in params if n not in loaded and "tape" not in n and not n.startswith("pe.")]
    if unexpected or missing or shape_errors:
        problems = []
        if missing:
            problems.append(f"missing from the checkpoint: {', '.join(missing)}")
        if unexpected:
            problems.append(f"unexpected (no tapetrain parameter): {', '.join(sorted(unexpected))}")
        if shape_errors:
            problems.append(f"shape mismatch: {'; '.join(shape_errors)}")
        raise InputError(f"cannot load {source} into a tapetrain {cfg.pe} model: " + " | ".join(problems)
                         + "; check that the checkpoint's config matches its weights and that model.pe suits it")
    log.info("loaded %s into a %s model (%d tensors; %d new positional parameters keep their init)",
             source, cfg.pe, len(loaded), len([n for n in params if n not in loaded]))
    return len(loaded)


def load_hf_llama(hf_dir: str, pe: str = "rope", **model_overrides) -> Transformer:
    """A Transformer (fp32, eval mode) holding a Hugging Face checkpoint's weights (any family of
    hf_families.py); `pe` picks the positional encoding (TAPE/FIRE parameters keep their init)."""
    cfg = config_from_hf(read_hf_config(hf_dir), pe, **model_overrides)
    model = Transformer(cfg)
    copy_hf_weights(model, hf_dir)
    return model.eval()
