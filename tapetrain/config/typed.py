"""Plain YAML data -> typed dataclasses, strictly: unknown keys and wrong types are ConfigErrors.

Only the conversions a YAML author expects are made: int -> float, list -> tuple. Nothing else is coerced
(no "3" -> 3, no 1 -> True), so a typo cannot silently turn into a different value.
"""

from __future__ import annotations

import dataclasses
import difflib
import types
import typing
from collections.abc import Callable, Mapping
from typing import Any, Literal, Union

from tapetrain.errors import ConfigError

# Maps a dotted key to where it was written ("configs/x.yaml:12", "override 'train.steps=0'").
Locate = Callable[[str], str]


class UnknownKeys(ConfigError):
    """Every unknown key of a config, reported at once (so a config with several typos is fixed in one go)."""

    def __init__(self, problems: list[str]):
        self.problems = problems
        listing = "\n".join(f"  - {p}" for p in problems)
        super().__init__(problems[0] if len(problems) == 1 else
                         f"{len(problems)} unknown keys in the config; fix them all:\n{listing}")


def gather(problems: list[str], step: Callable[..., Any], *args: Any, **kwargs: Any) -> tuple[Any, ConfigError | None]:
    """(step(*args, **kwargs), None), or (None, its ConfigError) with the unknown keys it found added to `problems`:
    a caller finishes its other keys, then raises UnknownKeys(problems) if any, else the first other error."""
    try:
        return step(*args, **kwargs), None
    except UnknownKeys as err:
        problems.extend(err.problems)
        return None, None
    except ConfigError as err:
        return None, err


def _no_location(key: str) -> str:
    return ""


def where(locate: Locate, key: str) -> str:
    """' (at configs/x.yaml:12)' or '' when the key's origin is unknown."""
    loc = locate(key)
    return f" (at {loc})" if loc else ""


def suggest(name: str, valid: list[str], prefix: str = "") -> str:
    """'; did you mean 'prefix.x'?' for the closest valid name, else the list of valid names."""
    dotted = (lambda n: f"{prefix}.{n}") if prefix else (lambda n: n)
    close = difflib.get_close_matches(name, valid, n=1, cutoff=0.6)
    if close:
        return f"; did you mean {dotted(close[0])!r}?"
    return f"; valid keys: {', '.join(dotted(n) for n in sorted(valid))}"


def type_name(tp: Any) -> str:
    """A YAML author's name for a type annotation: 'int or null', 'one of a, b', 'list of {path, weight}'."""
    origin = typing.get_origin(tp)
    if tp is type(None):
        return "null"
    if tp is Any:
        return "any value"
    if origin is Literal:
        return "one of " + ", ".join(str(a) for a in typing.get_args(tp))
    if origin in (Union, types.UnionType):
        return " or ".join(type_name(a) for a in typing.get_args(tp))
    if origin is list:
        return f"list of {type_name(typing.get_args(tp)[0])}"
    if origin is tuple:
        args = typing.get_args(tp)
        if len(args) == 2 and args[1] is Ellipsis:
            return f"list of {type_name(args[0])}"
        return f"list of {len(args)} ({', '.join(type_name(a) for a in args)})"
    if origin is dict or tp is dict:
        return "mapping"
    if dataclasses.is_dataclass(tp):
        return "{" + ", ".join(f.name for f in dataclasses.fields(tp)) + "}"
    return getattr(tp, "__name__", str(tp))


def _got(value: Any) -> str:
    return f"{value!r} ({type(value).__name__})"


