"""Reading run YAML: line-numbered errors, duplicate keys, `base:` includes and KEY=VALUE overrides.

A config file may start with `base: other.yaml` (or a list of files), a path relative to the file itself.
The bases are loaded first (recursively, in order) and the file's own keys are deep-merged over them:
mappings merge key by key, anything else (scalars, lists) replaces. Cycles are errors.
"""

from __future__ import annotations

import logging
import os
import re
from collections.abc import Iterable
from typing import Any

import yaml

from tapetrain.errors import ConfigError

log = logging.getLogger("tapetrain.config")

# Keys of which a config sets at most one. A command-line override of one replaces the other where a file set it
# (users of Hydra/OmegaConf-style overrides expect that); both from the same source stay an error (config/checks.py).
EXCLUSIVE_KEYS = (("optim.warmup_steps", "optim.warmup_ratio"),)

BASE_KEY = "base"


class _Loader(yaml.SafeLoader):
    """SafeLoader that also reads `1e-4` / `5e8` as floats (YAML 1.1 wants `1.0e-4`, a common trap)."""


_Loader.add_implicit_resolver(
    "tag:yaml.org,2002:float",
    re.compile(r"^[-+]?[0-9][0-9_]*(?:\.[0-9_]*)?[eE][-+]?[0-9]+$"),
    list("-+0123456789"),
)


def parse_value(text: str) -> Any:
    """Parse one YAML scalar/flow value, e.g. an override's right-hand side ('20', '[a, b]', '1e-4')."""
    return yaml.load(text, Loader=_Loader)


def _yaml_error(source: str, err: yaml.YAMLError) -> ConfigError:
    mark = getattr(err, "problem_mark", None) or getattr(err, "context_mark", None)
    problem = getattr(err, "problem", None) or str(err)
    context = getattr(err, "context", None)
    detail = f"{problem} ({context})" if context else problem
    context_mark = getattr(err, "context_mark", None)
    if context_mark is not None and mark is not None and context_mark.line != mark.line:
        detail += f"; that construct starts at line {context_mark.line + 1}"
    if mark is not None:
        return ConfigError(
            f"{source}:{mark.line + 1}:{mark.column + 1}: malformed YAML: {detail}; "
            "fix the syntax on that line (indentation, a missing ':' or an unclosed quote/bracket)"
        )
    return ConfigError(f"{source}: malformed YAML: {detail}")


def _walk(node: yaml.Node, prefix: str, source: str, out: dict[str, str]) -> None:
    """Record 'file:line' for every mapping key under `node`; duplicate keys are errors."""
    if not isinstance(node, yaml.MappingNode):
        return
    seen: dict[str, int] = {}
    for key_node, value_node in node.value:
        if not isinstance(key_node, yaml.ScalarNode) or key_node.value == "<<":
            continue
        line = key_node.start_mark.line + 1
        dotted = f"{prefix}.{key_node.value}" if prefix else key_node.value
        if key_node.value in seen:
            raise ConfigError(
                f"{source}:{line}: duplicate key {dotted!r} (first at line {seen[key_node.value]}); "
                "keep only one of them"
            )
        seen[key_node.value] = line
        out[dotted] = f"{source}:{line}"
        _walk(value_node, dotted, source, out)


def read_yaml(path: str) -> tuple[dict, dict[str, str]]:
    """One YAML file -> (mapping, {dotted key: 'file:line'}); no `base:` handling."""
    try:
        with open(path, encoding="utf-8") as fh:
            text = fh.read()
    except FileNotFoundError:
        raise ConfigError(
            f"config file not found: {path!r} (working directory {os.getcwd()}); check the path"
        ) from None
    except (IsADirectoryError, PermissionError, UnicodeDecodeError) as err:
        raise ConfigError(
            f"cannot read config file {path!r}: {err}; pass a readable UTF-8 YAML file"
        ) from None
    try:
        node = yaml.compose(text, Loader=_Loader)
        data = yaml.load(text, Loader=_Loader)
    except yaml.YAMLError as err:
        raise _yaml_error(path, err) from None
    if data is None:
        return {}, {}
    if not isinstance(data, dict):
        raise ConfigError(
            f"{path}:1: the top level must be a mapping of sections (run:, model:, data:, ...), "
            f"got a {type(data).__name__}"
        )
    locations: dict[str, str] = {}
    _walk(node, "", path, locations)
    return data, locations


