"""The memory model's activation term against the bytes autograd really saves (exact, via saved_tensors_hooks)."""

import pytest
import torch

from tapetrain.model import Transformer, preset_config
from tapetrain.train.memory import (
    estimate_memory,
    head_saved_bytes,
    layer_activation_bytes,
    loss_bytes,
    measure_saved_activation_bytes,
)


@pytest.mark.parametrize("pe", ["rope", "tape"])
@pytest.mark.parametrize("backend", ["chunked", "plain"])
def test_activation_estimate_within_5_percent_of_measurement(pe, backend):
    """Multi-head attention: with GQA, CPU SDPA expands k and v to every query head and keeps them (fused GPU
    kernels, which the model assumes, do not), so there the measurement is ~6% above the estimate."""
    cfg = preset_config("tiny", pe=pe, n_layers=3, n_kv_heads=4, attn_backend="sdpa", loss_backend=backend)
    model = Transformer(cfg)
    b, s = 2, 96
    measured = measure_saved_activation_bytes(model, torch.randint(0, cfg.vocab_size, (b, s + 1)))
    layers = (cfg.n_layers - 1) * layer_activation_bytes(cfg, b, s, 4) + layer_activation_bytes(
        cfg, b, s, 4, updates_state=False
    )
    estimated = layers + head_saved_bytes(cfg, b, s, 4, fused=backend != "plain")
    assert abs(estimated / measured - 1) < 0.05, (estimated, measured)


def test_zero_stages_shard_what_they_should():
    cfg = preset_config("llama2-7b", pe="rope", max_seq_len=8192)
    common = dict(seq_len=8192, micro_batch=1, world_size=8, trainable_params=6_738_415_616,
                  total_params=6_738_415_616, activation_checkpointing=True)
    z2 = estimate_memory(cfg, zero_stage=2, **common)
    z3 = estimate_memory(cfg, zero_stage=3, **common)
    off = estimate_memory(cfg, zero_stage=3, offload_optimizer=True, offload_params=True, **common)
    assert z3.weights_gb == pytest.approx(z2.weights_gb / 8)
    assert z2.optimizer_gb == pytest.approx(12 * 6_738_415_616 / 8 / 2**30)
    assert off.optimizer_gb == 0 and off.weights_gb == 0 and off.host_offload_gb > 0
    assert z3.total_gpu_gb < 80  # Llama-2-7B full fine-tuning at 8K fits 8×A100-80GB with ZeRO-3 + checkpointing


def test_fused_loss_column_for_llama2_7b_at_8k():
    """The logits column: 2.44 GiB for the plain path (bf16, 8192 tokens, V = 32000) and about 1 GiB fused (dW's
    fp32 accumulator and one 256 MiB chunk dominate); estimate_memory uses the fused figure unless told not to."""
    cfg = preset_config("llama2-7b", pe="tape", max_seq_len=8192)
    plain, fused = loss_bytes(cfg, 1, 8192, fused=False), loss_bytes(cfg, 1, 8192)
    assert plain / 2**30 == pytest.approx(2.44, abs=0.01)
    assert fused / 2**30 == pytest.approx(1.05, abs=0.01) and fused < plain / 2
    common = dict(seq_len=8192, micro_batch=1, world_size=8, zero_stage=3, trainable_params=10**9,
                  total_params=7 * 10**9, activation_checkpointing=True)
    assert estimate_memory(cfg, **common).logits_gb == pytest.approx(fused / 2**30)
    assert estimate_memory(cfg, fused_loss=False, **common).logits_gb == pytest.approx(plain / 2**30)
    # The fused term does not grow with the vocabulary × tokens product: 4× the tokens adds only dh
    assert loss_bytes(cfg, 4, 8192) - fused == 3 * 8192 * 4096 * 2
    # A frozen LM head (TAPE PEFT) keeps no dW: dh plus one chunk's logits and their bf16 copy
    chunk = 2**28 // (4 * 32000)
    assert loss_bytes(cfg, 1, 8192, head_trainable=False) == 8192 * 4096 * 2 + chunk * 32000 * 6
