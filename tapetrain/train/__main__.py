"""`python -m tapetrain.train CONFIG.yaml [KEY=VALUE ...]` = `tapetrain train ...`: the form the deepspeed launcher
starts (`deepspeed --module tapetrain.train`, which adds `--local_rank=N`; rank and world size come from the
environment)."""

from __future__ import annotations

import sys

from tapetrain.cli import main as cli_main


def main(argv: list[str] | None = None) -> int:
    return cli_main(["train", *(sys.argv[1:] if argv is None else argv)], prog="python -m tapetrain.train")


if __name__ == "__main__":
    sys.exit(main())
