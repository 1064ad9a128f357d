"""OUT/summary.json and OUT/README.md of a compare: a table per evaluation (a row per model, a column per length),
the paired difference of every model from the first with its verdict, its figure, the training of the runs when
they are at hand, and the command that reproduces the report. No value is marked best: a model is called better
only where the paired interval says so."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import TYPE_CHECKING

from tapetrain import atomic_io
from tapetrain.atomic_io import write_json
from tapetrain.compare.entries import ModelEntry
from tapetrain.compare.summary import format_cell, format_difference, judgement

if TYPE_CHECKING:
    from tapetrain.checkpoint.export_source import ExportRun

FIGURES = {"ppl": "ppl_vs_length.png", "needle": "needle_heatmaps.png", "ruler": "ruler_vs_length.png"}
LOSS_FIGURE = "loss.png"
METRICS = "metrics.jsonl"  # the run directory's training log (tapetrain.train.metrics)


def has_metrics(run_dir: Path) -> bool:
    return (run_dir / METRICS).is_file()


def read_metrics(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / METRICS).read_text().splitlines() if line.strip()]


def training_rows(sources: dict[str, ExportRun], curves: dict[str, list[dict]]) -> list[dict]:
    """{model, run, steps, train_loss, val_loss, val_ppl, tokens_per_s, problem} for every model with a training
    run (`sources`, in report order), from its metrics.jsonl (`curves`); `problem` says why a row has no numbers."""
    rows = []
    for key, source in sources.items():
        records = curves.get(key, [])
        train = [r for r in records if r.get("loss") is not None]
        val = [r for r in records if r.get("val_loss") is not None]
        last_train, last_val = (train[-1] if train else {}), (val[-1] if val else {})
        problem = source.problem or (None if train else f"no training loss in {source.run_dir / METRICS}")
        rows.append({"model": key, "run": str(source.run_dir) if source.run_dir else None,
                     "steps": last_train.get("step"), "train_loss": last_train.get("loss"),
                     "val_loss": last_val.get("val_loss"), "val_ppl": last_val.get("val_ppl"),
                     "tokens_per_s": last_train.get("tokens_per_s"), "problem": problem})
    return rows


def _number(value, spec: str) -> str:
    return "–" if value is None else format(value, spec)


def evaluation_table(summary: dict) -> list[str]:
    lengths = summary["lengths"]
    lines = ["| model | " + " | ".join(str(n) for n in lengths) + " |", "|---|" + "---|" * len(lengths)]
    for row in summary["rows"]:
        cells = {c["length"]: c for c in row["cells"]}
        label = row["label"] + (f" ({len(row['seeds'])} seeds)" if row["seeds"] is not None else "")
        lines.append(f"| {label} | " + " | ".join(format_cell(cells[n], summary["percent"]) for n in lengths) + " |")
    return lines


def paired_table(summary: dict) -> list[str]:
    """Each later model minus the first on the same windows/prompts, its paired interval and what it resolves;
    empty for a single model."""
    rows = [row for row in summary["rows"] if row.get("paired")]
    if not rows:
        return []
    reference = rows[0]["paired"][0]["reference"]
    lines = [f"Paired difference from {reference} (model − {reference}, the same {summary['n_counts']} resampled "
             "together): a model is called better only where this interval excludes 0 (for seed groups: every seed "
             "pair's interval, on the same side).", "",
             "| model − " + reference + " | " + " | ".join(str(n) for n in summary["lengths"]) + " |",
             "|---|" + "---|" * len(summary["lengths"])]
    for row in rows:
        texts = [judgement(c, row["label"]) if c["difference"] is None else
                 f"{format_difference(c, summary['percent'])}: {judgement(c, row['label'])}" for c in row["paired"]]
        lines.append(f"| {row['label']} | " + " | ".join(texts) + " |")
    return lines


def write_readme(out_dir: str, title: str, notes: str | None, entries: list[ModelEntry], summaries: list[dict],
                 training: list[dict], command: str) -> Path:
    lines = [f"# {title}", ""]
    if notes:
        lines += [notes.strip(), ""]
    lines += ["| model | kind | path |", "|---|---|---|"]
    for entry in entries:
        kinds = sorted({"run directory" if r.kind == "run" else "Hugging Face export" for r in entry.runs})
        seeds = f", seeds {', '.join(str(r.seed) for r in entry.runs)}" if entry.is_group else ""
        lines.append(f"| {entry.label} | {' / '.join(kinds)}{seeds} | `{entry.path}` |")
    lines.append("")
    if training:
        lines += ["## Training", "", "| run | steps | final train loss | val loss | val PPL | tokens/s (last log) |",
                  "|---|---|---|---|---|---|"]
        for row in training:
            if row["problem"]:
                lines.append(f"| {row['model']} | {row['problem']} | – | – | – | – |")
                continue
            lines.append(f"| {row['model']} | {row['steps']} | {_number(row['train_loss'], '.4f')} | "
                         f"{_number(row['val_loss'], '.4f')} | {_number(row['val_ppl'], '.2f')} | "
                         f"{_number(row['tokens_per_s'], '.0f')} |")
        lines += [""]
        if any(row["problem"] is None for row in training):
            lines += [f"![training loss]({LOSS_FIGURE})", ""]
    for summary in summaries:
        lines += [f"## {summary['title']}", "", summary["description"], ""]
        lines += evaluation_table(summary)
        paired = paired_table(summary)
        lines += ["", *paired] if paired else []
        lines += ["", f"![{summary['name']}]({FIGURES[summary['name']]})", ""]
    lines += ["## Reproduce", "", "```bash", command, "```", "",
              "Each result is in `results/<model>/<evaluation>.json` (what `tapetrain eval ...` writes, plus the "
              "settings it was computed with); running the command again reuses every result whose settings are "
              "unchanged, so adding a model only evaluates that model."]
    path = Path(out_dir) / "README.md"
    return atomic_io.write_text(path, "\n".join(lines) + "\n")


def write_summary(out_dir: str, payload: dict) -> None:
    write_json(os.path.join(out_dir, "summary.json"), payload, parents=True)
