"""xPos (Sun et al., 2022) as the TAPE paper's baseline defines it, computed so that it never overflows.

After the RoPE rotation, xPos scales query i by ζ^(p_i/γ) and key j by ζ^(−p_j/γ), per rotate-half pair f with
ζ_f = (2f + 0.4·D) / (1.4·D) and scale base γ (2048 in the TAPE repository), so every logit carries the decay
ζ^((p_i − p_j)/γ) ≤ 1 (causal: p_j ≤ p_i). Only that product matters: any centre c cancels in
ζ^((p_i − c)/γ) · ζ^((c − p_j)/γ). The TAPE repository centres at c = max(training length, T) // 2, so its factors
still reach ζ_min^(−T/(2γ)) ≈ 3.5^(T/4096) (ζ_min = 2/7): past fp16's 65504 from about 36K tokens. Uncentred, on
absolute positions with γ = 512 (tapetrain before), every fp16 logit was NaN from about 4.5K positions and every
bf16/fp32 one from about 36K.

Here the queries go in blocks of γ tokens, each with its own centre c = its largest query position: query factors
are ζ^((p_i − c)/γ) ∈ [1, ζ_min^(−1)] (at most 3.5), key factors ζ^(max(c − p_j, 0)/γ) ∈ (0, 1] (keys after c
are causally masked, so clamping them changes nothing). Nothing exceeds 3.5·|q| at any length or offset, in any
dtype; a key factor that underflows is one whose true decay is below the dtype's resolution anyway. A sequence of
at most γ tokens (training at 1024 or 2048) is a single block: one attention call, as before.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from tapetrain.model.documents import DocumentMask


def xpos_zeta(head_dim: int, device: torch.device | None = None) -> torch.Tensor:
    """ζ (D,) float64: (2f + 0.4·D) / (1.4·D) for pair f, repeated for both halves of the rotate-half layout."""
    zeta = (torch.arange(0, head_dim, 2, dtype=torch.float64, device=device) + 0.4 * head_dim) / (1.4 * head_dim)
    return torch.cat([zeta, zeta])


@dataclass
class XposDecay:
    """What one forward needs to apply the decay: ζ (D,), γ, query positions (B, T), key positions (B, S)."""

    zeta: torch.Tensor
    scale_base: float
    q_pos: torch.Tensor
    k_pos: torch.Tensor

    @property
    def block(self) -> int:
        return max(1, int(self.scale_base))

    def factors(self, first: int, stop: int, keys: int, causal: bool) -> tuple[torch.Tensor, torch.Tensor]:
        """Query factors (B, 1, stop − first, D) and key factors (B, 1, keys, D) for queries [first, stop) and the
        first `keys` keys, centred at the block's largest query position (float64)."""
        q_pos = self.q_pos[:, first:stop]  # (B, Tb)
        centre = q_pos.max(dim=1, keepdim=True).values  # (B, 1)
        k_offset = centre - self.k_pos[:, :keys]  # (B, Sb): >= 0 for every key a causal query may see
        if causal:
            k_offset = k_offset.clamp(min=0)
        q_factor = self.zeta ** ((q_pos - centre) / self.scale_base)[..., None]  # (B, Tb, D)
        k_factor = self.zeta ** (k_offset / self.scale_base)[..., None]  # (B, Sb, D)
        return q_factor[:, None], k_factor[:, None]


def decayed_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    e: torch.Tensor | None,
    decay: XposDecay,
    attend: Callable[..., tuple[torch.Tensor, torch.Tensor | None]],
    *,
    causal: bool,
    bias: torch.Tensor | None,
    docs: DocumentMask | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """`attend` (an attention backend call) with the xPos decay, query block by query block.

    q (B, H, T, D) and k (B, Hk, S, D) are rotated but not decayed; v, e, bias as `attention`. Causal blocks see
    the keys up to their last query (bottom-right aligned: query t sits at key S − T + t). `docs` (packed
    documents) is sliced like the queries and keys; the decay's positions are then the stream's (arange), whose
    differences equal the documents' inside a document, so a block's factors never exceed 3.5 either.
    """
    t, s = q.shape[2], k.shape[2]
    outs, attended = [], []
    for first in range(0, t, decay.block):
        stop = min(t, first + decay.block)
        keys = s - t + stop if causal else s
        q_factor, k_factor = decay.factors(first, stop, keys, causal)
        block_bias = None if bias is None else bias[..., first:stop, :keys]
        extra = {} if docs is None else {"docs": docs.slice(first, stop, keys)}
        out, out_e = attend(
            q[:, :, first:stop] * q_factor.to(q.dtype),
            k[:, :, :keys] * k_factor.to(k.dtype),
            v[:, :, :keys],
            None if e is None else e[:, :, :keys],
            causal=causal,
            bias=block_bias,
            **extra,
        )
        outs.append(out)
        attended.append(out_e)
    if len(outs) == 1:
        return outs[0], attended[0]
    return torch.cat(outs, dim=2), None if e is None else torch.cat(attended, dim=2)
