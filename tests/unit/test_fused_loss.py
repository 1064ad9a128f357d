"""The fused (chunked / liger) linear cross-entropy against the plain logits path: loss, gradients, masking,
tied embeddings, errors, and the bytes autograd keeps. ZeRO-3 is in tests/distributed/test_fused_loss_zero3.py."""

import pytest
import torch
import torch.nn.functional as F
from model_helpers import assert_reference_grads_nonzero, build, randomize_tape, trainable_names

from tapetrain.errors import ConfigError
from tapetrain.model import Transformer, preset_config
from tapetrain.model.loss import (
    LMHead,
    chunk_tokens_for,
    count_targets,
    linear_cross_entropy,
    resolve_loss_backend,
)
from tapetrain.train.memory import measure_loss_saved_bytes

TOKENS = torch.randint(0, 512, (3, 21), generator=torch.Generator().manual_seed(5))


def masked_labels(tokens: torch.Tensor) -> torch.Tensor:
    """Labels with scattered -100s and one row that is entirely -100."""
    labels = tokens.clone()
    labels[0, ::3] = -100
    labels[1] = -100
    return labels


def rel_err(actual: torch.Tensor, expected: torch.Tensor) -> float:
    """max |actual − expected| / max |expected|; 0 when both are all zeros (a gradient that is exactly 0 at
    initialisation, as behind TAPE's zero-initialised projections), inf when only the expected one is."""
    actual, expected = actual.detach().double(), expected.detach().double()
    scale = expected.abs().max()
    err = (actual - expected).abs().max()
    if scale == 0:
        return 0.0 if err == 0 else float("inf")
    return float(err / scale)


def loss_and_grads(hidden, weight, labels, **kwargs):
    hidden = hidden.detach().clone().requires_grad_()
    weight = weight.detach().clone().requires_grad_()
    loss = linear_cross_entropy(hidden, weight, labels, **kwargs)
    loss.backward()
    return loss.detach(), hidden.grad, weight.grad


# chunk_mib → tokens per chunk for V = 300: 1 token, 7 tokens (chunks do not divide 63), all 63 in one chunk
@pytest.mark.parametrize("chunk_tokens", [1, 7, 64])
@pytest.mark.parametrize("reduction", ["mean", "sum"])
def test_chunked_equals_plain_loss_and_gradients_fp32(chunk_tokens, reduction):
    gen = torch.Generator().manual_seed(0)
    hidden = torch.randn(3, 21, 32, generator=gen)  # (B, T, C)
    weight = torch.randn(300, 32, generator=gen) * 0.3  # (V, C): O(1)-O(10) logits
    labels = masked_labels(torch.randint(0, 300, (3, 21), generator=gen))
    mib = chunk_tokens * 300 * 4 / 2**20
    assert chunk_tokens_for(300, mib) == chunk_tokens
    plain = loss_and_grads(hidden, weight, labels, backend="plain", reduction=reduction)
    fused = loss_and_grads(hidden, weight, labels, backend="chunked", chunk_mib=mib, reduction=reduction)
    for name, a, b in zip(("loss", "d hidden", "d weight"), fused, plain, strict=True):
        assert rel_err(a, b) <= 1e-6, (name, rel_err(a, b))
    assert (fused[1][1] == 0).all()  # the all -100 row gets no gradient
    assert (fused[1][0, ::3] == 0).all()


def test_sum_and_count_give_the_mean_and_everything_masked_matches_plain():
    hidden, weight = torch.randn(2, 5, 8), torch.randn(40, 8)
    labels = masked_labels(torch.randint(0, 40, (2, 5)))
    total = linear_cross_entropy(hidden, weight, labels, reduction="sum")
    mean = linear_cross_entropy(hidden, weight, labels)
    assert int(count_targets(labels)) == 3
    torch.testing.assert_close(total / count_targets(labels), mean, rtol=1e-6, atol=0)
    # No target at all: nan mean (as F.cross_entropy), zero sum, zero gradients.
    nothing = torch.full((2, 5), -100)
    plain = loss_and_grads(hidden, weight, nothing, backend="plain")
    fused = loss_and_grads(hidden, weight, nothing, backend="chunked")
    assert plain[0].isnan() and fused[0].isnan()
    assert (fused[1] == 0).all() and (fused[2] == 0).all() and (plain[1] == 0).all()
    assert float(linear_cross_entropy(hidden, weight, nothing, reduction="sum")) == 0.0


def test_evaluation_without_grad_gives_the_same_loss():
    hidden, weight = torch.randn(4, 9, 16), torch.randn(64, 16, requires_grad=True)
    labels = torch.randint(0, 64, (4, 9))
    with torch.no_grad():
        evaluated = linear_cross_entropy(hidden, weight, labels, chunk_mib=1e-3)
        plain = linear_cross_entropy(hidden, weight, labels, backend="plain")
    assert evaluated.grad_fn is None
    assert rel_err(evaluated, plain) <= 1e-6


