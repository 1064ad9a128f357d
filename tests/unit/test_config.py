"""Run config: shipped YAMLs, strict keys/types, overrides, cross-field checks, round trip, DeepSpeed JSON."""

from __future__ import annotations

import dataclasses
import glob
import os
import textwrap
import types
from pathlib import Path

import pytest

from tapetrain.config import (
    RunConfig,
    build_deepspeed_config,
    load_run_config,
    save_resolved,
)
from tapetrain.config.reference import render_reference
from tapetrain.errors import ConfigError

REPO = Path(__file__).resolve().parents[2]
SHIPPED = sorted(glob.glob(str(REPO / "configs" / "*.yaml")))
CONTRACT_KEYS = [
    "run.out_dir",
    "run.seed",
    "model.pe",
    "model.init_from",
    "data.train",
    "data.seq_len",
    "train.steps",
    "train.micro_batch_size",
    "train.global_batch_size",
    "train.save_interval",
    "train.log_interval",
    "optim.lr",
    "deepspeed.zero_stage",
    "deepspeed.precision",
]
MINIMAL = """\
model:
  preset: tiny
data:
  train: shards
train:
  steps: 100
  micro_batch_size: 2
  global_batch_size: 8
deepspeed:
  precision: fp32
"""


def write(tmp_path: Path, text: str, name: str = "run.yaml") -> str:
    path = tmp_path / name
    path.write_text(textwrap.dedent(text))
    return str(path)


def load(tmp_path: Path, *overrides: str, text: str = MINIMAL) -> RunConfig:
    return load_run_config(write(tmp_path, text), list(overrides))


def error_of(tmp_path: Path, *overrides: str, text: str = MINIMAL) -> str:
    with pytest.raises(ConfigError) as info:
        load(tmp_path, *overrides, text=text)
    return str(info.value)


def deepspeed_parse(ds: dict, world_size: int, monkeypatch: pytest.MonkeyPatch):
    """DeepSpeed's own config parser, told the world size (it asks torch.distributed, absent here)."""
    import deepspeed.runtime.config as ds_config

    fake_dist = types.SimpleNamespace(get_rank=lambda *a, **k: 0, get_world_size=lambda *a, **k: world_size)
    monkeypatch.setattr(ds_config, "dist", fake_dist)
    return ds_config.DeepSpeedConfig(ds)


# ---- shipped configs ---------------------------------------------------------------------------------------


def test_configs_are_shipped():
    names = {os.path.basename(p) for p in SHIPPED}
    expected = {"tiny-cpu.yaml", "tiny-cpu-zero3.yaml", "paper-155m-tape.yaml"}
    expected.add("paper-155m-tape-zero3-offload.yaml")
    expected |= {f"paper-155m-{pe}.yaml" for pe in ("rope", "nope", "alibi", "randpe", "xpos", "fire")}
    assert expected <= names


@pytest.mark.parametrize("path", SHIPPED, ids=os.path.basename)
def test_shipped_config_loads_resolves_and_deepspeed_accepts_it(path, monkeypatch):
    cfg = load_run_config(path)
    world, device = (1, "cpu") if "cpu" in path else (8, "cuda")
    resolved = cfg.resolve(world, device)
    ds = build_deepspeed_config(resolved, world)
    parsed = deepspeed_parse(ds, world, monkeypatch)
    assert parsed.train_batch_size == resolved.train.global_batch_size
    assert parsed.zero_optimization_stage == cfg.deepspeed.zero_stage


def test_the_tiny_config_takes_a_five_step_smoke_test():
    """Its fixed 5-step warmup refused `train.steps=5`, the first smoke test people try; a warmup ratio scales."""
    cfg = load_run_config(str(REPO / "configs" / "tiny-cpu.yaml"), ["train.steps=5"])
    assert cfg.optim.warmup_for(5) < 5
    assert load_run_config(str(REPO / "configs" / "tiny-cpu.yaml")).optim.warmup_for(50) == 5  # as before


def test_paper_configs_match_the_paper_recipe():
    cfg = load_run_config(str(REPO / "configs" / "paper-155m-tape.yaml"))
    m = cfg.model
    shape = (m.n_layers, m.d_model, m.n_heads, m.vocab_size, m.max_seq_len, m.pe)
    assert shape == (12, 768, 12, 32000, 1024, "tape")
    assert (cfg.data.seq_len, cfg.train.global_batch_size, cfg.train.micro_batch_size) == (1024, 512, 16)
    assert (cfg.train.steps, cfg.optim.lr, cfg.optim.warmup_for(cfg.train.steps)) == (10000, 1e-4, 200)
    assert (cfg.optim.schedule, cfg.optim.power, cfg.optim.weight_decay) == ("polynomial", 1.0, 0.01)
    assert (cfg.deepspeed.zero_stage, cfg.deepspeed.precision) == (2, "bf16")
    assert cfg.data.train[0].path == "data/c4"


