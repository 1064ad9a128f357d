"""Document ids of packed sequences (data.document_mask): which document each input token belongs to.

A batch of token windows (B, T + 1) (inputs w[:-1], labels w[1:]) becomes a `TokenBatch` that also carries
doc_ids (B, T) int32: per row, 0 for the first document in the window, +1 after every EOS (an EOS belongs to the
document it ends). Ids are a function of the window's tokens alone, so they survive resume, any rank count and
sequence parallelism (the model receives the whole sequence's ids and derives each document's start from them).
The model restarts positions at every document start and attends within a document only (tapetrain.model.documents).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch


def document_ids_from_eos(inputs: np.ndarray, eos_id: int) -> np.ndarray:
    """inputs (..., T) int -> (..., T) int32: the number of EOS tokens strictly before each position."""
    ends = (inputs == eos_id).astype(np.int32)
    ids = np.cumsum(ends, axis=-1, dtype=np.int32) - ends  # exclusive prefix count: the EOS stays in its document
    return ids


@dataclass
class TokenBatch:
    """A micro batch of language-model windows with their document ids; moves to a device like a tensor."""

    tokens: torch.Tensor  # (B, T + 1) int64
    doc_ids: torch.Tensor  # (B, T) int32, of the inputs tokens[:, :-1]

    def to(self, device, non_blocking: bool = False) -> TokenBatch:
        return TokenBatch(
            self.tokens.to(device, non_blocking=non_blocking), self.doc_ids.to(device, non_blocking=non_blocking)
        )


class DocumentCollate:
    """`collate` of a PackedDataset with data.document_mask: windows (seq_len + 1,) -> TokenBatch.
    A class (not a bound method) so that datasets stay picklable for reader workers."""

    def __init__(self, eos_id: int):
        self.eos_id = int(eos_id)

    def __call__(self, samples: list[np.ndarray]) -> TokenBatch:
        tokens = np.stack(samples)  # (B, T + 1)
        ids = document_ids_from_eos(tokens[:, :-1], self.eos_id)
        return TokenBatch(torch.from_numpy(tokens), torch.from_numpy(ids))


def document_stats(doc_ids: torch.Tensor, block: int = 128) -> tuple[float, float]:
    """(mean tokens per document, fraction of causal (block × block) attention tiles skipped by the document
    mask) for doc_ids (B, T): a tile is skipped when no query in it shares a document with a key in it."""
    ids = doc_ids.long()
    b, t = ids.shape
    docs = int((ids[:, -1] - ids[:, 0] + 1).sum())  # ids are non-decreasing runs per row
    tiles = -(-t // block)
    first = ids[:, ::block]  # (B, tiles): id of each tile's first token
    last = ids[:, torch.clamp(torch.arange(tiles) * block + block - 1, max=t - 1)]
    qi, ki = torch.tril_indices(tiles, tiles)  # causal tile pairs (query tile qi >= key tile ki)
    skipped = first[:, qi] > last[:, ki]  # (B, pairs): every query's document starts after every key's
    return b * t / max(docs, 1), float(skipped.float().mean())
