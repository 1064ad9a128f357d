"""Addition data for length generalisation (McLeish et al. 2024, "bucket" sampling), as the TAPE paper used it.

A problem a + b is written with every number reversed (least significant digit first):
    prompt  = <s> rev(a) + rev(b) =          answer = rev(a + b) </s>
e.g. 17 + 5 = 22 is "<s>71+5=22</s>". Characters come from a fixed alphabet (tapetrain.data.char_vocab).

Training set: for each example the pair of operand lengths is uniform over [1, max_digits]², then each operand is
uniform among the numbers with exactly that many digits (0-9 for one digit, no leading zero otherwise).
Evaluation grid: for every (len_a, len_b) in [1, eval_max_digits]², `per_cell` distinct problems, except where a
cell has fewer than 2·per_cell problems at all (1+1 digits: 100): there it takes half of them, so the training set
can still contain the other half. No training example equals an evaluation problem: candidates are compared by a
64-bit hash of (len_a, len_b, a, b) and rejected (the manifest counts them), a hash collision only ever drops an
extra training example.

Digits are handled as uint8 arrays (n, width), least significant first, so 20-digit (and 40-digit) operands need
no big integers and a million examples take well under a second.
"""

from __future__ import annotations

import json
import logging
import os
import time
from collections.abc import Iterator
from dataclasses import dataclass

import numpy as np

from tapetrain import atomic_io
from tapetrain.data.char_vocab import BOS_ID, EOS_ID, PAD_ID, SPECIALS, write_char_vocab
from tapetrain.data.errors import DataError
from tapetrain.data.examples import TOKENIZER_FILE, ExampleWriter, example_dir_writer, write_manifest
from tapetrain.progress import progress as progress_bar

log = logging.getLogger(__name__)

ALPHABET = "0123456789+="
DIGIT0 = len(SPECIALS)  # id of "0"; digit d has id DIGIT0 + d
PLUS, EQUALS = DIGIT0 + 10, DIGIT0 + 11
VOCAB_SIZE = len(SPECIALS) + len(ALPHABET)  # 16
EVAL_GRID = "eval_grid.jsonl"
CHUNK = 1 << 18  # training examples generated at a time


@dataclass
class Problems:
    """n addition problems as reversed digit arrays (least significant digit first, zeros past the length)."""

    a: np.ndarray  # (n, width) uint8
    b: np.ndarray  # (n, width) uint8
    len_a: np.ndarray  # (n,) int64
    len_b: np.ndarray  # (n,) int64

    def __len__(self) -> int:
        return len(self.len_a)

    def sums(self) -> tuple[np.ndarray, np.ndarray]:
        """(digits (n, width + 1) uint8 least significant first, lengths (n,)) of a + b."""
        n, width = self.a.shape
        out = np.zeros((n, width + 1), dtype=np.uint8)
        carry = np.zeros(n, dtype=np.uint8)
        for col in range(width):  # ripple carry, one column for all problems at once
            total = self.a[:, col] + self.b[:, col] + carry
            out[:, col], carry = total % 10, total // 10
        out[:, width] = carry
        nonzero = out != 0
        # length = 1 + index of the most significant non-zero digit (1 for a sum of 0)
        lengths = np.where(nonzero.any(axis=1), width + 1 - np.argmax(nonzero[:, ::-1], axis=1), 1)
        return out, lengths.astype(np.int64)

    def keys(self) -> np.ndarray:
        """(n,) uint64 hash of (len_a, len_b, a, b): equal problems give equal keys."""
        key = self.len_a.astype(np.uint64) * np.uint64(1_000_003) + self.len_b.astype(np.uint64)
        with np.errstate(over="ignore"):  # wrap-around multiplication is the point
            for digits in (self.a, self.b):
                for col in range(digits.shape[1]):
                    key = key * np.uint64(0x9E3779B97F4A7C15) + digits[:, col].astype(np.uint64) + np.uint64(1)
                key ^= key >> np.uint64(29)
        return key


def numbers_with_length(length: int) -> int:
    """How many numbers have exactly `length` digits (0 counts as a one-digit number)."""
    return 10 if length == 1 else 9 * 10 ** (length - 1)


def sample_operands(rng: np.random.Generator, lengths: np.ndarray, width: int) -> np.ndarray:
    """(n, width) uint8: uniform numbers with exactly lengths[i] digits, least significant first."""
    n = len(lengths)
    digits = rng.integers(0, 10, size=(n, width), dtype=np.uint8)
    cols = np.arange(width)[None, :]
    digits[cols >= lengths[:, None]] = 0
    top = lengths - 1  # the most significant digit must not be 0 for numbers of two digits or more
    multi = lengths > 1
    digits[np.flatnonzero(multi), top[multi]] = rng.integers(1, 10, size=int(multi.sum()), dtype=np.uint8)
    return digits


