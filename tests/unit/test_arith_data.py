"""`tapetrain data arith`: reversed layout, exact operand lengths, bucket distribution, the evaluation grid, no
train/eval overlap (counted), the character tokenizer, and clear errors."""

from __future__ import annotations

import json
import random

import numpy as np
import pytest

from tapetrain.cli import main
from tapetrain.data.arith import (
    VOCAB_SIZE,
    Problems,
    answer_ids,
    build_eval_grid,
    encode,
    numbers_with_length,
    problem_ids,
    read_eval_grid,
    sample_bucket,
    sample_operands,
    to_text,
    write_arith_data,
)
from tapetrain.data.errors import DataError
from tapetrain.data.examples import ExampleStore
from tapetrain.data.tokenizer import Tokenizer


def problems_from_ints(pairs: list[tuple[int, int]], width: int) -> Problems:
    def digits(x: int) -> list[int]:
        rev = [int(c) for c in str(x)[::-1]]
        return rev + [0] * (width - len(rev))

    return Problems(np.array([digits(a) for a, _ in pairs], dtype=np.uint8),
                    np.array([digits(b) for _, b in pairs], dtype=np.uint8),
                    np.array([len(str(a)) for a, _ in pairs]), np.array([len(str(b)) for _, b in pairs]))


def test_layout_reverses_every_number_and_sums_long_operands(tmp_path):
    big_a, big_b = 9 * 10**39 + 12345678901234567890123456789, 10**39 + 98765432109876543210
    pairs = [(17, 5), (0, 0), (999, 1), (big_a, big_b), (10**19, 10**19 - 1)]
    tokens, prompt_lens, answer_lens = encode(problems_from_ints(pairs, width=40))
    write_arith_data(str(tmp_path / "d"), max_digits=2, eval_max_digits=2, train_examples=10, eval_per_cell=2)
    tok = Tokenizer(str(tmp_path / "d" / "tokenizer.model"))
    pos = 0
    for (a, b), p_len, a_len in zip(pairs, prompt_lens, answer_lens, strict=True):
        ids = tokens[pos:pos + p_len + a_len].tolist()
        pos += p_len + a_len
        assert ids == problem_ids(str(a), str(b)) + answer_ids(str(a + b))
        assert ids[0] == tok.bos_id and ids[-1] == tok.eos_id
        assert tok.decode(ids[1:-1]) == f"{str(a)[::-1]}+{str(b)[::-1]}={str(a + b)[::-1]}"
        assert tok.encode(f"{str(a)[::-1]}+{str(b)[::-1]}=") == ids[1:p_len]
    assert pos == len(tokens)
    assert tok.decode(problem_ids("17", "5")[1:] + answer_ids("22")[:-1]) == "71+5=22"
    assert tok.vocab_size == VOCAB_SIZE


def test_operands_have_exactly_the_requested_length():
    rng = np.random.default_rng(0)
    lengths = rng.integers(1, 9, size=20000)
    digits = sample_operands(rng, lengths, width=8)
    for row, length in zip(digits[:2000], lengths[:2000], strict=True):
        text = to_text(row, int(length))
        assert len(text) == length and len(str(int(text))) == length  # no leading zero (0 itself is one digit)
        assert not row[length:].any()
    # one-digit operands include 0; longer ones never start with 0 and their top digit is uniform over 1..9
    ones = digits[lengths == 1, 0]
    assert set(ones.tolist()) == set(range(10))
    tops = digits[lengths == 5, 4]
    counts = np.bincount(tops, minlength=10)
    assert counts[0] == 0 and counts[1:].min() > 0.7 * counts[1:].mean()


def test_bucket_sampling_is_uniform_over_length_pairs():
    n, max_digits = 60000, 5
    problems = sample_bucket(np.random.default_rng(1), n, max_digits, width=5)
    counts = np.zeros((max_digits, max_digits))
    np.add.at(counts, (problems.len_a - 1, problems.len_b - 1), 1)
    expected = n / max_digits**2
    chi2 = float(((counts - expected) ** 2 / expected).sum())
    assert chi2 < 60  # 24 degrees of freedom: p < 1e-4 above 53
    # a number-uniform sampler would put almost everything at 5 digits; bucket sampling does not
    assert counts[0, 0] > 0.8 * expected


