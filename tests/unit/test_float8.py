"""train.float8 (tapetrain/train/float8.py): the refusals, the module filter, torchao's conversion in emulation."""

import pytest
import torch

from tapetrain.errors import ConfigError
from tapetrain.model import Transformer, preset_config
from tapetrain.train.float8 import (
    EMULATE_ENV,
    convert_model_to_float8,
    float8_refusal,
    plan_float8,
    resolve_float8,
)

pytest.importorskip("torchao")


def test_a_cpu_run_asking_for_float8_is_refused_naming_the_fix(monkeypatch):
    monkeypatch.delenv(EMULATE_ENV, raising=False)
    for recipe in ("rowwise", "tensorwise"):
        with pytest.raises(ConfigError, match="train.float8=off") as err:
            resolve_float8(recipe, torch.device("cpu"))
        assert "\n" not in str(err.value) and "on cpu" in str(err.value)
    assert resolve_float8("off", torch.device("cpu")) == "off"


def test_a_gpu_without_fp8_tensor_cores_is_refused():
    """Compute capability below 8.9 (A100: 8.0) has no FP8 tensor cores; Ada (8.9) and Hopper (9.0) have them."""
    refusal = float8_refusal("rowwise", "cuda", (8, 0), "NVIDIA A100-SXM4-80GB")
    assert refusal and "A100" in refusal and "8.0" in refusal and "train.float8=off" in refusal
    assert float8_refusal("tensorwise", "cuda", (8, 6), "RTX 3090") is not None
    assert float8_refusal("rowwise", "cuda", (8, 9), "L40S") is None
    assert float8_refusal("rowwise", "cuda", (9, 0), "H200") is None


def test_emulation_is_allowed_only_behind_the_test_switch(monkeypatch):
    monkeypatch.setenv(EMULATE_ENV, "1")
    assert resolve_float8("rowwise", torch.device("cpu")) == "rowwise"
    monkeypatch.setenv(EMULATE_ENV, "true")  # only "1" switches it on
    with pytest.raises(ConfigError):
        resolve_float8("rowwise", torch.device("cpu"))


def test_config_reads_off_and_rejects_other_values(tmp_path):
    """`train.float8: off` is YAML 1.1's false: read as the setting 'off', not a type error."""
    from tapetrain.config.run_config import load_run_config

    path = tmp_path / "c.yaml"
    path.write_text("model: {preset: tiny}\ndata: {train: d}\ntrain: {float8: off}\n")
    assert load_run_config(str(path)).train.float8 == "off"
    assert load_run_config(str(path), ["train.float8=rowwise"]).train.float8 == "rowwise"
    with pytest.raises(ConfigError, match="train.float8.*rowwise"):
        load_run_config(str(path), ["train.float8=rowise"])


def test_the_filter_converts_the_projections_only():
    """TAPE tiny: layer 0 carries the MLP-side update (the last layer does not). Converted: q/k/v/o and
    gate/up/down of both layers; skipped: W_x, W_up, W_down of TAPE's update and the LM head."""
    model = Transformer(preset_config("tiny", pe="tape"))
    plan = plan_float8(model, "rowwise")
    projections = ("attn.q_proj", "attn.k_proj", "attn.v_proj", "attn.o_proj", "mlp.gate_proj", "mlp.up_proj",
                   "mlp.down_proj")
    assert plan.converted == tuple(f"layers.{i}.{p}" for i in range(2) for p in projections)
    assert set(plan.skipped) == {"layers.0.tape_mlp.x_proj", "layers.0.tape_mlp.up_proj",
                                 "layers.0.tape_mlp.down_proj", "lm_head"}
    assert plan.summary().startswith("14 linear(s) in FP8 (rowwise); skipped: layers.*.tape_mlp.x_proj")


def test_dimensions_that_are_not_multiples_of_16_stay_in_high_precision():
    model = Transformer(preset_config("tiny", pe="rope", ffn_hidden=100))  # SwiGLU 100 wide
    plan = plan_float8(model, "tensorwise")
    assert not any(".mlp." in name for name in plan.converted) and len(plan.converted) == 8
    assert "layers.*.mlp.gate_proj (2)" in plan.summary()


@pytest.mark.parametrize(("recipe", "dtype"), [("rowwise", torch.float32), ("tensorwise", torch.bfloat16)])
def test_converted_model_trains_close_to_the_original(recipe, dtype):
    """Forward and backward in emulation: the parameters (names, objects) are unchanged, the loss and gradients
    are those of the high-precision model up to FP8 rounding, and differ from them (the FP8 path ran)."""
    torch.manual_seed(0)
    reference = Transformer(preset_config("tiny", pe="tape")).to(dtype)
    model = Transformer(preset_config("tiny", pe="tape")).to(dtype)
    model.load_state_dict(reference.state_dict())
    params = dict(model.named_parameters())
    conversion = convert_model_to_float8(model, recipe, emulate=True)
    assert dict(model.named_parameters()) == params and model.state_dict().keys() == reference.state_dict().keys()
    assert type(model.layers[0].attn.q_proj).__name__ == "Float8Linear" and len(conversion.converted) == 14
    ids = torch.randint(0, 512, (2, 33), generator=torch.Generator().manual_seed(1))
    losses, grads = [], []
    for m in (reference, model):
        loss = m(ids[:, :-1], labels=ids[:, 1:]).loss
        loss.backward()
        losses.append(loss.item())
        grads.append(m.layers[1].mlp.up_proj.weight.grad.float())
    assert losses[0] != losses[1] and abs(losses[0] - losses[1]) < 0.02 * losses[0]
    assert grads[0].norm() > 0
    assert (grads[1] - grads[0]).norm() / grads[0].norm() < 0.15


