"""Packed documents inside one sequence (data.document_mask): per-document positions and the attention mask.

doc_ids (B, T) int: equal ids mark one document; a document is a contiguous run (ids non-decreasing along T, as
tapetrain.data.documents emits them). With them the model
  * restarts positions at 0 at every document start (`document_positions`), for every encoding;
  * attends causally within a document only (`DocumentMask`), so TAPE's A·E and both state updates stay inside it.
Every backend gets the same `DocumentMask`: eager/sdpa a dense boolean mask, flex a BlockMask, the Triton kernel
per-token ids (it skips key tiles outside the query tile's documents), flash-attn cu_seqlens.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch


def document_starts(doc_ids: torch.Tensor) -> torch.Tensor:
    """doc_ids (B, T) -> (B, T) int64: the index of the first token of each token's document."""
    t = doc_ids.shape[-1]
    idx = torch.arange(t, device=doc_ids.device).expand_as(doc_ids)
    new = torch.ones_like(doc_ids, dtype=torch.bool)
    new[..., 1:] = doc_ids[..., 1:] != doc_ids[..., :-1]
    return torch.where(new, idx, torch.zeros_like(idx)).cummax(dim=-1).values


def document_positions(doc_ids: torch.Tensor) -> torch.Tensor:
    """doc_ids (B, T) -> (B, T) float64: each token's position inside its document (0 at a document start)."""
    idx = torch.arange(doc_ids.shape[-1], device=doc_ids.device)
    return (idx - document_starts(doc_ids)).to(torch.float64)


@dataclass
class DocumentMask:
    """Document ids of the queries (B, T) and keys (B, S) of one attention call (int32, bottom-right aligned like
    the causal mask: query t is key S − T + t)."""

    q_ids: torch.Tensor
    k_ids: torch.Tensor
    cache: dict = field(default_factory=dict, repr=False, compare=False)  # e.g. flex's BlockMask, built once

    @classmethod
    def of(cls, doc_ids: torch.Tensor) -> DocumentMask:
        ids = doc_ids.to(torch.int32)
        return cls(ids, ids)

    def slice(self, first: int, stop: int, keys: int) -> DocumentMask:
        """The mask of queries [first, stop) against the first `keys` keys (xPos's query blocks)."""
        return DocumentMask(self.q_ids[:, first:stop], self.k_ids[:, :keys])

    def same(self) -> torch.Tensor:
        """(B, 1, T, S) bool: True where query and key are in one document (causality is applied separately)."""
        return (self.q_ids[:, :, None] == self.k_ids[:, None, :])[:, None]
