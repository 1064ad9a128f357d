"""Entry point for `python -m tapetrain.train` and `deepspeed --module tapetrain.train CONFIG.yaml [KEY=VALUE ...]`.

The deepspeed launcher passes `--local_rank=N`; rank and world size are read from the environment instead.
"""

from __future__ import annotations

import argparse
import logging
import sys

from tapetrain.train.arguments import configure_train_parser


def main(argv: list[str] | None = None) -> int:
    parser = configure_train_parser(argparse.ArgumentParser(prog="python -m tapetrain.train"))
    args = parser.parse_intermixed_args(argv)  # overrides may come before or after --dry-run / --print-config
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
