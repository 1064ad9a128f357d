"""train.float8 on a GPU with FP8 tensor cores (compute capability 8.9+; run by tools/gpu_check.sh): the converted
model's forward and backward through torch._scaled_mm against the same model in bf16, eager and compiled."""

from __future__ import annotations

import pytest
import torch

from tapetrain.model import Transformer, preset_config
from tapetrain.train.float8 import MIN_CAPABILITY, convert_model_to_float8, resolve_float8
from tests.unit.model_helpers import assert_reference_grads_nonzero, randomize_tape, trainable_names

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
    pytest.mark.skipif(torch.cuda.is_available() and torch.cuda.get_device_capability() < MIN_CAPABILITY,
                       reason="needs FP8 tensor cores (compute capability 8.9+)"),
]


def _model(pe: str, compiled: bool) -> Transformer:
    """Projections of 512 x 1536: dimensions _scaled_mm takes, big enough for FP8 rounding to average out."""
    torch.manual_seed(0)
    cfg = preset_config("tiny", pe=pe, d_model=512, n_heads=4, n_kv_heads=2, n_layers=3, ffn_hidden=1536,
                        max_seq_len=512, vocab_size=1024, compile=compiled)
    model = Transformer(cfg)
    randomize_tape(model, std=0.05)
    return model.cuda().to(torch.bfloat16)


def _loss_and_grads(model: Transformer, ids: torch.Tensor) -> tuple[float, dict[str, torch.Tensor]]:
    loss = model(ids[:, :-1], labels=ids[:, 1:]).loss
    loss.backward()
    grads = {n: p.grad.float().clone() for n, p in model.named_parameters() if p.grad is not None}
    assert_reference_grads_nonzero(grads, trainable_names(model))
    return float(loss), grads


@pytest.mark.parametrize("compiled", [False, True])
@pytest.mark.parametrize("recipe", ["rowwise", "tensorwise"])
@pytest.mark.parametrize("pe", ["tape", "rope"])
def test_float8_forward_backward_against_bf16(pe, recipe, compiled, record_property):
    assert resolve_float8(recipe, torch.device("cuda"), emulate=False) == recipe
    ids = torch.randint(0, 1024, (4, 257), device="cuda", generator=torch.Generator("cuda").manual_seed(1))
    reference = _model(pe, compiled)
    model = _model(pe, compiled)
    conversion = convert_model_to_float8(model, recipe, emulate=False)
    assert len(conversion.converted) == 21 and "lm_head" in conversion.skipped
    loss_ref, grads_ref = _loss_and_grads(reference, ids)
    loss, grads = _loss_and_grads(model, ids)
    assert loss != loss_ref and abs(loss - loss_ref) < 0.01 * loss_ref  # FP8 ran, and rounds little
    rel = {name: float((grads[name] - grads_ref[name]).norm() / grads_ref[name].norm())
           for name in ("layers.1.attn.q_proj.weight", "layers.1.mlp.down_proj.weight", "embed.weight")}
    record_property("grad_rel_err", rel)
    # 0.25, not the emulation's 0.15 (tests/unit/test_float8.py): on the H200 (2026-11-28 campaign, gpu-tests.log)
    # q_proj's gradient differed by 0.177-0.191 in all 8 cases. Hopper's FP8 tensor cores accumulate in reduced
    # precision, which the emulation (an fp32 matmul of FP8-rounded inputs) does not model; the loss still agrees
    # within 1% (above).
    assert all(r < 0.25 for r in rel.values()), rel