@pytest.mark.parametrize("pe", ["rope", "nope", "alibi", "randpe", "xpos", "fire"])
def test_baseline_twins_differ_only_in_pe_and_out_dir(pe):
    tape = load_run_config(str(REPO / "configs" / "paper-155m-tape.yaml")).to_dict()
    twin = load_run_config(str(REPO / "configs" / f"paper-155m-{pe}.yaml")).to_dict()
    assert twin["model"]["pe"] == pe
    assert twin["run"]["out_dir"] == f"runs/paper-155m-{pe}"
    for d in (tape, twin):
        del d["model"]["pe"], d["run"]["out_dir"]
    assert twin == tape


@pytest.mark.parametrize("method", ["yarn", "ntk"])
def test_rope_scaling_baselines_differ_from_lora_only_in_rope_and_out_dir(method):
    """The context-extension table compares like with like: the YaRN / NTK-by-parts runs are the LoRA run (itself
    the TAPE run's data, batch, schedule, steps and evaluation) with another RoPE scaling."""
    lora = load_run_config(str(REPO / "configs" / "llama2-7b-8k-lora.yaml")).to_dict()
    run = load_run_config(str(REPO / "configs" / f"llama2-7b-8k-{method}.yaml")).to_dict()
    scaling = run["model"]["rope_scaling"]
    assert (scaling["rope_type"], scaling["factor"], scaling["original_max_position_embeddings"]) == ("yarn", 2, 4096)
    assert scaling["attention_factor"] == (1.0 if method == "ntk" else None)  # NTK-by-parts: no temperature
    assert (lora["model"]["pi_factor"], run["model"]["pi_factor"]) == (2.0, 1.0)
    assert run["run"]["out_dir"] == f"runs/llama2-7b-8k-{method}"
    for d in (lora, run):
        del d["model"]["pi_factor"], d["model"]["rope_scaling"], d["run"]["out_dir"]
    assert run == lora
    tape = load_run_config(str(REPO / "configs" / "llama2-7b-8k-tape.yaml")).to_dict()
    for section in ("data", "optim"):
        assert run[section] == tape[section]
    assert {k: v for k, v in run["train"].items() if k not in ("trainable", "lora", "random_position_offset")} == {
        k: v for k, v in tape["train"].items() if k not in ("trainable", "lora", "random_position_offset")}


def test_sequence_parallel_recipes_extend_the_ones_they_build_on():
    """The 32K SP recipe is the 8K TAPE recipe at 4× the length (interpolation ×8, SP 8, the same tokens per step);
    the 155M SP recipe is the from-scratch one at 16384 tokens (SP 4, tiled MLP, the same tokens per step)."""
    for name, base, changed in (
        ("llama2-7b-32k-tape-sp", "llama2-7b-8k-tape", {"max_seq_len", "pi_factor"}),
        ("paper-155m-tape-sp", "paper-155m-tape", {"max_seq_len", "activation_checkpointing", "tiled_mlp"}),
    ):
        sp = load_run_config(str(REPO / "configs" / f"{name}.yaml")).resolve(8, "cuda")
        ref = load_run_config(str(REPO / "configs" / f"{base}.yaml")).resolve(8, "cuda")
        assert sp.parallel.sequence_parallel > 1 and sp.data.seq_len > ref.data.seq_len
        assert sp.tokens_per_step(8) == ref.tokens_per_step(8)
        assert sp.optim == ref.optim and sp.deepspeed == ref.deepspeed
        assert dataclasses.replace(sp.data, seq_len=ref.data.seq_len) == ref.data
        a, b = dataclasses.asdict(sp.model), dataclasses.asdict(ref.model)
        differ = {k for k in a if a[k] != b[k]}
        assert differ == changed - ({"tiled_mlp"} if a["tiled_mlp"] == b["tiled_mlp"] else set()), differ


def test_offload_variant_and_tiny_zero3():
    off = load_run_config(str(REPO / "configs" / "paper-155m-tape-zero3-offload.yaml")).deepspeed
    assert (off.zero_stage, off.offload_optimizer, off.offload_params) == (3, True, True)
    tiny3 = load_run_config(str(REPO / "configs" / "tiny-cpu-zero3.yaml"))
    assert (tiny3.deepspeed.zero_stage, tiny3.deepspeed.precision, tiny3.model.pe) == (3, "fp32", "tape")


