#!/usr/bin/env python
"""A synthetic long-context retrieval task in SCROLLS' record format, to check the fine-tuning path end to end.

    python tools/synthetic_scrolls.py --out work/kv [--pairs 10] [--train 6000] [--validation 200] [--seed 0]

Each record asks for the value of key K, hidden at a random place in a list of key=value pairs (a passkey-style
retrieval), question first as in SCROLLS' QA tasks:
    {"id": "kv-train-000001", "pid": "kv-train-000001_0", "input": "Q:K|a=41;x=07;K=85;...;", "output": "85"}
The other keys are distinct lower-case letters, values two digits. Writes train.jsonl, validation.jsonl and
tokenizer.model (a character vocabulary for exactly this alphabet), ready for
    tapetrain data scrolls --task quality --input work/kv/train.jsonl --tokenizer work/kv/tokenizer.model ...
    tapetrain eval scrolls RUN --task quality --data work/kv/validation.jsonl ...
Scored by exact match (the QuALITY / ContractNLI metric).
"""

from __future__ import annotations

import argparse
import json
import os
import string
import sys

import numpy as np

QUERY_KEY = "K"
ALPHABET = string.digits + string.ascii_lowercase + "QK:|=;"


def records(split: str, count: int, pairs: int, rng: np.random.Generator) -> list[dict]:
    out = []
    for i in range(count):
        keys = rng.choice(list(string.ascii_lowercase), size=pairs, replace=False)
        values = rng.integers(0, 100, size=pairs)
        target = int(rng.integers(0, pairs))
        keys[target] = QUERY_KEY
        listing = "".join(f"{k}={v:02d};" for k, v in zip(keys, values, strict=True))
        rid = f"kv-{split}-{i:06d}"
        out.append({"id": rid, "pid": f"{rid}_0", "input": f"Q:{QUERY_KEY}|{listing}",
                    "output": f"{values[target]:02d}"})
    return out


def write_jsonl(path: str, rows: list[dict]) -> None:
    tmp = f"{path}.tmp"
    with open(tmp, "w", encoding="utf-8") as f:
        for row in rows:
            f.write(json.dumps(row) + "\n")
    os.replace(tmp, path)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", required=True)
    parser.add_argument("--pairs", type=int, default=10, help="key=value pairs per record (at most 26)")
    parser.add_argument("--train", type=int, default=6000)
    parser.add_argument("--validation", type=int, default=200)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    if not 1 <= args.pairs <= 26:
        parser.error(f"--pairs must be in [1, 26] (distinct letters), got {args.pairs}")
    from tapetrain.data.char_vocab import write_char_vocab

    os.makedirs(args.out, exist_ok=True)
    rng = np.random.default_rng(args.seed)
    write_jsonl(os.path.join(args.out, "train.jsonl"), records("train", args.train, args.pairs, rng))
    write_jsonl(os.path.join(args.out, "validation.jsonl"), records("validation", args.validation, args.pairs, rng))
    write_char_vocab(ALPHABET, os.path.join(args.out, "tokenizer.model"))
    print(f"wrote {args.out}: {args.train} training and {args.validation} validation records, tokenizer.model")
    return 0


if __name__ == "__main__":
    sys.exit(main())
