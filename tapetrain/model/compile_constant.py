"""Decisions made once and taken as constants by torch.compile (the record lookups of `auto`)."""

from __future__ import annotations

from collections.abc import Callable
from typing import TypeVar

F = TypeVar("F", bound=Callable)


def constant_to_compile(fn: F) -> F:
    """What torch.compiler.assume_constant_result(fn) does: dynamo runs fn for real on the (constant) arguments of a
    traced call and keeps the result as a constant, so a file read or a log line inside never breaks a graph. It sets
    this one attribute, which dynamo reads; setting it here avoids importing torch._dynamo (~1 s of every process
    that loads the model). tests/unit/test_tape_fused_setting.py checks torch's decorator still does just this."""
    fn._dynamo_marked_constant = True  # type: ignore[attr-defined]
    return fn
