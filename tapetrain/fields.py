"""`option()`: a dataclass field carrying its help text, for ModelConfig and the run config sections alike (the
configuration reference is generated from it). Neutral ground: model/ and config/ both import it."""

from __future__ import annotations

import copy
from dataclasses import MISSING, Field, field
from typing import Any


def option(default: Any = MISSING, help: str = "", *, shown_type: str | None = None) -> Any:  # noqa: A002
    """A dataclass field with `metadata={"help": ...}`.

    Mutable defaults (lists, dicts) are copied per instance. `shown_type` overrides the type column of the
    generated reference where the annotation is not what a YAML author writes (e.g. normalised data sources).
    """
    if not help:
        raise ValueError("every config field needs a help text")
    metadata: dict[str, Any] = {"help": help}
    if shown_type is not None:
        metadata["type"] = shown_type
    if isinstance(default, (list, dict, set)):
        return field(default_factory=lambda: copy.deepcopy(default), metadata=metadata)
    return field(default=default, metadata=metadata)


def field_help(f: Field) -> str:
    """The help text of a dataclass field ('' if it has none)."""
    return str(f.metadata.get("help", ""))
