"""The baselines as the TAPE paper ran them (the TAPE repository's xpos.py, fire.py, randrope.py), each against a
re-statement of that code's formulas written out here, plus the shift-invariance rule of random position offsets.

Restated (for understanding; no code copied):
  xpos.py     XposRotaryEmbedding(dim, max_position_embeddings=1024), scale_base 2048: t = arange(max(1024, T)),
              scale = (arange(0, D, 2) + 0.4·D) / (1.4·D), power = (t − max(1024, T) // 2) / 2048, factor =
              scale ** power (both halves); q ← (q·cos + rotate_half(q)·sin)·factor, k ← (...)/factor.
  fire.py     FIRE(num_heads, mlp_width=32, init_c=0.1, init_L=512, eps=1e-6) in every attention layer: positions
              = arange(T); rel = log(|c·(i − j)| + 1); norm = log(|c·max(i, |L_mult·init_L|)| + 1); bias =
              mlp(rel / (norm + eps)); L_mult starts at 1, init_L is frozen.
  randrope.py RandomRotaryEmbedding: max_seq_len_cached = 2·max_position_embeddings; every forward (training and
              evaluation) of every layer draws t = sort(randperm(max_seq_len_cached)[:T]) (the range grows to T
              when T is larger).
"""

import math

import pytest
import torch
from model_helpers import build, randomize_fire, randomize_tape

from tapetrain.config import load_run_config
from tapetrain.errors import ConfigError
from tapetrain.model import POSITIONAL_ENCODINGS, ModelConfig
from tapetrain.model import randpe as randpe_module
from tapetrain.model.attention import attention
from tapetrain.model.positions import rope_angles, rotate_pairs
from tapetrain.model.rope_scaling import rope_frequencies
from tapetrain.model.xpos import XposDecay, xpos_zeta

# ---- xPos --------------------------------------------------------------------------------------------------------


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def tape_repo_xpos_attention(q, k, v, max_len: int, scale_base: float) -> torch.Tensor:
    """xpos.py's eager attention over positions 0..T−1 (float64): q, k, v (B, H, T, D) before any rotation."""
    t, d = q.shape[2], q.shape[3]
    cached = max(max_len, t)
    inv_freq = 1.0 / (10000 ** (torch.arange(0, d, 2, dtype=torch.float64) / d))
    pos = torch.arange(cached, dtype=torch.float64)
    freqs = torch.cat([torch.outer(pos, inv_freq)] * 2, dim=-1)[:t]  # (T, D)
    scale = (torch.arange(0, d, 2, dtype=torch.float64) + 0.4 * d) / (1.4 * d)
    power = (pos - cached // 2) / scale_base
    factor = torch.cat([scale ** power[:, None]] * 2, dim=-1)[:t]  # (T, D)
    q_embed = (q * freqs.cos() + rotate_half(q) * freqs.sin()) * factor
    k_embed = (k * freqs.cos() + rotate_half(k) * freqs.sin()) / factor
    scores = q_embed @ k_embed.transpose(-1, -2) / math.sqrt(d)
    scores = scores.masked_fill(torch.ones(t, t, dtype=torch.bool).triu(1), float("-inf"))
    return torch.softmax(scores, dim=-1) @ v


@pytest.mark.parametrize("t, scale_base", [(300, 64.0), (2100, 2048.0)])  # 5 and 2 query blocks
def test_xpos_matches_tape_repository(t, scale_base):
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 2, t, 8, generator=g, dtype=torch.float64) for _ in range(3))
    expected = tape_repo_xpos_attention(q, k, v, max_len=1024, scale_base=scale_base)
    pos = torch.arange(t, dtype=torch.float64)[None]
    inv_freq = rope_frequencies(8, {"rope_type": "default", "rope_theta": 10000.0})
    cos, sin = (x[:, None] for x in rope_angles(pos, inv_freq))
    decay = XposDecay(xpos_zeta(8), scale_base, pos, pos)
    for backend in ("eager", "sdpa"):
        out, _ = attention(rotate_pairs(q, cos, sin), rotate_pairs(k, cos, sin), v, decay=decay, backend=backend)
        torch.testing.assert_close(out, expected, atol=1e-6, rtol=0)  # the backends' softmax runs in fp32
    assert ModelConfig().xpos_scale_base == 2048.0


def test_xpos_fp16_is_finite_at_32k_positions():
    ids = torch.randint(0, 512, (1, 64), generator=torch.Generator().manual_seed(1))
    exact = build("xpos", init_std=0.05).double()
    half = build("xpos", init_std=0.05).half()
    offset = 32768 - 64  # positions 32704 .. 32767
    with torch.no_grad():
        ref = exact(ids, position_offset=offset).logits
        out = half(ids, position_offset=offset).logits.double()
        assert torch.isfinite(out).all()
        torch.testing.assert_close(out, ref, atol=2e-2, rtol=2e-2)
        # The logits depend on position differences only (ζ^((i−j)/γ)): the offset changes nothing.
        torch.testing.assert_close(exact(ids).logits, ref, atol=1e-9, rtol=0)


