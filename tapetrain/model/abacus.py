"""Abacus digit-place embeddings (McLeish et al. 2024), as the TAPE paper's arithmetic runs used them.

Every digit token gets, on top of its token embedding, a learned embedding of its place inside its number: 1 for
the number's first digit, 2 for the second, ... in the order the tokens come. `tapetrain data arith` writes every
number least significant digit first, so place 1 is the units of every operand and of the sum: the digits that
add up get the same embedding whatever the numbers' lengths. Any other token (BOS, +, =, EOS, padding) gets none
(place 0). Which ids are digits is model.abacus_digit_ids, part of the model's config so an export computes the
same places.

While training, a random offset in [0, model.abacus_train_offset) is added to every place of a sequence, so the
places of numbers longer than the training ones were trained too; evaluation and generation use none. The
offsets are a pure function of (run.seed, the sample's global slot in the data order), `abacus_offsets`, so they
are the same on any number of ranks and after a resume, with no random state to save.
"""

from __future__ import annotations

import numpy as np
import torch
from torch import nn

SPLITMIX_GAMMA = np.uint64(0x9E3779B97F4A7C15)


def digit_places(is_digit: torch.Tensor, carry: torch.Tensor | None = None) -> torch.Tensor:
    """is_digit (B, T) bool -> places (B, T) int64: 1, 2, ... along every run of consecutive digits, 0 elsewhere.

    carry (B,) int64: the place of the token just before these (the last cached token; 0 = not a digit), so a
    number that began in a cached prefix keeps counting where the prefix stopped."""
    b, t = is_digit.shape
    index = torch.arange(t, device=is_digit.device).expand(b, t)  # (B, T)
    # The last non-digit at or before each token; before the first one it is a virtual token `carry` places back.
    before = -1 - (carry if carry is not None else torch.zeros(b, dtype=torch.long, device=is_digit.device))
    last_break = torch.where(is_digit, before[:, None].expand(b, t), index).cummax(dim=1).values  # (B, T)
    return torch.where(is_digit, index - last_break, torch.zeros_like(index))


class AbacusEmbedding(nn.Module):
    """Learned embeddings of places 1..max_places; place 0 (not a digit) adds nothing."""

    def __init__(self, max_places: int, d_model: int):
        super().__init__()
        self.max_places = max_places
        self.embed = nn.Embedding(max_places + 1, d_model)

    def forward(self, places: torch.Tensor) -> torch.Tensor:
        """places (B, T) int64 -> (B, T, C). Places past max_places are refused on CPU (`check_places`); elsewhere
        they are clamped to the last embedding rather than read out of bounds."""
        vectors = self.embed(places.clamp(max=self.max_places))
        return vectors * (places > 0).unsqueeze(-1).to(vectors.dtype)


def abacus_offsets(seed: int, slots: np.ndarray, limit: int) -> torch.Tensor:
    """(n,) int64 offsets in [0, limit) for the samples at these global slots of the data order: splitmix64 of
    (seed, slot), so every rank draws its samples' offsets alone and a resumed run draws the same ones."""
    if limit <= 1:
        return torch.zeros(len(slots), dtype=torch.long)
    with np.errstate(over="ignore"):  # wrap-around arithmetic is the hash
        z = np.asarray(slots, dtype=np.uint64) + np.uint64(seed + 1) * SPLITMIX_GAMMA
        z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
        z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
        z ^= z >> np.uint64(31)
    return torch.from_numpy((z % np.uint64(limit)).astype(np.int64))


def offset_places(places: torch.Tensor, offsets: torch.Tensor | None) -> torch.Tensor:
    """places (B, T) with offsets (B,) added to the digits' places (non-digits stay 0)."""
    if offsets is None:
        return places
    return torch.where(places > 0, places + offsets.to(places.device)[:, None], places)


def check_places(places: torch.Tensor, max_places: int) -> None:
    """Refuse places past the table (host-side, on CPU only: elsewhere the read would synchronise every step)."""
    if places.device.type == "cpu" and places.numel() and int(places.max()) > max_places:
        raise ValueError(
            f"a number reaches digit place {int(places.max())} (with its training offset) but "
            f"model.abacus_max_places={max_places}; raise model.abacus_max_places above the longest number plus "
            "model.abacus_train_offset, or lower the offset"
        )
