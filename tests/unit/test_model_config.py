"""Model config validation, presets, parameter counts and the FLOPs formula."""

import pytest
import torch

from tapetrain.errors import ConfigError
from tapetrain.model import ModelConfig, Transformer, preset_config


@pytest.mark.parametrize(
    "overrides,key,fix",
    [
        (dict(d_model=100, n_heads=12), "model.n_heads", "dividing d_model"),
        (dict(n_heads=4, n_kv_heads=3), "model.n_kv_heads", "dividing n_heads"),
        (dict(d_model=36, n_heads=4), "model.n_heads", "even head dim"),
        (dict(pe="sinusoid"), "model.pe", "choose one of"),
        (dict(tape_head_mix="diag"), "model.tape_head_mix", "'full' or 'gain'"),
        (dict(attn_backend="cuda"), "model.attn_backend", "choose one of"),
        (dict(vocab_size=0), "model.vocab_size", "positive"),
    ],
)
def test_invalid_configs_name_key_and_fix(overrides, key, fix):
    with pytest.raises(ConfigError) as err:
        preset_config("tiny", **overrides)
    assert key in str(err.value) and fix in str(err.value)


def test_odd_head_dim_is_fine_without_rotary():
    assert preset_config("tiny", d_model=36, n_heads=4, pe="alibi").head_dim == 9


def test_unknown_key_suggests_the_close_one():
    with pytest.raises(ConfigError, match="did you mean 'n_layers'"):
        ModelConfig.from_dict({"n_layer": 2})


def test_unknown_preset():
    with pytest.raises(ConfigError, match="choose one of"):
        preset_config("gpt5")


def paper_param_formula(tape: bool) -> int:
    v, c, layers, h, ffn = 32000, 768, 12, 12, 3072
    per_layer = 4 * c * c + 3 * c * ffn + 2 * c  # q, k, v, o + SwiGLU + two RMSNorms
    total = 2 * v * c + layers * per_layer + c  # untied embed + lm_head, final norm
    tape_per_layer = h * h + c * 4 * h + 4 * h * h + h * 4 * h  # W_A, W_x, W_up, W_down
    return total + ((layers - 1) * tape_per_layer if tape else 0)  # the last layer's E updates would be dead


def test_paper_model_parameter_count_matches_formula():
    with torch.device("meta"):
        rope = Transformer(preset_config("paper-155m", pe="rope"))
        tape = Transformer(preset_config("paper-155m", pe="tape"))
    assert rope.num_params() == paper_param_formula(False) == 162_417_408  # ≈ 163M, the paper's 12-layer / 768-d model
    assert tape.num_params() == paper_param_formula(True)
    # ≈ 38K per layer as in the paper; the official code also builds them in the last layer (dead: 0.46M total).
    assert tape.tape_params() == 11 * 38_160 == 419_760


def test_llama2_7b_shape_parameter_count():
    with torch.device("meta"):
        model = Transformer(preset_config("llama2-7b", pe="rope"))
    assert model.num_params() == 6_738_415_616  # Llama-2-7B's published count


def test_llama31_8b_shape_parameter_count():
    with torch.device("meta"):
        model = Transformer(preset_config("llama3.1-8b", pe="tape"))
    assert model.num_params() - model.tape_params() == 8_030_261_248  # Llama-3.1-8B's count (safetensors index)


def test_flops_formula_matches_matmul_parameters():
    model = Transformer(preset_config("tiny", pe="rope"))
    cfg, seq = model.cfg, 128
    matmul_params = model.num_params() - cfg.vocab_size * cfg.d_model - (2 * cfg.n_layers + 1) * cfg.d_model
    attention = 4 * cfg.n_layers * cfg.n_heads * cfg.head_dim * seq
    assert model.flops_per_token(seq, training=False) == 2 * matmul_params + attention
    assert model.flops_per_token(seq) == 3 * model.flops_per_token(seq, training=False)
    tape = Transformer(preset_config("tiny", pe="tape"))
    extra = tape.flops_per_token(seq) - model.flops_per_token(seq)
    assert 0 < extra < 0.5 * model.flops_per_token(seq)
