"""FIRE (Li et al., 2023) as the TAPE paper's baseline defines it (the TAPE repository's FIRE module).

    bias_h(i, j) = f_θ( ψ(i − j) / (ψ(max(L, i)) + ε) ),   ψ(x) = log(|c·x| + 1),   L = |m · L₀|

f_θ is a 1 → hidden → n_heads MLP (ReLU); c starts at 0.1, and the threshold L is learned through a multiplier m
(starting at 1) on a fixed L₀ = 512, so under Adam L moves L₀ times faster than a directly learned L would; ε = 1e-6.
i and j are the query's and key's absolute positions, so FIRE is not shift-invariant (ψ(max(L, i)) sees i).
The baseline has one such module per layer (model.fire_shared=true shares one, our earlier variant).
"""

from __future__ import annotations

import torch
from torch import nn


class FireBias(nn.Module):
    """FIRE's attention bias f_θ(ψ(i − j) / (ψ(max(L, i)) + ε)), ψ(x) = log(|c·x| + 1), L = |m·L₀|, per head."""

    def __init__(self, n_heads: int, hidden: int, init_c: float = 0.1, init_threshold: float = 512.0,
                 eps: float = 1e-6):
        super().__init__()
        self.mlp = nn.Sequential(nn.Linear(1, hidden), nn.ReLU(), nn.Linear(hidden, n_heads))
        self.init_c, self.init_threshold, self.eps = init_c, init_threshold, eps
        # (1,), not 0-dim: deepspeed.initialize broadcasts every parameter as a byte view, which 0-dim tensors refuse
        self.c = nn.Parameter(torch.full((1,), float(init_c)))
        self.threshold_scale = nn.Parameter(torch.ones(1))  # the multiplier m; L = |m · L₀|

    def reset_scalars(self) -> None:
        """c and m back to their inits (the MLP's Linear layers are initialised like every other Linear)."""
        with torch.no_grad():
            self.c.fill_(self.init_c)
            self.threshold_scale.fill_(1.0)

    @property
    def threshold(self) -> torch.Tensor:
        return (self.threshold_scale * self.init_threshold).abs()

    def forward(self, q_pos: torch.Tensor, k_pos: torch.Tensor) -> torch.Tensor:
        """Query positions (B, T), key positions (B, S) (float64) -> bias (B, H, T, S) in the MLP's dtype.

        Distances are taken as |i − j| (the future half is causally masked anyway) and computed in fp32 or wider.
        """
        dtype = torch.promote_types(self.c.dtype, torch.float32)
        c = self.c.to(dtype)
        rel = (q_pos[:, :, None] - k_pos[:, None, :]).to(dtype)  # (B, T, S)
        normaliser = torch.maximum(q_pos.to(dtype), self.threshold.to(dtype))  # (B, T)
        distance = torch.log(torch.abs(c * rel) + 1)
        scale = torch.log(torch.abs(c * normaliser) + 1)[:, :, None] + self.eps  # (B, T, 1)
        weight = self.mlp[0].weight
        return self.mlp((distance / scale).to(weight.dtype)[..., None]).permute(0, 3, 1, 2)  # (B, H, T, S)