def deep_merge(base: dict, over: dict) -> dict:
    """`over` on top of `base`: mappings merge recursively, other values replace. Inputs are not modified."""
    out = dict(base)
    for key, value in over.items():
        if isinstance(value, dict) and isinstance(out.get(key), dict):
            out[key] = deep_merge(out[key], value)
        else:
            out[key] = value
    return out


def read_with_bases(path: str, _stack: tuple[str, ...] = ()) -> tuple[dict, dict[str, str]]:
    """Read `path`, resolving its `base:` includes (relative to the file); returns (mapping, locations)."""
    real = os.path.realpath(path)
    if real in _stack:
        chain = " -> ".join(os.path.basename(p) for p in (*_stack, real))
        raise ConfigError(f"{path}: 'base' include cycle {chain}; remove one of these base: entries")
    data, locations = read_yaml(path)
    if BASE_KEY not in data:
        return data, locations
    bases = data.pop(BASE_KEY)
    base_where = locations.get(BASE_KEY, path)
    if isinstance(bases, str):
        bases = [bases]
    if not isinstance(bases, list) or not all(isinstance(b, str) for b in bases):
        raise ConfigError(f"{base_where}: 'base' must be a path or a list of paths, got {bases!r}")
    merged: dict = {}
    merged_locations: dict[str, str] = {}
    for base in bases:
        base_path = os.path.join(os.path.dirname(path), base)
        if not os.path.isfile(base_path):
            raise ConfigError(
                f"{base_where}: base file {base!r} not found (looked for {base_path}); "
                "base paths are relative to the file that names them"
            )
        base_data, base_locations = read_with_bases(base_path, (*_stack, real))
        merged = deep_merge(merged, base_data)
        merged_locations.update(base_locations)
    merged_locations.update(locations)
    return deep_merge(merged, data), merged_locations


def apply_overrides(data: dict, overrides: Iterable[str], locations: dict[str, str]) -> dict:
    """Apply `KEY=VALUE` strings (dotted keys, YAML values) to a copy of `data`; record their origin."""
    out = deep_merge({}, data)
    for text in overrides:
        key, sep, raw_value = text.partition("=")
        key = key.strip()
        if not sep or not key:
            raise ConfigError(
                f"override {text!r} must look like KEY=VALUE with a dotted key, e.g. train.steps=20"
            )
        parts = key.split(".")
        if any(not p for p in parts):
            raise ConfigError(f"override {text!r}: empty part in key {key!r}; write e.g. optim.lr=1e-4")
        try:
            value = parse_value(raw_value)
        except yaml.YAMLError as err:
            problem = getattr(err, "problem", None) or err
            raise ConfigError(
                f"override {text!r}: the value is not valid YAML ({problem}); quote it, e.g. {key}='...'"
            ) from None
        node = out
        for i, part in enumerate(parts[:-1]):
            child = node.get(part)
            if child is None:
                child = node[part] = {}
            elif not isinstance(child, dict):
                parent = ".".join(parts[: i + 1])
                raise ConfigError(
                    f"override {text!r}: {parent!r} holds a value ({child!r}), not a section; "
                    f"set {parent} itself"
                )
            else:
                child = node[part] = dict(child)
            node = child
        node[parts[-1]] = value
        for known in [k for k in locations if k == key or k.startswith(key + ".")]:
            del locations[known]
        locations[key] = f"override {text!r}"
        if value is not None:
            _replace_exclusive_partner(out, key, text, locations)
    return out


def _replace_exclusive_partner(data: dict, key: str, text: str, locations: dict[str, str]) -> None:
    """After override `text` set `key`: null its exclusive partner when a file (not another override) set it."""
    for pair in EXCLUSIVE_KEYS:
        if key not in pair:
            continue
        other = pair[1 - pair.index(key)]
        section, _, leaf = other.rpartition(".")
        node = data.get(section) if isinstance(data.get(section), dict) else None
        where = locations.get(other, "")
        if node is None or node.get(leaf) is None or where.startswith("override"):
            continue
        log.info("override %s replaces %s=%s%s", text.strip(), other, node[leaf], f" (from {where})" if where else "")
        node[leaf] = None
        locations[other] = f"override {text!r}"


_LAST_PART = re.compile(r"(\[\d+\]|\.[^.\[\]]*)$")


def locator(locations: dict[str, str]):
    """A `Locate` function: the origin of a dotted key, or of its closest written ancestor ('' if none)."""

    def locate(key: str) -> str:
        probe = key
        while probe:
            if probe in locations:
                return locations[probe]
            parent = _LAST_PART.sub("", probe)
            probe = "" if parent == probe else parent
        return ""

    return locate