def test_xpos_fp16_long_span_in_many_blocks():
    """γ = 16 with 1024 tokens spans 64 γ (a 131K-token sequence at γ = 2048): plain xPos factors would reach
    3.5^32 ≈ 10^17, past even fp32; block by block fp16 stays finite and close to float64."""
    ids = torch.randint(0, 512, (1, 1024), generator=torch.Generator().manual_seed(2))
    exact = build("xpos", init_std=0.05, xpos_scale_base=16.0).double()
    half = build("xpos", init_std=0.05, xpos_scale_base=16.0).half()
    with torch.no_grad():
        out = half(ids).logits.double()
        assert torch.isfinite(out).all()
        torch.testing.assert_close(out, exact(ids).logits, atol=3e-2, rtol=3e-2)


# ---- FIRE --------------------------------------------------------------------------------------------------------


def tape_repo_fire_bias(mlp, c: float, l_mult: float, t: int, init_l: float = 512.0, eps: float = 1e-6):
    positions = torch.arange(t, dtype=torch.float64)
    rel = positions[:, None] - positions[None, :]
    threshold = abs(l_mult * init_l)
    norm = torch.maximum(positions, torch.tensor(threshold, dtype=torch.float64))[:, None]
    rel = torch.log(torch.abs(c * rel) + 1)
    norm = torch.log(torch.abs(c * norm) + 1)
    return mlp((rel / (norm + eps))[..., None]).unsqueeze(0).permute(0, 3, 1, 2)  # (1, H, T, T)


def test_fire_is_per_layer_with_the_baseline_init():
    model = build("fire")
    names = {n for n, _ in model.named_parameters() if "fire" in n}
    assert not any(n.startswith("pe.") for n in names)
    for i, layer in enumerate(model.layers):
        assert {f"layers.{i}.fire.c", f"layers.{i}.fire.threshold_scale"} <= names
        assert float(layer.fire.c.detach()) == pytest.approx(0.1) and float(layer.fire.threshold_scale.detach()) == 1.0
        assert float(layer.fire.threshold.detach()) == 512.0 and layer.fire.eps == 1e-6
        assert layer.fire.mlp[0].out_features == 32
    shared = build("fire", fire_shared=True)
    assert {n for n, _ in shared.named_parameters() if "fire" in n} == {
        "pe.fire.mlp.0.weight", "pe.fire.mlp.0.bias", "pe.fire.mlp.2.weight", "pe.fire.mlp.2.bias", "pe.fire.c",
        "pe.fire.threshold_scale"}


def test_fire_bias_matches_tape_repository():
    model = build("fire").double()
    t = 700  # beyond L = 512 for the later queries
    pos = torch.arange(t, dtype=torch.float64)[None]
    with torch.no_grad():
        for layer, (c, m) in zip(model.layers, [(0.3, 1.7), (-0.05, 0.4)], strict=True):
            layer.fire.c.fill_(c)
            layer.fire.threshold_scale.fill_(m)
            expected = tape_repo_fire_bias(layer.fire.mlp, c, m, t)
            torch.testing.assert_close(layer.fire(pos, pos), expected, atol=1e-12, rtol=0)
        # Each layer's own module shapes its attention: changing layer 1's FIRE changes the logits.
        ids = torch.randint(0, 512, (1, 40))
        before = model(ids).logits
        model.layers[1].fire.mlp[2].weight.mul_(5.0)  # (a per-head constant bias would cancel in the softmax)
        assert (model(ids).logits - before).abs().max() > 1e-3


def test_fire_threshold_moves_through_its_multiplier():
    """One Adam step moves L by about lr·L₀ (the multiplier's step times 512), not by lr."""
    model = build("fire").train()
    layer = model.layers[0].fire
    params = [p for n, p in model.named_parameters() if "threshold_scale" in n]
    opt = torch.optim.Adam(params, lr=1e-3)
    before = float(layer.threshold.detach())
    model(torch.randint(0, 512, (2, 64)), labels=torch.randint(0, 512, (2, 64))).loss.backward()
    assert layer.threshold_scale.grad is not None and layer.threshold_scale.grad.abs() > 0
    opt.step()
    assert abs(float(layer.threshold.detach()) - before) == pytest.approx(1e-3 * 512, rel=1e-3)


# ---- RandPE ------------------------------------------------------------------------------------------------------


def tape_repo_randpe_draw(t: int, max_len: int) -> torch.Tensor:
    cached = 2 * max_len
    if t > cached:
        cached = t
    return torch.sort(torch.randperm(cached)[:t]).values.to(torch.float64)


def recorded_draws(monkeypatch) -> list[torch.Tensor]:
    draws: list[torch.Tensor] = []
    real = randpe_module.draw_positions

    def record(*args, **kwargs):
        draws.append(real(*args, **kwargs))
        return draws[-1]

    monkeypatch.setattr("tapetrain.model.positions.draw_positions", record)
    return draws


@pytest.mark.parametrize("t", [100, 300])  # 300 > 2·128: the range grows to T, as the repository's cache does
def test_randpe_draws_are_the_repositorys(t):
    torch.manual_seed(5)
    expected = tape_repo_randpe_draw(t, 128)
    torch.manual_seed(5)
    draw = randpe_module.draw_positions(t, randpe_module.randpe_limit(None, 128), torch.device("cpu"))
    assert torch.equal(draw, expected)


