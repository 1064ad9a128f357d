"""Positional encodings: RoPE angles, TAPE's initial state, and the baselines' rotations and biases.

Pairing is Hugging Face Llama's rotate-half: dims f and f + F (F = D/2) form frequency pair f, so Llama weights load
without permutation. A pair (x1, x2) rotated by a block (c, s) becomes (x1·c − x2·s, x2·c + x1·s).

Everything position-dependent that layers share is computed once per forward into a `PositionContext`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import nn

from tapetrain.model.config import ModelConfig


@dataclass
class PositionContext:
    """Per-forward positional inputs shared by all layers.

    positions      (B, T) float64  absolute (offset-included, not yet interpolated) positions of the new tokens
    key_positions  (B, S) float64  positions of every key (cached + new)
    cos, sin       (B, 1, T, F)    rotary tables for rope/randpe/xpos (model dtype)
    q_scale/k_scale (B, 1, T, D)   xpos decay factors
    bias           (1|B, H, T, S)  additive attention bias for alibi/fire
    tape_init      (B, H, T, D)    TAPE's E^(0): [c ‖ s] per head
    """

    positions: torch.Tensor
    key_positions: torch.Tensor
    cos: torch.Tensor | None = None
    sin: torch.Tensor | None = None
    q_scale: torch.Tensor | None = None
    k_scale: torch.Tensor | None = None
    bias: torch.Tensor | None = None
    tape_init: torch.Tensor | None = None


def rope_angles(
    positions: torch.Tensor, head_dim: int, theta: float, pi_factor: float = 1.0
) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin of t·θ_f, t = position / pi_factor, θ_f = theta^(−2f/D); (..., T) -> (..., T, F) float64.

    Computed in float64: fp32 angles at positions in the thousands are off by ~1e-4 rad, enough to break the
    exact shift-invariance of TAPE that the tests check.
    """
    freqs = theta ** (-torch.arange(0, head_dim, 2, dtype=torch.float64, device=positions.device) / head_dim)
    angles = (positions.to(torch.float64) / pi_factor)[..., None] * freqs
    return torch.cos(angles), torch.sin(angles)