def sample_bucket(rng: np.random.Generator, n: int, max_digits: int, width: int) -> Problems:
    """n problems with (len_a, len_b) uniform over [1, max_digits]², operands uniform given their lengths."""
    len_a = rng.integers(1, max_digits + 1, size=n).astype(np.int64)
    len_b = rng.integers(1, max_digits + 1, size=n).astype(np.int64)
    return Problems(sample_operands(rng, len_a, width), sample_operands(rng, len_b, width), len_a, len_b)


def encode(problems: Problems) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Token ids of every problem, concatenated: (tokens (sum of lengths,), prompt lengths (n,), answer lengths (n,)).

    Each row is laid out in fixed columns, BOS | a digits (width) | + | b digits (width) | = | sum digits
    (width + 1) | EOS, and a mask drops the digit columns past each number's length; reading the kept entries in
    row-major order gives every example's ids back to back."""
    sums, len_s = problems.sums()
    n, width = problems.a.shape
    ones = np.ones((n, 1), dtype=np.uint8)
    rows = np.hstack([ones * BOS_ID, problems.a + DIGIT0, ones * PLUS, problems.b + DIGIT0, ones * EQUALS,
                      sums + DIGIT0, ones * EOS_ID])  # (n, 3 * width + 5) uint8
    keep = np.ones(rows.shape, dtype=bool)
    digit_col = np.arange(width + 1)[None, :]
    keep[:, 1:1 + width] = digit_col[:, :width] < problems.len_a[:, None]
    keep[:, 2 + width:2 + 2 * width] = digit_col[:, :width] < problems.len_b[:, None]
    keep[:, 3 + 2 * width:4 + 3 * width] = digit_col < len_s[:, None]
    prompt_lens = problems.len_a + problems.len_b + 3
    return rows[keep], prompt_lens, len_s + 1


def to_text(digits: np.ndarray, length: int) -> str:
    """A reversed digit row -> the number in normal order, e.g. [1, 7, 0] (length 2) -> '71'."""
    return "".join(str(int(d)) for d in digits[:length][::-1])


