"""Load a trained Transformer from a run directory (or one checkpoint in it): any ZeRO stage, LoRA merged.

Layout (written by the trainer): RUN_DIR/config.yaml, RUN_DIR/checkpoints/step_XXXXXXXX/ = one DeepSpeed tag
(mp_rank_00_model_states.pt, *_optim_states.pt for ZeRO) + model_config.json + trainer_state.json (written last:
a checkpoint without it is incomplete and never loaded).
"""

from __future__ import annotations

import contextlib
import io
import json
import logging
import re
from dataclasses import fields
from pathlib import Path

import torch
import yaml

from tapetrain.checkpoint import manifest
from tapetrain.checkpoint.store import CHECKPOINTS, STATE_FILE, complete_checkpoints
from tapetrain.errors import InputError, MissingInputError
from tapetrain.model import ModelConfig, Transformer

log = logging.getLogger("tapetrain.checkpoint")

WRAPPER_PREFIXES = ("module.", "model.", "_orig_mod.", "base_model.")  # engine / peft / torch.compile wrappers
_STEP_DIR = re.compile(r"^step_\d{8}")  # a checkpoint tag directory (complete or not)
_LORA_A = re.compile(r"^(?P<module>.+)\.lora_A(?:\.(?P<adapter>[^.]+))?(?:\.weight)?$")


def resolve_checkpoint(run_dir_or_ckpt: str, step: int | None = None, *, verify: bool = True,
                       ) -> tuple[Path, Path | None]:
    """(checkpoint directory, run directory or None) for a run directory (+ optional step) or a checkpoint dir,
    verified against its manifest (sizes, then checksums: ~0.25 s/GiB) before anything reads it; `verify=False`
    only locates it (for callers that name it and load it later)."""
    ckpt, run_dir = _locate_checkpoint(run_dir_or_ckpt, step)
    if not verify:
        return ckpt, run_dir
    defect = manifest.find_defect(ckpt)
    if defect is not None and defect.kind == "damaged":
        intact = [] if run_dir is None else [s for s, c in complete_checkpoints(run_dir) if c != ckpt]
        others = f"; other complete checkpoints: --step {', '.join(map(str, intact))}" if intact else ""
        raise InputError(f"checkpoint {ckpt} is damaged: {defect.detail}. Nothing was read from it{others} "
                         f"(tapetrain data verify {run_dir or ckpt} checks them all)")
    return ckpt, run_dir


def _locate_checkpoint(run_dir_or_ckpt: str, step: int | None) -> tuple[Path, Path | None]:
    path = Path(run_dir_or_ckpt)
    if not path.exists():
        raise MissingInputError(f"{path} does not exist; pass a run directory (with {CHECKPOINTS}/) or a checkpoint "
                                "directory (with trainer_state.json)")
    if (path / STATE_FILE).is_file() or _STEP_DIR.match(path.name) or any(path.glob("*model_states.pt")):
        if not (path / STATE_FILE).is_file():
            raise MissingInputError(f"{path} has no {STATE_FILE}: the checkpoint is incomplete (the save was "
                                    "interrupted); pass the run directory to use its newest complete checkpoint")
        state = json.loads((path / STATE_FILE).read_text())
        if step is not None and state.get("step") != step:
            raise InputError(f"{path} is the checkpoint of step {state.get('step')}, not {step}; pass the run "
                             "directory with --step, or drop --step")
        run_dir = path.parent.parent if path.parent.name == CHECKPOINTS else None
        return path, run_dir
    checkpoints = complete_checkpoints(path)
    if not checkpoints:
        raise MissingInputError(f"no complete checkpoint in {path / CHECKPOINTS} (a checkpoint is complete once its "
                                f"{STATE_FILE} exists); train longer or pass a checkpoint directory")
    if step is None:
        return checkpoints[-1][1], path
    for found, ckpt in checkpoints:
        if found == step:
            return ckpt, path
    available = ", ".join(str(s) for s, _ in checkpoints)
    raise MissingInputError(f"no complete checkpoint for step {step} in {path / CHECKPOINTS}; available steps: "
                            f"{available}")