def test_contract_keys_exist_and_are_documented():
    cfg = RunConfig()
    reference = render_reference()
    for key in CONTRACT_KEYS:
        section, name = key.split(".")
        assert hasattr(getattr(cfg, section), name), key
        assert f"| `{key}` |" in reference, key


def test_every_field_has_help_in_the_reference():
    reference = render_reference()
    for section in dataclasses.fields(RunConfig):
        for f in dataclasses.fields(getattr(RunConfig(), section.name)):
            assert f.metadata.get("help"), f"{section.name}.{f.name} has no help text"
            assert f"| `{section.name}.{f.name}` |" in reference
    assert "base:" in reference


# ---- unknown keys, bad YAML, bad types ---------------------------------------------------------------------


def test_unknown_top_level_key_names_it_and_suggests(tmp_path):
    msg = error_of(tmp_path, text=MINIMAL + "trian:\n  steps: 3\n")
    assert "'trian'" in msg and "did you mean 'train'" in msg and "run.yaml:11" in msg


def test_unknown_nested_key_names_dotted_key_and_suggests(tmp_path):
    msg = error_of(tmp_path, text=MINIMAL.replace("  steps: 100", "  stpes: 100"))
    assert "'train.stpes'" in msg and "did you mean 'train.steps'" in msg and "run.yaml:6" in msg


def test_unknown_model_key_suggests(tmp_path):
    msg = error_of(tmp_path, text=MINIMAL.replace("  preset: tiny", "  preset: tiny\n  d_modle: 64"))
    assert "'model.d_modle'" in msg and "did you mean 'model.d_model'" in msg


def test_key_in_the_wrong_section_points_to_its_section(tmp_path):
    msg = error_of(tmp_path, text=MINIMAL.replace("  steps: 100", "  steps: 100\n  lr: 0.001"))
    assert "'train.lr'" in msg and "optim.lr" in msg
    msg = error_of(tmp_path, text="steps: 3\n" + MINIMAL)
    assert "'steps'" in msg and "train.steps" in msg


def test_unknown_override_key_names_the_override(tmp_path):
    msg = error_of(tmp_path, "train.stpes=3")
    assert "'train.stpes'" in msg and "did you mean 'train.steps'" in msg
    assert "override 'train.stpes=3'" in msg


def test_malformed_yaml_names_file_and_line(tmp_path):
    text = "run:\n  out_dir: x\ntrain:\n  steps: [1, 2\n  micro_batch_size: 2\n"
    msg = error_of(tmp_path, text=text)
    assert "run.yaml:" in msg and "malformed YAML" in msg
    assert "starts at line 4" in msg  # the unclosed '[' (the parser notices on line 5)
    msg = error_of(tmp_path, text="run:\n  out_dir: x\n seed: 3\n")
    assert "run.yaml:3" in msg


def test_duplicate_key_is_an_error(tmp_path):
    msg = error_of(tmp_path, text=MINIMAL + "train:\n  steps: 5\n")
    assert "duplicate key 'train'" in msg and "run.yaml:11" in msg


def test_missing_file_is_a_clear_error(tmp_path):
    with pytest.raises(ConfigError, match="config file not found: .*nope.yaml"):
        load_run_config(str(tmp_path / "nope.yaml"))


@pytest.mark.parametrize(
    "override, expected",
    [
        ("train.steps=ten", "train.steps: expected int, got 'ten' (str)"),
        ("train.micro_batch_size=2.5", "train.micro_batch_size: expected int, got 2.5"),
        ("train.global_batch_size=abc", "train.global_batch_size: expected int or null, got 'abc' (str)"),
        ("optim.lr=fast", "optim.lr: expected float, got 'fast'"),
        ("model.tie_embeddings=1", "model.tie_embeddings: expected bool, got 1 (int)"),
        ("optim.betas=[0.9]", "optim.betas: expected list of 2"),
        ("optim.schedule=cosin", "did you mean 'cosine'"),
        ("deepspeed.precision=bf32", "deepspeed.precision: expected one of fp32, bf16, fp16"),
        ("train=5", "train: expected a mapping"),
        ("data.train=[{path: a, weight: heavy}]", "data.train[0].weight: expected float"),
        ("deepspeed.extra=[1]", "deepspeed.extra: expected mapping"),
    ],
)
def test_wrong_types_name_key_expected_type_and_value(tmp_path, override, expected):
    msg = error_of(tmp_path, override)
    assert expected in msg
    assert "override" in msg or override.startswith("train=")


def test_type_error_in_file_names_the_line(tmp_path):
    msg = error_of(tmp_path, text=MINIMAL.replace("steps: 100", "steps: many"))
    assert "train.steps: expected int" in msg and "run.yaml:6" in msg


# ---- values and overrides ----------------------------------------------------------------------------------