def eval_cell(rng: np.random.Generator, len_a: int, len_b: int, per_cell: int, width: int) -> Problems:
    """The distinct evaluation problems of one grid cell (see the module docstring for the count)."""
    space = numbers_with_length(len_a) * numbers_with_length(len_b)
    want = min(per_cell, space // 2)
    chosen: dict[int, int] = {}  # key -> row in the candidate pool, first occurrence wins
    pool: list[Problems] = []
    offset = 0
    while len(chosen) < want:
        n = 2 * want
        batch = Problems(sample_operands(rng, np.full(n, len_a), width), sample_operands(rng, np.full(n, len_b), width),
                         np.full(n, len_a, np.int64), np.full(n, len_b, np.int64))
        for i, key in enumerate(batch.keys().tolist()):
            if len(chosen) < want and key not in chosen:
                chosen[key] = offset + i
        pool.append(batch)
        offset += n
    rows = np.array(sorted(chosen.values()))
    merged = Problems(*(np.concatenate([getattr(p, f) for p in pool]) for f in ("a", "b", "len_a", "len_b")))
    return Problems(merged.a[rows], merged.b[rows], merged.len_a[rows], merged.len_b[rows])


def build_eval_grid(eval_max_digits: int, per_cell: int, seed: int, width: int) -> list[Problems]:
    """One Problems per cell, cells in row-major (len_a, len_b) order; each cell seeded on its own."""
    return [eval_cell(np.random.default_rng([seed, 1, la, lb]), la, lb, per_cell, width)
            for la in range(1, eval_max_digits + 1) for lb in range(1, eval_max_digits + 1)]


def write_eval_grid(cells: list[Problems], path: str) -> int:
    """eval_grid.jsonl: one problem per line, {len_a, len_b, a, b, sum} with numbers in normal digit order."""
    atomic_io.write_lines(path, (json.dumps(record) for cell in cells for record in _grid_records(cell)))
    return sum(len(cell) for cell in cells)


def _grid_records(cell: Problems) -> Iterator[dict]:
    sums, len_s = cell.sums()
    for i in range(len(cell)):
        la, lb = int(cell.len_a[i]), int(cell.len_b[i])
        yield {"len_a": la, "len_b": lb, "a": to_text(cell.a[i], la), "b": to_text(cell.b[i], lb),
               "sum": to_text(sums[i], int(len_s[i]))}


def write_arith_data(out_dir: str, max_digits: int = 20, eval_max_digits: int = 40, train_examples: int = 20_000_000,
                     eval_per_cell: int = 100, seed: int = 42, overwrite: bool = False,
                     progress: bool = True) -> dict:
    """`tapetrain data arith`: training examples (an example store) + eval_grid.jsonl + tokenizer.model."""
    for name, value in (("--max-digits", max_digits), ("--train-examples", train_examples),
                        ("--eval-per-cell", eval_per_cell)):
        if value < 1:
            raise DataError(f"{name} must be >= 1, got {value}")
    if eval_max_digits < max_digits:
        raise DataError(f"--eval-max-digits {eval_max_digits} is below --max-digits {max_digits}; the grid must cover "
                        "the training lengths (the paper tests to twice the training length, e.g. 40 for 20)")
    if seed < 0:
        raise DataError(f"--seed must be >= 0, got {seed}")
    width = eval_max_digits
    start = time.perf_counter()
    with example_dir_writer(out_dir, overwrite) as tmp:
        cells = build_eval_grid(eval_max_digits, eval_per_cell, seed, width)
        eval_keys = np.unique(np.concatenate([c.keys() for c in cells]))
        eval_count = write_eval_grid(cells, os.path.join(tmp, EVAL_GRID))
        writer = ExampleWriter(tmp, "train", VOCAB_SIZE)
        rng = np.random.default_rng([seed, 0])
        dropped = 0
        counts = np.zeros((max_digits, max_digits), dtype=np.int64)  # training examples per (len_a, len_b)
        generation_start = time.perf_counter()
        bar = progress_bar(total=train_examples, desc="data arith", unit="ex", unit_scale=True, disable=not progress)
        with bar:
            while writer.num_examples < train_examples:
                n = min(CHUNK, train_examples - writer.num_examples)
                problems = sample_bucket(rng, n, max_digits, width)
                fresh = ~np.isin(problems.keys(), eval_keys)
                dropped += int(n - fresh.sum())
                problems = Problems(problems.a[fresh], problems.b[fresh], problems.len_a[fresh], problems.len_b[fresh])
                writer.add_batch(*encode(problems))
                np.add.at(counts, (problems.len_a - 1, problems.len_b - 1), 1)
                bar.update(len(problems))
                rate = writer.num_examples / (time.perf_counter() - generation_start)
                bar.set_postfix_str(f"{rate:,.0f} ex/s", refresh=False)
        split = writer.close()
        write_char_vocab(ALPHABET, os.path.join(tmp, TOKENIZER_FILE))
        task = {
            "name": "addition",
            "layout": "<s> rev(a) + rev(b) = rev(a+b) </s>, digits least significant first",
            "sampling": "bucket",
            "max_digits": max_digits,
            "eval_max_digits": eval_max_digits,
            "train_examples": split["num_examples"],
            "eval_per_cell": eval_per_cell,
            "eval_problems": eval_count,
            "eval_grid": EVAL_GRID,
            "seed": seed,
            "dropped_eval_overlaps": dropped,
            "train_length_counts": counts.tolist(),
        }
        manifest = write_manifest(tmp, vocab_size=VOCAB_SIZE, bos_id=BOS_ID, eos_id=EOS_ID, pad_id=PAD_ID,
                                  splits={"train": split}, task=task, tokenizer_source=None)
    log.info("data arith: %d training examples (%d rejected as evaluation problems), %d evaluation problems in %d "
             "cells, %.1fs", split["num_examples"], dropped, eval_count, eval_max_digits ** 2,
             time.perf_counter() - start)
    return manifest


def read_eval_grid(data_dir: str) -> tuple[dict, list[dict]]:
    """(task section of the manifest, evaluation problems) of a `data arith` directory."""
    from tapetrain.data.examples import read_manifest

    manifest = read_manifest(data_dir)
    task = manifest.get("task", {})
    if task.get("name") != "addition":
        raise DataError(f"{data_dir} holds {task.get('name')!r} examples, not addition; pass a directory written by "
                        "`tapetrain data arith`")
    path = os.path.join(data_dir, task["eval_grid"])
    with open(path, encoding="utf-8") as f:
        problems = [json.loads(line) for line in f if line.strip()]
    if len(problems) != task["eval_problems"]:
        raise DataError(f"{path} holds {len(problems)} problems but the manifest lists {task['eval_problems']}: the "
                        "file is damaged; rebuild the data with `tapetrain data arith`")
    return task, problems


def problem_ids(a: str, b: str) -> list[int]:
    """Prompt ids of a + b (numbers in normal order): <s> rev(a) + rev(b) =."""
    return [BOS_ID, *(DIGIT0 + int(c) for c in a[::-1]), PLUS, *(DIGIT0 + int(c) for c in b[::-1]), EQUALS]


def answer_ids(total: str) -> list[int]:
    """Answer ids of a sum (normal order): rev(sum) </s>."""
    return [*(DIGIT0 + int(c) for c in total[::-1]), EOS_ID]
