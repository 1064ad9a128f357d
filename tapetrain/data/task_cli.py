"""argparse hooks for the task data commands: `tapetrain arith data` and `tapetrain scrolls data`."""

from __future__ import annotations

import argparse
import json
import sys


def _group_help(parser: argparse.ArgumentParser):
    def run(args: argparse.Namespace) -> int:
        parser.print_help(sys.stderr)
        return 2

    return run


def _summary(manifest: dict, out: str) -> str:
    split = manifest["splits"]["train"]
    return (f"wrote {out}: {split['num_examples']} training examples, {split['num_tokens']} tokens "
            f"({split['answer_tokens']} answer tokens), longest {split['max_length']} tokens")


def _arith_data(args: argparse.Namespace) -> int:
    from tapetrain.data.arith import write_arith_data

    manifest = write_arith_data(args.out, max_digits=args.max_digits, eval_max_digits=args.eval_max_digits,
                                train_examples=args.train_examples, eval_per_cell=args.eval_per_cell, seed=args.seed,
                                overwrite=args.overwrite)
    task = manifest["task"]
    print(_summary(manifest, args.out) + f"; {task['eval_problems']} evaluation problems on a "
          f"{task['eval_max_digits']}x{task['eval_max_digits']} grid; {task['dropped_eval_overlaps']} training "
          "candidates rejected as evaluation problems")
    return 0


def add_arith_parser(subparsers) -> argparse.ArgumentParser:
    """tapetrain arith data --out DIR [--max-digits 20] [--eval-max-digits 40] [--train-examples N]
    [--eval-per-cell 100] [--seed 42] [--overwrite]"""
    parser = subparsers.add_parser("arith", help="addition length-generalisation data (the TAPE paper's arithmetic)")
    actions = parser.add_subparsers(dest="arith_command")
    parser.set_defaults(func=_group_help(parser))
    data = actions.add_parser("data", help="write bucket-sampled training examples, the evaluation grid and the "
                              "character tokenizer", description="Addition problems with reversed digits: training "
                              "examples with bucket sampling (operand lengths uniform over [1, max]²) and an "
                              "evaluation grid of every (len_a, len_b) up to --eval-max-digits, disjoint from "
                              "training.")
    data.add_argument("--out", required=True, metavar="DIR")
    data.add_argument("--max-digits", type=int, default=20, help="longest training operand (default 20)")
    data.add_argument("--eval-max-digits", type=int, default=40, help="grid size of the evaluation (default 40)")
    data.add_argument("--train-examples", type=int, default=20_000_000, help="training examples (default 20M)")
    data.add_argument("--eval-per-cell", type=int, default=100, help="evaluation problems per grid cell")
    data.add_argument("--seed", type=int, default=42)
    data.add_argument("--overwrite", action="store_true", help="replace DIR if it exists")
    data.set_defaults(func=_arith_data)
    return parser


def _scrolls_data(args: argparse.Namespace) -> int:
    from tapetrain.data.scrolls import write_scrolls_data

    manifest = write_scrolls_data(args.task, args.input, args.tokenizer, args.out, seq_len=args.seq_len,
                                  max_answer_tokens=args.max_answer_tokens, overwrite=args.overwrite)
    task = manifest["task"]
    print(_summary(manifest, args.out) + f"; {task['records']} records of {task['ids']} ids; prompts truncated in "
          f"{task['truncated_prompts']}, answers in {task['truncated_answers']}")
    print(json.dumps({"prompt_format": task["prompt_format"]}))
    return 0


def add_scrolls_parser(subparsers) -> argparse.ArgumentParser:
    """tapetrain scrolls data --task NAME --input FILES|hf:tau/scrolls:NAME[:SPLIT] --tokenizer T --out DIR"""
    from tapetrain.data.scrolls import TASKS

    parser = subparsers.add_parser("scrolls", help="SCROLLS long-context fine-tuning data")
    actions = parser.add_subparsers(dest="scrolls_command")
    parser.set_defaults(func=_group_help(parser))
    data = actions.add_parser("data", help="SCROLLS records -> supervised examples (loss on the answer only)",
                              description="Build fine-tuning examples from SCROLLS records (id, pid, input, output; "
                              "jsonl or parquet, or hf:tau/scrolls:NAME[:SPLIT]) with the TAPE paper's prompt "
                              "formats and truncation.")
    data.add_argument("--task", required=True, choices=sorted(TASKS))
    data.add_argument("--input", nargs="+", required=True, metavar="FILES",
                      help=".jsonl/.json/.parquet files (globs) or hf:tau/scrolls:NAME[:SPLIT] (split default train)")
    data.add_argument("--tokenizer", required=True, metavar="T", help="sentencepiece .model of the model to tune")
    data.add_argument("--out", required=True, metavar="DIR")
    data.add_argument("--seq-len", type=int, default=8192, help="tokens per example, prompt + answer + EOS (8192)")
    data.add_argument("--max-answer-tokens", type=int, default=None,
                      help="answer budget (default: 200 for QA tasks, 1000 for summaries)")
    data.add_argument("--overwrite", action="store_true", help="replace DIR if it exists")
    data.set_defaults(func=_scrolls_data)
    return parser