def read_deepspeed_weights(ckpt: Path) -> tuple[dict[str, torch.Tensor], str]:
    """fp32 weights of one DeepSpeed tag directory and how they were read ('zero' or 'module').

    ZeRO 1/2/3 (and bf16) checkpoints keep the fp32 master weights partitioned in *_optim_states.pt:
    zero_to_fp32 reassembles them. Without ZeRO the full weights are mp_rank_00_model_states.pt's "module".
    """
    if any(ckpt.glob("*zero_pp_rank_*_optim_states.pt")):
        from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

        chatter = io.StringIO()  # zero_to_fp32 prints progress; keep it out of the tools' output
        with contextlib.redirect_stdout(chatter):
            state = get_fp32_state_dict_from_zero_checkpoint(str(ckpt.parent), tag=ckpt.name)
        log.debug("zero_to_fp32: %s", chatter.getvalue().strip())
        return dict(state), "zero"
    model_file = ckpt / "mp_rank_00_model_states.pt"
    if not model_file.is_file():
        found = ", ".join(sorted(p.name for p in ckpt.iterdir())) or "nothing"
        raise MissingInputError(f"{ckpt} holds no DeepSpeed model states (found: {found}); expected "
                                "mp_rank_00_model_states.pt or ZeRO *_optim_states.pt files")
    payload = torch.load(model_file, map_location="cpu", weights_only=False)
    return {k: v.float() if v.is_floating_point() else v for k, v in payload["module"].items()}, "module"


def strip_wrapper_prefixes(state: dict, expected: set[str]) -> dict:
    """Remove leading wrapper prefixes (module., model., ...) shared by every key until the names look like ours."""
    while state and not (set(state) & expected):
        for prefix in WRAPPER_PREFIXES:
            if all(k.startswith(prefix) for k in state):
                state = {k[len(prefix):]: v for k, v in state.items()}
                break
        else:
            break
    return state


def merge_lora(state: dict, alpha: float | None = None, r: int | None = None) -> tuple[dict, int]:
    """Merge peft-style LoRA pairs into their base weights: W += (alpha / r) · B · A.

    Keys: `<module>.lora_A[.<adapter>].weight` (r, in), `<module>.lora_B[...]` (out, r), base weight
    `<module>.base_layer.weight` or `<module>.weight`. Returns (state without LoRA keys, number merged).
    """
    pairs = {k: m for k in state if (m := _LORA_A.match(k))}
    if not pairs:
        return state, 0
    unsupported = [k for k in state if "lora_embedding" in k or "lora_magnitude" in k]
    if unsupported:
        raise InputError(f"cannot merge {', '.join(unsupported[:3])}: only LoRA on linear layers is supported "
                         "(no embedding LoRA, no DoRA)")
    if alpha is None:
        raise InputError("the checkpoint holds LoRA weights (lora_A/lora_B) but the run config has no "
                         "train.lora.alpha; add `train: {lora: {r: R, alpha: ALPHA}}` to the run's config.yaml")
    out = dict(state)
    for key_a, match in pairs.items():
        key_b = key_a.replace(".lora_A", ".lora_B", 1)
        if key_b not in out:
            raise InputError(f"LoRA weight {key_a} has no matching {key_b}; the checkpoint is damaged")
        a, b = out.pop(key_a).float(), out.pop(key_b).float()  # (r, in), (out, r)
        rank = a.shape[0]
        if r is not None and r != rank:
            raise InputError(f"train.lora.r={r} but {key_a} has rank {rank}; fix train.lora.r in config.yaml")
        module = match.group("module")
        base = f"{module}.base_layer.weight" if f"{module}.base_layer.weight" in out else f"{module}.weight"
        if base not in out:
            raise InputError(f"LoRA weight {key_a} has no base weight {module}.weight or {module}.base_layer.weight")
        out[base] = out[base].float() + (alpha / rank) * (b @ a)
    out = {k.replace(".base_layer.", "."): v for k, v in out.items()}
    return out, len(pairs)


def _read_run_config(run_dir: Path | None, ckpt: Path | None = None) -> dict | None:
    """The config that produced `ckpt` (its own config.yaml, written with it), else the run's latest config.yaml."""
    for path in ([ckpt / "config.yaml"] if ckpt is not None else []) + ([run_dir / "config.yaml"] if run_dir else []):
        if path.is_file():
            with open(path) as f:
                return yaml.safe_load(f) or {}
    return None


def _model_config(ckpt: Path, run_config: dict | None) -> ModelConfig:
    if (ckpt / "model_config.json").is_file():
        values = json.loads((ckpt / "model_config.json").read_text())
    elif run_config and isinstance(run_config.get("model"), dict):
        values = run_config["model"]
    else:
        raise MissingInputError(f"{ckpt} has no model_config.json and no run config.yaml with a model: section was "
                                "found; copy the run's config.yaml next to its checkpoints/ directory")
    known = {f.name for f in fields(ModelConfig)}
    return ModelConfig.from_dict({k: v for k, v in values.items() if k in known})


