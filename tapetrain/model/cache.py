"""KV cache for incremental decoding. For TAPE it also caches each layer's positional state E of past tokens."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch


@dataclass
class LayerCache:
    """Past keys (rotated; (B, Hk, S, D), per query head for TAPE) and values (B, Hkv, S, D), heads-first as
    attention takes them; TAPE's state E (B, S, M, D), token-major as everywhere."""

    k: torch.Tensor | None = None
    v: torch.Tensor | None = None
    e: torch.Tensor | None = None

    def append(
        self, k: torch.Tensor, v: torch.Tensor, e: torch.Tensor | None
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """Store the new tokens' entries and return everything so far: k, v (B, ·, T, D) along dim 2, E (B, T, M, D)
        along dim 1."""
        self.k = k if self.k is None else torch.cat([self.k, k], dim=2)
        self.v = v if self.v is None else torch.cat([self.v, v], dim=2)
        if e is not None:
            self.e = e if self.e is None else torch.cat([self.e, e], dim=1)
        return self.k, self.v, self.e


@dataclass
class KVCache:
    n_layers: int
    layers: list[LayerCache] = field(default_factory=list)
    positions: torch.Tensor | None = None  # (B, S) float64 positions of every cached token
    abacus_carry: torch.Tensor | None = None  # (B,) model.abacus: the digit place of the last cached token

    def __post_init__(self) -> None:
        if not self.layers:
            self.layers = [LayerCache() for _ in range(self.n_layers)]

    @property
    def length(self) -> int:
        return 0 if self.positions is None else self.positions.shape[1]

    def extend_positions(self, new: torch.Tensor) -> torch.Tensor:
        """Append (B, T) positions; returns all key positions (B, S)."""
        self.positions = new if self.positions is None else torch.cat([self.positions, new], dim=1)
        return self.positions
