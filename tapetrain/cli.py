"""The `tapetrain` command: one table of subcommands over typed package functions.

Each function's signature and docstring are its options and help (tapetrain.cli_parser). A command imports only
its own function's module, so `tapetrain data prepare` does not pay for torch. Exit codes: 0 done, 1 a user
error (one line naming the fix) or a failed check, 2 a malformed command line, 70 a bug (traceback first).
"""

from __future__ import annotations

import argparse
import importlib
import logging
import sys
import traceback
from collections.abc import Callable
from dataclasses import dataclass, field

from tapetrain.cli_parser import add_function_arguments, call_with, drop_launcher_rank, summary


@dataclass(frozen=True)
class Command:
    name: str  # the words after `tapetrain`, e.g. "eval ppl"
    target: str  # "module:function"
    positional: dict[str, str] = field(default_factory=dict)  # parameter -> metavar, in command-line order
    old: str | None = None  # the previous release's spelling: still accepted, with a deprecation line
    # parameter -> "dir" or "file": paths the command writes, checked before it starts (tapetrain.output_paths)
    outputs: dict[str, str] = field(default_factory=dict)

    def function(self) -> Callable:
        module, _, name = self.target.partition(":")
        return getattr(importlib.import_module(module), name)


MODEL = {"model_path": "MODEL"}
OUT_DIR, OUT_FILE = {"out": "dir"}, {"out": "file"}
OUT_AND_PLOT = {"out": "file", "plot": "file"}
COMMANDS = (
    Command("data tokenizer", "tapetrain.data.commands:tokenizer", old="tokenizer train", outputs=OUT_FILE),
    Command("data prepare", "tapetrain.data.commands:prepare", old="prepare", outputs=OUT_DIR),
    Command("data verify", "tapetrain.checkpoint.commands:verify", {"data_dirs": "DATA_DIR"}, old="verify"),
    Command("data arith", "tapetrain.data.commands:arith", old="arith data", outputs=OUT_DIR),
    Command("data scrolls", "tapetrain.data.commands:scrolls", old="scrolls data", outputs=OUT_DIR),
    Command("train", "tapetrain.train.run:train", {"config": "CONFIG.yaml", "overrides": "KEY=VALUE"}),
    Command("export hf", "tapetrain.checkpoint.commands:export_hf", {"run_dir": "RUN_DIR"}, old="export-hf",
            outputs=OUT_DIR),
    Command("eval ppl", "tapetrain.eval.ppl:run_eval_ppl", MODEL, old="eval-ppl", outputs=OUT_AND_PLOT),
    Command("eval passkey", "tapetrain.eval.passkey:run_eval_passkey", MODEL, old="eval-passkey",
            outputs=OUT_AND_PLOT),
    Command("eval arith", "tapetrain.eval.arith:run_eval_arith", MODEL, old="eval-arith", outputs=OUT_AND_PLOT),
    Command("eval scrolls", "tapetrain.eval.scrolls:run_eval_scrolls", MODEL, old="eval-scrolls", outputs=OUT_FILE),
    Command("eval ruler", "tapetrain.eval.ruler:run_eval_ruler", MODEL, outputs=OUT_AND_PLOT),
    Command("compare", "tapetrain.compare.command:run_compare", {"models": "MODEL"}, outputs=OUT_DIR),
)
GROUPS = {
    "data": "corpus -> tokenizer -> token shards; task data (arithmetic, SCROLLS); shard checks",
    "export": "checkpoint conversion",
    "eval": "perplexity, passkey retrieval, RULER and task accuracy of a run directory or an export",
}
BUG = 70  # EX_SOFTWARE


def command_parser(command: Command, prog: str) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog=prog)
    add_function_arguments(parser, command.function(), command.positional)
    return parser


def build_parser(prog: str = "tapetrain") -> argparse.ArgumentParser:
    """Every command (imports every command's module): `tapetrain --help`, group help and unknown commands."""
    listing = "\n".join(f"  {prog} {c.name:<15} {summary(c.function())}" for c in COMMANDS)
    parser = argparse.ArgumentParser(prog=prog, formatter_class=argparse.RawDescriptionHelpFormatter,
                                     description=f"commands (`{prog} COMMAND --help` for its options):\n{listing}")
    top = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    groups: dict[str, argparse._SubParsersAction] = {}
    for command in COMMANDS:
        words = command.name.split()
        func = command.function()
        if len(words) == 1:
            sub = top.add_parser(words[0], help=summary(func))
        else:
            if words[0] not in groups:
                group = top.add_parser(words[0], help=GROUPS[words[0]])
                groups[words[0]] = group.add_subparsers(dest="action", required=True, metavar="ACTION")
            sub = groups[words[0]].add_parser(words[1], help=summary(func))
        add_function_arguments(sub, func, command.positional)
    return parser


def find_command(argv: list[str], prog: str) -> tuple[Command | None, list[str]]:
    """The command that `argv` starts with (an old spelling prints its replacement) and the arguments after it."""
    for command in COMMANDS:
        for spelling in filter(None, (command.name, command.old)):
            words = spelling.split()
            if argv[: len(words)] == words:
                if spelling == command.old:
                    print(f"{prog}: `{prog} {spelling}` is deprecated and will be removed in the next release; use "
                          f"`{prog} {command.name}`", file=sys.stderr)
                return command, argv[len(words):]
    return None, argv


def check_outputs(command: Command, args: argparse.Namespace) -> None:
    """Every path the command will write is checked before it starts: a result that cannot be written is refused
    now, not after the work (train checks run.out_dir itself: it is a config key)."""
    from tapetrain.output_paths import check_output_dir, check_output_file

    for name, kind in command.outputs.items():
        path = getattr(args, name, None)
        if path is not None:
            check = check_output_dir if kind == "dir" else check_output_file
            check(path, f"--{name.replace('_', '-')}")


def run(command: Command, args: argparse.Namespace, prog: str) -> int:
    try:
        check_outputs(command, args)
        result = call_with(command.function(), args)
    except Exception as err:
        from tapetrain.errors import UserError

        if isinstance(err, UserError):  # its message names the problem and the fix; a traceback would bury it
            print(f"{prog}: error: {err}", file=sys.stderr)
            return 1
        traceback.print_exc()
        print(f"{prog}: internal error ({type(err).__name__}): this is a bug in tapetrain, not in your command; "
              "please report it in the project's issue tracker with the command line and the traceback above",
              file=sys.stderr)
        return BUG
    return result if isinstance(result, int) else 0


def main(argv: list[str] | None = None, prog: str = "tapetrain") -> int:
    """`tapetrain COMMAND ...`; `prog` names a shim (`python -m tapetrain.train`, the tools/ scripts)."""
    argv = drop_launcher_rank(list(sys.argv[1:] if argv is None else argv))  # rank comes from the environment
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    command, rest = find_command(argv, prog)
    if command is None:  # help, a bare group or an unknown word: argparse explains and exits
        build_parser(prog).parse_args(argv)
        return 2
    full = prog if prog != "tapetrain" else f"{prog} {command.name}"
    args = command_parser(command, full).parse_intermixed_args(rest)  # overrides may follow options
    return run(command, args, full)


if __name__ == "__main__":
    sys.exit(main())
