"""argparse hooks for `tapetrain tokenizer train` and `tapetrain prepare`; handlers return exit codes.

Wire into the main parser with:
    sub = parser.add_subparsers(dest="command")
    add_tokenizer_parser(sub); add_prepare_parser(sub)
    args = parser.parse_args(); sys.exit(args.func(args))
"""

from __future__ import annotations

import argparse
import logging
import sys

from tapetrain.data.errors import DataError

INPUT_HELP = (".jsonl/.json/.txt globs (also .gz, e.g. C4's c4-*.json.gz; .jsonl.zst), .parquet, or "
              "hf:NAME[:CONFIG][:SPLIT]")


def _fail(err: Exception) -> int:
    print(f"error: {err}", file=sys.stderr)
    return 1


def _tokenizer_train(args: argparse.Namespace) -> int:
    from tapetrain.data.tokenizer import Tokenizer, train_tokenizer

    try:
        out = train_tokenizer(args.input, args.vocab_size, args.out, text_key=args.text_key)
        tok = Tokenizer(out)
    except DataError as err:
        return _fail(err)
    print(f"wrote {out} (vocab_size={tok.vocab_size}, sha256={tok.checksum})")
    return 0


def _tokenizer_help(parser: argparse.ArgumentParser):
    def run(args: argparse.Namespace) -> int:
        parser.print_help(sys.stderr)
        return 2

    return run


def add_tokenizer_parser(subparsers) -> argparse.ArgumentParser:
    """tapetrain tokenizer train --input GLOB... --vocab-size N --out tok.model [--text-key text]"""
    parser = subparsers.add_parser("tokenizer", help="sentencepiece tokenizer tools")
    actions = parser.add_subparsers(dest="tokenizer_command")
    parser.set_defaults(func=_tokenizer_help(parser))
    train = actions.add_parser("train", help="train a BPE sentencepiece model (byte fallback, Llama ids)")
    train.add_argument("--input", nargs="+", required=True, metavar="GLOB",
                       help=INPUT_HELP)
    train.add_argument("--vocab-size", type=int, required=True, metavar="N")
    train.add_argument("--out", required=True, metavar="tok.model")
    train.add_argument("--text-key", default="text")
    train.set_defaults(func=_tokenizer_train)
    return parser


def _prepare(args: argparse.Namespace) -> int:
    from tapetrain.data.prepare import prepare

    logging.basicConfig(level=logging.INFO, format="%(message)s")
    try:
        manifest = prepare(args.input, args.tokenizer, args.out, text_key=args.text_key,
                           val_fraction=args.val_fraction, workers=args.workers, skip_bad=args.skip_bad,
                           overwrite=args.overwrite)
    except DataError as err:
        return _fail(err)
    splits = ", ".join(f"{name}: {s['num_tokens']} tokens, {s['num_documents']} docs, "
                       f"{len(s['shards'])} shards" for name, s in manifest["splits"].items())
    print(f"wrote {args.out}: {splits}; skipped {manifest['skipped_records']} bad records")
    return 0


def add_prepare_parser(subparsers) -> argparse.ArgumentParser:
    """tapetrain prepare --input GLOB...|hf:NAME[:CONFIG][:SPLIT] --tokenizer tok.model --out DIR
    [--text-key text] [--val-fraction F] [--workers N] [--skip-bad] [--overwrite]"""
    parser = subparsers.add_parser("prepare", help="tokenize a corpus into token shards + manifest.json")
    parser.add_argument("--input", nargs="+", required=True, metavar="GLOB",
                        help=INPUT_HELP)
    parser.add_argument("--tokenizer", required=True, metavar="tok.model")
    parser.add_argument("--out", required=True, metavar="DIR")
    parser.add_argument("--text-key", default="text")
    parser.add_argument("--val-fraction", type=float, default=0.0, metavar="F")
    parser.add_argument("--workers", type=int, default=1, metavar="N")
    parser.add_argument("--skip-bad", action="store_true", help="count and skip bad records, do not fail")
    parser.add_argument("--overwrite", action="store_true", help="replace a finished or interrupted run")
    parser.set_defaults(func=_prepare)
    return parser


def _verify(args: argparse.Namespace) -> int:
    from tapetrain.data.verify import verify_dataset

    bad = 0
    for path in args.data_dirs:
        try:
            problems = verify_dataset(path, progress=not args.quiet)
        except DataError as err:
            problems = [str(err)]
        for problem in problems:
            print(f"{path}: {problem}", file=sys.stderr)
        print(f"{path}: {'OK' if not problems else f'{len(problems)} problem(s)'}")
        bad += bool(problems)
    return 1 if bad else 0


def add_verify_parser(subparsers) -> argparse.ArgumentParser:
    """tapetrain verify DATA_DIR [DATA_DIR ...] [--quiet]"""
    parser = subparsers.add_parser(
        "verify", help="check every shard's sha256 and token ids against manifest.json (exit 1 on any mismatch)")
    parser.add_argument("data_dirs", nargs="+", metavar="DATA_DIR", help="directories written by `tapetrain prepare`")
    parser.add_argument("--quiet", action="store_true", help="no progress bar")
    parser.set_defaults(func=_verify)
    return parser
