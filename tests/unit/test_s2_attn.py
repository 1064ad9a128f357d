"""LongLoRA's shifted sparse attention against an explicit per-head mask, and its train/eval switch."""

import pytest
import torch

from tapetrain.errors import ConfigError
from tapetrain.model import Transformer, preset_config
from tapetrain.model.attention import eager_attention, shifted_sparse_attention


def reference_mask(heads: int, t: int, group: int) -> torch.Tensor:
    """(H, T, T) allowed[h, i, j]: causal within groups; the second half of heads on the sequence rolled by G/2."""
    idx = torch.arange(t)
    mask = torch.zeros(heads, t, t, dtype=torch.bool)
    for h in range(heads):
        r = idx if h < heads // 2 else (idx - group // 2) % t  # position of each token after the roll
        same_group = (r[:, None] // group) == (r[None, :] // group)
        mask[h] = same_group & (r[None, :] <= r[:, None])
    return mask


def test_matches_explicit_masked_attention():
    g = torch.Generator().manual_seed(0)
    b, h, t, d, group = 2, 4, 16, 8, 4
    q, k, v = (torch.randn(b, h, t, d, generator=g) for _ in range(3))
    k2, v2 = k[:, ::2], v[:, ::2]  # GQA: 2 kv heads
    got = shifted_sparse_attention(q, k2, v2, group, backend="eager")
    bias = torch.zeros(h, t, t).masked_fill(~reference_mask(h, t, group), float("-inf"))[None]
    want, _ = eager_attention(q, k2, v2, causal=False, bias=bias)
    torch.testing.assert_close(got, want, atol=1e-6, rtol=0)


def test_only_while_training_and_only_for_rope_or_nope():
    model = Transformer(preset_config("tiny", pe="rope", s2_attn=True))
    plain = Transformer(preset_config("tiny", pe="rope"))
    plain.load_state_dict(model.state_dict())
    tokens = torch.randint(0, 512, (1, 32))
    model.eval(), plain.eval()
    torch.testing.assert_close(model(tokens).logits, plain(tokens).logits)  # full attention at evaluation
    model.train(), plain.train()
    assert (model(tokens).logits - plain(tokens).logits).abs().max() > 1e-4
    with pytest.raises(ConfigError, match="model.s2_attn"):
        preset_config("tiny", pe="tape", s2_attn=True)
