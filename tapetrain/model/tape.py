"""TAPE's two position-state updates (README.md "TAPE as implemented").

Inside the model the state E is token-major, (B, T, M, D): per token and head, F = D/2 blocks (c, s) stored
rotate-half style as [c ‖ s]. Token-major is the layout q and k come out of their projections in, so rotating
them by E is a plain elementwise pass, the attention kernels read E rows with D contiguous, and the head
contractions below are small matrix products over contiguous (M, D) slices (a head-major E made every one of
those a strided, uncoalesced pass on GPU).

Both updates only contract over the head axis M (and the token axis, through the attention weights), so they
commute with any per-frequency rotation of E: that is what keeps TAPE shift- and O(2)-invariant.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from tapetrain.model.positions import rotate_pairs


def rotate_by_state(x: torch.Tensor, state: torch.Tensor) -> torch.Tensor:
    """x̃ = E^T x blockwise: x and state E = [c ‖ s] of one shape, e.g. (B, T, M, D). For E = RoPE this is RoPE."""
    half = state.shape[-1] // 2
    return rotate_pairs(x, state[..., :half], state[..., half:])


def rotate_qk_by_state(q: torch.Tensor, k: torch.Tensor, state: torch.Tensor,
                       fused: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """q (B, T, H, D), k (B, T, Hkv, D), E (B, T, H, D) -> q̃, k̃ both (B, T, H, D) token-major.

    E is per query head, so keys are expanded to the query heads before their rotation (GQA memory cost: H/Hkv).
    `fused` (the execution plan's decision for model.tape_fused_updates): the fused kernel reads q, k and E once
    and never materialises the expanded keys' input copy."""
    if fused:
        from tapetrain.kernels.tape_rotation import tape_rotate_qk  # lazy: triton is optional

        return tape_rotate_qk(q, k, state)
    groups = q.shape[2] // k.shape[2]
    k = k.repeat_interleave(groups, dim=2) if groups > 1 else k
    return rotate_by_state(q, state), rotate_by_state(k, state)


class TapeHeadMix(nn.Module):
    """Attention-side update E ← E + (A·E) ×_heads W_A.

    'full': W_A ∈ R^{M×M} mixes heads (the paper). 'gain': a per-head scalar (what the official code realises).
    Zero-initialised, so a fresh or retrofitted model starts as its RoPE twin.
    """

    def __init__(self, n_heads: int, mode: str):
        super().__init__()
        self.mode = mode
        shape = (n_heads, n_heads) if mode == "full" else (n_heads,)
        self.weight = nn.Parameter(torch.zeros(shape))

    def forward(self, state: torch.Tensor, attended: torch.Tensor) -> torch.Tensor:
        """state, attended = A·E: (B, T, M, D) -> updated state (B, T, M, D)."""
        weight = self.weight.to(attended.dtype)
        if self.mode == "full":
            mixed = torch.matmul(weight, attended)  # (M, M) @ (B, T, M, D): one small product per token
        else:
            mixed = attended * weight[:, None]
        return state + mixed


class TapeMlpUpdate(nn.Module):
    """MLP-side update E ← E + W_down · (SiLU(W_x · m) ⊙ (W_up · E)), contractions over heads.

    m is the MLP block's output for each token (B, T, C); I = channels (4·M by default). W_down starts at zero
    (the paper's zero W2); W_x and W_up keep the normal init so W_down receives gradient from step 0.
    """

    def __init__(self, d_model: int, n_heads: int, channels: int):
        super().__init__()
        self.x_proj = nn.Linear(d_model, channels, bias=False)  # W_x: C -> I
        self.up_proj = nn.Linear(n_heads, channels, bias=False)  # W_up: M -> I
        self.down_proj = nn.Linear(channels, n_heads, bias=False)  # W_down: I -> M
        self.down_proj.zero_init = True  # zeroed by the weight init: a fresh model is its RoPE twin

    def forward(self, state: torch.Tensor, mlp_out: torch.Tensor) -> torch.Tensor:
        """state (B, T, M, D), mlp_out (B, T, C) -> updated state (B, T, M, D)."""
        gate = F.silu(self.x_proj(mlp_out))  # (B, T, I)
        up = torch.matmul(self.up_proj.weight, state)  # (I, M) @ (B, T, M, D) -> (B, T, I, D)
        hidden = up * gate[..., None]  # (B, T, I, D)
        return state + torch.matmul(self.down_proj.weight, hidden)  # (M, I) @ (B, T, I, D) -> (B, T, M, D)


class TapeHeadMixWithKernels(TapeHeadMix):
    """TapeHeadMix that runs as the fused Triton kernel where the execution plan says so (model/execution_plan.py).
    Same parameters and names; the eager class stays the verbatim copy the Hugging Face remote code carries."""

    fused: bool = False  # the plan's decision, set by Transformer.use_plan (no __init__ of its own: ZeRO-3)

    def forward(self, state: torch.Tensor, attended: torch.Tensor) -> torch.Tensor:
        if not self.fused:
            return super().forward(state, attended)
        from tapetrain.kernels.tape_head_mix import tape_head_mix  # lazy: triton is optional

        return tape_head_mix(state, attended, self.weight.to(attended.dtype))  # the residual fused in


class TapeMlpUpdateWithKernels(TapeMlpUpdate):
    """TapeMlpUpdate that runs as the fused Triton kernel where the execution plan says so."""

    fused: bool = False  # the plan's decision, set by Transformer.use_plan (no __init__ of its own: ZeRO-3)

    def forward(self, state: torch.Tensor, mlp_out: torch.Tensor) -> torch.Tensor:
        if not self.fused:
            return super().forward(state, mlp_out)
        from tapetrain.kernels.tape_mlp_update import tape_mlp_update  # lazy: triton is optional

        # W_x·m (B, T, I) is an ordinary projection; the kernel applies the SiLU and never writes (B, T, I, D)
        return tape_mlp_update(state, self.x_proj(mlp_out), self.up_proj.weight, self.down_proj.weight)


class TapeMlpUpdateNonEquivariant(nn.Module):
    """The ablation without TAPE's equivariance constraints (the official code's non-equivariant variant).

    The official variant flattens its cos and sin tensors (heads × head dim) and mixes that whole axis:
    c ← c + W_down(SiLU(W_x m) ⊙ W_up c), the same for s, with the same weights. Here that acts on our layout: the
    c and the s halves of E, each flattened over heads × frequencies (M·F = C/2 channels). Mixing frequencies
    breaks O(2) equivariance and with it shift invariance. (The official code stores cos and sin with duplicated
    halves that its update lets drift apart, i.e. general 2×2 blocks; our D-number state keeps blocks c·I + s·J.)
    W_down starts at zero, so a fresh model is still its RoPE twin.
    """

    def __init__(self, d_model: int, n_heads: int, head_dim: int, channels: int):
        super().__init__()
        width = n_heads * (head_dim // 2)  # M·F
        self.x_proj = nn.Linear(d_model, channels, bias=False)  # W_x: C -> I
        self.up_proj = nn.Linear(width, channels, bias=False)  # W_up: M·F -> I
        self.down_proj = nn.Linear(channels, width, bias=False)  # W_down: I -> M·F
        self.down_proj.zero_init = True  # zeroed by the weight init: a fresh model is its RoPE twin

    def forward(self, state: torch.Tensor, mlp_out: torch.Tensor) -> torch.Tensor:
        """state (B, T, M, D) token-major, mlp_out (B, T, C) -> updated state (B, T, M, D)."""
        b, t, m, d = state.shape
        gate = F.silu(self.x_proj(mlp_out))  # (B, T, I)
        halves = state.reshape(b, t, m, 2, d // 2).permute(0, 3, 1, 2, 4).reshape(b, 2, t, m * (d // 2))  # c, s
        update = self.down_proj(self.up_proj(halves) * gate[:, None])  # (B, 2, T, M·F)
        update = update.view(b, 2, t, m, d // 2).permute(0, 2, 3, 1, 4).reshape(b, t, m, d)
        return state + update
