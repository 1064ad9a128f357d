"""Subcommands eval-arith and eval-scrolls: task accuracy of a run directory or a Hugging Face export."""

from __future__ import annotations

import argparse


def configure_eval_arith_parser(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    parser.add_argument("model", metavar="MODEL", help="run directory or Hugging Face export (tapetrain export-hf)")
    parser.add_argument("--data", required=True, metavar="DIR", help="directory written by `tapetrain arith data`")
    parser.add_argument("--out", required=True, metavar="R.json", help="result JSON (cells and the three means)")
    parser.add_argument("--plot", default=None, metavar="P.png", help="heatmap of accuracy per (len_a, len_b)")
    parser.add_argument("--batch-size", type=int, default=100, help="problems decoded together (equal-length prompts)")
    parser.add_argument("--dtype", choices=("fp32", "bf16"), default="fp32", help="compute dtype")
    parser.add_argument("--step", type=int, default=None, help="run directories: checkpoint step (default newest)")
    parser.add_argument("--local_rank", "--local-rank", type=int, default=None, help=argparse.SUPPRESS)

    def run(args: argparse.Namespace) -> int:
        from tapetrain.eval.arith import run_eval_arith

        run_eval_arith(args.model, args.data, args.out, args.plot, batch_size=args.batch_size, dtype=args.dtype,
                       step=args.step)
        return 0

    parser.set_defaults(func=run)
    return parser


def add_eval_arith_parser(subparsers) -> argparse.ArgumentParser:
    parser = subparsers.add_parser("eval-arith", help="addition exact match on the (len_a, len_b) grid + heatmap",
                                   description="Greedy decoding (KV cache, batched, until EOS) of every problem of "
                                   "the evaluation grid written by `tapetrain arith data`; exact match per cell. Runs "
                                   "on several ranks under torchrun/deepspeed, the cells split among them.")
    return configure_eval_arith_parser(parser)
