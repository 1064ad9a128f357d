"""`tapetrain eval arith`: exact-match accuracy of addition on the (len_a, len_b) grid, as in the TAPE paper.

For each grid cell the model decodes every problem greedily with the KV cache until EOS (batched: a cell's prompts
all have the same length). A problem is correct only if the generated answer is exactly the reversed sum followed
by EOS: a wrong digit, a missing or extra digit (leading zeros included), or no EOS within max(len_a, len_b) + 2
new tokens make it wrong. Cells are split among ranks under torchrun / the deepspeed launcher; the per-cell counts
are all-reduced, so every rank ends with the whole grid.
"""

from __future__ import annotations

import logging
import time
from collections import defaultdict
from typing import Literal

import numpy as np
import torch

from tapetrain.atomic_io import write_json
from tapetrain.data.arith import DIGIT0, VOCAB_SIZE, problem_ids, read_eval_grid
from tapetrain.data.char_vocab import EOS_ID
from tapetrain.distributed import EvalRanks, all_reduce_sum, init_eval_ranks
from tapetrain.errors import InputError
from tapetrain.eval.decoding import Continuation, generate
from tapetrain.eval.models import EvalModel, load_eval_model
from tapetrain.progress import progress as progress_bar

log = logging.getLogger("tapetrain.eval")

Cell = tuple[int, int]


def answer_text(continuation: Continuation) -> str | None:
    """The sum a continuation states, in normal digit order; None without EOS or with a non-digit token."""
    if not continuation.finished or not continuation.tokens:
        return None
    digits = [t - DIGIT0 for t in continuation.tokens]
    if any(not 0 <= d <= 9 for d in digits):
        return None
    return "".join(str(d) for d in reversed(digits))


def group_by_cell(problems: list[dict]) -> dict[Cell, list[dict]]:
    cells: dict[Cell, list[dict]] = defaultdict(list)
    for p in problems:
        cells[(p["len_a"], p["len_b"])].append(p)
    return dict(sorted(cells.items()))


def score_cells(problems: list[dict], predictions: list[str | None], train_max_digits: int) -> dict:
    """Exact match per cell and the three means the paper's figure reports.

    predictions[i] is the sum stated for problems[i] in normal digit order (None = no valid answer). Means are
    over cells (each cell weighs the same, as in the paper's average over the heatmap): in distribution = both
    operands at most train_max_digits long, out of distribution = the rest of the grid, all = every cell."""
    if len(predictions) != len(problems):
        raise ValueError(f"{len(predictions)} predictions for {len(problems)} problems")
    correct: dict[Cell, int] = defaultdict(int)
    total: dict[Cell, int] = defaultdict(int)
    for problem, predicted in zip(problems, predictions, strict=True):
        cell = (problem["len_a"], problem["len_b"])
        total[cell] += 1
        correct[cell] += int(predicted is not None and predicted == problem["sum"])
    return summarize({cell: (correct[cell], total[cell]) for cell in sorted(total)}, train_max_digits)


def summarize(counts: dict[Cell, tuple[int, int]], train_max_digits: int) -> dict:
    """{cells: [{len_a, len_b, accuracy, n, correct}], mean_in_distribution, mean_out_of_distribution, mean_all}
    from (correct, n) per cell; accuracies are fractions in [0, 1]."""
    cells = [{"len_a": la, "len_b": lb, "accuracy": c / n, "n": n, "correct": c}
             for (la, lb), (c, n) in sorted(counts.items())]

    def mean(rows: list[dict]) -> float | None:
        return float(np.mean([r["accuracy"] for r in rows])) if rows else None

    def in_distribution(row: dict) -> bool:
        return row["len_a"] <= train_max_digits and row["len_b"] <= train_max_digits

    inside = [r for r in cells if in_distribution(r)]
    outside = [r for r in cells if not in_distribution(r)]
    return {"cells": cells, "mean_in_distribution": mean(inside), "mean_out_of_distribution": mean(outside),
            "mean_all": mean(cells)}


def decode_problems(model: EvalModel, problems: list[dict], batch_size: int) -> list[str | None]:
    """Greedy answers (normal digit order) of problems whose prompts have the same length (equal len_a + len_b).

    Each problem gets max(len_a, len_b) + 2 new tokens (the sum has at most max + 1 digits, then EOS); a batch
    decodes to its largest budget and every row is judged within its own."""
    out: list[str | None] = []
    for i in range(0, len(problems), batch_size):
        chunk = problems[i:i + batch_size]
        budgets = [max(p["len_a"], p["len_b"]) + 2 for p in chunk]
        prompts = torch.tensor([problem_ids(p["a"], p["b"]) for p in chunk], dtype=torch.long)
        for budget, cont in zip(budgets, generate(model, prompts, max(budgets), EOS_ID), strict=True):
            in_budget = cont.finished and len(cont.tokens) < budget
            out.append(answer_text(cont) if in_budget else None)
    return out


