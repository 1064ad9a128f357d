"""The `tapetrain` command: one subcommand per job (README.md lists them with examples)."""

from __future__ import annotations

import argparse
import logging
import sys


def _add_train_parser(subparsers) -> None:
    from tapetrain.train.arguments import configure_train_parser

    parser = subparsers.add_parser("train", help="train from a YAML run config (one process or any launcher rank)")
    configure_train_parser(parser)


def is_override(arg: str) -> bool:
    return "=" in arg and not arg.startswith("-")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="tapetrain", description=__doc__)
    subparsers = parser.add_subparsers(dest="command", required=True)
    from tapetrain.data.cli import add_prepare_parser, add_tokenizer_parser, add_verify_parser
    from tapetrain.data.task_cli import add_arith_parser, add_scrolls_parser
    from tapetrain.eval.cli import add_eval_passkey_parser, add_eval_ppl_parser, add_export_parser
    from tapetrain.eval.task_cli import add_eval_arith_parser, add_eval_scrolls_parser

    add_tokenizer_parser(subparsers)
    add_prepare_parser(subparsers)
    add_verify_parser(subparsers)
    _add_train_parser(subparsers)
    add_export_parser(subparsers)
    add_eval_ppl_parser(subparsers)
    add_eval_passkey_parser(subparsers)
    add_arith_parser(subparsers)
    add_eval_arith_parser(subparsers)
    add_scrolls_parser(subparsers)
    add_eval_scrolls_parser(subparsers)
    return parser


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    parser = build_parser()
    args, extra = parser.parse_known_args(argv)
    if extra and isinstance(getattr(args, "overrides", None), list) and all(is_override(a) for a in extra):
        args.overrides += extra  # `tapetrain train CONFIG --dry-run train.steps=5`: overrides after an option
    elif extra:
        parser.error(f"unrecognized arguments: {' '.join(extra)}")
    try:
        return int(args.func(args) or 0)
    except (ValueError, FileNotFoundError, RuntimeError) as err:
        # Our errors already name the problem and the fix; a traceback would bury that.
        if logging.getLogger().isEnabledFor(logging.DEBUG):
            raise
        print(f"tapetrain {args.command}: error: {err}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
