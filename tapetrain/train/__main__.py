"""`python -m tapetrain.train CONFIG.yaml [KEY=VALUE ...]` = `tapetrain train ...`: the form the deepspeed launcher
starts (`deepspeed --module tapetrain.train`, which adds `--local_rank=N`; rank and world size come from the
environment)."""

from __future__ import annotations

import sys

from tapetrain.cli import main as cli_main


def main(argv: list[str] | None = None) -> int:
    return cli_main(["train", *(sys.argv[1:] if argv is None else argv)], prog="python -m tapetrain.train")


if __name__ == "__main__":
    code = main()
    if code != 0:
        from tapetrain.distributed import end_rank_process, under_launcher

        if under_launcher():
            # A failed rank's peers may be gone already: left to interpreter shutdown, gloo's threads can meet C++
            # static destruction unjoined and abort the rank (SIGABRT: the launcher reported 250, not 1). The run
            # has written and closed what it writes (its finally blocks ran); leave without static destruction.
            end_rank_process(code)
    sys.exit(code)