def evaluate_arith(model: EvalModel, problems: list[dict], train_max_digits: int, batch_size: int = 100,
                   ranks: EvalRanks | None = None) -> dict:
    """Decode this rank's share of the cells, all-reduce the per-cell counts, return `summarize`'s dict."""
    ranks = ranks or EvalRanks()
    if batch_size < 1:
        raise InputError(f"--batch-size must be >= 1, got {batch_size}")
    cells = group_by_cell(problems)
    keys = list(cells)
    # Deal cells round-robin by size so every rank gets long and short ones.
    order = sorted(range(len(keys)), key=lambda k: -(keys[k][0] + keys[k][1]))
    mine = [order[i] for i in ranks.share(len(order))]
    # Cells with the same len_a + len_b have prompts of the same length: decode them together.
    by_length: dict[int, list[tuple[int, dict]]] = defaultdict(list)
    for k in mine:
        by_length[sum(keys[k])].extend((k, p) for p in cells[keys[k]])
    counts = np.zeros((len(keys), 2))  # (cells, [correct, n])
    bar = progress_bar(total=sum(len(group) for group in by_length.values()), desc="eval arith", unit="problem",
                       disable=not ranks.is_main)
    start = time.perf_counter()
    with bar:
        for _, group in sorted(by_length.items()):
            predictions = decode_problems(model, [p for _, p in group], batch_size)
            for (k, problem), predicted in zip(group, predictions, strict=True):
                counts[k] += (predicted == problem["sum"], 1)
            bar.update(len(group))
            bar.set_postfix_str(f"{bar.n / (time.perf_counter() - start):.0f} problems/s", refresh=False)
    counts = np.asarray(all_reduce_sum(counts.ravel().tolist(), model.device)).reshape(-1, 2)
    return summarize({keys[k]: (int(c), int(n)) for k, (c, n) in enumerate(counts)}, train_max_digits)


def format_arith_table(report: dict) -> str:
    def pct(v: float | None) -> str:
        return "n/a" if v is None else f"{100 * v:.2f}%"

    return (f"addition exact match of {report['model']} (trained to {report['train_max_digits']} digits, grid to "
            f"{report['eval_max_digits']}): in distribution {pct(report['mean_in_distribution'])}, out of "
            f"distribution {pct(report['mean_out_of_distribution'])}, whole grid {pct(report['mean_all'])}")


def run_eval_arith(model_path: str, data: str, out: str, plot: str | None = None, *, batch_size: int = 100,
                   dtype: Literal["fp32", "bf16"] = "fp32", step: int | None = None) -> dict:
    """Addition exact match on the (len_a, len_b) grid, and its heatmap.

    Greedy decoding (KV cache, batched, until EOS) of every problem of the evaluation grid written by `tapetrain
    data arith`; exact match per cell. Runs on several ranks under torchrun/deepspeed, the cells split among
    them. Writes R.json (+ the heatmap PNG) on rank 0.

    Args:
        model_path: run directory or Hugging Face export (tapetrain export hf)
        data: directory written by `tapetrain data arith`
        out: result JSON (cells and the three means)
        plot: PNG heatmap of accuracy per (len_a, len_b)
        batch_size: problems decoded together (equal-length prompts)
        dtype: compute dtype
        step: run directories: checkpoint step (default newest)
    """
    from tapetrain.eval.arith_plots import plot_heatmaps

    task, problems = read_eval_grid(data)
    ranks = init_eval_ranks()
    try:
        model = load_eval_model(model_path, dtype, step)
        if model.vocab_size != VOCAB_SIZE:
            raise InputError(f"model {model_path} has vocab_size {model.vocab_size}, but the addition vocabulary has "
                             f"{VOCAB_SIZE} tokens; evaluate a model trained on `tapetrain data arith` output")
        start = time.perf_counter()
        result = evaluate_arith(model, problems, task["max_digits"], batch_size, ranks)
    finally:
        ranks.close()
    report = {
        "model": model.name,
        "model_kind": model.kind,
        "data": data,
        "train_max_digits": task["max_digits"],
        "eval_max_digits": task["eval_max_digits"],
        "problems": len(problems),
        "decoding": "greedy, KV cache, until EOS",
        "world_size": ranks.world_size,
        "seconds": round(time.perf_counter() - start, 2),
        **result,
    }
    if ranks.is_main:
        print(format_arith_table(report))
        write_json(out, report, parents=True)
        if plot:
            plot_heatmaps([report], plot)
    return report