def rotate_pairs(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate rotate-half pairs of x (..., D) by blocks (cos, sin) (..., F); broadcasting over heads/batch."""
    half = x.shape[-1] // 2
    x1, x2 = x[..., :half], x[..., half:]
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)


def alibi_slopes(n_heads: int) -> torch.Tensor:
    """ALiBi's geometric head slopes (Press et al.), with the standard interleave for non-powers of two."""

    def power_of_two(n: int) -> list[float]:
        start = 2 ** (-(2 ** -(math.log2(n) - 3)))
        return [start ** (i + 1) for i in range(n)]

    if math.log2(n_heads).is_integer():
        slopes = power_of_two(n_heads)
    else:
        closest = 2 ** math.floor(math.log2(n_heads))
        slopes = power_of_two(closest) + power_of_two(2 * closest)[0::2][: n_heads - closest]
    return torch.tensor(slopes, dtype=torch.float64)


class FireBias(nn.Module):
    """FIRE (Li et al., 2023): bias_h(i, j) = f_θ(ψ(i − j) / ψ(max(L, i))), ψ(x) = log(c·x + 1).

    One module shared by all layers; f_θ is a 1 -> hidden -> n_heads MLP; c and L are learned.
    """

    def __init__(self, n_heads: int, hidden: int, init_threshold: float):
        super().__init__()
        self.mlp = nn.Sequential(nn.Linear(1, hidden), nn.ReLU(), nn.Linear(hidden, n_heads))
        self.log_c = nn.Parameter(torch.zeros(1))  # c = exp(log_c) > 0, starts at 1
        self.threshold = nn.Parameter(torch.full((1,), float(init_threshold)))  # (1,): no 0-dim (DeepSpeed)

    def forward(self, q_pos: torch.Tensor, k_pos: torch.Tensor, causal: bool) -> torch.Tensor:
        """(B, T), (B, S) positions -> (B, H, T, S) bias."""
        c = self.log_c.exp()
        rel = q_pos[:, :, None] - k_pos[:, None, :]  # (B, T, S)
        rel = rel.clamp(min=0) if causal else rel.abs()
        q = q_pos.to(c.dtype)
        denom = torch.log(c * torch.maximum(self.threshold.abs(), q) + 1)[:, :, None]  # (B, T, 1)
        normalised = torch.log(c * rel.to(c.dtype) + 1) / denom
        return self.mlp(normalised[..., None]).permute(0, 3, 1, 2)  # (B, H, T, S)


class PositionalEncoding(nn.Module):
    """Builds the PositionContext for one forward pass, for any `cfg.pe`."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.cfg = cfg
        self.kind = cfg.pe
        if self.kind == "fire":
            self.fire = FireBias(cfg.n_heads, cfg.fire_hidden, init_threshold=cfg.max_seq_len)

    @property
    def rotary(self) -> bool:
        return self.kind in ("rope", "randpe", "xpos")

    def default_positions(self, batch: int, length: int, past: int, offset: int, device: torch.device) -> torch.Tensor:
        """(B, T) float64 positions of new tokens. randpe draws sorted random positions while training."""
        if self.kind == "randpe" and self.training and past == 0:
            limit = self.cfg.randpe_max_position or 4 * self.cfg.max_seq_len
            if limit < length:
                raise ValueError(
                    f"randpe needs model.randpe_max_position >= sequence length ({limit} < {length}); raise it"
                )
            draws = torch.stack([torch.randperm(limit, device=device)[:length] for _ in range(batch)])
            return draws.sort(dim=-1).values.to(torch.float64) + offset
        pos = torch.arange(past, past + length, device=device, dtype=torch.float64) + offset
        return pos.expand(batch, length)

    def context(self, positions: torch.Tensor, key_positions: torch.Tensor, dtype: torch.dtype) -> PositionContext:
        cfg = self.cfg
        ctx = PositionContext(positions=positions, key_positions=key_positions)
        if self.kind in ("rope", "randpe", "xpos", "tape"):
            cos, sin = rope_angles(positions, cfg.head_dim, cfg.rope_theta, cfg.pi_factor)  # (B, T, F)
            if self.kind == "tape":
                e0 = torch.cat([cos, sin], dim=-1).to(dtype)  # (B, T, D)
                ctx.tape_init = e0[:, None].expand(-1, cfg.n_heads, -1, -1)  # (B, H, T, D), same for every head
            else:
                ctx.cos, ctx.sin = cos[:, None].to(dtype), sin[:, None].to(dtype)  # (B, 1, T, F)
        if self.kind == "xpos":
            d = cfg.head_dim
            zeta = (torch.arange(0, d, 2, dtype=torch.float64, device=positions.device) + 0.4 * d) / (1.4 * d)
            zeta = torch.cat([zeta, zeta])  # (D,) duplicated over the rotate-half pair
            power = (positions / cfg.xpos_scale_base)[..., None]  # (B, T, 1)
            ctx.q_scale = (zeta**power)[:, None].to(dtype)  # (B, 1, T, D)
            ctx.k_scale = (zeta ** (-power))[:, None].to(dtype)
        if self.kind == "alibi":
            dist = positions[:, :, None] - key_positions[:, None, :]  # (B, T, S)
            dist = dist.clamp(min=0) if cfg.causal else dist.abs()
            slopes = alibi_slopes(cfg.n_heads).to(positions.device)  # recomputed: a few floats, no buffer to init
            ctx.bias = (-slopes[None, :, None, None] * dist[:, None]).to(dtype)  # (B, H, T, S)
        if self.kind == "fire":
            ctx.bias = self.fire(positions, key_positions, cfg.causal).to(dtype)
        return ctx

    def rotate_qk(self, q: torch.Tensor, k: torch.Tensor, ctx: PositionContext) -> tuple[torch.Tensor, torch.Tensor]:
        """Apply rope/randpe/xpos to q (B, H, T, D) and k (B, Hkv, T, D); identity for the rest."""
        if ctx.cos is None:
            return q, k
        q = rotate_pairs(q, ctx.cos, ctx.sin)
        k = rotate_pairs(k, ctx.cos, ctx.sin)
        if ctx.q_scale is not None:
            q, k = q * ctx.q_scale, k * ctx.k_scale
        return q, k
