"""model.tiled_mlp: SwiGLU and TAPE's MLP-side update over token chunks, recomputed in backward (model/tiling.py).

Exact against the untiled model (fp32 logits, loss and every gradient within 1e-6), with and without activation
checkpointing; the bytes autograd saves drop by what the memory model says the tile no longer keeps."""

import dataclasses

import pytest
import torch
from model_helpers import assert_reference_grads_nonzero, build, randomize_tape, trainable_names

from tapetrain.model import ModelConfig, Transformer, preset_config
from tapetrain.model.tiling import tile_count
from tapetrain.train.memory import layer_activation_bytes, measure_saved_activation_bytes, mlp_intermediate_values

TOKENS = torch.randint(0, 512, (2, 49), generator=torch.Generator().manual_seed(3))


def run(model: Transformer) -> tuple[torch.Tensor, torch.Tensor, dict[str, torch.Tensor]]:
    model.train()
    inputs, labels = TOKENS[:, :-1], TOKENS[:, 1:]
    logits = model(inputs).logits
    loss = model(inputs, labels=labels).loss
    loss.backward()
    return logits.detach(), loss.detach(), {n: p.grad for n, p in model.named_parameters()}


@pytest.mark.parametrize("pe", ["tape", "rope"])
@pytest.mark.parametrize("checkpointing", [False, True])
def test_tiled_mlp_is_exact(pe, checkpointing):
    reference = build(pe, activation_checkpointing=checkpointing, loss_backend="plain")
    if pe == "tape":
        randomize_tape(reference)  # W_down starts at zero: make the MLP-side update of E matter
    tiled = build(pe, activation_checkpointing=checkpointing, loss_backend="plain", tiled_mlp=5)  # 48 = 10+…+8
    tiled.load_state_dict(reference.state_dict())
    logits, loss, grads = run(reference)
    t_logits, t_loss, t_grads = run(tiled)
    torch.testing.assert_close(t_logits, logits, atol=1e-6, rtol=0)
    torch.testing.assert_close(t_loss, loss, atol=1e-6, rtol=0)
    assert grads.keys() == t_grads.keys()
    assert_reference_grads_nonzero(grads, trainable_names(reference))
    for name, grad in grads.items():
        torch.testing.assert_close(t_grads[name], grad, atol=1e-6, rtol=0, msg=name)


@pytest.mark.parametrize("pe", ["tape", "rope"])
def test_saved_bytes_drop_by_the_tiles_intermediates(pe):
    cfg = preset_config("tiny", pe=pe, n_layers=3, n_kv_heads=4, attn_backend="sdpa", loss_backend="chunked")
    b, s = 2, 96
    tokens = torch.randint(0, cfg.vocab_size, (b, s + 1), generator=torch.Generator().manual_seed(0))
    saved = {}
    for chunks in (0, 4):
        torch.manual_seed(0)
        saved[chunks] = measure_saved_activation_bytes(Transformer(dataclasses.replace(cfg, tiled_mlp=chunks)), tokens)
    updating = [cfg.updates_tape_state(i) for i in range(cfg.n_layers)]
    predicted = sum(b * s * mlp_intermediate_values(cfg, u) * 4 for u in updating)
    assert saved[0] - saved[4] == predicted
    per_layer = [
        layer_activation_bytes(cfg, b, s, 4, u) - layer_activation_bytes(cfg, b, s, 4, u, tiled_mlp=4) for u in updating
    ]
    assert sum(per_layer) == predicted


def test_tile_count_and_config():
    assert tile_count(0, 100, 64) == tile_count(1, 100, 64) == 1
    assert tile_count(8, 5, 64) == 5 and tile_count("auto", 4096, 4096) == 1 and tile_count("auto", 4097, 4096) == 2
    ModelConfig(tiled_mlp="auto").validate()
    for bad in (-1, "some", True):
        with pytest.raises(Exception, match="tiled_mlp"):
            ModelConfig(tiled_mlp=bad).validate()


def test_generation_with_tiling_is_unchanged():
    plain, tiled = build("tape"), build("tape", tiled_mlp=3)
    tiled.load_state_dict(plain.state_dict())
    prompt = TOKENS[:1, :20]
    assert torch.equal(plain.generate(prompt, 5), tiled.generate(prompt, 5))