def train_grads(model: Transformer, tokens: torch.Tensor, labels: torch.Tensor):
    out = model(tokens, labels=labels)
    out.loss.backward()
    return out, {name: param.grad for name, param in model.named_parameters()}


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("pe", ["tape", "rope"])
@pytest.mark.parametrize("tie", [False, True])
def test_model_fused_loss_matches_plain_for_every_parameter(pe, tie, dtype):
    """fp32: the loss and the head's own gradients (lm_head, tied embedding, final norm) within 1e-6; deeper
    parameters within 5e-6, since the TAPE layers amplify the head's 1e-7 rounding differences (measured up to
    1.6e-6 with this sharp test init). fp64: every gradient within 1e-11, so the two paths are the same math."""
    plain = build(pe, tie_embeddings=tie, loss_backend="plain").train().to(dtype)
    fused = build(pe, tie_embeddings=tie, loss_backend="chunked", loss_chunk_mib=10 * 512 * 4 / 2**20).train()
    fused.to(dtype)
    if pe == "tape":
        randomize_tape(plain)
    fused.load_state_dict(plain.state_dict())
    assert isinstance(fused.lm_head, LMHead) and set(fused.state_dict()) == set(plain.state_dict())
    labels = masked_labels(TOKENS)
    out_p, grads_p = train_grads(plain, TOKENS, labels)
    out_f, grads_f = train_grads(fused, TOKENS, labels)
    assert out_f.logits is None and out_p.logits is not None  # training with labels never builds (B, T, V)
    assert_reference_grads_nonzero(grads_p, trainable_names(plain))
    head, deep = (1e-6, 5e-6) if dtype == torch.float32 else (1e-11, 1e-11)
    assert rel_err(out_f.loss, out_p.loss) <= head
    for name, expected in grads_p.items():
        bound = head if name in ("lm_head.weight", "embed.weight", "norm.weight") else deep
        assert rel_err(grads_f[name], expected) <= bound, (name, rel_err(grads_f[name], expected))
    if tie:
        assert fused.lm_head.weight is fused.embed.weight and "lm_head.weight" not in grads_p
    with torch.no_grad():  # logits without labels, as evaluation and generation ask for them
        torch.testing.assert_close(fused(TOKENS).logits, plain(TOKENS).logits, rtol=0, atol=0)


def test_lora_wrapped_lm_head_takes_the_plain_path():
    from tapetrain.train.lora import apply_lora

    model = apply_lora(build("rope", loss_backend="chunked"), r=4, alpha=8, dropout=0.0, targets=["lm_head"])
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "lora_B" in name:
                param.normal_()  # make the adapter matter
    out = model(TOKENS, labels=TOKENS)
    expected = F.cross_entropy(model(TOKENS).logits.flatten(0, 1), TOKENS.flatten())
    assert out.logits is not None
    torch.testing.assert_close(out.loss, expected)


def test_fp16_gradients_survive_loss_scaling():
    """fp16 (DeepSpeed multiplies the loss by a scale, here 2**16): small softmax gradients must not underflow in
    the saved fp16 gradients before the scale arrives. Both paths against an fp32 reference."""
    gen = torch.Generator().manual_seed(1)
    hidden, weight = torch.randn(4096, 32, generator=gen), torch.randn(2000, 32, generator=gen) * 0.4
    labels = torch.randint(0, 2000, (4096,), generator=gen)  # mean over 4096 targets: p/4096 underflows fp16
    grads = {}
    for name, dtype, backend in [("ref", torch.float32, "plain"), ("plain", torch.float16, "plain"),
                                 ("fused", torch.float16, "chunked")]:  # fmt: skip
        h, w = (x.to(dtype, copy=True).requires_grad_() for x in (hidden, weight))
        loss = linear_cross_entropy(h, w, labels, backend=backend, chunk_mib=0.5)
        (loss * 2**16).backward()
        grads[name] = (h.grad.float() / 2**16, w.grad.float() / 2**16)
    for i in (0, 1):
        assert rel_err(grads["fused"][i], grads["ref"][i]) <= 1.5 * rel_err(grads["plain"][i], grads["ref"][i])


def test_double_backward_is_refused():
    hidden, weight = torch.randn(3, 8, requires_grad=True), torch.randn(20, 8)
    loss = linear_cross_entropy(hidden, weight, torch.randint(0, 20, (3,)))
    loss.backward(retain_graph=True)
    with pytest.raises(RuntimeError, match="retain_graph"):
        loss.backward()


