"""Data layer: tokenizers (sentencepiece, Hugging Face tokenizer.json), corpus readers, `prepare` into token
shards, and the training reader.

Exports are resolved lazily so `tapetrain data prepare` does not import torch.
"""

from __future__ import annotations

import importlib
from typing import Any

from tapetrain.data.errors import DataError

_EXPORTS = {
    "BatchIterator": "tapetrain.data.batches",
    "ExampleBatch": "tapetrain.data.supervised",
    "ExampleStore": "tapetrain.data.examples",
    "FlatTokenFile": "tapetrain.data.flat_tokens",
    "MixedDataset": "tapetrain.data.mixture",
    "PackedDataset": "tapetrain.data.packed",
    "SupervisedDataset": "tapetrain.data.supervised",
    "HFTokenizer": "tapetrain.data.hf_tokenizer",
    "Tokenizer": "tapetrain.data.tokenizer",
    "open_dataset": "tapetrain.data.stream",
    "open_tokenizer": "tapetrain.data.tokenizer",
    "train_tokenizer": "tapetrain.data.tokenizer",
}

__all__ = ["DataError", *_EXPORTS]


def __getattr__(name: str) -> Any:
    if name in _EXPORTS:
        return getattr(importlib.import_module(_EXPORTS[name]), name)
    raise AttributeError(f"module 'tapetrain.data' has no attribute {name!r}")
