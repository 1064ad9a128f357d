"""Entry point for `python -m tapetrain.train` and `deepspeed --module tapetrain.train CONFIG.yaml [KEY=VALUE ...]`.

The deepspeed launcher passes `--local_rank=N`; rank and world size are read from the environment instead.
"""

from __future__ import annotations

import argparse
import logging
import sys


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tapetrain.train")
    parser.add_argument("config")
    parser.add_argument("overrides", nargs="*")
    parser.add_argument("--local_rank", "--local-rank", type=int, default=None, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    from tapetrain.train.run import train_from_args

    return train_from_args(args.config, args.overrides)


if __name__ == "__main__":
    sys.exit(main())
