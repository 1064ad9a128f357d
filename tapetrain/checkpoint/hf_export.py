"""Export a trained tapetrain model to Hugging Face format, verified by reloading it with transformers.

RoPE models become a plain checkpoint of their family's own class (LlamaForCausalLM, MistralForCausalLM,
Qwen2ForCausalLM, Qwen3ForCausalLM) with their RoPE scaling as `rope_parameters` (PI as linear scaling); every other
PE ships the self-contained remote code in hf_modeling/ registered via `auto_map` (trust_remote_code=True).
Everything is written to OUT.tmp and renamed to OUT only after the reloaded model's logits match tapetrain's.
"""

from __future__ import annotations

import copy
import json
import logging
import os
import re
import shutil
from pathlib import Path

import torch

from tapetrain import atomic_io
from tapetrain.checkpoint.export_tokenizer import special_token_ids, write_tokenizer
from tapetrain.checkpoint.hf_families import HF_CLASSES, hf_rope_parameters
from tapetrain.checkpoint.hf_keys import to_hf_state_dict
from tapetrain.checkpoint.hf_modeling import AUTO_MAP, HERE, MODELING_FILES
from tapetrain.errors import InputError
from tapetrain.file_modes import use_umask_mode
from tapetrain.model import ModelConfig, Transformer

log = logging.getLogger("tapetrain.checkpoint")

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
DEFAULT_MAX_SHARD_SIZE = "5GB"
VERIFY_TOLERANCE = 1e-4  # max |Δlogits| in fp32, relative to max(1, max |logits|)


