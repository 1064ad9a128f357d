"""The paper's ablations that need more than a switch: TAPE without its equivariance constraints (the official
code's non-equivariant variant) and TAPE in a subset of layers (model.tape_layers).

The official variant (TAPE repository, models/llama/adawoeq.py, PELayer) restated for our layout: each of its
cos / sin tensors (batch, heads, T, head dim) is transposed to (batch, T, heads × head dim), then
down_proj(act(x_proj(m)) * up_proj(e)) is reshaped back and added, with the same weights for cos and for sin.
Here the two tensors are the c and the s halves of E (heads × frequencies each).
"""

import pytest
import torch
import torch.nn.functional as F
from model_helpers import build, randomize_tape

from tapetrain.checkpoint.hf_export import export_model
from tapetrain.errors import ConfigError
from tapetrain.model import preset_config
from tapetrain.model.positions import rotate_pairs
from tapetrain.model.tape import TapeMlpUpdate

TOKENS = torch.randint(0, 512, (2, 24), generator=torch.Generator().manual_seed(3))


def official_non_equivariant_update(module, state: torch.Tensor, mlp_out: torch.Tensor) -> torch.Tensor:
    b, h, t, d = state.shape
    halves = []
    for e in (state[..., : d // 2], state[..., d // 2 :]):
        flat = e.transpose(1, 2).reshape(b, t, h * (d // 2))
        down = module.down_proj(F.silu(module.x_proj(mlp_out)) * module.up_proj(flat))
        halves.append(e + down.reshape(b, t, h, d // 2).transpose(1, 2))
    return torch.cat(halves, dim=-1)


def test_non_equivariant_update_is_the_official_variant():
    model = build("tape", tape_equivariant=False)
    randomize_tape(model)
    module = model.layers[0].tape_mlp
    assert module.up_proj.weight.shape == (4 * 4, 4 * 8)  # I × (heads · frequencies) for the tiny model
    g = torch.Generator().manual_seed(1)
    state, mlp_out = torch.randn(2, 4, 9, 16, generator=g), torch.randn(2, 9, 64, generator=g)
    # the model keeps E token-major (B, T, M, D); the official restatement takes it head-major (B, M, T, D)
    got = module(state.transpose(1, 2), mlp_out).transpose(1, 2)
    torch.testing.assert_close(got, official_non_equivariant_update(module, state, mlp_out))


def test_non_equivariant_variant_breaks_the_invariances_and_starts_as_rope():
    fresh, rope = build("tape", tape_equivariant=False), build("rope")
    rope.load_state_dict(fresh.state_dict(), strict=False)
    torch.testing.assert_close(fresh(TOKENS).logits, rope(TOKENS).logits, atol=1e-5, rtol=0)  # zero W_down
    model = build("tape", tape_equivariant=False)
    randomize_tape(model)
    shift = (model(TOKENS, position_offset=1000).logits - model(TOKENS).logits).abs().max()
    b, t = TOKENS.shape
    positions = torch.arange(t, dtype=torch.float64).expand(b, t)
    state = model.pe.context(positions, positions, torch.float32).tape_init
    phi = torch.rand(8, generator=torch.Generator().manual_seed(5), dtype=torch.float64) * 6.283
    rotated = rotate_pairs(state, torch.cos(phi).float(), torch.sin(phi).float())
    o2 = (model(TOKENS, tape_state=rotated).logits - model(TOKENS, tape_state=state).logits).abs().max()
    assert shift > 1e-2 and o2 > 1e-2  # the equivariant model keeps both below 2e-5 (test_tape_properties)


def test_tape_layers_restricts_the_updates_to_the_listed_layers():
    full = build("tape", n_layers=3)
    randomize_tape(full)
    only_middle = build("tape", n_layers=3, tape_layers=[1])
    names = {n for n, _ in only_middle.named_parameters() if "tape" in n}
    assert names and all(n.startswith("layers.1.") for n in names)
    missing, unexpected = only_middle.load_state_dict(full.state_dict(), strict=False)
    assert not missing and all(k.startswith("layers.0.") for k in unexpected)
    with torch.no_grad():  # the same network with layer 0's updates switched off (W_A = W_down = 0)
        full.layers[0].attn.tape_mix.weight.zero_()
        full.layers[0].tape_mlp.down_proj.weight.zero_()
    torch.testing.assert_close(only_middle(TOKENS).logits, full(TOKENS).logits, atol=1e-5, rtol=0)
    torch.testing.assert_close(only_middle(TOKENS, position_offset=777).logits, only_middle(TOKENS).logits,
                               atol=2e-5, rtol=0)  # still shift-invariant
    assert only_middle.flops_per_token(128) < build("tape", n_layers=3).flops_per_token(128)
    with pytest.raises(ConfigError, match="tape_layers"):
        build("tape", tape_layers=[0, 5])
    with pytest.raises(ConfigError, match="tape_layers: applies to pe=tape"):
        build("rope", tape_layers=[0])


@pytest.mark.parametrize("overrides", [{"tape_equivariant": False}, {"n_layers": 3, "tape_layers": [1]}])
def test_ablations_export_with_verified_logits(tmp_path, overrides):
    from transformers import AutoModelForCausalLM

    model = build("tape", **overrides)
    randomize_tape(model)
    result = export_model(model, str(tmp_path / "hf"))
    assert result["verification"]["passed"]
    theirs = AutoModelForCausalLM.from_pretrained(tmp_path / "hf", trust_remote_code=True).eval()
    with torch.no_grad():
        diff = (theirs(input_ids=TOKENS, use_cache=False).logits - model(TOKENS).logits).abs().max()
    assert diff <= 1e-4
    cached = theirs.generate(TOKENS[:1, :8], max_new_tokens=8, do_sample=False)
    assert torch.equal(cached, model.generate(TOKENS[:1, :8], 8))


def test_the_non_equivariant_ablation_builds_no_fused_update_module(monkeypatch):
    """tape_equivariant=false has no fused MLP-side kernel: its layers build the non-equivariant module alone. Building
    the fused module first and replacing it allocated parameters for nothing (partitioned ones under ZeRO-3) and moved
    the initialisation's random stream."""
    from tapetrain.model import transformer

    built = []

    class Counted(transformer.TapeMlpUpdateWithKernels):
        def __new__(cls, *args, **kwargs):
            built.append(args)
            return super().__new__(cls)

    monkeypatch.setattr(transformer, "TapeMlpUpdateWithKernels", Counted)
    model = transformer.Transformer(preset_config("tiny", pe="tape", n_layers=3, tape_equivariant=False))
    assert built == []
    assert all(not isinstance(layer.tape_mlp, TapeMlpUpdate) for layer in model.layers)
    transformer.Transformer(preset_config("tiny", pe="tape", n_layers=3))
    assert len(built) == 2  # the equivariant model: layers 0 and 1 (the last layer updates no E)