def test_compiled_float8_layers_match_eager():
    """torch.compile traces torchao's float8 tensors (dynamo and AOTAutograd; aot_eager keeps the CPU test short,
    inductor is what model.compile uses): the same loss and gradients as the eager converted model."""
    torch.manual_seed(0)
    eager = Transformer(preset_config("tiny", pe="rope"))
    compiled = Transformer(preset_config("tiny", pe="rope"))
    compiled.load_state_dict(eager.state_dict())
    for m in (eager, compiled):
        convert_model_to_float8(m, "rowwise", emulate=True)
    compiled.layers[0].mlp.compile(backend="aot_eager")  # three float8 projections in one graph (a whole layer: 4x)
    from torch._dynamo.utils import counters

    counters.clear()
    ids = torch.randint(0, 512, (2, 33), generator=torch.Generator().manual_seed(1))
    results = []
    for m in (eager, compiled):
        loss = m(ids[:, :-1], labels=ids[:, 1:]).loss
        loss.backward()
        results.append((loss.item(), m.layers[0].mlp.up_proj.weight.grad.clone()))
    assert counters["stats"]["unique_graphs"] >= 1 and not counters["graph_break"]  # it compiled, in one graph
    assert results[0][0] == pytest.approx(results[1][0], rel=1e-6)
    torch.testing.assert_close(results[1][1], results[0][1], rtol=1e-5, atol=1e-7)


def test_print_config_names_the_rule_and_what_converts(tmp_path, capsys, monkeypatch):
    from tapetrain.train.preflight import print_resolved

    monkeypatch.delenv(EMULATE_ENV, raising=False)
    path = tmp_path / "c.yaml"
    path.write_text("model: {preset: tiny, pe: tape}\ndata: {train: d, seq_len: 64}\ntrain: {float8: rowwise}\n")
    print_resolved(str(path), [], 1)
    out = capsys.readouterr().out
    assert "float8 (train.float8=rowwise): refused (train.float8=rowwise on cpu" in out
    assert "rule: the attention (q/k/v/o_proj) and MLP" in out
    assert "this model: 14 linear(s) in FP8 (rowwise); skipped: layers.*.tape_mlp.x_proj" in out
    assert "model.compile=true for speed" in out


def test_float8_without_torchao_is_refused(monkeypatch):
    import sys

    monkeypatch.setitem(sys.modules, "torchao", None)  # `import torchao` raises ImportError, as if not installed
    with pytest.raises(ConfigError, match="needs torchao.*train.float8=off"):
        resolve_float8("rowwise", torch.device("cpu"), emulate=True)


def test_turning_float8_on_or_off_on_resume_is_a_named_change(tmp_path):
    """A checkpoint records train.float8; one from before the setting existed ran without it ('off')."""
    import json

    from tapetrain.config import RunConfig
    from tapetrain.train import resume_checks

    def config(float8: str) -> RunConfig:
        return RunConfig.from_dict({"model": {"preset": "tiny"}, "data": {"train": "d"}, "train": {"float8": float8}})

    state = json.loads(json.dumps({"step": 3, **resume_checks.training_settings(config("rowwise"))}))
    assert resume_checks.setting_changes(state, config("off"), tmp_path) == ["train.float8: 'rowwise' -> 'off'"]
    assert resume_checks.setting_changes(state, config("rowwise"), tmp_path) == []
    del state["float8"]
    assert resume_checks.setting_changes(state, config("tensorwise"), tmp_path) == [
        "train.float8: 'off' -> 'tensorwise'"]


def test_dry_run_refuses_float8_on_a_cpu_before_reading_data(tmp_path, monkeypatch):
    from tapetrain.config.run_config import load_run_config
    from tapetrain.distributed import DistEnv
    from tapetrain.train.preflight import dry_run

    monkeypatch.delenv(EMULATE_ENV, raising=False)
    path = tmp_path / "c.yaml"
    path.write_text(f"run: {{out_dir: {tmp_path / 'run'}}}\nmodel: {{preset: tiny}}\n"
                    f"data: {{train: {tmp_path / 'no-data'}, seq_len: 64}}\ntrain: {{float8: tensorwise}}\n")
    cfg = load_run_config(str(path)).resolve(world_size=1)
    with pytest.raises(ConfigError, match="train.float8=tensorwise on cpu.*set train.float8=off"):
        dry_run(cfg, DistEnv())
    assert not (tmp_path / "run").exists()
