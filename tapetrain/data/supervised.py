"""Supervised examples as training samples: fixed windows of seq_len + 1 tokens with the loss on answers only.

A sample is an int64 array (2, seq_len + 1): row 0 the tokens, row 1 the target mask (1 where the token is part
of an answer, its EOS included). `collate` turns a list of samples into an `ExampleBatch`:
    input_ids = tokens[:, :-1]                                   (B, seq_len)
    labels    = tokens[:, 1:] where mask[:, 1:] else -100         (B, seq_len)
so the model's cross-entropy (ignore_index -100) sees the answer tokens and nothing else: no prompt, no padding.

Two layouts (data.packing):
  padding (default)  sample i = example i, padded with the pad id to seq_len + 1 tokens;
  packing            sample i = a run of consecutive examples (in store order) filling at most seq_len + 1 tokens,
                     then padded. Each example keeps its own answer-only loss mask. With data.document_mask
                     (the default with packing) every example is its own document: positions restart at its first
                     token and attention stays inside it, so a packed example computes exactly what it would
                     padded; with document_mask=false attention spans the whole window.
With document_mask a sample has a third row, the document id of each token (example k of the pack = k, the
padding tail one more), and the batch carries doc_ids (B, seq_len) int32.
Samples go through the same BatchIterator as token shards, so the seeded global order, O(1) resume, the rank-count
independence and exact resume after SIGKILL carry over unchanged.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from tapetrain.data.documents import TokenBatch
from tapetrain.data.errors import DataError
from tapetrain.data.examples import ExampleStore

IGNORE_INDEX = -100


@dataclass
class ExampleBatch:
    """A micro batch of supervised examples; moves to a device like a tensor."""

    input_ids: torch.Tensor  # (B, T) int64
    labels: torch.Tensor  # (B, T) int64, IGNORE_INDEX where no loss
    doc_ids: torch.Tensor | None = None  # (B, T) int32 with data.document_mask

    def to(self, device, non_blocking: bool = False) -> ExampleBatch:
        docs = None if self.doc_ids is None else self.doc_ids.to(device, non_blocking=non_blocking)
        return ExampleBatch(self.input_ids.to(device, non_blocking=non_blocking),
                            self.labels.to(device, non_blocking=non_blocking), docs)


def inputs_and_labels(batch: torch.Tensor | ExampleBatch | TokenBatch) -> tuple[torch.Tensor, torch.Tensor]:
    """(input_ids, labels) of a micro batch: an ExampleBatch, or LM token windows (B, T + 1) shifted by one."""
    if isinstance(batch, ExampleBatch):
        return batch.input_ids, batch.labels
    if isinstance(batch, TokenBatch):
        batch = batch.tokens
    return batch[:, :-1], batch[:, 1:]


def document_ids(batch: torch.Tensor | ExampleBatch | TokenBatch) -> torch.Tensor | None:
    """The batch's document ids (B, T) int32 (data.document_mask), or None."""
    return getattr(batch, "doc_ids", None)


def pack_boundaries(lengths: np.ndarray, window: int) -> np.ndarray:
    """Greedy packing of consecutive examples: (num_packs + 1,) indices; pack p = examples [b[p], b[p+1])."""
    ends = np.concatenate([[0], np.cumsum(lengths, dtype=np.int64)])
    bounds, start, n = [0], 0, len(lengths)
    while start < n:
        # the largest end with ends[end] - ends[start] <= window (at least one example: all fit, checked before)
        end = max(start + 1, int(np.searchsorted(ends, ends[start] + window, side="right")) - 1)
        bounds.append(end)
        start = end
    return np.asarray(bounds, dtype=np.int64)


class SupervisedDataset:
    """An example store as samples of seq_len + 1 tokens; the PackedDataset interface (num_samples,
    __getitem__, vocab_size, seq_len) plus `collate`."""

    def __init__(self, path: str, seq_len: int, split: str = "train", expected_vocab_size: int | None = None,
                 packing: bool = False, document_mask: bool | None = None):
        if int(seq_len) < 1:
            raise DataError(f"seq_len must be >= 1, got {seq_len}")
        self.store = ExampleStore(path, split, expected_vocab_size)
        self.path, self.split, self.seq_len, self.packing = self.store.path, split, int(seq_len), packing
        self.vocab_size, self.pad_id = self.store.vocab_size, self.store.pad_id
        self.window = self.seq_len + 1
        self.document_mask = packing if document_mask is None else bool(document_mask)  # None: on when packing
        if self.store.max_length > self.window:
            raise DataError(f"examples {path} ({split}) hold up to {self.store.max_length} tokens but data.seq_len="
                            f"{self.seq_len} fits {self.window} (inputs + the last label); set data.seq_len to at "
                            f"least {self.store.max_length - 1} or rebuild the data shorter")
        self._packs = pack_boundaries(self.store.lengths(), self.window) if packing else None
        self.num_samples = len(self._packs) - 1 if packing else self.store.num_examples

    def __len__(self) -> int:
        return self.num_samples

    def __getitem__(self, index: int) -> np.ndarray:
        """Sample `index` -> (2, seq_len + 1) int64: tokens and the answer mask (and document ids: 3 rows)."""
        if not 0 <= index < self.num_samples:
            raise IndexError(f"sample {index} out of range [0, {self.num_samples})")
        out = np.zeros((3 if self.document_mask else 2, self.window), dtype=np.int64)
        out[0] = self.pad_id
        members = range(self._packs[index], self._packs[index + 1]) if self._packs is not None else [index]
        pos = 0
        for doc, i in enumerate(members):
            ids, prompt_len = self.store.example(int(i))
            out[0, pos:pos + len(ids)] = ids
            out[1, pos + prompt_len:pos + len(ids)] = 1
            if self.document_mask:
                out[2, pos:pos + len(ids)] = doc
            pos += len(ids)
        if self.document_mask:
            out[2, pos:] = len(members)  # the padding tail: a document of its own
        return out

    @staticmethod
    def collate(samples: list[np.ndarray]) -> ExampleBatch:
        stacked = torch.from_numpy(np.stack(samples))  # (B, 2 or 3, T + 1)
        tokens, mask = stacked[:, 0], stacked[:, 1].bool()
        labels = torch.where(mask[:, 1:], tokens[:, 1:], torch.full_like(tokens[:, 1:], IGNORE_INDEX))
        docs = stacked[:, 2, :-1].to(torch.int32) if stacked.shape[1] == 3 else None
        return ExampleBatch(tokens[:, :-1].contiguous(), labels.contiguous(), docs)

    def __repr__(self) -> str:
        return (f"SupervisedDataset({self.path!r}, split={self.split!r}, seq_len={self.seq_len}, "
                f"packing={self.packing}, document_mask={self.document_mask}, num_samples={self.num_samples})")