def test_overrides_parse_yaml_values(tmp_path):
    cfg = load(
        tmp_path,
        "train.steps=20",
        "optim.lr=1e-4",
        "data.train=[a, {path: b, weight: 3}]",
        "deepspeed.extra.comms_logger={enabled: true}",
        "run.name=demo",
    )
    assert cfg.train.steps == 20 and cfg.optim.lr == 1e-4 and cfg.run.name == "demo"
    assert [(s.path, s.weight) for s in cfg.data.train] == [("a", 1.0), ("b", 3.0)]
    assert cfg.deepspeed.extra == {"comms_logger": {"enabled": True}}


def test_scientific_notation_without_dot_is_a_float(tmp_path):
    cfg = load(tmp_path, text=MINIMAL + "optim:\n  lr: 3e-4\n  eps: 1e-8\n")
    assert cfg.optim.lr == 3e-4 and cfg.optim.eps == 1e-8
    assert load(tmp_path, "deepspeed.reduce_bucket_size=5e8").deepspeed.reduce_bucket_size == 500_000_000


@pytest.mark.parametrize("bad", ["train.steps", "=3", "train..steps=3"])
def test_malformed_override(tmp_path, bad):
    assert "override" in error_of(tmp_path, bad)


def test_override_below_a_scalar_is_an_error(tmp_path):
    msg = error_of(tmp_path, "train.steps.max=3")
    assert "'train.steps' holds a value" in msg


def test_preset_fills_model_and_keys_override_it(tmp_path):
    cfg = load(tmp_path, "model.d_model=128", "model.pe=rope")
    assert (cfg.model.d_model, cfg.model.n_layers, cfg.model.pe, cfg.model.preset) == (128, 2, "rope", "tiny")
    assert cfg.data.seq_len == cfg.model.max_seq_len == 128  # data.seq_len null -> model.max_seq_len
    plain = cfg.model.model_config()
    assert type(plain).__name__ == "ModelConfig" and plain.d_model == 128
    assert "preset" not in cfg.model.to_dict()
    assert "unknown preset 'huge'" in error_of(tmp_path, "model.preset=huge")


def test_model_without_preset_uses_model_config_fields(tmp_path):
    text = MINIMAL.replace("  preset: tiny", "  vocab_size: 256\n  d_model: 32\n  n_layers: 1\n  n_heads: 2")
    cfg = load(tmp_path, text=text)
    m = cfg.model
    assert (m.vocab_size, m.d_model, m.preset, m.init_from) == (256, 32, None, None)
    assert load(tmp_path, "model.init_from=hf/llama").model.init_from == "hf/llama"


def test_data_shorthands(tmp_path):
    assert [s.path for s in load(tmp_path, "data.train=[a, b]").data.train] == ["a", "b"]
    assert load(tmp_path, "data.val=null").data.val == []
    assert load(tmp_path, "data.val=v").data.val[0].path == "v"


# ---- impossible values -------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "overrides, expected",
    [
        (["train.steps=0"], "train.steps: must be > 0"),
        (["optim.lr=0"], "optim.lr: must be > 0"),
        (["optim.min_lr=1"], "optim.min_lr: 1.0 is above optim.lr"),
        (["optim.warmup_steps=100"], "not shorter than train.steps=100"),
        (["optim.warmup_ratio=1.0"], "optim.warmup_ratio: must be in [0, 1)"),
        (["optim.warmup_steps=5", "optim.warmup_ratio=0.1"], "set one of them to null"),
        (["optim.schedule=wsd", "optim.warmup_steps=90", "optim.decay_ratio=0.2"], "exceed train.steps=100"),
        (["optim.betas=[0.9, 1.0]"], "optim.betas[1]: must be in [0, 1)"),
        (["deepspeed.zero_stage=4"], "deepspeed.zero_stage: must be 0, 1, 2 or 3"),
        (["deepspeed.offload_params=true"], "set deepspeed.zero_stage=3 or deepspeed.offload_params=false"),
        (["deepspeed.zero_stage=0", "deepspeed.offload_optimizer=true"], "deepspeed.offload_optimizer"),
        (["data.seq_len=256"], "raise model.max_seq_len to 256"),
        (["data.seq_len=0"], "data.seq_len: must be > 0"),
        (["data.cache_limit_gb=0"], "data.cache_limit_gb: must be > 0"),
        (["data.train=[]"], "data.train: no training data"),
        (["train.global_batch_size=9"], "use train.global_batch_size=8"),
        (["train.eval_interval=10"], "set data.val or train.eval_interval=0"),
        (["train.trainable=tape", "model.pe=rope"], "set model.pe=tape or train.trainable=all"),
        (["train.log_interval=0"], "train.log_interval: must be > 0"),
        (["model.n_heads=5"], "model.n_heads"),
        (["deepspeed.extra={optimizer: {type: Adam}}"], "deepspeed.extra.optimizer: is derived by tapetrain"),
        (["deepspeed.extra={zero_optimization: {stage: 1}}"], "set deepspeed.zero_stage instead"),
        (["deepspeed.extra={train_batch_size: 4}"], "set train.global_batch_size instead"),
        (["deepspeed.timeout_minutes=0"], "deepspeed.timeout_minutes: must be > 0"),
        (["deepspeed.timeout_minutes=0.1"], "deepspeed.timeout_minutes: must be >= 0.2 (12 s), got 0.1"),
        (["train.profile={start_step: 0}"], "train.profile.start_step: must be > 0"),
        (["train.profile={start_step: 500}"], "profile a step the run reaches, e.g. train.profile.start_step=10"),
        (["logging.wandb={mode: sometimes}"], "logging.wandb.mode"),
    ],
)
def test_impossible_values_name_key_and_fix(tmp_path, overrides, expected):
    assert expected in error_of(tmp_path, *overrides)


