"""RoPE scaling (tapetrain/model/rope_scaling.py) against transformers' own functions, and its settings.

Frequencies and attention factors of every type equal transformers' ROPE_INIT_FUNCTIONS for the same
rope_parameters at several lengths (dynamic's growth past L₀ and longrope's switch included), and the cos/sin of its
rotary module as it updates them forward by forward; pi_factor is linear scaling; contradictory or incomplete
settings are refused naming the key.
"""

import math

import pytest
import torch
from model_helpers import SCALING_THETA, SCALINGS, build

from tapetrain.errors import ConfigError
from tapetrain.model import ModelConfig, preset_config
from tapetrain.model.positions import rope_angles
from tapetrain.model.rope_scaling import RopeScaling, rope_attention_factor, rope_frequencies, rope_parameters

HEAD_DIM = 16
LENGTHS = (5, 16, 17, 40, 100)  # below, at and beyond L₀ = 16


def hf_config(kind: str, max_positions: int = 64):
    """LlamaConfig with SCALINGS[kind] (transformers' dynamic takes L₀ from max_position_embeddings)."""
    from transformers import LlamaConfig

    params = dict(SCALINGS[kind] or {"rope_type": "default"})
    if kind == "dynamic":
        max_positions = params.pop("original_max_position_embeddings")
    return LlamaConfig(hidden_size=4 * HEAD_DIM, num_attention_heads=4, max_position_embeddings=max_positions,
                       rope_parameters={**params, "rope_theta": SCALING_THETA})


def ours(kind: str) -> dict:
    return rope_parameters(SCALING_THETA, 1.0, SCALINGS[kind])


def transformers_frequencies(kind: str, length: int | None) -> tuple[torch.Tensor, float]:
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

    config = hf_config(kind)
    if kind == "default":
        return LlamaRotaryEmbedding.compute_default_rope_parameters(config)
    return ROPE_INIT_FUNCTIONS[kind](config, None, seq_len=length)


@pytest.mark.parametrize("kind", list(SCALINGS))
def test_frequencies_and_attention_factor_equal_transformers(kind):
    for length in LENGTHS:
        theirs, factor = transformers_frequencies(kind, length)
        mine = rope_frequencies(HEAD_DIM, ours(kind), torch.tensor(float(length), dtype=torch.float64))
        torch.testing.assert_close(mine, theirs.double(), rtol=2e-6, atol=0)  # theirs are fp32
        assert rope_attention_factor(ours(kind)) == pytest.approx(factor, rel=1e-12)
    default = rope_frequencies(HEAD_DIM, ours("default"))
    if kind != "default":  # guards the comparison: every type changes some frequency
        grown = rope_frequencies(HEAD_DIM, ours(kind), torch.tensor(100.0, dtype=torch.float64))
        assert (grown - default).abs().max() > 1e-3


def test_length_dependent_types_change_past_the_original_length():
    for kind in ("dynamic", "longrope"):
        at = {n: rope_frequencies(HEAD_DIM, ours(kind), torch.tensor(float(n), dtype=torch.float64)) for n in LENGTHS}
        assert torch.equal(at[5], at[16]) and not torch.equal(at[16], at[17])
        assert torch.equal(rope_frequencies(HEAD_DIM, ours(kind)), at[16])  # no length = up to L₀
    dynamic = ours("dynamic")
    assert not torch.equal(*(rope_frequencies(HEAD_DIM, dynamic, torch.tensor(n, dtype=torch.float64))
                             for n in (40.0, 100.0)))  # dynamic keeps growing


