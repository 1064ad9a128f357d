"""Subcommands eval-arith and eval-scrolls: task accuracy of a run directory or a Hugging Face export."""

from __future__ import annotations

import argparse

from tapetrain.eval.cli import accept_launcher_rank, add_step_argument


def configure_eval_arith_parser(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    parser.add_argument("model", metavar="MODEL", help="run directory or Hugging Face export (tapetrain export-hf)")
    parser.add_argument("--data", required=True, metavar="DIR", help="directory written by `tapetrain arith data`")
    parser.add_argument("--out", required=True, metavar="R.json", help="result JSON (cells and the three means)")
    parser.add_argument("--plot", default=None, metavar="P.png", help="heatmap of accuracy per (len_a, len_b)")
    parser.add_argument("--batch-size", type=int, default=100, help="problems decoded together (equal-length prompts)")
    parser.add_argument("--dtype", choices=("fp32", "bf16"), default="fp32", help="compute dtype")
    add_step_argument(parser)
    accept_launcher_rank(parser)

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


def configure_eval_scrolls_parser(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    from tapetrain.data.scrolls import TASKS

    parser.add_argument("model", metavar="MODEL", help="run directory or Hugging Face export (not loaded with "
                        "--predictions)")
    parser.add_argument("--task", required=True, choices=sorted(TASKS))
    parser.add_argument("--data", required=True, metavar="FILE", help="SCROLLS records with outputs (the validation "
                        "split): .jsonl/.json/.parquet or hf:tau/scrolls:NAME:validation")
    parser.add_argument("--out", required=True, metavar="R.json", help="scores, settings and every prediction")
    parser.add_argument("--predictions", default=None, metavar="PRED.json",
                        help="score these predictions ({id: text}) instead of generating")
    parser.add_argument("--tokenizer", default=None, help="sentencepiece .model (default: the model's)")
    parser.add_argument("--seq-len", type=int, default=8192, help="prompt + answer budget, as in fine-tuning (8192)")
    parser.add_argument("--max-answer-tokens", type=int, default=None,
                        help="new tokens at most (default: 200 for QA, 1000 for summaries)")
    parser.add_argument("--max-examples", type=int, default=None, help="evaluate the first N ids only")
    parser.add_argument("--seed", type=int, default=0, help="sampling seed of the summary tasks")
    parser.add_argument("--dtype", choices=("fp32", "bf16"), default="fp32", help="compute dtype")
    add_step_argument(parser)
    accept_launcher_rank(parser)

    def run(args: argparse.Namespace) -> int:
        from tapetrain.eval.scrolls import run_eval_scrolls

        run_eval_scrolls(args.model, args.task, args.data, args.out, predictions=args.predictions,
                         tokenizer=args.tokenizer, seq_len=args.seq_len, max_answer_tokens=args.max_answer_tokens,
                         max_examples=args.max_examples, seed=args.seed, dtype=args.dtype, step=args.step)
        return 0

    parser.set_defaults(func=run)
    return parser


def add_eval_scrolls_parser(subparsers) -> argparse.ArgumentParser:
    parser = subparsers.add_parser("eval-scrolls", help="SCROLLS generation and scoring (EM, F1, ROUGE)",
                                   description="Generate answers for SCROLLS records as the TAPE paper's code did "
                                   "(greedy QA, sampled summaries) and score them with SCROLLS' metrics; or score "
                                   "--predictions. Runs on several ranks under torchrun/deepspeed.")
    return configure_eval_scrolls_parser(parser)