def _tokenizer_path(run_config: dict | None, run_dir: Path | None) -> str | None:
    path = ((run_config or {}).get("data") or {}).get("tokenizer")
    if not path:
        return None
    # As written; relative to the run directory; the run's own copy (tokenizer/) after the run directory moved.
    candidates = [Path(path), (run_dir or Path(".")) / path]
    if run_dir is not None:
        candidates.append(run_dir / "tokenizer" / Path(path).name)
    for candidate in candidates:
        if candidate.is_file():
            return str(candidate.resolve())
    return path  # configured but not found here: callers report it


def load_run_model(
    run_dir_or_ckpt: str, step: int | None = None, *, attn_backend: str | None = "auto", compile: bool | None = None
) -> tuple[Transformer, dict]:
    """(Transformer in eval mode, info) for the newest complete checkpoint of a run (or `step`, or the
    checkpoint directory given). `attn_backend` replaces the trained one ("flash"/"triton" may not exist here;
    None keeps it), `compile` the trained model.compile (None keeps it). info: run_dir, checkpoint, step,
    trainer_state, model_config, run_config, tokenizer, source, lora_merged."""
    cfg, state, info = read_run_state(run_dir_or_ckpt, step)
    if attn_backend is not None:
        cfg.attn_backend = attn_backend
    if compile is not None:
        cfg.compile = compile
    cfg.activation_checkpointing = False
    if cfg.tape_fused_updates is True:
        cfg.tape_fused_updates = "auto"  # the Triton kernels may not run here; auto takes them where verified
    if cfg.loss_backend == "liger":
        cfg.loss_backend = "auto"  # liger-kernel (CUDA only) may not be installed here; auto picks it where it is
    model = Transformer(cfg)
    model.load_state_dict(state, strict=False)
    log.info("loaded %s (step %s, %s weights%s)", info["checkpoint"], info["step"], info["source"],
             f", {info['lora_merged']} LoRA pairs merged" if info["lora_merged"] else "")
    return model.eval(), info


def read_run_model_config(run_dir_or_ckpt: str, step: int | None = None) -> ModelConfig:
    """The trained ModelConfig of a run's newest complete checkpoint (or `step`), without reading weights."""
    ckpt, run_dir = resolve_checkpoint(run_dir_or_ckpt, step, verify=False)
    return _model_config(ckpt, _read_run_config(run_dir, ckpt))


def run_tokenizer(run_dir_or_ckpt: str, step: int | None = None) -> str | None:
    """The tokenizer file a run was trained with (its config's data.tokenizer), without reading weights."""
    ckpt, run_dir = resolve_checkpoint(run_dir_or_ckpt, step, verify=False)
    return _tokenizer_path(_read_run_config(run_dir, ckpt), run_dir)


def read_run_state(run_dir_or_ckpt: str, step: int | None = None) -> tuple[ModelConfig, dict, dict]:
    """(trained ModelConfig, fp32 state dict with tapetrain names and LoRA merged, info) of a run's newest complete
    checkpoint (or `step`, or the checkpoint directory given), without building the model."""
    ckpt, run_dir = resolve_checkpoint(run_dir_or_ckpt, step)
    run_config = _read_run_config(run_dir, ckpt)
    cfg = _model_config(ckpt, run_config)
    with torch.device("meta"):
        expected = set(Transformer(cfg).state_dict())
    state, source = read_deepspeed_weights(ckpt)
    state = strip_wrapper_prefixes(state, expected)
    lora = ((run_config or {}).get("train") or {}).get("lora") or {}
    state, merged = merge_lora(state, lora.get("alpha"), lora.get("r"))
    state = strip_wrapper_prefixes(state, expected)
    missing = sorted(expected - set(state) - ({"lm_head.weight"} if cfg.tie_embeddings else set()))
    unexpected = sorted(set(state) - expected)
    if missing or unexpected:
        raise InputError(f"checkpoint {ckpt} does not match its model config ({cfg.pe}, {cfg.n_layers} layers): "
                         f"missing {missing or 'none'}, unexpected {unexpected or 'none'}; the checkpoint and "
                         "model_config.json come from different runs or code versions")
    trainer_state = json.loads((ckpt / STATE_FILE).read_text())
    info = {
        "run_dir": str(run_dir) if run_dir is not None else None,
        "checkpoint": str(ckpt),
        "step": trainer_state.get("step"),
        "trainer_state": trainer_state,
        "model_config": cfg.to_dict(),
        "run_config": run_config,
        "tokenizer": _tokenizer_path(run_config, run_dir),
        "source": source,
        "lora_merged": merged,
    }
    return cfg, state, info


def is_run_or_checkpoint(path: str) -> bool:
    """Whether `path` looks like a run directory or a checkpoint directory (vs a Hugging Face export)."""
    p = Path(path)
    return (p / CHECKPOINTS).is_dir() or (p / STATE_FILE).is_file() or (p / "mp_rank_00_model_states.pt").is_file()