def parse_size(size: int | str) -> int:
    """'5GB' / '500MB' / '10KB' (powers of 1000, as transformers) or an int -> bytes."""
    if isinstance(size, int):
        return size
    match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([KMG]?B)?\s*", str(size).upper())
    if not match:
        raise InputError(f"max shard size {size!r} is not a size; use e.g. 5GB, 500MB or a number of bytes")
    factor = {None: 1, "B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9}[match.group(2)]
    return int(float(match.group(1)) * factor)


def uses_remote_code(cfg: ModelConfig) -> bool:
    """Everything but plain RoPE (a family's own class) needs the remote code; Abacus embeddings do too."""
    return cfg.pe != "rope" or cfg.abacus


def hf_config(cfg: ModelConfig, dtype: str, bos_id: int | None = None, eos_id: int | None = None):
    """The transformers config object: the family's own config class for rope, TapetrainConfig (+ auto_map)
    otherwise."""
    if not cfg.causal:
        raise InputError("model.causal=false models (equivariance tests only) cannot be exported as causal LMs")
    common = dict(
        vocab_size=cfg.vocab_size,
        hidden_size=cfg.d_model,
        intermediate_size=cfg.ffn_dim,
        num_hidden_layers=cfg.n_layers,
        num_attention_heads=cfg.n_heads,
        num_key_value_heads=cfg.kv_heads,
        head_dim=cfg.head_dim,
        max_position_embeddings=cfg.max_seq_len,
        rms_norm_eps=cfg.norm_eps,
        initializer_range=cfg.init_std,
        tie_word_embeddings=cfg.tie_embeddings,
        bos_token_id=bos_id,
        eos_token_id=eos_id,
    )
    if not uses_remote_code(cfg):
        import transformers

        config_class, model_class = HF_CLASSES[cfg.family]
        rope, common["max_position_embeddings"] = hf_rope_parameters(cfg)
        # Attention over the whole context, as tapetrain's (an imported window was checked against the length).
        family_fields = {"mistral": dict(sliding_window=None), "qwen2": dict(use_sliding_window=False),
                         "qwen3": dict(use_sliding_window=False, attention_bias=False),
                         "llama": dict(attention_bias=False, mlp_bias=False)}[cfg.family]
        config = getattr(transformers, config_class)(rope_parameters=rope, **family_fields, **common)
        config.architectures = [model_class]
    else:
        from tapetrain.checkpoint.hf_modeling.configuration_tapetrain import TapetrainConfig

        config = TapetrainConfig(
            pe=cfg.pe,
            family=cfg.family,
            rope_theta=cfg.rope_theta,
            pi_factor=cfg.pi_factor,
            rotary_scaling=cfg.rope_scaling.as_dict() if cfg.rope_scaling is not None else None,
            tape_attn_update=cfg.tape_attn_update,
            tape_mlp_update=cfg.tape_mlp_update,
            tape_channels=cfg.tape_dim,
            tape_head_mix=cfg.tape_head_mix,
            tape_equivariant=cfg.tape_equivariant,
            tape_layers=cfg.tape_layers,
            randpe_max_position=cfg.randpe_max_position,
            randpe_sample_at_eval=cfg.randpe_sample_at_eval,
            randpe_per_layer=cfg.randpe_per_layer,
            xpos_scale_base=cfg.xpos_scale_base,
            fire_hidden=cfg.fire_hidden,
            fire_shared=cfg.fire_shared,
            fire_init_c=cfg.fire_init_c,
            fire_init_threshold=cfg.fire_init_threshold,
            abacus=cfg.abacus,
            abacus_digit_ids=list(cfg.abacus_digit_ids),
            abacus_max_places=cfg.abacus_max_places,
            abacus_train_offset=cfg.abacus_train_offset,
            **common,
        )
        config.auto_map = dict(AUTO_MAP)
        config.architectures = ["TapetrainForCausalLM"]
    config.dtype = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16"}[dtype]
    return config


def export_state_dict(model: Transformer, dtype: str) -> dict[str, torch.Tensor]:
    """HF-named, cast, contiguous tensors; a tied LM head is stored once (as the embedding). fp32 tensors are the
    parameters themselves (no copy: a 7B model would need another 28 GB)."""
    state = model.state_dict()
    if model.cfg.tie_embeddings:
        state.pop("lm_head.weight", None)
    return {k: v.detach().to(DTYPES[dtype]).contiguous() for k, v in to_hf_state_dict(state).items()}


def write_safetensors(state: dict[str, torch.Tensor], out_dir: Path, max_shard_size: int | str) -> list[str]:
    """model.safetensors, or model-0000i-of-0000n.safetensors + model.safetensors.index.json when over the limit."""
    from safetensors.torch import save_file

    limit = parse_size(max_shard_size)
    shards: list[dict[str, torch.Tensor]] = [{}]
    size = 0
    for name, tensor in state.items():
        nbytes = tensor.numel() * tensor.element_size()
        if shards[-1] and size + nbytes > limit:
            shards.append({})
            size = 0
        shards[-1][name] = tensor
        size += nbytes
    if len(shards) == 1:
        save_file(shards[0], str(out_dir / "model.safetensors"), metadata={"format": "pt"})
        use_umask_mode(out_dir / "model.safetensors")  # safetensors writes 0600
        return ["model.safetensors"]
    names = [f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors" for i in range(len(shards))]
    weight_map = {}
    for name, shard in zip(names, shards, strict=True):
        save_file(shard, str(out_dir / name), metadata={"format": "pt"})
        use_umask_mode(out_dir / name)
        weight_map.update(dict.fromkeys(shard, name))
    total = sum(t.numel() * t.element_size() for t in state.values())
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (out_dir / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")
    return [*names, "model.safetensors.index.json"]


def verify_export(out_dir: Path, model: Transformer, dtype: str) -> dict:
    """Reload `out_dir` with transformers and compare its logits with tapetrain's on a fixed batch (fp32 compute).

    For bf16/fp16 exports the reference is tapetrain with its weights rounded to that dtype, so the comparison
    checks the export itself at fp32 tolerance instead of a rounding-sized one.
    """
    from transformers import AutoModelForCausalLM

    cfg = model.cfg
    gen = torch.Generator().manual_seed(1234)
    ids = torch.randint(0, cfg.vocab_size, (2, min(64, cfg.max_seq_len)), generator=gen)
    reference = model
    if dtype != "fp32":
        reference = copy.deepcopy(model)
        with torch.no_grad():
            for p in reference.parameters():
                p.copy_(p.to(DTYPES[dtype]).float())
    was_training = reference.training
    with torch.no_grad():  # the same seed before both forwards: randpe draws the same positions in both
        torch.manual_seed(1234)
        expected = reference.eval()(ids).logits.float()
    reference.train(was_training)
    del reference
    loaded = AutoModelForCausalLM.from_pretrained(
        str(out_dir), trust_remote_code=uses_remote_code(cfg), dtype=torch.float32
    ).eval()
    with torch.no_grad():
        torch.manual_seed(1234)
        actual = loaded(input_ids=ids, use_cache=False).logits.float()
    kind = type(loaded).__name__
    del loaded
    diff = float((actual - expected).abs().max())
    tolerance = VERIFY_TOLERANCE * max(1.0, float(expected.abs().max()))
    return {
        "passed": diff <= tolerance,
        "max_abs_diff": diff,
        "tolerance": tolerance,
        "batch": list(ids.shape),
        "loaded_class": kind,
        "reference": "tapetrain fp32" if dtype == "fp32" else f"tapetrain with weights rounded to {dtype}",
    }


def export_model(
    model: Transformer,
    out_dir: str,
    *,
    dtype: str = "fp32",
    verify: bool = True,
    tokenizer: str | None = None,
    max_shard_size: int | str = DEFAULT_MAX_SHARD_SIZE,
    overwrite: bool = False,
    provenance: dict | None = None,
) -> dict:
    """Write `model` as a Hugging Face checkpoint directory (atomically: OUT.tmp, verified, renamed)."""
    if dtype not in DTYPES:
        raise InputError(f"dtype {dtype!r} is not one of {', '.join(DTYPES)}")
    out = Path(out_dir)
    if out.exists() and not overwrite:
        raise InputError(f"{out} already exists; choose another --out or pass --overwrite")
    if out.exists() and not _replaceable_export(out):
        raise InputError(f"{out} is not a tapetrain export (no tapetrain_export.json) and is not empty; "
                         "--overwrite only replaces an earlier export. Choose another --out, or empty it yourself")
    tmp = out.with_name(out.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)  # left over from an interrupted export
    tmp.mkdir(parents=True)
    cfg = model.cfg
    try:
        bos_id, eos_id = special_token_ids(tokenizer)
        config = hf_config(cfg, dtype, bos_id, eos_id)
        config.to_json_file(str(tmp / "config.json"), use_diff=False)
        from transformers import GenerationConfig

        GenerationConfig(bos_token_id=bos_id, eos_token_id=eos_id).save_pretrained(str(tmp))
        if uses_remote_code(cfg):
            for name in MODELING_FILES:
                shutil.copyfile(os.path.join(HERE, name), tmp / name)
        files = write_safetensors(export_state_dict(model, dtype), tmp, max_shard_size)
        token_info = write_tokenizer(tokenizer, tmp, cfg.max_seq_len)
        result = {
            "out_dir": str(out),
            "pe": cfg.pe,
            "architecture": config.architectures[0],
            "remote_code": uses_remote_code(cfg),
            "dtype": dtype,
            "weight_files": files,
            "tokenizer": token_info,
            "verification": None,
            **(provenance or {}),
        }
        if verify:
            check = verify_export(tmp, model, dtype)
            result["verification"] = check
            if not check["passed"]:
                raise RuntimeError(
                    f"EXPORT VERIFICATION FAILED: transformers' {check['loaded_class']} differs from tapetrain by "
                    f"max |Δlogits| = {check['max_abs_diff']:.3g} > {check['tolerance']:.3g}; nothing was written "
                    f"to {out}. This is a bug in the exporter or the remote code (hf_modeling/): please report it "
                    "with the run's model_config.json"
                )
            log.info("export verified: max |Δlogits| = %.3g (tolerance %.3g)", check["max_abs_diff"],
                     check["tolerance"])
        (tmp / "tapetrain_export.json").write_text(json.dumps({"model_config": cfg.to_dict(), **result}, indent=2))
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    atomic_io.publish_dir(tmp, out, out.with_name(out.name + ".old"))
    return result


def _replaceable_export(path: Path) -> bool:
    """--overwrite may replace an earlier tapetrain export or an empty directory, never anything else."""
    return path.is_dir() and ((path / "tapetrain_export.json").is_file() or not any(path.iterdir()))


def export_hf(
    run_dir: str,
    out_dir: str,
    step: int | None = None,
    dtype: str = "fp32",
    verify: bool = True,
    tokenizer: str | None = None,
    *,
    max_shard_size: int | str = DEFAULT_MAX_SHARD_SIZE,
    overwrite: bool = False,
) -> dict:
    """Export a run's checkpoint (newest complete one, or `step`) to `out_dir`; returns a summary dict.

    `tokenizer` defaults to the run config's data.tokenizer. LoRA weights are merged (run_loader).
    """
    from tapetrain.checkpoint.export_source import run_record
    from tapetrain.checkpoint.run_loader import load_run_model

    model, info = load_run_model(run_dir, step)
    run_dir = Path(info["run_dir"]) if info["run_dir"] else None
    provenance = {"step": info["step"], **run_record(Path(info["checkpoint"]), run_dir, Path(out_dir)),
                  "lora_merged": info["lora_merged"],
                  "model_config": info["model_config"]}  # as trained (load_run_model swaps the attention backend)
    return export_model(
        model,
        out_dir,
        dtype=dtype,
        verify=verify,
        tokenizer=tokenizer or info["tokenizer"],
        max_shard_size=max_shard_size,
        overwrite=overwrite,
        provenance=provenance,
    )
