"""Every positional encoding: forward/backward, KV-cache decoding, SDPA vs eager, generation."""

import pytest
import torch
from model_helpers import assert_reference_grads_nonzero, build, randomize_tape, trainable_names

from tapetrain.model import POSITIONAL_ENCODINGS, KVCache, ModelConfig, Transformer
from tapetrain.model.attention import attention, eager_attention, sdpa_attention

TOKENS = torch.randint(0, 512, (2, 19), generator=torch.Generator().manual_seed(11))


def active_model(pe: str, **overrides):
    if pe == "randpe":  # deterministic positions at evaluation here; the random draws are tested in test_baselines
        overrides.setdefault("randpe_sample_at_eval", False)
    model = build(pe, **overrides)
    if pe == "tape":
        randomize_tape(model)
    return model


@pytest.mark.parametrize("pe", POSITIONAL_ENCODINGS)
def test_forward_backward_every_pe(pe):
    model = active_model(pe).train()
    out = model(TOKENS, labels=TOKENS)
    assert out.logits is None and torch.isfinite(out.loss)  # the fused loss builds no (B, T, V) logits
    assert model(TOKENS).logits.shape == (2, 19, 512)
    out.loss.backward()
    for name, param in model.named_parameters():
        assert param.grad is not None and torch.isfinite(param.grad).all(), name
        assert param.grad.abs().sum() > 0, f"{name} got no gradient"


@pytest.mark.parametrize("pe", POSITIONAL_ENCODINGS)
def test_kv_cache_matches_full_forward(pe):
    model = active_model(pe)
    full = model(TOKENS).logits
    cache = KVCache(model.cfg.n_layers)
    chunks = [model(TOKENS[:, :7], cache=cache).logits]
    for i in range(7, 19):  # one token at a time, as generation does
        chunks.append(model(TOKENS[:, i : i + 1], cache=cache).logits)
    torch.testing.assert_close(torch.cat(chunks, dim=1), full, atol=2e-5, rtol=0)


@pytest.mark.parametrize("pe", POSITIONAL_ENCODINGS)
def test_sdpa_matches_eager_outputs_and_gradients(pe):
    eager = active_model(pe, attn_backend="eager")
    sdpa = active_model(pe, attn_backend="sdpa")
    sdpa.load_state_dict(eager.state_dict())
    torch.testing.assert_close(sdpa(TOKENS).logits, eager(TOKENS).logits, atol=2e-5, rtol=0)
    out_e = eager(TOKENS, labels=TOKENS)
    out_s = sdpa(TOKENS, labels=TOKENS)
    out_e.loss.backward()
    out_s.loss.backward()
    grads_s = dict(sdpa.named_parameters())
    assert_reference_grads_nonzero({n: p.grad for n, p in eager.named_parameters()}, trainable_names(eager))
    for name, param in eager.named_parameters():
        torch.testing.assert_close(grads_s[name].grad, param.grad, atol=2e-5, rtol=1e-4, msg=name)


@pytest.mark.parametrize("value_calls", [None, 1, 2])
@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("t,s", [(9, 9), (1, 9), (4, 11)])
def test_attention_functions_agree_with_gqa_and_e(causal, t, s, value_calls):
    """SDPA's two strategies for TAPE ([V ‖ E] in one call; V and E in two) both equal the eager reference."""
    g = torch.Generator().manual_seed(0)
    q = torch.randn(2, 4, t, 16, generator=g, requires_grad=True)
    k = torch.randn(2, 4, s, 16, generator=g, requires_grad=True)
    v = torch.randn(2, 2, s, 16, generator=g, requires_grad=True)
    e = torch.randn(2, 4, s, 16, generator=g, requires_grad=True)
    ref = eager_attention(q, k, v, e, causal=causal)
    got = sdpa_attention(q, k, v, e, causal=causal, value_calls=value_calls)
    for a, b in zip(got, ref, strict=True):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=0)
    upstream = [torch.randn_like(x) for x in ref]
    g_ref = torch.autograd.grad(ref, (q, k, v, e), upstream)
    g_got = torch.autograd.grad(got, (q, k, v, e), upstream)
    for a, b in zip(g_got, g_ref, strict=True):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=0)


def test_cpu_sdpa_splits_the_values_from_the_measured_length_on():
    from tapetrain.model.attention import CPU_TWO_CALLS_FROM_KEYS, sdpa_value_calls

    def calls(s: int, width_e: int = 16, device: str = "cpu") -> int:
        q, k = torch.empty(1, 4, 1, 16, device=device), torch.empty(1, 4, s, 16, device=device)
        v, e = torch.empty(1, 2, s, 16, device=device), torch.empty(1, 4, s, width_e, device=device)
        return sdpa_value_calls(q, k, v, e)

    assert calls(CPU_TWO_CALLS_FROM_KEYS - 1) == 1 and calls(CPU_TWO_CALLS_FROM_KEYS) == 2
    assert calls(CPU_TWO_CALLS_FROM_KEYS, width_e=32) == 1  # E wider than q/k: no fused kernel for it either
    assert calls(CPU_TWO_CALLS_FROM_KEYS, device="meta") == 1  # not CPU: one call (fused kernels take any width)


