"""Per-length numbers of every entry and evaluation, as summary.json holds them and the tables show them.

A single model's cell is its point estimate with the evaluation's bootstrap interval. A group of seed runs' cell
is the mean of its runs' point estimates ± their sample standard deviation (the spread over seeds), with every
run's own value and interval kept under `runs`.

Every row after the first also gets, per length, its paired difference from the first (the reference): value
minus the reference's on the same windows/prompts, with the paired bootstrap interval (tapetrain.eval.bootstrap).
The verdict names the better model only where that interval excludes 0; with seed groups, only where every pair's
interval excludes 0 on the same side (pairs: the runs of equal seed when both are groups, else every run against
the other side's single model). Results that were not computed on the same windows/prompts are not paired.
"""

from __future__ import annotations

import hashlib
import os
import statistics
from functools import cache

from tapetrain.compare.entries import ModelEntry, ModelRun
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


@cache
def _file_digest(path: str) -> str:
    with open(path, "rb") as f:
        return hashlib.sha256(f.read()).hexdigest()


def tokenizers_differ(a: ModelRun, b: ModelRun) -> bool:
    """Both tokenizers known and not the same file contents: the same text is not the same tokens."""
    paths = [a.tokenizer(), b.tokenizer()]
    if any(p is None or not os.path.isfile(p) for p in paths):
        return False
    return _file_digest(paths[0]) != _file_digest(paths[1])


def run_pairs(entry: ModelEntry, reference: ModelEntry) -> list[tuple[ModelRun, ModelRun]]:
    """(run, reference run) pairs: equal seeds when both are seed groups, else every run against every run."""
    if entry.is_group and reference.is_group:
        ref_by_seed = {r.seed: r for r in reference.runs}
        return [(r, ref_by_seed[r.seed]) for r in entry.runs if r.seed in ref_by_seed]
    return [(r, ref) for r in entry.runs for ref in reference.runs]


def verdict(intervals: list[tuple[float, float]], better: str) -> str:
    """'better' / 'worse' (the row against the reference) only if every interval excludes 0 on the same side."""
    if all(low > 0 for low, _ in intervals):
        higher = True
    elif all(high < 0 for _, high in intervals):
        higher = False
    else:
        return "not resolved"
    return "better" if higher == (better == "higher") else "worse"


def paired_cell(evaluation: Evaluation, entry: ModelEntry, reference: ModelEntry, reports: dict[str, dict],
                options: CompareOptions, length: int) -> dict:
    """{length, reference, difference, ci, spread, pairs: [{key, reference_key, difference, ci}], verdict, note}:
    `difference` is this row minus the reference (mean over pairs for seed groups, ± `spread`)."""
    cell = {"length": length, "reference": reference.label, "difference": None, "ci": None, "spread": None,
            "pairs": [], "verdict": "not paired", "note": None}
    pairs = run_pairs(entry, reference)
    if not pairs:
        cell["note"] = "no seed in common with the reference"
        return cell
    for run, ref in pairs:
        why = "another tokenizer" if tokenizers_differ(run, ref) else \
            evaluation.unpaired(reports[ref.key], reports[run.key], length)
        if why:
            cell["note"] = f"{run.key} against {ref.key}: {why}"
            return cell
        value = evaluation.paired(reports[ref.key], reports[run.key], length, options)
        cell["pairs"].append({"key": run.key, "reference_key": ref.key, "difference": value.value,
                              "ci": [value.low, value.high]})
    differences = [p["difference"] for p in cell["pairs"]]
    cell["difference"] = statistics.fmean(differences)
    if len(pairs) == 1:
        cell["ci"] = cell["pairs"][0]["ci"]
    else:
        cell["spread"] = statistics.stdev(differences)
    cell["verdict"] = verdict([tuple(p["ci"]) for p in cell["pairs"]], evaluation.better)
    return cell


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
                  "cells": entry_cells(e, evaluation, reports, paths, options),
                  "paired": None if i == 0 else [paired_cell(evaluation, e, entries[0], reports, options, n)
                                                 for n in evaluation.lengths(options)]}
                 for i, e in enumerate(entries)],
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


def format_difference(cell: dict, percent: bool) -> str:
    """`+0.35 [0.10, 0.60]`, `+5.0 pp [1.0, 9.0]` (percentage points), or `+0.35 ± 0.05` over seed pairs."""
    def signed(x: float) -> str:
        return f"{100 * x:+.1f} pp" if percent else f"{x:+.2f}"

    if cell["difference"] is None:
        return "–"
    if cell["spread"] is not None:
        return f"{signed(cell['difference'])} ± {signed(cell['spread']).lstrip('+').removesuffix(' pp')}"
    low, high = (signed(b).removesuffix(" pp") for b in cell["ci"])
    return f"{signed(cell['difference'])} [{low}, {high}]"


def judgement(cell: dict, label: str) -> str:
    """What the paired difference says: who is better, or that it is not resolved (or not paired, and why)."""
    if cell["verdict"] == "not paired":
        return f"not paired: {cell['note']}"
    pairs = len(cell["pairs"])
    if cell["verdict"] == "not resolved":
        return "not resolved (" + ("a seed pair's interval contains 0 or the pairs disagree" if pairs > 1 else
                                   "the interval contains 0") + ")"
    winner = label if cell["verdict"] == "better" else cell["reference"]
    return f"{winner} better (" + (f"all {pairs} seed pairs' intervals exclude 0" if pairs > 1 else
                                   "interval excludes 0") + ")"


def relative(path: str, start: str) -> str:
    return os.path.relpath(path, start)
