"""The figures of a compare report: one axis per evaluation with every model on it (error bars: the bootstrap
interval, or the spread over seeds), the needle heatmaps side by side, and the training loss of the runs."""

from __future__ import annotations

import numpy as np

from tapetrain.atomic_io import save_figure


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def line_plot(summary: dict, out_png: str, ylabel: str, title: str, trained: list[int], *, log_y: bool = False,
              ylim: tuple[float, float] | None = None) -> None:
    """Value vs context length, one line per row of an evaluation summary; dotted lines mark training lengths."""
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(6.5, 4.2))
    values = []
    for row in summary["rows"]:
        cells = sorted(row["cells"], key=lambda c: c["length"])
        x = [c["length"] for c in cells]
        y = np.array([c["value"] for c in cells])
        if row["seeds"] is not None:
            err = np.array([[c["spread"] for c in cells]] * 2)
            label = f"{row['label']} (mean ± sd, {len(row['seeds'])} seeds)"
        else:
            err = np.array([[c["value"] - c["ci"][0] for c in cells], [c["ci"][1] - c["value"] for c in cells]])
            label = row["label"]
        ax.errorbar(x, y, yerr=np.clip(err, 0, None), marker="o", capsize=3, label=label, clip_on=ylim is None)
        values.extend(y.tolist())
    for ctx in sorted(set(trained)):
        ax.axvline(ctx, color="grey", linestyle=":", linewidth=1)
    lengths = summary["lengths"]
    ax.set_xscale("log", base=2)
    ax.set_xticks(lengths, [str(n) for n in lengths])
    ax.minorticks_off()
    if log_y and values and min(values) > 0 and max(values) / min(values) > 10:
        ax.set_yscale("log")
    if ylim is not None:
        ax.set_ylim(*ylim)
    ax.set_xlabel("context length (tokens)")
    ax.set_ylabel(ylabel)
    ax.set_title(title)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8)
    save_figure(fig, out_png)
    plt.close(fig)


def mean_needle_report(reports: list[dict]) -> dict:
    """One needle result whose cells average the given seed runs' cells (the heatmap of a group)."""
    first = reports[0]
    cells = []
    for i, cell in enumerate(first["cells"]):
        accuracy = float(np.mean([r["cells"][i]["accuracy"] for r in reports]))
        cells.append({**cell, "accuracy": accuracy, "n": sum(r["cells"][i]["n"] for r in reports)})
    return {**first, "cells": cells}


def loss_plot(curves: dict[str, list[dict]], out_png: str) -> None:
    """Training loss (and validation loss where logged) vs step, one colour per run."""
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(6.5, 4.2))
    for label, records in curves.items():
        train = [(r["step"], r["loss"]) for r in records if r.get("loss") is not None]
        val = [(r["step"], r["val_loss"]) for r in records if r.get("val_loss") is not None]
        if not train:
            continue
        line = ax.plot(*zip(*train, strict=True), label=f"{label} train", alpha=0.8)[0]
        if val:
            ax.plot(*zip(*val, strict=True), "o--", color=line.get_color(), label=f"{label} validation")
    ax.set_xlabel("optimizer step")
    ax.set_ylabel("cross-entropy (nats/token)")
    ax.set_title("Training loss")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    save_figure(fig, out_png)
    plt.close(fig)
