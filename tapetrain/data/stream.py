"""Training-time data API: open prepared datasets (single or weighted mixture) and iterate micro batches.

    ds = open_dataset("data/tok", seq_len=2048, expected_vocab_size=32000)        # PackedDataset
    ds = open_dataset([{"path": "a", "weight": 3}, {"path": "b", "weight": 1}], 2048, seed=0)  # MixedDataset
    it = BatchIterator(ds, global_batch_size=256, micro_batch_size=4, rank=r, world_size=w, seed=0)
    x = it.next_micro_batch()          # (4, 2049) int64: inputs x[:, :-1], labels x[:, 1:]
    val = open_dataset("data/tok", 2048, split="val")
"""

from __future__ import annotations

import os
from typing import Any

from tapetrain.data.batches import BatchIterator
from tapetrain.data.errors import DataError
from tapetrain.data.mixture import MixedDataset
from tapetrain.data.packed import PackedDataset

__all__ = ["BatchIterator", "MixedDataset", "PackedDataset", "open_dataset"]


def open_dataset(
    spec: str | os.PathLike | list[dict[str, Any]],
    seq_len: int,
    split: str = "train",
    expected_vocab_size: int | None = None,
    seed: int = 0,
) -> PackedDataset | MixedDataset:
    """spec: a path (str) or a list of {'path': str, 'weight': float} dicts -> PackedDataset/MixedDataset."""
    if isinstance(spec, (str, os.PathLike)):
        return PackedDataset(os.fspath(spec), seq_len, split=split, expected_vocab_size=expected_vocab_size)
    if not isinstance(spec, (list, tuple)) or not spec:
        raise DataError(f"data spec {spec!r} must be a path or a non-empty list of "
                        "{'path': ..., 'weight': ...} dicts")
    sources = []
    for i, entry in enumerate(spec):
        if not isinstance(entry, dict) or "path" not in entry or "weight" not in entry:
            raise DataError(f"data spec entry {i} ({entry!r}) must be a dict with 'path' and 'weight', e.g. "
                            "{'path': 'data/web', 'weight': 0.7}")
        unknown = set(entry) - {"path", "weight"}
        if unknown:
            raise DataError(f"data spec entry {i} has unknown keys {sorted(unknown)}; allowed: path, weight")
        ds = PackedDataset(os.fspath(entry["path"]), seq_len, split=split,
                           expected_vocab_size=expected_vocab_size)
        sources.append((ds, entry["weight"]))
    return MixedDataset(sources, seed=seed)