def test_resolve_checks_batch_divisibility_with_world_size(tmp_path):
    cfg = load(tmp_path, "train.global_batch_size=512", "train.micro_batch_size=16")
    assert cfg.resolve(8, "cuda").train.global_batch_size == 512
    assert cfg.grad_accum_steps(8) == 4 and cfg.tokens_per_step(8) == 512 * 128
    with pytest.raises(ConfigError) as info:
        cfg.resolve(3, "cuda")
    msg = str(info.value)
    assert "train.global_batch_size=512" in msg and "train.micro_batch_size" in msg
    assert "use train.global_batch_size=528 (or 480)" in msg


def test_resolve_fills_null_global_batch(tmp_path):
    cfg = load(tmp_path, "train.global_batch_size=null")
    assert cfg.train.global_batch_size is None
    assert cfg.resolve(4, "cpu").train.global_batch_size == 8
    with pytest.raises(ConfigError, match="world size must be a positive integer"):
        cfg.resolve(0)


def test_resolve_rejects_half_precision_on_cpu(tmp_path):
    cfg = load(tmp_path, "deepspeed.precision=bf16")
    with pytest.raises(ConfigError, match="precision=bf16 is not supported on CPU.*deepspeed.precision=fp32"):
        cfg.resolve(1, "cpu")
    assert cfg.resolve(1, "cuda").deepspeed.precision == "bf16"


# ---- base includes -----------------------------------------------------------------------------------------


def test_base_include_deep_merges_relative_to_the_file(tmp_path):
    (tmp_path / "sub").mkdir()
    write(tmp_path, MINIMAL + "optim:\n  lr: 0.01\n  weight_decay: 0.0\n", "sub/base.yaml")
    path = write(tmp_path, "base: sub/base.yaml\noptim:\n  lr: 0.02\n", "child.yaml")
    cfg = load_run_config(path)
    assert (cfg.optim.lr, cfg.optim.weight_decay, cfg.model.preset) == (0.02, 0.0, "tiny")


def test_base_list_merges_in_order(tmp_path):
    write(tmp_path, MINIMAL, "a.yaml")
    write(tmp_path, "train:\n  steps: 7\n", "b.yaml")
    cfg = load_run_config(write(tmp_path, "base: [a.yaml, b.yaml]\n", "c.yaml"))
    assert cfg.train.steps == 7 and cfg.train.micro_batch_size == 2


def test_base_cycle_is_an_error(tmp_path):
    write(tmp_path, "base: b.yaml\n" + MINIMAL, "a.yaml")
    write(tmp_path, "base: a.yaml\n", "b.yaml")
    with pytest.raises(ConfigError, match=r"include cycle a.yaml -> b.yaml -> a.yaml"):
        load_run_config(str(tmp_path / "a.yaml"))


def test_missing_base_is_an_error(tmp_path):
    with pytest.raises(ConfigError, match="base file 'gone.yaml' not found"):
        load_run_config(write(tmp_path, "base: gone.yaml\n"))


def test_error_in_base_names_the_base_file_line(tmp_path):
    write(tmp_path, MINIMAL + "optim:\n  lr: -1.0\n", "base.yaml")
    msg = error_of(tmp_path, text="base: base.yaml\nrun:\n  seed: 1\n")
    assert "optim.lr: must be > 0" in msg and "base.yaml:12" in msg


