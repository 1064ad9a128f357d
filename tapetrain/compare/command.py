"""`tapetrain compare`: the signature and docstring are the command-line options and help (tapetrain.cli_parser)."""

from __future__ import annotations

import dataclasses
import logging
import os
import shlex
import time
from pathlib import Path
from typing import Literal

from tapetrain.errors import MissingInputError

log = logging.getLogger("tapetrain.compare")

DEFAULT_LENGTHS = (1024, 2048, 4096, 8192)
DEFAULT_DEPTHS = (0.0, 0.25, 0.5, 0.75, 1.0)


def command_line(models: list[str], given: dict) -> str:
    """The `tapetrain compare` call that reproduces a report: the models and every option not at its default."""
    import inspect

    parts = ["tapetrain", "compare", *models]
    for name, param in inspect.signature(run_compare).parameters.items():
        if name == "models" or given[name] == param.default:
            continue
        value = given[name]
        flag = "--" + name.replace("_", "-")
        if isinstance(value, bool):
            parts.append(flag if value else "--no-" + flag[2:])
        elif isinstance(value, list):
            joined = ",".join(f"{v:g}" if isinstance(v, float) else str(v) for v in value)
            parts += [flag, *(map(str, value) if name in ("labels", "ruler_tasks") else [joined])]
        else:
            parts += [flag, str(value)]
    return " ".join(shlex.quote(p) for p in parts)


def run_compare(
    models: list[str],
    *,
    out: str,
    suite: str = "ppl,needle",
    lengths: list[int] | None = None,
    labels: list[str] | None = None,
    data: str | None = None,
    tokenizer: str | None = None,
    split: Literal["val", "train"] | None = None,
    max_tokens: int | None = None,
    protocol: Literal["nonoverlap", "sliding", "longlora"] = "nonoverlap",
    stride: int | None = None,
    needle_lengths: list[int] | None = None,
    depths: list[float] | None = None,
    trials: int = 10,
    ruler_lengths: list[int] | None = None,
    ruler_tasks: list[str] | None = None,
    ruler_samples: int = 100,
    ruler_max_new_tokens: int | None = None,
    batch_size: int | None = None,
    seed: int = 0,
    dtype: Literal["fp32", "bf16", "fp16"] = "fp32",
    resamples: int = 1000,
    title: str | None = None,
    notes: str | None = None,
    recompute: bool = False,
) -> dict:
    """Compare models on the same evaluations: one report with a table per evaluation and confidence intervals.

    Every MODEL (run directory, `tapetrain export hf` output, or a directory of seed runs NAME/seed-S/, shown as
    mean ± spread over seeds) gets the same evaluations with the same data, seeds and protocol. Writes
    OUT/summary.json, OUT/README.md (a table per evaluation, and each model's paired difference from the first on
    the same windows/prompts: better only where its interval excludes 0), the figures, and
    OUT/results/<model>/<evaluation>.json; a result whose settings are unchanged is reused, so adding a model only
    evaluates that model. ppl and needle run on several ranks under torchrun/deepspeed.

    Args:
        models: run directories, Hugging Face exports, or directories of seed runs (seed-0/, seed-1/, ...)
        out: report directory
        suite: evaluations, comma-separated: ppl (perplexity), needle (passkey grid over depths), ruler (RULER via
            lm-evaluation-harness, needs the lm-eval extra)
        lengths: context lengths of every evaluation (default 1024,2048,4096,8192)
        labels: model names in the tables (default: the directory names)
        data: ppl: eval tokens (a `tapetrain data prepare` directory, a flat .bin or text), the same for every model
        tokenizer: ppl on text data and needle prompts: the tokenizer of every model (a sentencepiece .model, a
            tokenizer.json or a model directory; default each model's own: its export's, its run's)
        split: ppl: the shard directory's split (default val)
        max_tokens: ppl: evaluate the first N tokens of the data only
        protocol: ppl: window protocol (token-weighted ones only, so that windows can be resampled)
        stride: ppl: --protocol sliding: tokens between window starts
        needle_lengths: needle: its own lengths (default --lengths; a prompt needs room for the task, key line
            and question)
        depths: needle: key depths in [0, 1] (default 0,0.25,0.5,0.75,1)
        trials: needle: prompts per (length, depth)
        ruler_lengths: ruler: its own lengths, lm-eval's max_seq_lengths (default --lengths)
        ruler_tasks: ruler: lm-eval RULER tasks or groups (default offline: the six that need no files or
            network; essay, qa, ruler = all 13)
        ruler_samples: ruler: samples per task and length
        ruler_max_new_tokens: ruler: cap each task's answer budget (quick runs; default the tasks' own)
        batch_size: windows per forward (ppl, default 1), prompts per batch (needle, default 8), lm-eval batch
            (ruler, default 1)
        seed: needle prompts, lm-eval's RULER generators and the bootstrap
        dtype: compute dtype
        resamples: bootstrap resamples of every interval
        title: report title (default: the model labels)
        notes: markdown file whose text goes under the title (what the models are, how they were trained)
        recompute: evaluate again even where a result with the same settings exists
    """
    given = dict(locals())  # the arguments, for the report's command line
    from tapetrain.compare.cache import load_cached, result_path, store
    from tapetrain.compare.entries import resolve_entries
    from tapetrain.compare.models import ModelHandle
    from tapetrain.compare.suites import CompareOptions, parse_suite
    from tapetrain.distributed import init_eval_ranks
    from tapetrain.progress import progress

    started = time.perf_counter()
    evaluations = parse_suite(suite)
    options = CompareOptions(
        lengths=sorted(set(lengths or DEFAULT_LENGTHS)), seed=seed, dtype=dtype, resamples=resamples, data=data,
        tokenizer=tokenizer, split=split, max_tokens=max_tokens, protocol=protocol, stride=stride,
        needle_lengths=sorted(set(needle_lengths)) if needle_lengths else None,
        depths=sorted(set(depths if depths is not None else DEFAULT_DEPTHS)), trials=trials,
        ruler_lengths=sorted(set(ruler_lengths)) if ruler_lengths else None, ruler_tasks=ruler_tasks,
        ruler_samples=ruler_samples, ruler_max_new_tokens=ruler_max_new_tokens)
    if batch_size is not None:
        options.ppl_batch_size = options.needle_batch_size = options.ruler_batch_size = batch_size
    entries = resolve_entries(models, labels)
    for evaluation in evaluations:
        evaluation.check(options, entries)
    notes_text = None
    if notes:
        if not os.path.isfile(notes):
            raise MissingInputError(f"--notes {notes} does not exist; pass a markdown file (or drop --notes)")
        notes_text = Path(notes).read_text()

    reports: dict[str, dict[str, dict]] = {e.name: {} for e in evaluations}
    paths: dict[str, dict[str, str]] = {e.name: {} for e in evaluations}
    computed, reused = [], []
    ranks = init_eval_ranks()
    try:
        runs = [run for entry in entries for run in entry.runs]
        bar = progress(total=len(runs) * len(evaluations), desc="compare", unit="result", disable=not ranks.is_main)
        for run in runs:
            handle = ModelHandle(run, dtype, out)
            try:
                for evaluation in evaluations:
                    path = result_path(out, run.key, evaluation.name)
                    settings = {"model": run.identity(), **evaluation.settings(options)}
                    bar.set_postfix_str(f"{run.key}: {evaluation.name}")
                    report = None if recompute else load_cached(path, settings)
                    if report is None:
                        log.info("compare: %s %s: evaluating", run.key, evaluation.name)
                        report = evaluation.compute(handle, options, ranks)
                        if ranks.is_main:
                            report = store(path, settings, report)
                        computed.append(f"{run.key}/{evaluation.name}")
                    else:
                        log.info("compare: %s %s: reusing %s (same model and settings)", run.key, evaluation.name,
                                 path)
                        reused.append(f"{run.key}/{evaluation.name}")
                    reports[evaluation.name][run.key] = report
                    paths[evaluation.name][run.key] = os.path.relpath(path, out)
                    bar.update(1)
            finally:
                handle.close()
        bar.close()
    finally:
        ranks.close()
    payload = {}
    if ranks.is_main:
        payload = write_report(out, entries, evaluations, options, reports, paths, title, notes_text,
                               command_line(models, given))
        log.info("compare: %s written in %.0f s (%d results computed, %d reused)",
                 os.path.join(out, "README.md"), time.perf_counter() - started, len(computed), len(reused))
        from tapetrain.compare.report import evaluation_table, paired_table

        for summary in payload["evaluations"].values():
            print("\n".join([f"{summary['title']}: value [95% interval over {summary['n_counts']}]",
                              *evaluation_table(summary), "", *paired_table(summary)]))
        print(f"compare: {os.path.join(out, 'README.md')} ({len(computed)} results computed, {len(reused)} reused)")
    return {**payload, "computed": computed, "reused": reused}


