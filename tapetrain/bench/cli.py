"""The parser of `tools/benchmark.py`: one subcommand per mode, each with the options its module adds."""

from __future__ import annotations

import argparse
from types import ModuleType

from tapetrain.bench import attention, bakeoff, cp, data, docmask, engine, layer, sp, train

# In the order `--help` lists them; each module has HELP and add_arguments (built from tapetrain.bench.arguments).
MODES: dict[str, ModuleType] = {"attention": attention, "train": train, "engine": engine, "layer": layer, "sp": sp,
                                "cp": cp, "docmask": docmask, "data": data, "bakeoff": bakeoff}  # fmt: skip


def build_parser(description: str | None = None) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=description, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="mode", required=True)
    for name, module in MODES.items():
        module.add_arguments(sub.add_parser(name, help=module.HELP))
    return parser
