"""The arguments of `tapetrain train` and `python -m tapetrain.train` (the form the deepspeed launcher starts)."""

from __future__ import annotations

import argparse

DESCRIPTION = """\
Train from a YAML run config: one process, or one rank of a launcher. Rank and world size come from the
environment; the launcher's --local_rank is accepted and ignored.

  tapetrain train configs/tiny-cpu.yaml train.steps=20
  deepspeed --num_gpus 8 --module tapetrain.train configs/paper-155m-tape.yaml train.steps=2000
  torchrun --nproc_per_node 8 -m tapetrain.train configs/paper-155m-tape.yaml
  launch/single_node.sh | launch/multi_node.sh | launch/slurm.sbatch (stop them cleanly with SIGTERM)

Every config key, its default and meaning: the "Configuration reference" section of README.md.
"""


def configure_train_parser(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    parser.description = DESCRIPTION
    parser.formatter_class = argparse.RawDescriptionHelpFormatter
    parser.add_argument("config", metavar="CONFIG.yaml",
                        help="run config (may start with `base: other.yaml`; see configs/ for examples)")
    parser.add_argument("overrides", nargs="*", metavar="KEY=VALUE",
                        help="dotted overrides, parsed as YAML: train.steps=20 'data.train=[a, b]' optim.lr=1e-4")
    parser.add_argument("--print-config", action="store_true",
                        help="print the resolved config, the DeepSpeed JSON, gradient accumulation, tokens per step "
                        "and the memory estimate per GPU, then exit (reads no data, starts nothing)")
    parser.add_argument("--world-size", type=int, default=None, metavar="N",
                        help="with --print-config: derive for N ranks (default: $WORLD_SIZE, else 1)")
    parser.add_argument("--dry-run", action="store_true",
                        help="check config, data, tokenizer, resume compatibility and free disk space as a start "
                        "would, write nothing and exit before training (works under a launcher too)")
    parser.add_argument("--local_rank", "--local-rank", type=int, default=None, help=argparse.SUPPRESS)
    parser.set_defaults(func=run_train)
    return parser


def run_train(args: argparse.Namespace) -> int:
    from tapetrain.train.run import leave_process_group, train_from_args

    code = train_from_args(args.config, args.overrides, print_config=args.print_config, dry_run=args.dry_run,
                           world_size=args.world_size)
    if code != 0:  # the process exits next; callers of train_from_args that go on keep their process group
        leave_process_group()
    return code
