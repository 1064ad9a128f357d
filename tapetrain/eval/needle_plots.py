"""Heatmaps of the needle grid (`eval passkey --protocol tapetrain --depths ...`): accuracy per (length, depth),
lengths on x, depth on y, red (0) to green (1), one panel per result side by side."""

from __future__ import annotations

import os

import numpy as np

from tapetrain.atomic_io import save_figure


def needle_grid(report: dict) -> tuple[list[int], list[float], np.ndarray]:
    """(lengths, depths, accuracy (depths, lengths), NaN where a cell is missing) of a result with `cells`."""
    lengths = sorted({c["length"] for c in report["cells"]})
    depths = sorted({c["depth"] for c in report["cells"]})
    grid = np.full((len(depths), len(lengths)), np.nan)
    for cell in report["cells"]:
        grid[depths.index(cell["depth"]), lengths.index(cell["length"])] = cell["accuracy"]
    return lengths, depths, grid


def panel_title(report: dict, label: str | None = None) -> str:
    name = label or os.path.basename(str(report["model"]).split("@")[0].rstrip("/"))
    _, _, grid = needle_grid(report)
    return f"{name}: {np.nanmean(grid):.0%} of the grid"


def plot_needle_heatmaps(reports: list[dict], out_png: str, labels: list[str] | None = None) -> None:
    """One heatmap per report; a dashed line separates the lengths within the training context from longer ones."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    n = len(reports)
    lengths0, depths0, _ = needle_grid(reports[0])
    width = max(3.2, 0.55 * len(lengths0) + 1.6)
    fig, axes = plt.subplots(1, n, figsize=(width * n + 0.9, max(3.0, 0.3 * len(depths0) + 1.8)), squeeze=False,
                             sharey=True)  # the same depths: tick labels on the first panel only
    image = None
    for i, (ax, report) in enumerate(zip(axes[0], reports, strict=True)):
        lengths, depths, grid = needle_grid(report)
        image = ax.imshow(grid, origin="lower", cmap="RdYlGn", vmin=0.0, vmax=1.0, aspect="auto")
        if grid.size <= 200:  # small grids: print the numbers
            for d in range(len(depths)):
                for col in range(len(lengths)):
                    if not np.isnan(grid[d, col]):
                        ax.text(col, d, f"{100 * grid[d, col]:.0f}", ha="center", va="center", fontsize=6)
        ax.set_xticks(range(len(lengths)), [str(n) for n in lengths], rotation=45 if len(lengths) > 6 else 0)
        ax.set_yticks(range(len(depths)), [f"{d:g}" for d in depths])
        trained = report.get("trained_context")
        if trained and any(n > trained for n in lengths):
            inside = sum(n <= trained for n in lengths)  # columns at or below the training length
            ax.axvline(inside - 0.5, color="black", linestyle="--", linewidth=1.2)
            ax.text(inside - 0.45, len(depths) - 0.6, f"trained {trained} →", va="top", ha="left", fontsize=7,
                    bbox={"facecolor": "white", "alpha": 0.7, "linewidth": 0, "pad": 1})
        ax.set_xlabel("context length (tokens)")
        if i == 0:
            ax.set_ylabel("needle depth (0 = start of the haystack)")
        ax.set_title(panel_title(report, labels[i] if labels else None), fontsize=9)
    fig.colorbar(image, ax=axes[0].tolist(), label="passkey accuracy", shrink=0.85)
    save_figure(fig, out_png)
    plt.close(fig)
