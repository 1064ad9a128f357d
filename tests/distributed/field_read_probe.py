"""Which run-config fields does tapetrain actually read? Run by test_config_fields_used.py:

    python tests/distributed/field_read_probe.py DATA_DIR TOKENIZER WORK_DIR OUT.json

Every config dataclass (the sections, DataSource, LoraSection, and ModelConfig, which model code reads) gets a
recording __getattribute__. Then real work runs in this process: a full training run that exercises every
optional path (validation data and evaluation, TensorBoard, console lines, data verification, read-ahead workers,
random position offsets, a resume with a new schedule), a diverging run under on_nan=skip, a LoRA run, DeepSpeed
JSON for fp16 and for ZeRO-3 with offloading, and every positional encoding and model switch built, trained for a
step and evaluated. A read counts when it is made by tapetrain code that uses the value. It does not count when
it is made while the config is validated, serialised or copied (tapetrain/config/checks.py, typed.py, yaml_io.py,
to_dict/from_dict/model_config/validate, the dataclass machinery, this probe). A read inside a derived-value
helper of a config class (OptimSection.warmup_for, ModelConfig.head_dim, ...) counts for that helper's caller.
OUT.json gets {"unread": [...], "read": [...]}: dotted keys as the README's reference names them.
"""

from __future__ import annotations

import dataclasses
import json
import os
import sys
from pathlib import Path

import torch
import yaml

PACKAGE = str(Path(__file__).resolve().parents[2] / "tapetrain") + "/"
CONFIG_MODULES = (PACKAGE + "config/", PACKAGE + "model/config.py")
# Where the config classes and their derived-value helpers live (config/deepspeed_config.py is a consumer).
HELPER_FILES = {PACKAGE + "config/sections.py", PACKAGE + "config/run_config.py", PACKAGE + "model/config.py"}
VALIDATION_FILES = {PACKAGE + f"config/{name}.py" for name in ("checks", "typed", "yaml_io", "reference", "fields")}
SERIALIZERS = {"to_dict", "from_dict", "model_config", "validate", "to_plain", "dump_run_config", "save_resolved",
               "resolve", "_expand_preset", "normalize_raw", "from_raw", "build", "convert"}

reads: set[str] = set()


def _counts(frame) -> bool:
    """Walk out from the frame that read the attribute to the code the value is for."""
    while frame is not None:
        file, func = frame.f_code.co_filename, frame.f_code.co_name
        if file == __file__ and func == "getattribute":  # a property read through the recorder itself
            frame = frame.f_back
            continue
        if file in VALIDATION_FILES or (file.startswith(CONFIG_MODULES) and func in SERIALIZERS):
            return False  # validated, serialised or copied: not a use
        if file in HELPER_FILES:
            frame = frame.f_back  # a derived-value helper: the read is for its caller
            continue
        return file.startswith(PACKAGE)
    return False


def instrument() -> list[str]:
    from tapetrain.config import sections
    from tapetrain.model.config import ModelConfig

    owners = {ModelConfig: "model", sections.ModelSection: "model", sections.RunSection: "run",
              sections.DataSection: "data", sections.DataSource: "data.train[i]", sections.TrainSection: "train",
              sections.LoraSection: "train.lora", sections.OptimSection: "optim",
              sections.DeepSpeedSection: "deepspeed", sections.LoggingSection: "logging",
              sections.ProfileSection: "train.profile", sections.WandbSection: "logging.wandb"}
    every = []
    for cls, owner in owners.items():
        names = {f.name for f in dataclasses.fields(cls)}
        every += [f"{owner}.{n}" for n in names]

        def getattribute(self, name, _names=names, _owner=owner):
            if name in _names and _counts(sys._getframe(1)):
                reads.add(f"{_owner}.{name}")
            return object.__getattribute__(self, name)

        cls.__getattribute__ = getattribute
    if not have_wandb():  # an optional extra: its keys can only be exercised where it is installed
        every = [key for key in every if not key.startswith("logging.wandb.")]
    return sorted(set(every))


def have_wandb() -> bool:
    try:
        import wandb  # noqa: F401
    except ImportError:
        return False
    return True