def test_eval_grid_cells_are_distinct_correct_and_sized():
    cells = build_eval_grid(eval_max_digits=3, per_cell=100, seed=5, width=3)
    assert [(int(c.len_a[0]), int(c.len_b[0])) for c in cells] == [(a, b) for a in (1, 2, 3) for b in (1, 2, 3)]
    for cell in cells:
        la, lb = int(cell.len_a[0]), int(cell.len_b[0])
        space = numbers_with_length(la) * numbers_with_length(lb)
        assert len(cell) == min(100, space // 2)  # 1+1 digits: 50 of the 100 problems stay for training
        pairs = {(to_text(cell.a[i], la), to_text(cell.b[i], lb)) for i in range(len(cell))}
        assert len(pairs) == len(cell)
        sums, len_s = cell.sums()
        for i in range(len(cell)):
            a, b = int(to_text(cell.a[i], la)), int(to_text(cell.b[i], lb))
            assert to_text(sums[i], int(len_s[i])) == str(a + b)
    again = build_eval_grid(eval_max_digits=3, per_cell=100, seed=5, width=3)
    assert all((x.a == y.a).all() and (x.b == y.b).all() for x, y in zip(cells, again, strict=True))


def decode_store(path) -> list[tuple[str, str]]:
    """(a, b) in normal digit order of every training example, read back from the example store."""
    store = ExampleStore(str(path))
    out = []
    for i in range(store.num_examples):
        ids, prompt_len = store.example(i)
        text = "".join(str(t - 4) if 4 <= t < 14 else {14: "+", 15: "="}.get(int(t), "?") for t in ids[1:prompt_len])
        a, b = text[:-1].split("+")
        out.append((a[::-1], b[::-1]))
    return out


def test_no_train_eval_overlap_and_counts(tmp_path):
    out = tmp_path / "arith"
    manifest = write_arith_data(str(out), max_digits=2, eval_max_digits=3, train_examples=4000, eval_per_cell=60,
                                seed=3)
    task, problems = read_eval_grid(str(out))
    train = decode_store(out)
    assert len(train) == 4000 == manifest["splits"]["train"]["num_examples"]
    eval_pairs = {(p["a"], p["b"]) for p in problems}
    assert not eval_pairs & set(train)
    # 1+1 digits: 50 of its 100 problems are evaluation problems, so bucket sampling must have hit some
    assert task["dropped_eval_overlaps"] > 0
    counts = np.zeros((2, 2), dtype=int)
    for a, b in train:
        counts[len(a) - 1, len(b) - 1] += 1
    assert counts.tolist() == task["train_length_counts"]
    assert max(len(a) for a, _ in train) == 2 and max(p["len_a"] for p in problems) == 3
    assert len(problems) == task["eval_problems"] == 50 + 8 * 60
    for p in random.Random(0).sample(problems, 40):
        assert int(p["a"]) + int(p["b"]) == int(p["sum"]) and (len(p["a"]), len(p["b"])) == (p["len_a"], p["len_b"])
    # same arguments -> byte-identical store
    again = write_arith_data(str(tmp_path / "again"), max_digits=2, eval_max_digits=3, train_examples=4000,
                             eval_per_cell=60, seed=3)
    assert again["splits"]["train"]["files"] == manifest["splits"]["train"]["files"]
    assert (tmp_path / "again" / "eval_grid.jsonl").read_bytes() == (out / "eval_grid.jsonl").read_bytes()


def test_cli_writes_and_refuses_to_clobber(tmp_path, capsys):
    out = tmp_path / "d"
    args = ["data", "arith", "--out", str(out), "--max-digits", "3", "--eval-max-digits", "4",
            "--train-examples", "500", "--eval-per-cell", "5", "--seed", "1"]
    assert main(args) == 0
    assert "500 training examples" in capsys.readouterr().out
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["task"]["max_digits"] == 3 and manifest["vocab_size"] == VOCAB_SIZE
    assert main(args) == 1  # a user error: one line, exit 1
    err = capsys.readouterr().err
    assert "already exists" in err and "--overwrite" in err
    assert main(args + ["--overwrite"]) == 0
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]  # no temporary directories left behind


def test_bad_arguments_name_the_fix(tmp_path):
    with pytest.raises(DataError, match="--eval-max-digits 3 is below --max-digits 5"):
        write_arith_data(str(tmp_path / "x"), max_digits=5, eval_max_digits=3, train_examples=10)
    with pytest.raises(DataError, match="--train-examples must be >= 1"):
        write_arith_data(str(tmp_path / "x"), max_digits=2, eval_max_digits=3, train_examples=0)
    assert not (tmp_path / "x").exists()