def write_report(out: str, entries, evaluations, options, reports, paths, title, notes_text, command) -> dict:
    """summary.json, README.md and the figures; returns the summary."""
    from tapetrain.compare.plots import line_plot, loss_plot, mean_needle_report
    from tapetrain.compare.report import (
        FIGURES,
        LOSS_FIGURE,
        has_metrics,
        read_metrics,
        training_rows,
        write_readme,
        write_summary,
    )
    from tapetrain.compare.summary import evaluation_summary
    from tapetrain.eval.needle_plots import plot_needle_heatmaps

    summaries = [evaluation_summary(e, entries, reports[e.name], paths[e.name], options) for e in evaluations]
    for evaluation, summary in zip(evaluations, summaries, strict=True):
        figure = os.path.join(out, FIGURES[evaluation.name])
        trained = [r["trained_context"] for r in reports[evaluation.name].values() if r.get("trained_context")]
        if evaluation.name == "ppl":
            line_plot(summary, figure, "perplexity", "Perplexity vs context length", trained, log_y=True)
        elif evaluation.name == "ruler":
            line_plot(summary, figure, "RULER score (mean over tasks)", "RULER vs context length", trained,
                      ylim=(0.0, 1.0))
        elif evaluation.name == "needle":
            grids = [mean_needle_report([reports["needle"][r.key] for r in e.runs]) for e in entries]
            plot_needle_heatmaps(grids, figure, [e.label for e in entries])
    runs = [run for e in entries for run in e.runs]
    known_runs = [Path(run.path).resolve() for run in runs if run.kind == "run"]
    sources = {run.key: source for run in runs if (source := run.training_run(known_runs)) is not None}
    curves = {key: read_metrics(s.run_dir) for key, s in sources.items()
              if s.run_dir is not None and has_metrics(s.run_dir)}
    training = training_rows(sources, curves)
    if curves:
        loss_plot(curves, os.path.join(out, LOSS_FIGURE))
    title = title or "Comparison: " + ", ".join(e.label for e in entries)
    payload = {
        "title": title,
        "command": command,
        "suite": [e.name for e in evaluations],
        "options": dataclasses.asdict(options),
        "models": [{"label": e.label, "path": e.path,
                    "runs": [{"key": r.key, "path": r.path, "kind": r.kind, "seed": r.seed} for r in e.runs]}
                   for e in entries],
        "training": training,
        "evaluations": {s["name"]: s for s in summaries},
    }
    write_summary(out, payload)
    write_readme(out, title, notes_text, entries, summaries, training, command)
    return payload
