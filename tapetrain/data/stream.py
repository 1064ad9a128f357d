"""Training-time data API: open prepared datasets (single or weighted mixture) and iterate micro batches.

    ds = open_dataset("data/tok", seq_len=2048, expected_vocab_size=32000)        # PackedDataset
    ds = open_dataset([{"path": "a", "weight": 3}, {"path": "b", "weight": 1}], 2048, seed=0)  # MixedDataset
    it = BatchIterator(ds, global_batch_size=256, micro_batch_size=4, rank=r, world_size=w, seed=0)
    x = it.next_micro_batch()          # (4, 2049) int64: inputs x[:, :-1], labels x[:, 1:]
    val = open_dataset("data/tok", 2048, split="val")
    ds = open_dataset("data/arith", 64)        # an example store (tapetrain data arith/scrolls): SupervisedDataset
    ds = open_dataset("s3://bucket/tok", 2048, cache=ShardCache("/tmp/cache", 100))  # object storage
"""

from __future__ import annotations

import os
from typing import Any

from tapetrain.data import remote
from tapetrain.data.batches import BatchIterator
from tapetrain.data.cache import ShardCache
from tapetrain.data.errors import DataError
from tapetrain.data.examples import is_example_dir
from tapetrain.data.mixture import MixedDataset
from tapetrain.data.packed import PackedDataset
from tapetrain.data.supervised import SupervisedDataset

__all__ = ["BatchIterator", "MixedDataset", "PackedDataset", "SupervisedDataset", "open_dataset"]


def _open_one(path: str, seq_len: int, split: str, expected_vocab_size: int | None,
              packing: bool, document_mask: bool | None,
              cache: ShardCache | None) -> PackedDataset | SupervisedDataset:
    """Token shards (tapetrain data prepare) or an example store (tapetrain data arith / data scrolls)."""
    if is_example_dir(path):
        if remote.is_remote(path):
            raise DataError(f"{path} is an example store (data arith / data scrolls): those are read from local "
                            "paths only; copy it to local disk (token shards can stay in object storage)")
        return SupervisedDataset(path, seq_len, split, expected_vocab_size, packing, document_mask)
    return PackedDataset(path, seq_len, split=split, expected_vocab_size=expected_vocab_size,
                         document_mask=document_mask, cache=cache)


def open_dataset(
    spec: str | os.PathLike | list[dict[str, Any]],
    seq_len: int,
    split: str = "train",
    expected_vocab_size: int | None = None,
    seed: int = 0,
    packing: bool = False,
    document_mask: bool | None = False,
    cache: ShardCache | None = None,
) -> PackedDataset | SupervisedDataset | MixedDataset:
    """spec: a path (str) or a list of {'path': str, 'weight': float} dicts -> PackedDataset/SupervisedDataset
    or a MixedDataset of them; `packing` applies to example stores only. `document_mask`: batches carry document
    ids (None: only for packed examples); the opened dataset's `document_mask` says what was chosen. `cache` holds
    the shards of paths in object storage (default: the node-local default directory, no size limit)."""
    if isinstance(spec, (str, os.PathLike)):
        return _open_one(os.fspath(spec), seq_len, split, expected_vocab_size, packing, document_mask, cache)
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
        ds = _open_one(os.fspath(entry["path"]), seq_len, split, expected_vocab_size, packing, document_mask, cache)
        sources.append((ds, entry["weight"]))
    if len({isinstance(ds, SupervisedDataset) for ds, _ in sources}) > 1:
        raise DataError("data spec mixes token shards and example stores; train on one kind at a time (language "
                        "modelling shards or supervised examples)")
    return MixedDataset(sources, seed=seed)