def test_bottom_right_causal_alignment():
    # With a KV cache the single new query is the last position: it must see every key.
    q, k, v = torch.randn(1, 1, 1, 8), torch.randn(1, 1, 5, 8), torch.randn(1, 1, 5, 8)
    out, _ = eager_attention(q, k, v, causal=True)
    nocausal, _ = eager_attention(q, k, v, causal=False)
    torch.testing.assert_close(out, nocausal)


def test_unknown_backend_is_rejected():
    with pytest.raises(ValueError, match="not a backend"):
        attention(torch.zeros(1, 1, 2, 4), torch.zeros(1, 1, 2, 4), torch.zeros(1, 1, 2, 4), backend="magic")


@pytest.mark.parametrize("pe", ["tape", "rope", "alibi"])
def test_generate_greedy_with_and_without_cache(pe):
    model = active_model(pe)
    prompt = TOKENS[:, :5]
    with_cache = model.generate(prompt, 8, use_cache=True)
    without = model.generate(prompt, 8, use_cache=False)
    assert with_cache.shape == (2, 13)
    assert torch.equal(with_cache, without)


def test_generate_sampling_is_reproducible_and_respects_top_k():
    model = active_model("tape")
    prompt = TOKENS[:, :4]
    a = model.generate(prompt, 6, temperature=1.0, top_k=5, generator=torch.Generator().manual_seed(1))
    b = model.generate(prompt, 6, temperature=1.0, top_k=5, generator=torch.Generator().manual_seed(1))
    assert torch.equal(a, b)
    top1 = model.generate(prompt, 6, temperature=1.0, top_k=1)
    assert torch.equal(top1, model.generate(prompt, 6))  # top_k=1 sampling is greedy


def test_activation_checkpointing_gives_same_gradients():
    plain = active_model("tape").train()
    ckpt = active_model("tape", activation_checkpointing=True).train()
    ckpt.load_state_dict(plain.state_dict())
    plain(TOKENS, labels=TOKENS).loss.backward()
    ckpt(TOKENS, labels=TOKENS).loss.backward()
    other = dict(ckpt.named_parameters())
    assert_reference_grads_nonzero({n: p.grad for n, p in plain.named_parameters()}, trainable_names(plain))
    for name, param in plain.named_parameters():
        torch.testing.assert_close(other[name].grad, param.grad, atol=1e-6, rtol=1e-5, msg=name)


def test_token_id_out_of_vocab_is_a_clear_error():
    with pytest.raises(ValueError, match="vocab_size"):
        build("rope")(torch.tensor([[1, 600]]))


def test_tape_state_in_the_head_major_layout_is_a_clear_error():
    model = build("tape")
    b, t = TOKENS.shape
    head_major = torch.zeros(b, model.cfg.n_heads, t, model.cfg.head_dim)  # E is token-major (B, T, M, D)
    with pytest.raises(ValueError, match=r"token-major \(B, T, M, D\)"):
        model(TOKENS, tape_state=head_major)


def test_tied_embeddings_share_storage():
    model = build("rope", tie_embeddings=True)
    assert model.lm_head.weight is model.embed.weight
    assert model.num_params() == build("rope").num_params() - 512 * 64


@pytest.mark.parametrize("pe", ["tape", "rope", "randpe"])
def test_forward_reads_nothing_back_from_a_non_cpu_device(pe):
    """A training forward must not synchronise with the device: on the meta device every host read (`int()`,
    `.item()`, `.tolist()`) raises, so this runs the whole forward and loss there. The token-id check used to
    read `input_ids.max()` on every micro-step."""
    cfg = ModelConfig(vocab_size=64, d_model=32, n_layers=2, n_heads=4, pe=pe, max_seq_len=16, attn_backend="sdpa")
    with torch.device("meta"):
        model = Transformer(cfg)
        ids = torch.zeros(2, 16, dtype=torch.long)
        out = model(ids, labels=ids)
    assert out.loss.shape == () and out.loss.device.type == "meta"


@pytest.mark.parametrize("pe", POSITIONAL_ENCODINGS)
def test_every_parameter_survives_deepspeeds_byte_broadcast(pe):
    # deepspeed.initialize broadcasts each parameter as p.data.view(torch.uint8), which fails on 0-dim tensors
    model = build(pe)
    for name, param in model.named_parameters():
        assert param.dim() >= 1 and param.data.view(torch.uint8).numel() == 4 * param.numel(), name