def test_bad_settings_are_clear_errors():
    with pytest.raises(ConfigError, match="loss_chunk_mib.*> 0"):
        preset_config("tiny", loss_chunk_mib=0)
    with pytest.raises(ConfigError, match="loss_backend.*choose one of auto, chunked, liger, plain"):
        preset_config("tiny", loss_backend="fast")
    with pytest.raises(ValueError, match="loss_chunk_mib must be > 0"):
        linear_cross_entropy(torch.randn(2, 4), torch.randn(5, 4), torch.zeros(2, dtype=torch.long), chunk_mib=-1)
    with pytest.raises(ValueError, match="do not match"):
        linear_cross_entropy(torch.randn(2, 4), torch.randn(5, 4), torch.zeros(3, dtype=torch.long))
    assert resolve_loss_backend("auto", torch.device("cpu")) == "chunked"
    with pytest.raises(RuntimeError, match="pip install 'tapetrain\\[liger\\]'.*loss_backend=auto"):
        resolve_loss_backend("liger", torch.device("cpu"))


def test_fused_loss_saves_far_fewer_bytes_than_plain():
    """Measured with saved_tensors_hooks on a vocabulary-heavy model (V = 64·C, as Llama-2's 32000 vs 512 shape):
    what autograd keeps for the loss drops from N·V·4 (the fp32 log-softmax) to V·C·4, exactly as modelled."""
    cfg = preset_config("tiny", vocab_size=4096, n_layers=1, attn_backend="sdpa")
    result = measure_loss_saved_bytes(cfg, batch=2, seq=256)
    assert result["fused_bytes"] < result["plain_bytes"] / 2.5, result
    assert abs(result["drop_bytes"] - result["predicted_drop_bytes"]) <= 64, result
    assert result["predicted_drop_bytes"] == 2 * 256 * (4096 * 4 + 8) - 4096 * 64 * 4


@pytest.mark.gpu
@pytest.mark.parametrize("backend", ["chunked", "liger"])
def test_fused_backends_match_plain_on_cuda(backend, verifies):
    """On CUDA: chunked always, liger-kernel when installed (pip install 'tapetrain[liger]'; make gpu-wheels
    should carry it). fp32 (no TF32) against the plain path: loss within 1e-6, gradients within 1e-5 (cuBLAS
    reduction order); then bf16 through the whole model."""
    verifies(kind="loss", backend=backend, dtypes=["fp32", "bf16"])
    if backend == "liger":
        pytest.importorskip("liger_kernel", reason="liger-kernel not installed: pip install 'tapetrain[liger]'")
    gen = torch.Generator().manual_seed(0)
    hidden = torch.randn(2, 1024, 256, generator=gen).cuda()
    weight = (torch.randn(32000, 256, generator=gen) * 0.05).cuda()
    labels = masked_labels(torch.randint(0, 32000, (2, 1024), generator=gen)).cuda()
    tf32 = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = False
    try:
        plain = loss_and_grads(hidden, weight, labels, backend="plain")
        fused = loss_and_grads(hidden, weight, labels, backend=backend, chunk_mib=16)
    finally:
        torch.backends.cuda.matmul.allow_tf32 = tf32
    for name, a, b, bound in zip(("loss", "d hidden", "d weight"), fused, plain, (1e-6, 1e-5, 1e-5), strict=True):
        assert rel_err(a, b) <= bound, (name, rel_err(a, b))
    model_p = build("tape", loss_backend="plain", attn_backend="sdpa")
    randomize_tape(model_p)  # TAPE's zero-initialised projections would give 0-vs-0 gradients
    model_p = model_p.cuda().to(torch.bfloat16).train()
    model_f = build("tape", loss_backend=backend, attn_backend="sdpa", loss_chunk_mib=10 * 512 * 4 / 2**20)
    model_f = model_f.cuda().to(torch.bfloat16).train()
    model_f.load_state_dict(model_p.state_dict())
    tokens = TOKENS.cuda()
    out_p, out_f = model_p(tokens, labels=tokens), model_f(tokens, labels=tokens)
    assert out_f.logits is None
    assert abs(float(out_f.loss) - float(out_p.loss)) <= 1e-2 * abs(float(out_p.loss))
    out_p.loss.backward()
    out_f.loss.backward()
    grads = dict(model_f.named_parameters())
    assert_reference_grads_nonzero({n: p.grad for n, p in model_p.named_parameters()}, trainable_names(model_p))
    for name, param in model_p.named_parameters():
        assert rel_err(grads[name].grad.float(), param.grad.float()) <= 3e-2, name


def test_the_reference_gradient_check_catches_zero_initialised_tape():
    """The escape of the 2026-11-26 GPU fix: without randomize_tape, TAPE's x_proj/up_proj gradients are exactly 0
    (W_down starts at 0), so a comparison would pass on 0 against 0. The check names them instead."""
    model = build("tape", loss_backend="plain").train()
    _, grads = train_grads(model, TOKENS, masked_labels(TOKENS))
    with pytest.raises(AssertionError, match=r"tape_mlp\.x_proj"):
        assert_reference_grads_nonzero(grads, trainable_names(model))
    allowed = {name: "zero-initialised W_down upstream" for name in grads if "tape" in name}
    assert_reference_grads_nonzero(grads, trainable_names(model), allowed_zero=allowed)