def convert(value: Any, tp: Any, key: str, locate: Locate = _no_location) -> Any:
    """Check `value` against annotation `tp`; return it in its typed form or raise ConfigError at `key`."""

    def mismatch() -> ConfigError:
        return ConfigError(f"{key}: expected {type_name(tp)}, got {_got(value)}{where(locate, key)}")

    origin = typing.get_origin(tp)
    if tp is Any:
        return value
    if tp is type(None):
        if value is None:
            return None
        raise mismatch()
    if origin in (Union, types.UnionType):
        args = typing.get_args(tp)
        if value is None:
            if type(None) in args:
                return None
            raise mismatch()
        errors = []
        for arg in args:
            if arg is type(None):
                continue
            try:
                return convert(value, arg, key, locate)
            except ConfigError as err:
                errors.append(err)
        deeper = [e for e in errors if not str(e).startswith(f"{key}:")]
        if len(errors) == 1 and deeper:
            raise deeper[0]  # e.g. a bad item inside a list: name the item
        raise mismatch()
    if origin is Literal:
        choices = typing.get_args(tp)
        if value is False and "off" in choices:  # YAML 1.1 reads a bare `off` as false (train.float8: off)
            return "off"
        if value in choices and type(value) is type(choices[choices.index(value)]):
            return value
        hint = ""
        if isinstance(value, str):
            close = difflib.get_close_matches(value, [str(c) for c in choices], n=1, cutoff=0.5)
            hint = f"; did you mean {close[0]!r}?" if close else ""
        raise ConfigError(
            f"{key}: expected one of {', '.join(map(str, choices))}, got {_got(value)}"
            f"{hint}{where(locate, key)}"
        )
    if dataclasses.is_dataclass(tp):
        if not isinstance(value, Mapping):
            raise mismatch()
        return build(tp, value, key, locate)
    if origin is list:
        if not isinstance(value, list):
            raise mismatch()
        (item_tp,) = typing.get_args(tp)
        return [convert(v, item_tp, f"{key}[{i}]", locate) for i, v in enumerate(value)]
    if origin is tuple:
        if not isinstance(value, (list, tuple)):
            raise mismatch()
        args = typing.get_args(tp)
        if len(args) == 2 and args[1] is Ellipsis:
            return tuple(convert(v, args[0], f"{key}[{i}]", locate) for i, v in enumerate(value))
        if len(value) != len(args):
            raise mismatch()
        return tuple(
            convert(v, a, f"{key}[{i}]", locate) for i, (v, a) in enumerate(zip(value, args, strict=True))
        )
    if origin is dict or tp is dict:
        if not isinstance(value, Mapping):
            raise mismatch()
        if any(not isinstance(k, str) for k in value):
            raise ConfigError(f"{key}: mapping keys must be strings, got {list(value)!r}{where(locate, key)}")
        return dict(value)
    if tp is bool:
        if isinstance(value, bool):
            return value
        raise mismatch()
    if tp is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
        if isinstance(value, float) and value.is_integer() and abs(value) < 2**53:
            return int(value)  # 1e6 written for an integer count
        raise mismatch()
    if tp is float:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
        raise mismatch()
    if tp is str:
        if isinstance(value, str):
            return value
        raise mismatch()
    raise TypeError(f"{key}: unsupported annotation {tp!r} in the config schema")


def build(
    cls: type,
    raw: Mapping,
    prefix: str,
    locate: Locate = _no_location,
    elsewhere: Callable[[str], str | None] | None = None,
) -> Any:
    """Build dataclass `cls` from mapping `raw`; missing keys take defaults, unknown keys are errors.

    A class may define `normalize_raw(raw) -> raw` to accept YAML shorthands before type checking.
    `elsewhere(name)` may return the dotted key where an unknown name belongs instead (e.g. 'optim.lr').
    """
    normalize = getattr(cls, "normalize_raw", None)
    if normalize is not None:
        raw = normalize(raw)
    hints = typing.get_type_hints(cls)
    names = [f.name for f in dataclasses.fields(cls) if f.init]
    problems = []
    for key in (k for k in raw if k not in names):
        dotted = f"{prefix}.{key}" if prefix else str(key)
        hint = suggest(str(key), names, prefix)
        # The exact name in another section beats a fuzzy match here ('train.lr' -> 'optim.lr', not 'train.lora').
        moved = elsewhere(str(key)) if elsewhere is not None else None
        if moved:
            hint = f"; did you mean {moved!r}? ({key!r} belongs in that section)"
        problems.append(f"unknown key {dotted!r}{where(locate, dotted)}{hint}")
    values, errors = {}, []
    for name in names:
        if name in raw:
            dotted = f"{prefix}.{name}" if prefix else name
            values[name], error = gather(problems, convert, raw[name], hints[name], dotted, locate)
            errors += [error] if error else []
    if problems:
        raise UnknownKeys(problems)
    if errors:
        raise errors[0]
    missing = [
        f.name
        for f in dataclasses.fields(cls)
        if f.init
        and f.name not in values
        and f.default is dataclasses.MISSING
        and f.default_factory is dataclasses.MISSING
    ]
    if missing:
        dotted = f"{prefix}.{missing[0]}" if prefix else missing[0]
        raise ConfigError(f"{dotted}: required key is missing{where(locate, prefix)}; add it")
    return cls(**values)


def to_plain(obj: Any) -> Any:
    """Dataclasses/tuples -> dicts/lists of YAML scalars (field order kept)."""
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        return {f.name: to_plain(getattr(obj, f.name)) for f in dataclasses.fields(obj)}
    if isinstance(obj, (list, tuple)):
        return [to_plain(v) for v in obj]
    if isinstance(obj, dict):
        return {k: to_plain(v) for k, v in obj.items()}
    return obj