def test_randpe_samples_every_layer_in_training_and_evaluation(monkeypatch):
    draws = recorded_draws(monkeypatch)
    model = build("randpe")  # tiny: max_seq_len 128, 2 layers
    ids = torch.randint(0, 512, (2, 100))
    with torch.no_grad():
        torch.manual_seed(0)
        first = model(ids).logits  # evaluation mode
        torch.manual_seed(0)
        again = model(ids).logits
        third = model(ids).logits
    assert torch.equal(first, again) and (third - first).abs().max() > 1e-4  # seeded, and random
    assert len(draws) == 3 * model.cfg.n_layers  # one draw per layer per forward
    assert not torch.equal(draws[0], draws[1])  # the layers' draws differ
    model.train()
    for _ in range(20):
        model(ids)
    drawn = torch.cat(draws)
    assert drawn.max() < 256 and drawn.max() > 200  # [0, 2·max_seq_len), not the old 4·max_seq_len
    draws.clear()
    shared = build("randpe", randpe_per_layer=False)
    with torch.no_grad():
        shared(ids)
    assert len(draws) == 1


def test_randpe_per_layer_draws_survive_activation_checkpointing():
    """Recomputing a layer in backward must redraw the same positions (checkpointing restores the RNG)."""
    grads = []
    for checkpointing in (False, True):
        model = build("randpe", activation_checkpointing=checkpointing).train()
        ids = torch.randint(0, 512, (2, 64), generator=torch.Generator().manual_seed(2))
        torch.manual_seed(9)
        model(ids, labels=ids).loss.backward()
        grads.append(torch.cat([p.grad.flatten() for p in model.parameters()]))
        assert all(p.grad.abs().max() > 0 for p in model.parameters())  # every parameter's gradient is compared
    torch.testing.assert_close(grads[1], grads[0], atol=1e-6, rtol=1e-5)


def test_randpe_without_eval_sampling_is_the_rope_twin():
    fixed = build("randpe", randpe_sample_at_eval=False)
    rope = build("rope")
    rope.load_state_dict(fixed.state_dict())
    ids = torch.randint(0, 512, (2, 50))
    with torch.no_grad():
        torch.testing.assert_close(fixed(ids).logits, rope(ids).logits, atol=0, rtol=0)
    with pytest.raises(ValueError, match="randpe_max_position"):
        build("randpe", randpe_max_position=64)


# ---- random position offsets -------------------------------------------------------------------------------------

VARIANTS = [(pe, {}) for pe in POSITIONAL_ENCODINGS] + [("tape", {"tape_equivariant": False})]


def offset_effect(pe: str, overrides: dict) -> float:
    """Max |Δlogits| from a global position offset of 2048, float64, with every positional parameter active."""
    if pe == "randpe":
        overrides = {**overrides, "randpe_sample_at_eval": False}
    model = build(pe, **overrides).double()
    if pe == "tape":
        randomize_tape(model)
    randomize_fire(model)
    ids = torch.randint(0, 512, (2, 48), generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        return float((model(ids, position_offset=2048).logits - model(ids).logits).abs().max())


@pytest.mark.parametrize("pe, overrides", VARIANTS, ids=[p + ("-nonequivariant" if o else "") for p, o in VARIANTS])
def test_random_offset_is_allowed_exactly_for_measured_shift_invariance(tmp_path, pe, overrides):
    effect = offset_effect(pe, overrides)
    invariant = effect < 1e-8
    assert invariant or effect > 1e-3  # a clear verdict either way
    assert build(pe, **overrides).cfg.shift_invariant == invariant
    text = "model:\n  preset: tiny\ndata:\n  train: shards\ntrain:\n  steps: 10\ndeepspeed:\n  precision: fp32\n"
    (tmp_path / "run.yaml").write_text(text)
    keys = [f"model.pe={pe}", "train.random_position_offset=2048"]
    keys += [f"model.{k}={str(v).lower()}" for k, v in overrides.items()]
    if invariant:
        assert load_run_config(str(tmp_path / "run.yaml"), keys).train.random_position_offset == 2048
    else:
        with pytest.raises(ConfigError, match="not shift-invariant.*set train.random_position_offset=0"):
            load_run_config(str(tmp_path / "run.yaml"), keys)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_xpos_half_precision_full_32k_sequence_on_gpu(dtype):
    """A whole 32768-token sequence (16 query blocks of γ = 2048) in fp16/bf16 on CUDA, against fp32."""
    ids = torch.randint(0, 512, (1, 32768), generator=torch.Generator().manual_seed(6)).cuda()
    half = build("xpos", init_std=0.05).cuda().to(dtype)
    exact = build("xpos", init_std=0.05).cuda()
    with torch.no_grad():
        out = half(ids).logits.float()
        assert torch.isfinite(out).all()
        ref = exact(ids).logits
        torch.testing.assert_close(out[:, -512:], ref[:, -512:], atol=0.1, rtol=0.05)
