"""Generate the configuration reference (markdown) from the config dataclasses' field help texts.

tools/gen_config_reference.py writes it to docs/config-reference.md (a test fails when that file is stale).
"""

from __future__ import annotations

import dataclasses
import typing
from typing import Any

import yaml

from tapetrain.config.run_config import RunConfig
from tapetrain.config.sections import DataSource, LoraSection, ModelSection, ProfileSection, WandbSection
from tapetrain.config.typed import type_name
from tapetrain.fields import field_help
from tapetrain.model.rope_scaling import RopeScaling

INTRO = """\
A run is one YAML file with the sections below; `tapetrain train CONFIG.yaml KEY=VALUE ...` overrides any
key with a dotted name (`train.steps=20`, `data.train=[a, b]`; values are parsed as YAML). Unknown keys are
errors. A file may start with `base: other.yaml` (or a list of files, paths relative to the file): the bases
are loaded first and this file's keys are deep-merged over them (mappings merge, other values replace).
Of two exclusive keys (`optim.warmup_steps` / `optim.warmup_ratio`) a command-line override of one replaces the
other where a file set it (logged); both set in the files, or both on the command line, is an error.
`model.preset` fills every model key from a named shape; model keys written next to it override the preset.
"""


def _default(f: dataclasses.Field) -> str:
    if f.default is not dataclasses.MISSING:
        value: Any = f.default
    elif f.default_factory is not dataclasses.MISSING:
        value = f.default_factory()
    else:
        return "required"
    if isinstance(value, tuple):
        value = list(value)
    text = yaml.safe_dump(value, default_flow_style=True, width=1000).strip()
    return text.removesuffix("\n...").removesuffix("...").strip()


def _cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


def _ordered_fields(cls: type) -> list[dataclasses.Field]:
    fields = list(dataclasses.fields(cls))
    if cls is ModelSection:  # run-level model keys first, then the architecture
        own = [f for f in fields if f.name in ("preset", "init_from")]
        fields = own + [f for f in fields if f.name not in ("preset", "init_from")]
    return fields


def render_section(name: str, cls: type) -> str:
    """One markdown table: key, type, default, description."""
    hints = typing.get_type_hints(cls)
    doc = (cls.__doc__ or "").strip().splitlines()[0] if cls.__doc__ else ""
    lines = [f"## `{name}`", "", doc, "", "| Key | Type | Default | Description |", "|---|---|---|---|"]
    for f in _ordered_fields(cls):
        shown = f.metadata.get("type") or type_name(hints[f.name])
        lines.append(
            f"| `{name}.{f.name}` | {_cell(shown)} | `{_cell(_default(f))}` | {_cell(field_help(f))} |"
        )
    return "\n".join(lines) + "\n"


def render_reference() -> str:
    """The full configuration reference: an introduction and one table per section."""
    hints = typing.get_type_hints(RunConfig)
    parts = ["# Configuration reference", "", INTRO]
    for f in dataclasses.fields(RunConfig):
        parts.append(render_section(f.name, hints[f.name]))
    parts.append(render_section("model.rope_scaling", RopeScaling))
    parts.append(render_section("data.train[i]", DataSource))
    parts.append(render_section("train.lora", LoraSection))
    parts.append(render_section("train.profile", ProfileSection))
    parts.append(render_section("logging.wandb", WandbSection))
    return "\n".join(parts)


if __name__ == "__main__":
    print(render_reference())