# ---- round trip --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("path", SHIPPED, ids=os.path.basename)
def test_resolved_config_round_trips(path, tmp_path):
    cfg = load_run_config(path, ["data.train=[{path: a, weight: 2}, b]", "deepspeed.extra={x: {y: [1, 2]}}"])
    cfg = cfg.resolve(cfg.parallel.sequence_parallel, "cuda")  # the smallest launch a config can take
    out = tmp_path / "run" / "config.yaml"
    save_resolved(cfg, str(out))
    assert load_run_config(str(out)) == cfg
    save_resolved(dataclasses.replace(cfg, run=dataclasses.replace(cfg.run, seed=5)), str(out))  # replaces
    assert load_run_config(str(out)).run.seed == 5
    assert os.listdir(out.parent) == ["config.yaml"]  # no temp file left behind


# ---- DeepSpeed JSON ----------------------------------------------------------------------------------------


def _deepspeed_key_names() -> set[str]:
    import deepspeed.runtime.constants as constants
    import deepspeed.runtime.precision_config as precision
    import deepspeed.runtime.zero.config as zero

    names = set()
    for module in (constants, precision, zero):
        names |= {v for k, v in vars(module).items() if k.isupper() and isinstance(v, str)}
    return names


@pytest.mark.parametrize(
    "stage, offload_optimizer, offload_params, precision",
    [
        (0, False, False, "fp32"),
        (1, False, False, "bf16"),
        (2, True, False, "fp16"),
        (3, True, True, "bf16"),
        (3, False, False, "fp32"),
    ],
)
def test_deepspeed_config_is_accepted_by_deepspeed(
    tmp_path, monkeypatch, stage, offload_optimizer, offload_params, precision
):
    cfg = load(
        tmp_path,
        f"deepspeed.zero_stage={stage}",
        f"deepspeed.offload_optimizer={str(offload_optimizer).lower()}",
        f"deepspeed.offload_params={str(offload_params).lower()}",
        f"deepspeed.precision={precision}",
        "train.grad_clip=0.5",
    )
    ds = build_deepspeed_config(cfg, world_size=2)
    assert "optimizer" not in ds and "scheduler" not in ds
    assert set(ds) <= _deepspeed_key_names(), set(ds) - _deepspeed_key_names()
    parsed = deepspeed_parse(ds, 2, monkeypatch)  # pydantic models forbid unknown ZeRO/offload/precision keys
    assert (parsed.train_batch_size, parsed.train_micro_batch_size_per_gpu) == (8, 2)
    assert parsed.gradient_accumulation_steps == 2 and parsed.gradient_clipping == 0.5
    assert parsed.zero_optimization_stage == stage
    zero = parsed.zero_config
    assert (zero.offload_optimizer is not None) == offload_optimizer
    assert (zero.offload_param is not None) == offload_params
    if offload_optimizer:
        assert zero.offload_optimizer.device == "cpu" and ds["zero_force_ds_cpu_optimizer"] is False
    assert parsed.bfloat16_config.enabled == (precision == "bf16")
    assert parsed.float16_config.enabled == (precision == "fp16")
    if precision == "fp16":
        assert parsed.float16_config.loss_scale == 0 and parsed.float16_config.initial_scale_power == 16
    assert parsed.steps_per_print >= 10**9 and parsed.wall_clock_breakdown is False


def test_deepspeed_stage3_knobs_and_extra_deep_merge(tmp_path, monkeypatch):
    cfg = load(
        tmp_path,
        "deepspeed.zero_stage=3",
        "deepspeed.stage3_max_live_parameters=1e8",
        "deepspeed.extra={zero_optimization: {sub_group_size: 1e8}, comms_logger: {enabled: false}}",
    )
    ds = build_deepspeed_config(cfg, 1)
    assert ds["zero_optimization"]["stage"] == 3 and ds["zero_optimization"]["sub_group_size"] == 1e8
    assert ds["comms_logger"] == {"enabled": False}
    parsed = deepspeed_parse(ds, 1, monkeypatch)
    assert parsed.zero_config.max_live_parameters == 10**8
    assert parsed.zero_config.sub_group_size == 10**8


def test_deepspeed_grad_accum_error_suggests_a_valid_global_batch(tmp_path):
    cfg = load(tmp_path, "train.global_batch_size=12", "train.micro_batch_size=2")
    with pytest.raises(ConfigError) as info:
        build_deepspeed_config(cfg, 4)
    msg = str(info.value)
    assert "train.global_batch_size=12" in msg and "train.micro_batch_size × world size = 2 × 4 = 8" in msg
    assert "use train.global_batch_size=8 (or 16)" in msg


# ---- task configs: arithmetic (addition length generalisation) and SCROLLS ---------------------------------


