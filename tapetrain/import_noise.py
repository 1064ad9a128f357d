"""Filters for two kinds of warning that importing torchao prints on every machine without its CUDA extensions
(transformers imports torchao when it is installed, so every export and evaluation printed them):

    torchao                 "Failed to load .../torchao/_C_*.so: Could not load this library"  (one per extension)
    torch.utils._pytree     "<enum ...> is an Enum subclass ... register_constant() ... is deprecated"

They are not ours to fix and say nothing about the run. The filters drop exactly those messages; every other record
of the two loggers passes. `install()` is idempotent."""

from __future__ import annotations

import logging


class _DropMessages(logging.Filter):
    def __init__(self, *fragments: str):
        super().__init__()
        self.fragments = fragments

    def filter(self, record: logging.LogRecord) -> bool:
        message = record.getMessage()
        return not all(fragment in message for fragment in self.fragments)


_FILTERS = {
    "torchao": _DropMessages("Failed to load", "_C_", "Could not load this library"),
    "torch.utils._pytree": _DropMessages("is an Enum subclass", "register_constant()"),
}


def install() -> None:
    for name, drop in _FILTERS.items():
        logger = logging.getLogger(name)
        if drop not in logger.filters:
            logger.addFilter(drop)
