"""argparse options from a typed function: its signature gives names, types and defaults, its docstring the help.

Mapping (the parameter `val_fraction: float = 0.0` becomes `--val-fraction F`):
  listed in `positional`      positional argument (a list: one or more, or any number when it has a default)
  no default                  required option
  bool = False / True         flag `--name` / `--no-name`
  Literal[...]                choices
  list[int]                   one comma-separated value, `--lengths 1024,2048`
  list[float]                 one comma-separated value, `--depths 0,0.5,1`
  list[str]                   one or more values, `--input a.jsonl b.jsonl` (shell globs expand into it)
  X | None                    as X, default None

The docstring's text before `Args:` is the command's description (its first line the summary in `tapetrain
--help`); each `name: text` under `Args:` is that option's help. Defaults other than None/False are appended.

Why this rather than typer, tyro or jsonargparse (which generate parsers from signatures too): the mapping above is
all tapetrain needs, and owning it keeps three things a library would make awkward: a command imports only its
own function's module (`tapetrain data verify` runs without importing torch; only `--help` reads every docstring),
the deepspeed launcher's `--local_rank=N` and the `KEY=VALUE` overrides after `train`'s options parse as they always
did, and the previous release's spellings map onto the same functions with one deprecation line. No dependency.
"""

from __future__ import annotations

import argparse
import inspect
import re
import textwrap
import types
import typing
from collections.abc import Callable

# The deepspeed launcher and torchrun start every rank with --local_rank=N; rank and world size come from the
# environment, so every command accepts it and ignores it.
LAUNCHER_RANK = "local_rank"


def drop_launcher_rank(argv: list[str]) -> list[str]:
    """`argv` without the launcher's rank argument, wherever it is: `deepspeed --module tapetrain.cli eval ppl ...`
    starts `python -m tapetrain.cli --local_rank=N eval ppl ...`, before the subcommand that would parse it.
    Spellings: --local_rank=N, --local-rank=N, --local_rank N, --local-rank N."""
    flags = ("--" + LAUNCHER_RANK, "--local-rank")
    out: list[str] = []
    i = 0
    while i < len(argv):
        arg = argv[i]
        name, eq, _ = arg.partition("=")
        if name in flags and eq:
            i += 1
        elif arg in flags and i + 1 < len(argv) and argv[i + 1].lstrip("-").isdigit():
            i += 2
        else:
            out.append(arg)
            i += 1
    return out


def read_docstring(func: Callable) -> tuple[str, dict[str, str]]:
    """(description, {parameter: help}) of a Google-style docstring."""
    doc = inspect.getdoc(func) or ""
    description, _, args = doc.partition("\nArgs:\n")
    helps: dict[str, str] = {}
    name = None
    for line in textwrap.dedent(args).splitlines():
        match = re.match(r"^(\w+): (.*)$", line)
        if match:
            name, text = match.groups()
            helps[name] = text
        elif line.startswith(" ") and name:
            helps[name] += " " + line.strip()
        elif line.strip():  # another section (Returns:, ...) ends the arguments
            break
    return description.strip(), helps


def summary(func: Callable) -> str:
    return read_docstring(func)[0].split("\n\n")[0].replace("\n", " ")


def comma_separated_ints(text: str) -> list[int]:
    try:
        values = [int(x) for x in text.replace(" ", "").split(",") if x]
    except ValueError as err:
        raise argparse.ArgumentTypeError(f"{text!r}: expected comma-separated integers, e.g. 1024,2048") from err
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError(f"{text!r}: give positive integers, e.g. 1024,2048")
    return values


def comma_separated_floats(text: str) -> list[float]:
    try:
        values = [float(x) for x in text.replace(" ", "").split(",") if x]
    except ValueError as err:
        raise argparse.ArgumentTypeError(f"{text!r}: expected comma-separated numbers, e.g. 0,0.5,1") from err
    if not values:
        raise argparse.ArgumentTypeError(f"{text!r}: give at least one number, e.g. 0,0.5,1")
    return values


def _unwrap_optional(tp):
    """`X | None` -> X."""
    if typing.get_origin(tp) in (typing.Union, types.UnionType):
        rest = [a for a in typing.get_args(tp) if a is not type(None)]
        return rest[0] if len(rest) == 1 else str  # int | str (a size such as 5GB): read as text
    return tp


def _argument(name: str, tp, default, help_text: str | None, metavar: str | None) -> tuple[list[str], dict]:
    """(flags, add_argument keywords) of one parameter; no flags for a positional argument."""
    tp = _unwrap_optional(tp)
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    has_default = default is not inspect.Parameter.empty
    kwargs: dict = {"help": help_text}
    if has_default and not isinstance(default, bool) and default is not None and help_text \
            and "default" not in help_text:
        shown = ",".join(map(str, default)) if isinstance(default, (list, tuple)) else default
        kwargs["help"] = f"{help_text} (default: {shown})"
    if kwargs["help"]:
        kwargs["help"] = kwargs["help"].replace("%", "%%")
    flag = "--" + name.replace("_", "-")
    if metavar is not None:  # positional
        kwargs["metavar"] = metavar
        if origin is list:
            kwargs.update(nargs="*" if has_default else "+", type=args[0])
            if has_default:
                kwargs["default"] = default
        else:
            kwargs["type"] = tp
        return [], kwargs
    kwargs["dest"] = name
    if tp is bool:
        if default is True:
            return ["--no-" + flag[2:]], dict(kwargs, action="store_false")
        return [flag], dict(kwargs, action="store_true")
    kwargs.update(required=not has_default, default=None if not has_default else default)
    if origin is typing.Literal:
        kwargs.update(choices=args, type=type(args[0]))
    elif origin is list and args == (int,):
        kwargs.update(type=comma_separated_ints, metavar="N,N,...")
    elif origin is list and args == (float,):
        kwargs.update(type=comma_separated_floats, metavar="F,F,...")
    elif origin is list:
        kwargs.update(nargs="+", type=args[0])
    else:
        kwargs.update(type=tp, metavar={int: "N", float: "F"}.get(tp))
    return [flag], kwargs


def add_function_arguments(parser: argparse.ArgumentParser, func: Callable, positional: dict[str, str]) -> None:
    """One argument per parameter of `func` (`positional`: parameter -> metavar), plus the ignored --local_rank."""
    description, helps = read_docstring(func)
    parser.description = description
    parser.formatter_class = argparse.RawDescriptionHelpFormatter
    hints = typing.get_type_hints(func)
    for name, param in inspect.signature(func).parameters.items():
        if param.kind in (param.VAR_POSITIONAL, param.VAR_KEYWORD):
            raise TypeError(f"{func.__qualname__}: *args/**kwargs cannot become command-line options")
        flags, kwargs = _argument(name, hints[name], param.default, helps.get(name), positional.get(name))
        parser.add_argument(*(flags or [name]), **kwargs)
    parser.add_argument("--" + LAUNCHER_RANK, "--local-rank", type=int, default=None, help=argparse.SUPPRESS)


def call_with(func: Callable, args: argparse.Namespace):
    """func(**the parsed values of its parameters)."""
    return func(**{name: getattr(args, name) for name in inspect.signature(func).parameters})
