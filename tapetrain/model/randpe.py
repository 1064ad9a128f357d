"""Randomized positional encoding (Ruoss et al., 2023) as the TAPE paper's baseline defines it.

RoPE at sorted random positions: a forward over T tokens draws T distinct integers from [0, N) without replacement
and sorts them, N = model.randpe_max_position (None = 2·max_seq_len, the TAPE repository's range); when T > N the
draw is from [0, T), i.e. positions 0..T−1 (the repository grows its range to the input length). Like the
repository, positions are drawn at evaluation too (model.randpe_sample_at_eval), independently in every layer
(model.randpe_per_layer) and shared by the rows of a batch. With packed documents (doc_ids, data.document_mask)
every document of every row draws its own sorted set of its own length instead, as if it were run alone
(`draw_document_positions`); per layer, each layer draws for all documents in turn. Forwards with a KV cache
(cached generation) and forwards given explicit positions use their positions as they are.
"""

from __future__ import annotations

import torch


def randpe_limit(max_position: int | None, max_seq_len: int) -> int:
    return max_position or 2 * max_seq_len


def draw_positions(length: int, limit: int, device: torch.device) -> torch.Tensor:
    """(length,) float64: a sorted draw of `length` distinct integers from [0, max(limit, length))."""
    return torch.randperm(max(limit, length), device=device)[:length].sort().values.to(torch.float64)


def draw_document_positions(doc_ids: torch.Tensor, limit: int) -> torch.Tensor:
    """doc_ids (B, T) -> (B, T) float64: one `draw_positions` per document, of the document's length.

    The draws are taken row by row and, inside a row, document by document, so each document gets exactly the
    positions it would draw run alone (B = 1) from the same RNG state: packed documents = separate runs."""
    rows = []
    for row in doc_ids:
        _, counts = torch.unique_consecutive(row, return_counts=True)  # contiguous runs (document lengths)
        rows.append(torch.cat([draw_positions(n, limit, row.device) for n in counts.tolist()]))
    return torch.stack(rows)
