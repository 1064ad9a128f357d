"""AdamW param groups (weight decay), trainable modes, and both on the real tiny Transformer."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from tapetrain.config.sections import OptimSection
from tapetrain.errors import ConfigError
from tapetrain.train.optim import apply_trainable, build_optimizer, is_trainable, param_groups


class Toy(nn.Module):
    """Parameter names shaped like the model's: embed, layers.N.{attn,mlp,norms,tape_*}, pe, norm, lm_head."""

    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(10, 4)
        layer = nn.Module()
        layer.attn = nn.Module()
        layer.attn.q_proj = nn.Linear(4, 4, bias=True)
        layer.attn.tape_mix = nn.Module()
        layer.attn.tape_mix.weight = nn.Parameter(torch.zeros(2, 2))
        layer.tape_mlp = nn.Module()
        layer.tape_mlp.x_proj = nn.Linear(4, 8, bias=False)
        layer.attn_norm = nn.Module()
        layer.attn_norm.weight = nn.Parameter(torch.ones(4))
        self.layers = nn.ModuleList([layer])
        self.pe = nn.Module()
        self.pe.log_c = nn.Parameter(torch.zeros(()))
        self.norm = nn.Module()
        self.norm.weight = nn.Parameter(torch.ones(4))
        self.lm_head = nn.Linear(4, 10, bias=False)


def names(model: nn.Module, params) -> set[str]:
    ids = {id(p) for p in params}
    return {n for n, p in model.named_parameters() if id(p) in ids}


def test_decay_only_for_matrices_that_are_not_embeddings():
    model = Toy()
    decay, no_decay = param_groups(model, 0.1)
    assert decay["weight_decay"] == 0.1 and no_decay["weight_decay"] == 0.0
    assert names(model, decay["params"]) == {
        "layers.0.attn.q_proj.weight",
        "layers.0.attn.tape_mix.weight",
        "layers.0.tape_mlp.x_proj.weight",
        "lm_head.weight",
    }
    assert names(model, no_decay["params"]) == {
        "embed.weight",
        "layers.0.attn.q_proj.bias",
        "layers.0.attn_norm.weight",
        "pe.log_c",
        "norm.weight",
    }


@pytest.mark.parametrize(
    "mode, expected",
    [
        ("tape", {"layers.0.attn.tape_mix.weight", "layers.0.tape_mlp.x_proj.weight", "pe.log_c"}),
        (
            "tape+embed+norm",
            {
                "layers.0.attn.tape_mix.weight",
                "layers.0.tape_mlp.x_proj.weight",
                "pe.log_c",
                "embed.weight",
                "layers.0.attn_norm.weight",
                "norm.weight",
            },
        ),
    ],
)
def test_trainable_modes_select_by_name(mode, expected):
    model = Toy()
    trainable, total = apply_trainable(model, mode)
    selected = {n for n, p in model.named_parameters() if p.requires_grad}
    assert selected == expected
    assert trainable == sum(p.numel() for n, p in model.named_parameters() if n in expected)
    assert total == sum(p.numel() for p in model.parameters())
    opt = build_optimizer(model, OptimSection(), trainable=None)  # requires_grad already set
    assert names(model, [p for g in opt.param_groups for p in g["params"]]) == expected


def test_all_mode_unfreezes_everything():
    model = Toy()
    apply_trainable(model, "tape")
    apply_trainable(model, "all")
    assert all(p.requires_grad for p in model.parameters())


def test_mode_selecting_nothing_or_unknown_is_an_error():
    plain = nn.Sequential(nn.Linear(2, 2))
    with pytest.raises(ConfigError, match="train.trainable='tape' selects no parameter.*train.trainable=all"):
        apply_trainable(plain, "tape")
    with pytest.raises(ConfigError, match="train.trainable: unknown mode 'adapters'"):
        is_trainable("x", "adapters")
    for p in plain.parameters():
        p.requires_grad_(False)
    with pytest.raises(ConfigError, match="no trainable parameters"):
        build_optimizer(plain, OptimSection())


def test_adamw_hyperparameters_and_empty_groups_dropped():
    cfg = OptimSection(lr=2e-4, betas=(0.8, 0.9), eps=1e-6, weight_decay=0.05)
    model = nn.Sequential(nn.Linear(3, 3))
    model[0].weight.requires_grad_(False)  # only the bias (no decay) remains
    opt = build_optimizer(model, cfg)
    assert isinstance(opt, torch.optim.AdamW)
    assert len(opt.param_groups) == 1
    group = opt.param_groups[0]
    assert (group["lr"], group["betas"], group["eps"], group["weight_decay"]) == (2e-4, (0.8, 0.9), 1e-6, 0.0)


def _tiny(**overrides):
    from tapetrain.model import Transformer, preset_config

    return Transformer(preset_config("tiny", **overrides))


def test_real_model_tape_mode_trains_only_tape_parameters():
    model = _tiny(pe="tape")
    trainable, total = apply_trainable(model, "tape")
    assert 0 < trainable < total
    assert trainable == model.tape_params()
    for name, p in model.named_parameters():
        assert p.requires_grad == ("tape" in name), name
    opt = build_optimizer(model, OptimSection(), "tape+embed+norm")
    chosen = names(model, [p for g in opt.param_groups for p in g["params"]])
    assert "embed.weight" in chosen and "norm.weight" in chosen and "lm_head.weight" not in chosen
    assert not any("q_proj" in n or ".mlp.down_proj" in n for n in chosen)


def test_real_model_rope_has_nothing_for_tape_mode():
    with pytest.raises(ConfigError, match="selects no parameter"):
        apply_trainable(_tiny(pe="rope"), "tape")


def test_real_model_tied_embeddings_appear_once_without_decay():
    model = _tiny(tie_embeddings=True)
    opt = build_optimizer(model, OptimSection(weight_decay=0.1), "all")
    params = [p for g in opt.param_groups for p in g["params"]]
    assert len(params) == len({id(p) for p in params}) == len(list(model.parameters()))
    decayed = {id(p) for p in opt.param_groups[0]["params"]}
    assert opt.param_groups[0]["weight_decay"] == 0.1 and id(model.embed.weight) not in decayed
