"""A TAPE model with model.tape_fused_updates=true computes what the eager model computes: loss and every gradient,
fp32, through the real decoder (GQA, odd T, 'full' and 'gain' head mix, a tiled MLP, a KV-cached generation step),
and a compiled layer keeps one graph. Without CUDA the kernels run in Triton's CPU interpreter (TRITON_INTERPRET=1,
set before triton is imported). The kernels alone: tests/unit/test_kernel_tape_{mlp_update,rotation,head_mix}.py."""

from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"
pytest.importorskip("triton")

from tests.unit.model_helpers import (  # noqa: E402
    assert_reference_grads_nonzero,
    build,
    randomize_tape,
)

DEV = torch.device("cuda" if torch.cuda.is_available() else "cpu")


def _loss_and_grads(fused: bool, t: int = 13, **overrides) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    model = build("tape", tape_fused_updates=fused, n_layers=3, **overrides).to(DEV).train()
    randomize_tape(model)
    gen = torch.Generator().manual_seed(3)
    ids = torch.randint(0, model.cfg.vocab_size, (2, t), generator=gen).to(DEV)
    loss = model(ids, labels=ids).loss
    loss.backward()
    return loss.detach(), {n: p.grad for n, p in model.named_parameters() if p.grad is not None}


def _calls(monkeypatch) -> dict[str, int]:
    """Count the fused ops the model calls, so a test knows the kernels (not the eager fallback) ran."""
    from tapetrain.kernels import tape_head_mix, tape_mlp_update, tape_rotation

    counts = {"rotation": 0, "head_mix": 0, "mlp_update": 0}
    for module, name, key in ((tape_rotation, "tape_rotate_qk", "rotation"),
                              (tape_head_mix, "tape_head_mix", "head_mix"),
                              (tape_mlp_update, "tape_mlp_update", "mlp_update")):
        real = getattr(module, name)

        def counted(*args, _real=real, _key=key, **kwargs):
            counts[_key] += 1
            return _real(*args, **kwargs)

        monkeypatch.setattr(module, name, counted)
    return counts


@pytest.mark.parametrize("overrides", [
    {},  # tiny: 4 heads over 2 KV heads (GQA), 'full' head mix
    {"n_kv_heads": None, "tape_head_mix": "gain"},
    {"tiled_mlp": 3},
], ids=["gqa-full", "mha-gain", "tiled-mlp"])
def test_fused_updates_train_like_eager(overrides, monkeypatch):
    ref_loss, ref = _loss_and_grads(False, **overrides)
    assert_reference_grads_nonzero(ref, ref.keys())
    calls = _calls(monkeypatch)
    loss, grads = _loss_and_grads(True, **overrides)
    # 3 layers: layers 0 and 1 update E (the last one's would be dropped), so each op runs twice (per tile if tiled)
    assert calls["rotation"] >= 2 and calls["head_mix"] == 2 and calls["mlp_update"] >= 2, calls
    torch.testing.assert_close(loss, ref_loss, rtol=1e-5, atol=1e-6)
    assert grads.keys() == ref.keys()
    for name in ref:
        torch.testing.assert_close(grads[name], ref[name], rtol=1e-5, atol=1e-6, msg=lambda m, n=name: f"{n}: {m}")


def test_the_ablation_without_equivariance_stays_eager(monkeypatch):
    calls = _calls(monkeypatch)
    loss, _ = _loss_and_grads(True, tape_equivariant=False)
    ref_loss, _ = _loss_and_grads(False, tape_equivariant=False)
    assert calls["mlp_update"] == 0 and calls["rotation"] >= 2, calls  # its MLP update has no fused kernel
    torch.testing.assert_close(loss, ref_loss, rtol=1e-5, atol=1e-6)


def test_generation_with_a_kv_cache_matches_eager():
    outs = []
    for fused in (False, True):
        model = build("tape", tape_fused_updates=fused).to(DEV)
        randomize_tape(model)
        prompt = torch.randint(0, model.cfg.vocab_size, (1, 5), generator=torch.Generator().manual_seed(1)).to(DEV)
        with torch.no_grad():
            outs.append(model.generate(prompt, max_new_tokens=4, temperature=0.0))
    assert torch.equal(outs[0], outs[1])


def test_a_compiled_tape_layer_keeps_one_graph():
    model = build("tape", tape_fused_updates=True).to(DEV)
    randomize_tape(model)
    layer = model.layers[0]
    b, t, cfg = 2, 7, model.cfg
    x = torch.randn(b, t, cfg.d_model, device=DEV)
    positions = model.pe.default_positions(b, t, 0, 0, DEV, False)
    ctx = model.pe.context(positions, positions, x.dtype)
    state = ctx.tape_init.contiguous() + 0.1 * torch.randn(b, t, cfg.n_heads, cfg.head_dim, device=DEV)
    explain = torch._dynamo.explain(lambda x, s: layer(x, ctx, s, model.pe))(x, state)
    assert explain.graph_break_count == 0, explain.break_reasons
    assert explain.graph_count == 1