def train_runs(data: str, tokenizer: str, work: Path) -> None:
    from tapetrain.train.run import train_from_args

    base = {
        "run": {"out_dir": str(work / "full"), "seed": 1, "name": "probe"},
        "model": {"preset": "tiny", "pe": "tape", "max_seq_len": 64},
        "data": {"train": [{"path": data, "weight": 1.0}], "val": data, "seq_len": 64, "tokenizer": tokenizer,
                 "num_workers": 1, "verify": True},
        "train": {"steps": 2, "micro_batch_size": 2, "global_batch_size": 4, "save_interval": 1, "log_interval": 1,
                  "eval_interval": 1, "eval_steps": 1, "keep_last": 1, "random_position_offset": 8,
                  "profile": {"start_step": 2, "steps": 1}},
        "optim": {"lr": 1e-3, "warmup_ratio": 0.5},
        "deepspeed": {"zero_stage": 2, "precision": "fp32"},
        "logging": {"tensorboard": True, "console_interval": 1, "peak_tflops": 1.0},
    }
    if have_wandb():
        os.environ.update(WANDB_MODE="offline", WANDB_SILENT="true")
        base["logging"]["wandb"] = {"project": "probe", "entity": None, "name": "probe", "tags": ["t"],
                                    "mode": "offline"}
    diverging = {**base, "run": {"out_dir": str(work / "nan")}, "data": {**base["data"], "verify": False}}
    nan = ["optim.lr=1e30", "optim.warmup_ratio=null", "train.grad_clip=0.0", "train.on_nan=skip",
           "train.max_nan_skips=1", "train.steps=4"]
    assert train_from_args(str(_write(work / "nan.yaml", diverging)), nan) == 1  # stops: too many skipped steps
    for name, cfg, overrides in [
        ("full", base, []),
        ("full", base, ["train.steps=3", "optim.schedule=polynomial", "optim.power=2.0"]),  # a resume
        ("lora", {**base, "run": {"out_dir": str(work / "lora")}}, ["train.trainable=lora+embed+norm",
                                                                    "train.lora={r: 4, alpha: 8}", "train.steps=2",
                                                                    "optim.schedule=wsd", "optim.decay_ratio=0.5",
                                                                    "model.pe=rope"]),
    ]:
        assert train_from_args(str(_write(work / f"{name}.yaml", cfg)), overrides) == 0, (name, overrides)


def _write(path: Path, cfg: dict) -> Path:
    path.write_text(yaml.safe_dump(cfg))
    return path


def deepspeed_variants(data: str) -> None:
    """The DeepSpeed keys that only mean something for fp16, ZeRO-3 or offloading, turned into DeepSpeed's JSON."""
    from tapetrain.config import RunConfig, build_deepspeed_config

    for ds in ({"precision": "fp16", "loss_scale": 128.0, "initial_scale_power": 12},
               {"zero_stage": 3, "offload_optimizer": True, "offload_params": True, "pin_memory": False}):
        cfg = RunConfig.from_dict({"model": {"preset": "tiny"}, "data": {"train": data}, "deepspeed": ds})
        build_deepspeed_config(cfg.resolve(2), 2)


def model_variants() -> None:
    from tapetrain.model import ModelConfig, Transformer

    tiny = dict(vocab_size=64, d_model=32, n_layers=2, n_heads=4, n_kv_heads=2, max_seq_len=32)
    variants = [dict(pe="tape", tape_head_mix="gain", tape_channels=8, activation_checkpointing=True, tiled_mlp=2),
                dict(pe="tape", tape_attn_update=False, tape_mlp_update=False, tie_embeddings=True),
                dict(pe="rope", s2_attn=True, s2_attn_group_fraction=0.5), dict(pe="nope", causal=False),
                dict(pe="alibi"), dict(pe="randpe", randpe_max_position=64), dict(pe="xpos", xpos_scale_base=64.0),
                dict(pe="fire", fire_hidden=8),
                dict(pe="rope", abacus=True, abacus_digit_ids=list(range(4, 14)), abacus_max_places=64,
                     abacus_train_offset=8),
                dict(pe="tape", family="qwen3", head_size=16,
                     rope_scaling={"rope_type": "yarn", "factor": 2.0, "original_max_position_embeddings": 16}),
                dict(pe="rope", family="qwen2", rope_scaling={"rope_type": "dynamic", "factor": 2.0,
                                                              "original_max_position_embeddings": 8})]
    for extra in variants:
        model = Transformer(ModelConfig(**{**tiny, **extra}).validate()).train()
        ids = torch.randint(0, 64, (2, 16))
        model(ids, labels=ids).loss.backward()
        with torch.no_grad():  # evaluation-only switches (randpe_sample_at_eval) are read in eval mode
            model.eval()(ids)


def main() -> None:
    data, tokenizer, work, out = sys.argv[1], sys.argv[2], Path(sys.argv[3]), Path(sys.argv[4])
    every = instrument()
    train_runs(data, tokenizer, work)
    deepspeed_variants(data)
    model_variants()
    out.write_text(json.dumps({"unread": sorted(set(every) - reads), "read": sorted(reads)}, indent=2))


if __name__ == "__main__":
    main()