def test_arith_paper_config_matches_the_paper_recipe():
    cfg = load_run_config(str(REPO / "configs" / "arith-tape.yaml"))
    m = cfg.model
    assert (m.n_layers, m.d_model, m.n_heads, m.ffn_hidden, m.vocab_size, m.pe) == (16, 1024, 16, 2048, 16, "tape")
    assert (cfg.data.seq_len, cfg.train.global_batch_size, cfg.train.steps, cfg.optim.lr) == (64, 512, 20000, 1e-4)
    assert cfg.data.packing is False  # one example per sequence
    # Abacus as the paper's code: places of a 21-digit sum plus the largest training offset fit the table
    assert (m.abacus, m.abacus_train_offset, m.abacus_digit_ids) == (True, 100, list(range(4, 14)))
    assert m.abacus_max_places >= 21 + m.abacus_train_offset - 1


@pytest.mark.parametrize("pe", ["rope", "nope", "randpe", "fire"])
def test_arith_twins_differ_only_in_pe_and_out_dir(pe):
    """... and in Abacus, which the paper ran with TAPE, RoPE and FIRE but not with RandPE and NoPE."""
    tape = load_run_config(str(REPO / "configs" / "arith-tape.yaml")).to_dict()
    twin = load_run_config(str(REPO / "configs" / f"arith-{pe}.yaml")).to_dict()
    assert twin["model"]["pe"] == pe and twin["run"]["out_dir"] == f"runs/arith-{pe}"
    assert twin["model"]["abacus"] == (pe in ("rope", "fire"))
    for d in (tape, twin):
        del d["model"]["pe"], d["run"]["out_dir"], d["model"]["abacus"]
    assert twin == tape


def test_arith_tiny_config_fits_its_data(tmp_path):
    """The data tools/arith_compare.py --scale tiny writes for this config fits its sequence length."""
    import importlib.util

    from tapetrain.data.arith import write_arith_data
    from tapetrain.data.examples import ExampleStore

    spec = importlib.util.spec_from_file_location("arith_compare", REPO / "tools" / "arith_compare.py")
    compare = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(compare)
    args = compare.SCALES["tiny"]["data"]
    assert compare.SCALES["tiny"]["config"] == "configs/arith-tiny-cpu.yaml"
    max_digits = int(args[args.index("--max-digits") + 1])
    write_arith_data(str(tmp_path / "d"), max_digits=max_digits, eval_max_digits=max_digits, train_examples=500,
                     eval_per_cell=2, progress=False)
    cfg = load_run_config(str(REPO / "configs" / "arith-tiny-cpu.yaml")).resolve(1, "cpu")
    assert cfg.model.vocab_size == 16 and cfg.model.max_seq_len >= cfg.data.seq_len
    assert ExampleStore(str(tmp_path / "d")).max_length <= cfg.data.seq_len  # 3+3 digits: 14 tokens
    assert (cfg.deepspeed.precision, cfg.optim.schedule, cfg.train.steps) == ("fp32", "wsd", 8000)


SCROLLS_TASKS = ["qasper", "contract_nli", "narrative_qa", "quality", "qmsum", "summ_screen_fd", "gov_report"]


@pytest.mark.parametrize("task", SCROLLS_TASKS)
def test_scrolls_configs_follow_the_paper_recipe(task):
    cfg = load_run_config(str(REPO / "configs" / f"scrolls-{task}.yaml"))
    assert (cfg.train.steps, cfg.train.global_batch_size, cfg.optim.lr, cfg.run.seed) == (1000, 64, 1e-5, 2024)
    assert (cfg.optim.schedule, cfg.optim.warmup_for(cfg.train.steps), cfg.data.seq_len) == ("polynomial", 100, 8192)
    assert cfg.model.init_from == "runs/paper-155m-tape" and cfg.data.train[0].path == f"data/scrolls-{task}"
    base = load_run_config(str(REPO / "configs" / "scrolls-qasper.yaml")).to_dict()
    this = cfg.to_dict()
    for d in (base, this):
        del d["data"]["train"], d["run"]["out_dir"]
    assert this == base


@pytest.mark.parametrize(
    "override, key",
    [
        ("train.steps=99999999999999999999999", "train.steps"),
        ("train.micro_batch_size=100000000", "train.micro_batch_size"),
        ("train.global_batch_size=1000000000000", "train.global_batch_size"),
        ("optim.warmup_steps=99999999999999999999999", "optim.warmup_steps"),
        ("train.save_interval=99999999999999999999999", "train.save_interval"),
        ("train.eval_steps=99999999999999999999999", "train.eval_steps"),
        ("data.seq_len=100000000", "data.seq_len"),
    ],
)
def test_values_no_run_can_reach_are_refused_with_the_bound(tmp_path, override, key):
    message = error_of(tmp_path, override)
    assert message.startswith(f"{key}: must be <= "), message


