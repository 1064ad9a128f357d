"""Per-length numbers of every entry and evaluation, as summary.json holds them and the tables show them.

A single model's cell is its point estimate with the evaluation's bootstrap interval. A group of seed runs' cell
is the mean of its runs' point estimates ± their sample standard deviation (the spread over seeds), with every
run's own value and interval kept under `runs`.
"""

from __future__ import annotations

import os
import statistics

from tapetrain.compare.entries import ModelEntry
from tapetrain.compare.suites import CompareOptions, Evaluation


def entry_cells(entry: ModelEntry, evaluation: Evaluation, reports: dict[str, dict], paths: dict[str, str],
                options: CompareOptions) -> list[dict]:
    """One cell per length: {length, value, ci, spread, n, runs: [{key, seed, value, ci, n, result}]}."""
    per_run = {run.key: {v.length: v for v in evaluation.values(reports[run.key], options)} for run in entry.runs}
    cells = []
    for length in evaluation.lengths(options):
        runs = [{"key": run.key, "seed": run.seed, "value": per_run[run.key][length].value,
                 "ci": [per_run[run.key][length].low, per_run[run.key][length].high],
                 "n": per_run[run.key][length].n, "result": paths[run.key]} for run in entry.runs]
        values = [r["value"] for r in runs]
        if entry.is_group:
            spread = statistics.stdev(values) if len(values) > 1 else 0.0
            cells.append({"length": length, "value": statistics.fmean(values), "ci": None, "spread": spread,
                          "n": sum(r["n"] for r in runs), "runs": runs})
        else:
            cells.append({"length": length, "value": values[0], "ci": runs[0]["ci"], "spread": None,
                          "n": runs[0]["n"], "runs": runs})
    return cells


def evaluation_summary(evaluation: Evaluation, entries: list[ModelEntry], reports: dict[str, dict],
                       paths: dict[str, str], options: CompareOptions) -> dict:
    return {
        "name": evaluation.name,
        "title": evaluation.title,
        "better": evaluation.better,
        "percent": evaluation.percent,
        "n_counts": evaluation.unit,
        "description": evaluation.describe(options),
        "lengths": evaluation.lengths(options),
        "rows": [{"label": e.label, "path": e.path, "seeds": [r.seed for r in e.runs] if e.is_group else None,
                  "cells": entry_cells(e, evaluation, reports, paths, options)} for e in entries],
    }


def format_value(value: float, percent: bool) -> str:
    return f"{100 * value:.1f}%" if percent else f"{value:.2f}"


def format_cell(cell: dict, percent: bool) -> str:
    """`11.62 [11.40, 11.85]`, `45.0% [30.0, 60.0]`, or `11.62 ± 0.20` for seed groups."""
    value = format_value(cell["value"], percent)
    if cell["spread"] is not None:
        spread = format_value(cell["spread"], percent).rstrip("%")
        return f"{value} ± {spread}"
    low, high = (format_value(b, percent).rstrip("%") for b in cell["ci"])
    return f"{value} [{low}, {high}]"


def best_labels(summary: dict, length: int) -> set[str]:
    """The rows whose value at `length` is best as displayed (ties all count)."""
    shown = {row["label"]: format_value(c["value"], summary["percent"])
             for row in summary["rows"] for c in row["cells"] if c["length"] == length}
    values = {row["label"]: c["value"] for row in summary["rows"] for c in row["cells"] if c["length"] == length}
    pick = min if summary["better"] == "lower" else max
    best = pick(values, key=values.__getitem__)
    return {label for label, text in shown.items() if text == shown[best]}


def relative(path: str, start: str) -> str:
    return os.path.relpath(path, start)
