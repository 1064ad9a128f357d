"""eval arith's scorer on hand-made predictions, answer parsing, batched KV-cache decoding and the heatmap."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tapetrain.data.arith import DIGIT0, answer_ids, problem_ids
from tapetrain.data.char_vocab import EOS_ID
from tapetrain.eval.arith import answer_text, score_cells
from tapetrain.eval.arith_plots import accuracy_grid, heatmap_figure, plot_heatmaps
from tapetrain.eval.decoding import Continuation, generate
from tapetrain.eval.models import EvalModel
from tapetrain.model import ModelConfig, Transformer

REPO = Path(__file__).resolve().parents[2]


def digits(text: str) -> list[int]:
    return [DIGIT0 + int(c) for c in text]


def test_answer_text_reads_reversed_digits_and_needs_eos():
    assert answer_text(Continuation(digits("22"), True)) == "22"
    assert answer_text(Continuation(digits("321"), True)) == "123"  # reversed: least significant digit first
    assert answer_text(Continuation(digits("220"), True)) == "022"  # a leading zero is kept, so it is wrong
    assert answer_text(Continuation(digits("22"), False)) is None  # no EOS within the budget
    assert answer_text(Continuation([], True)) is None
    assert answer_text(Continuation(digits("2") + [14], True)) is None  # "+" inside the answer


def test_scorer_on_hand_made_predictions():
    problems = [
        {"len_a": 1, "len_b": 1, "a": "3", "b": "4", "sum": "7"},
        {"len_a": 1, "len_b": 1, "a": "9", "b": "9", "sum": "18"},
        {"len_a": 1, "len_b": 2, "a": "5", "b": "10", "sum": "15"},
        {"len_a": 1, "len_b": 2, "a": "0", "b": "99", "sum": "99"},
        {"len_a": 2, "len_b": 1, "a": "12", "b": "3", "sum": "15"},
        {"len_a": 2, "len_b": 2, "a": "50", "b": "50", "sum": "100"},
        {"len_a": 3, "len_b": 1, "a": "100", "b": "1", "sum": "101"},
        {"len_a": 3, "len_b": 1, "a": "999", "b": "1", "sum": "1000"},
        {"len_a": 3, "len_b": 1, "a": "123", "b": "4", "sum": "127"},
        {"len_a": 3, "len_b": 3, "a": "500", "b": "500", "sum": "1000"},
    ]
    predictions = ["7", "81", "15", "99", "15", None, "101", "1000", "0127", "1000"]
    result = score_cells(problems, predictions, train_max_digits=2)
    by_cell = {(c["len_a"], c["len_b"]): (c["accuracy"], c["n"], c["correct"]) for c in result["cells"]}
    assert by_cell == {(1, 1): (0.5, 2, 1), (1, 2): (1.0, 2, 2), (2, 1): (1.0, 1, 1), (2, 2): (0.0, 1, 0),
                       (3, 1): (2 / 3, 3, 2), (3, 3): (1.0, 1, 1)}
    assert result["mean_in_distribution"] == pytest.approx((0.5 + 1 + 1 + 0) / 4)
    assert result["mean_out_of_distribution"] == pytest.approx((2 / 3 + 1) / 2)
    assert result["mean_all"] == pytest.approx((0.5 + 1 + 1 + 0 + 2 / 3 + 1) / 6)
    with pytest.raises(ValueError, match="10 predictions for 9 problems"):
        score_cells(problems[:9], predictions, 2)


def test_batched_kv_cache_decoding_matches_one_at_a_time():
    torch.manual_seed(0)
    model = Transformer(ModelConfig(vocab_size=16, d_model=32, n_layers=2, n_heads=2, ffn_hidden=64, max_seq_len=32,
                                    pe="tape")).eval()
    for p in model.parameters():  # non-zero TAPE updates, so the cached E stream matters
        p.data.normal_(std=0.3)
    em = EvalModel(model, "run", "tiny", 16, 32, None, torch.device("cpu"), "fp32")
    prompts = torch.tensor([problem_ids("123", "45"), problem_ids("999", "10"), problem_ids("500", "77")])
    together = generate(em, prompts, max_new_tokens=6, eos_id=EOS_ID)
    for row, cont in zip(prompts, together, strict=True):
        ids = row[None]
        for _ in range(6):  # no cache, full recompute per token
            nxt = model(ids).logits[0, -1].argmax()
            ids = torch.cat([ids, nxt.view(1, 1)], dim=1)
            if int(nxt) == EOS_ID:
                break
        new = ids[0, len(row):].tolist()
        assert cont.finished == (EOS_ID in new)
        assert cont.tokens == (new[:new.index(EOS_ID)] if EOS_ID in new else new)
    assert answer_ids("15") == digits("51") + [EOS_ID]


def test_heatmap_png(tmp_path):
    report = {"model": "runs/x", "train_max_digits": 2, "eval_max_digits": 3, "mean_all": 0.5,
              "cells": [{"len_a": a, "len_b": b, "accuracy": (a + b) / 6, "n": 1, "correct": 0}
                        for a in (1, 2, 3) for b in (1, 2, 3)]}
    grid = accuracy_grid(report)
    assert grid.shape == (3, 3) and grid[2, 0] == pytest.approx(100 * 4 / 6)
    plot_heatmaps([report, report], str(tmp_path / "h.png"), labels=["TAPE", "RoPE"])
    assert (tmp_path / "h.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    import matplotlib.pyplot as plt

    fig = heatmap_figure([report])
    (box,) = fig.axes[0].patches  # where the training lengths end: the 2x2 square of the 3x3 grid
    assert (box.get_x(), box.get_y(), box.get_width(), box.get_height()) == (0.5, 0.5, 2, 2)
    assert fig.axes[0].get_title() == "x: 50.00% average"  # the whole grid's mean, the paper's number
    plt.close(fig)


def test_arith_compare_is_a_shim_over_the_package():
    """tools/arith_compare.py keeps its scales and PEs in tapetrain.eval.arith_sweep (the table is tested in
    test_arith_seeds.py)."""
    import importlib.util

    from tapetrain.eval import arith_sweep

    spec = importlib.util.spec_from_file_location("arith_compare", REPO / "tools" / "arith_compare.py")
    compare = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(compare)
    assert compare.SCALES is arith_sweep.SCALES and compare.PES == ("tape", "rope", "randpe", "nope", "fire")
    args = compare.parse_args(["--scale", "tiny"])
    assert (args.seeds, args.data_seed, args.model_seed) == (3, 42, 0)