def test_a_seed_override_gives_each_seed_its_own_run_directory(tmp_path):
    """`run.seed=S` alone moves the run to OUT_DIR/seed-S: no two seeds (nor a seed run and the config's own run)
    share a directory, and the layout is the NAME/seed-S group that `tapetrain compare` reads."""
    text = MINIMAL + "run:\n  out_dir: runs/arith\n  seed: 0\n"
    plain = load(tmp_path, text=text)
    seeded = {s: load(tmp_path, f"run.seed={s}", text=text) for s in (0, 1, 2, 7)}
    assert plain.run.out_dir == "runs/arith" and plain.run.name is None
    assert {s: c.run.out_dir for s, c in seeded.items()} == {s: f"runs/arith/seed-{s}" for s in seeded}
    dirs = [plain.run.out_dir, *(c.run.out_dir for c in seeded.values())]
    assert len(set(dirs)) == len(dirs)
    assert seeded[7].run.seed == 7 and seeded[7].run.name == "arith-seed-7"


def test_an_explicit_out_dir_or_name_wins_over_the_seed_layout(tmp_path):
    text = MINIMAL + "run:\n  out_dir: runs/arith\n  name: mine\n"
    explicit = load(tmp_path, "run.seed=3", "run.out_dir=elsewhere", text=text)
    assert explicit.run.out_dir == "elsewhere" and explicit.run.seed == 3
    assert load(tmp_path, "run.seed=3", text=text).run.name == "mine"


def test_reloading_a_seed_run_config_with_another_seed_does_not_nest(tmp_path):
    """A seed run's saved config.yaml names runs/NAME/seed-1; loading it with run.seed=2 gives runs/NAME/seed-2."""
    cfg = load(tmp_path, "run.seed=1", text=MINIMAL + "run:\n  out_dir: runs/arith/\n")
    saved = tmp_path / "config.yaml"
    save_resolved(cfg, str(saved))
    assert load_run_config(str(saved)).run.out_dir == os.path.join("runs/arith", "seed-1")
    assert load_run_config(str(saved), ["run.seed=2"]).run.out_dir == os.path.join("runs/arith", "seed-2")


def test_an_override_of_one_exclusive_key_replaces_the_files_other(tmp_path, caplog):
    """configs/tiny-cpu.yaml sets optim.warmup_ratio; `optim.warmup_steps=0` on the command line replaces it (as
    Hydra/OmegaConf-style overrides do), with an INFO line. Both keys from the same source stay an error."""
    import logging

    config = str(Path(__file__).resolve().parents[2] / "configs" / "tiny-cpu.yaml")
    with caplog.at_level(logging.INFO, logger="tapetrain.config"):
        cfg = load_run_config(config, ["optim.warmup_steps=0"])
    assert cfg.optim.warmup_steps == 0 and cfg.optim.warmup_ratio is None
    (line,) = [r.getMessage() for r in caplog.records if "warmup_ratio" in r.getMessage()]
    assert "optim.warmup_steps=0" in line and "replaces optim.warmup_ratio=0.1" in line and "tiny-cpu.yaml" in line
    with pytest.raises(ConfigError, match="both optim.warmup_steps=3 and optim.warmup_ratio=0.2 are set"):
        load_run_config(config, ["optim.warmup_steps=3", "optim.warmup_ratio=0.2"])  # both on the command line
    both = tmp_path / "both.yaml"
    both.write_text(f"base: {config}\noptim:\n  warmup_steps: 2\n")  # the file sets both (with its base)
    with pytest.raises(ConfigError, match="both optim.warmup_steps=2 and optim.warmup_ratio=0.1 are set"):
        load_run_config(str(both))


def test_every_unknown_key_is_reported_at_once(tmp_path):
    """Three typos in three places (top level, a section, an override) are one error naming all three with their
    fixes, not one per run; a single typo reads as before."""
    text = MINIMAL.replace("  steps: 100", "  stpes: 100\n  lr: 0.001") + "trian:\n  steps: 3\n"
    msg = error_of(tmp_path, "model.d_modle=64", text=text)
    assert msg.startswith("4 unknown keys"), msg
    for expected in ("'trian'", "did you mean 'train'", "'train.stpes'", "did you mean 'train.steps'", "'train.lr'",
                     "optim.lr", "'model.d_modle'", "did you mean 'model.d_model'", "override 'model.d_modle=64'"):
        assert expected in msg, (expected, msg)
    assert error_of(tmp_path, text=MINIMAL.replace("  steps: 100", "  stpes: 100")).startswith(
        "unknown key 'train.stpes'")
