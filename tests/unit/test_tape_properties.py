"""The five TAPE properties listed in README.md "TAPE as implemented", with every TAPE weight randomised to
non-zero values (fp32); shift and O(2) invariance under every RoPE scaling too."""

import pytest
import torch
from model_helpers import SCALING_THETA, SCALINGS, build, randomize_tape

from tapetrain.model.positions import rotate_pairs

TOKENS = torch.randint(0, 512, (2, 24), generator=torch.Generator().manual_seed(3))


@pytest.fixture(params=["full", "gain"])
def tape_model(request):
    model = build("tape", tape_head_mix=request.param)
    randomize_tape(model)
    return model


def test_randomised_tape_differs_from_rope(tape_model):
    # Guards the other tests: with active updates the logits must move away from the RoPE twin.
    rope = build("rope")
    rope.load_state_dict(tape_model.state_dict(), strict=False)
    diff = (tape_model(TOKENS).logits - rope(TOKENS).logits).abs().max()
    assert diff > 1e-2


def test_shift_invariance(tape_model):
    base = tape_model(TOKENS, position_offset=0).logits
    shifted = tape_model(TOKENS, position_offset=1000).logits
    torch.testing.assert_close(shifted, base, atol=2e-5, rtol=0)


def test_o2_invariance(tape_model):
    assert_o2_invariant(tape_model)


def assert_o2_invariant(tape_model):
    b, t = TOKENS.shape
    cfg = tape_model.cfg
    positions = torch.arange(t, dtype=torch.float64).expand(b, t)
    state = tape_model.pe.context(positions, positions, torch.float32).tape_init
    phi = torch.rand(cfg.head_dim // 2, generator=torch.Generator().manual_seed(5), dtype=torch.float64) * 6.283
    rotated = rotate_pairs(state, torch.cos(phi).float(), torch.sin(phi).float())  # every block by its own angle
    assert (rotated - state).abs().max() > 0.1
    base = tape_model(TOKENS, tape_state=state).logits
    turned = tape_model(TOKENS, tape_state=rotated).logits
    torch.testing.assert_close(turned, base, atol=2e-5, rtol=0)


def test_permutation_equivariance_non_causal():
    model = build("tape", causal=False)
    randomize_tape(model)
    t = TOKENS.shape[1]
    positions = torch.arange(t, dtype=torch.float64)
    perm = torch.randperm(t, generator=torch.Generator().manual_seed(7))
    base = model(TOKENS, positions=positions).logits
    permuted = model(TOKENS[:, perm], positions=positions[perm]).logits
    torch.testing.assert_close(permuted, base[:, perm], atol=2e-5, rtol=0)
    # Causal mode is, as it must be, not permutation-equivariant: the check above is not vacuous.
    causal = build("tape")
    causal.load_state_dict(model.state_dict())
    moved = causal(TOKENS[:, perm], positions=positions[perm]).logits
    assert (moved - causal(TOKENS, positions=positions).logits[:, perm]).abs().max() > 1e-2


def test_causality(tape_model):
    cut = 10
    changed = TOKENS.clone()
    changed[:, cut + 1 :] = torch.randint(0, 512, changed[:, cut + 1 :].shape)
    a = tape_model(TOKENS).logits
    b = tape_model(changed).logits
    torch.testing.assert_close(b[:, : cut + 1], a[:, : cut + 1], atol=0, rtol=0)
    assert (b[:, cut + 1 :] - a[:, cut + 1 :]).abs().max() > 1e-3


@pytest.mark.parametrize("head_mix", ["full", "gain"])
def test_retrofit_identity_with_rope(head_mix):
    tape = build("tape", tape_head_mix=head_mix)
    randomize_tape(tape)
    with torch.no_grad():  # W_A = W_down = 0; W_x and W_up stay random and non-zero
        for layer in tape.layers[:-1]:
            layer.attn.tape_mix.weight.zero_()
            layer.tape_mlp.down_proj.weight.zero_()
    rope = build("rope", seed=123)
    missing, unexpected = rope.load_state_dict(tape.state_dict(), strict=False)
    assert not missing and all("tape" in k for k in unexpected)
    torch.testing.assert_close(tape(TOKENS).logits, rope(TOKENS).logits, atol=1e-5, rtol=0)


def test_fresh_tape_model_equals_rope_twin():
    tape, rope = build("tape"), build("rope")
    rope.load_state_dict(tape.state_dict(), strict=False)
    torch.testing.assert_close(tape(TOKENS).logits, rope(TOKENS).logits, atol=1e-5, rtol=0)


def test_ablations_remove_modules_and_stay_invariant():
    for attn_update, mlp_update in [(False, True), (True, False), (False, False)]:
        model = build("tape", tape_attn_update=attn_update, tape_mlp_update=mlp_update)
        names = [n for n, _ in model.named_parameters()]
        assert any("tape_mix" in n for n in names) == attn_update
        assert any("tape_mlp" in n for n in names) == mlp_update
        randomize_tape(model)
        torch.testing.assert_close(model(TOKENS, position_offset=777).logits, model(TOKENS).logits, atol=2e-5, rtol=0)


@pytest.mark.parametrize("kind", list(SCALINGS))
def test_shift_and_o2_invariance_under_every_rope_scaling(kind):
    """24 tokens reach past L₀ = 16: dynamic NTK has grown its base (from the span of positions, which a shift keeps)
    and longrope uses its long factors; yarn's temperature is on the logits, not on E."""
    model = build("tape", rope_theta=SCALING_THETA, rope_scaling=SCALINGS[kind])
    randomize_tape(model)
    base = model(TOKENS).logits
    torch.testing.assert_close(model(TOKENS, position_offset=1000).logits, base, atol=2e-5, rtol=0)
    assert_o2_invariant(model)
    if kind != "default":  # the scaling changes what the model computes at this length
        plain = build("tape", rope_theta=SCALING_THETA)
        plain.load_state_dict(model.state_dict())
        assert (plain(TOKENS).logits - base).abs().max() > 1e-3
