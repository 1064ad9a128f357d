"""Whole-model checks that need CUDA: the Triton backend against SDPA in bf16, and `model.compile` on GPU with
the fused kernel as an opaque custom op (skipped without CUDA; run by tools/gpu_check.sh)."""

from __future__ import annotations

import pytest
import torch

from tapetrain.model import Transformer, preset_config
from tests.unit.model_helpers import assert_reference_grads_nonzero, randomize_tape, trainable_names

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


def _model(backend: str, head_dim: int, pe: str = "tape", **extra) -> Transformer:
    torch.manual_seed(0)
    cfg = preset_config(
        "tiny", pe=pe, d_model=4 * head_dim, n_heads=4, n_kv_heads=2, n_layers=3, max_seq_len=512,
        vocab_size=1024, attn_backend=backend, **extra,
    )  # fmt: skip
    model = Transformer(cfg)
    randomize_tape(model, std=0.05)  # every TAPE weight non-zero, so the E stream and its gradients matter
    return model.cuda().to(torch.bfloat16)


def _loss_and_grads(model: Transformer, ids: torch.Tensor) -> tuple[float, dict[str, torch.Tensor]]:
    model.zero_grad(set_to_none=True)
    loss = model(ids[:, :-1], labels=ids[:, 1:]).loss
    loss.backward()
    grads = {n: p.grad.float().clone() for n, p in model.named_parameters() if p.grad is not None}
    assert_reference_grads_nonzero(grads, trainable_names(model))  # no comparison of 0 against 0
    return float(loss), grads


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).norm() / b.norm().clamp_min(1e-12))


@pytest.mark.verifies(kind="attention", backend="triton", dtypes=["bf16"], e=True, gqa=True)
@pytest.mark.verifies(kind="attention", backend="sdpa", dtypes=["bf16"], e=True, gqa=True)
@pytest.mark.verifies(kind="attention", backend="sdpa", dtypes=["bf16"], e=False, gqa=True)
@pytest.mark.parametrize("head_dim", [64, 128])
def test_triton_backend_matches_sdpa(head_dim):
    ids = torch.randint(0, 1024, (2, 513), device="cuda")
    loss_t, grads_t = _loss_and_grads(_model("triton", head_dim), ids)
    loss_s, grads_s = _loss_and_grads(_model("sdpa", head_dim), ids)
    assert loss_t == pytest.approx(loss_s, rel=2e-3)
    assert grads_t.keys() == grads_s.keys()
    worst = max((_rel(grads_t[n], grads_s[n]), n) for n in grads_s)
    assert worst[0] < 5e-2, worst  # bf16 end to end; a dropped gradient term would be O(1)


def test_compiled_layers_match_eager_on_gpu():
    import torch._dynamo

    ids = torch.randint(0, 1024, (2, 257), device="cuda")
    eager = _model("triton", 64)
    compiled = _model("triton", 64, compile=True)
    x = compiled.embed(ids[:, :-1])
    pos = compiled.pe.default_positions(2, 256, 0, 0, x.device)
    ctx = compiled.pe.context(pos, pos, x.dtype)
    state = ctx.tape_init  # token-major (B, T, M, D), as Transformer.forward passes it
    explained = torch._dynamo.explain(compiled.layers[0].forward)(x, ctx, state, compiled.pe)
    assert explained.graph_break_count == 0, explained.break_reasons  # the Triton op is opaque, not a break
    loss_e, grads_e = _loss_and_grads(eager, ids)
    loss_c, grads_c = _loss_and_grads(compiled, ids)
    assert loss_c == pytest.approx(loss_e, rel=2e-3)
    assert max(_rel(grads_c[n], grads_e[n]) for n in grads_e) < 5e-2


@pytest.mark.parametrize("backend, pe", [("triton", "tape"), ("flash", "rope")])
def test_rope_scaling_temperature_reaches_the_fused_backends(backend, pe, verifies):
    """YaRN's temperature is the attention scale of every backend (Qwen3 layout: q/k norms too): the fused kernels
    equal SDPA in loss and gradients."""
    verifies(kind="attention", backend=backend, dtypes=["bf16"], e=pe == "tape", gqa=True)
    if backend == "flash":
        pytest.importorskip("flash_attn.flash_attn_interface")  # flash-attn 2 (4 alone: a namespace)
    extra = dict(family="qwen3", rope_scaling={"rope_type": "yarn", "factor": 4.0,
                                               "original_max_position_embeddings": 128})
    ids = torch.randint(0, 1024, (2, 513), device="cuda")
    loss_f, grads_f = _loss_and_grads(_model(backend, 64, pe, **extra), ids)
    loss_s, grads_s = _loss_and_grads(_model("sdpa", 64, pe, **extra), ids)
    assert loss_f == pytest.approx(loss_s, rel=2e-3)
    assert max(_rel(grads_f[n], grads_s[n]) for n in grads_s) < 5e-2