@pytest.mark.parametrize("kind", list(SCALINGS))
def test_rotary_module_forward_by_forward(kind):
    """transformers' rotary module updates dynamic/longrope frequencies from max(position_ids) + 1 as the sequence
    grows; our angles for the same positions, times the attention factor, give its cos and sin."""
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

    module = LlamaRotaryEmbedding(hf_config(kind))
    x = torch.zeros(1, dtype=torch.float32)
    for length in (8, 20, 48, 90):  # growing, as generation does
        positions = torch.arange(length)[None]
        cos, sin = module(x, positions)
        model_cfg = preset_config("tiny", pe="rope", rope_theta=SCALING_THETA, rope_scaling=SCALINGS[kind])
        inv_freq = build("rope", rope_theta=SCALING_THETA, rope_scaling=SCALINGS[kind]).pe.context(
            positions.double(), positions.double(), torch.float32).inv_freq
        my_cos, my_sin = rope_angles(positions.double(), inv_freq)
        factor = rope_attention_factor(model_cfg.rope_parameters)
        atol = 2 * 2**-23 * length  # transformers' angles are fp32: up to `length` rad, rounded
        torch.testing.assert_close(cos[..., : HEAD_DIM // 2].double(), my_cos * factor, rtol=0, atol=atol)
        torch.testing.assert_close(sin[..., : HEAD_DIM // 2].double(), my_sin * factor, rtol=0, atol=atol)


@pytest.mark.parametrize("variant", [
    {"attention_factor": 1.0},  # NTK-by-parts: YaRN's frequencies without its temperature
    {"mscale": 1.0, "mscale_all_dim": 0.5},
    {"truncate": False, "beta_fast": 16.0, "beta_slow": 2.0},
])
def test_yarn_options_equal_transformers(variant):
    from transformers import LlamaConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    scaling = {**SCALINGS["yarn"], **variant}
    config = LlamaConfig(hidden_size=64, num_attention_heads=4, max_position_embeddings=64,
                         rope_parameters={**scaling, "rope_theta": SCALING_THETA})
    theirs, factor = ROPE_INIT_FUNCTIONS["yarn"](config, None)
    mine = rope_parameters(SCALING_THETA, 1.0, scaling)
    torch.testing.assert_close(rope_frequencies(HEAD_DIM, mine), theirs.double(), rtol=2e-6, atol=0)
    assert rope_attention_factor(mine) == pytest.approx(factor, rel=1e-12)


def test_pi_factor_is_linear_scaling():
    pi = preset_config("tiny", pe="rope", pi_factor=2.0)
    linear = preset_config("tiny", pe="rope", rope_scaling={"rope_type": "linear", "factor": 2.0})
    assert pi.rope_parameters == linear.rope_parameters == {"rope_type": "linear", "factor": 2.0,
                                                            "rope_theta": 10000.0}
    same = preset_config("tiny", pe="rope", pi_factor=2.0, rope_scaling={"rope_type": "linear", "factor": 2.0})
    assert same.rope_parameters == pi.rope_parameters  # agreeing settings are not a contradiction
    tokens = torch.randint(0, 512, (1, 40))
    torch.testing.assert_close(build("tape", pi_factor=2.0)(tokens).logits,
                               build("tape", rope_scaling={"rope_type": "linear", "factor": 2.0})(tokens).logits,
                               rtol=0, atol=1e-6)


@pytest.mark.parametrize("overrides, message", [
    (dict(pi_factor=2.0, rope_scaling={"rope_type": "yarn", "factor": 2.0, "original_max_position_embeddings": 64}),
     "model.pi_factor: pi_factor=2.0 is linear scaling"),
    (dict(pi_factor=2.0, rope_scaling={"rope_type": "linear", "factor": 4.0}), "set only one of them"),
    (dict(rope_scaling={"rope_type": "yarn", "factor": 2.0}), "needs original_max_position_embeddings"),
    (dict(rope_scaling={"rope_type": "llama3", "factor": 8.0, "original_max_position_embeddings": 32}),
     "needs low_freq_factor, high_freq_factor"),
    (dict(rope_scaling={"rope_type": "linear", "factor": 2.0, "beta_fast": 4.0}), "beta_fast do(es) not apply"),
    (dict(rope_scaling={**SCALINGS["longrope"], "long_factor": [1.0, 2.0]}), "long_factor: needs head_dim/2 = 8"),
    (dict(rope_scaling={"type": "yarn", "factor": 2.0}), "'type' is spelled rope_type"),
    (dict(rope_scaling={"rope_type": "ntk", "factor": 2.0}), "unknown type 'ntk'"),
    (dict(rope_scaling={"rope_type": "dynamic", "factor": 0.5, "original_max_position_embeddings": 16}),
     "factor must be >= 1"),
    (dict(pe="alibi", rope_scaling={"rope_type": "linear", "factor": 2.0}), "model.rope_scaling: scales rotary"),
    (dict(pe="fire", pi_factor=2.0), "model.pi_factor: scales rotary angles, and pe=fire has none"),
])
def test_bad_rope_settings_are_refused_by_name(overrides, message):
    with pytest.raises(ConfigError) as err:
        preset_config("tiny", **{"pe": "rope", **overrides})
    assert message in str(err.value)


def test_rope_scaling_from_yaml_is_typed_and_round_trips(tmp_path):
    from tapetrain.config import load_run_config

    path = tmp_path / "run.yaml"
    path.write_text("model: {preset: tiny, pe: tape, rope_scaling: {rope_type: yarn, factor: 4, "
                    "original_max_position_embeddings: 32}}\ndata: {train: shards}\ndeepspeed: {precision: fp32}\n")
    cfg = load_run_config(str(path)).model.model_config()
    assert isinstance(cfg.rope_scaling, RopeScaling) and cfg.rope_scaling.factor == 4.0
    assert ModelConfig.from_dict(cfg.to_dict()) == cfg  # model_config.json -> the same config
    assert cfg.attention_scale == pytest.approx((0.1 * math.log(4) + 1) ** 2 / 4)  # 1/√16 × mscale²
    path.write_text(path.read_text().replace("rope_type", "type"))
    with pytest.raises(ConfigError, match=r"model\.rope_scaling\.type.*did you mean 'model\.rope_scaling\.rope_type'"):
        load_run_config(str(path))


def test_yarn_temperature_scales_tape_logits_not_its_state():
    """TAPE with YaRN: E⁽⁰⁾ keeps unit blocks (E is also value channels), the temperature is the attention scale,
    and a fresh TAPE model equals its RoPE twin (whose logits equal transformers', test_hf_families)."""
    tape = build("tape", rope_scaling=SCALINGS["yarn"], rope_theta=SCALING_THETA)
    positions = torch.arange(30, dtype=torch.float64)[None]
    state = tape.pe.context(positions, positions, torch.float32).tape_init  # (1, T, M, D)
    norms = state[..., :8] ** 2 + state[..., 8:] ** 2
    torch.testing.assert_close(norms, torch.ones_like(norms))
    assert tape.layers[0].attn.scale == pytest.approx(tape.cfg.attention_scale) and tape.cfg.attention_scale > 0.25
    rope = build("rope", rope_scaling=SCALINGS["yarn"], rope_theta=SCALING_THETA)
    rope.load_state_dict(tape.state_dict(), strict=False)
    tokens = torch.randint(0, 512, (2, 30))
    torch.testing.assert_close(tape(tokens).logits, rope(tokens).logits, rtol=0, atol=1e-5)
    plain = build("rope", rope_scaling={**SCALINGS["yarn"], "attention_factor": 1.0}, rope_theta=SCALING_THETA)
    plain.load_state_dict(tape.state_dict(), strict=False)
    assert (plain(tokens).logits - rope(tokens).logits).abs().max() > 1e-3  # the temperature does matter


def test_dynamic_frequencies_follow_the_span_not_the_offset():
    model = build("tape", rope_scaling=SCALINGS["dynamic"], rope_theta=SCALING_THETA)
    positions = torch.arange(40, dtype=torch.float64)[None]
    base = model.pe.context(positions, positions, torch.float32).inv_freq
    shifted = model.pe.context(positions + 1000, positions + 1000, torch.float32).inv_freq
    assert torch.equal(base, shifted)
    longer = torch.arange(80, dtype=torch.float64)[None]
    assert not torch.equal(base, model.pe.context(longer, longer, torch.float32).inv_freq)
