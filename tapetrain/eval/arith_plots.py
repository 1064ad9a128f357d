"""Heatmaps of `eval arith` results: accuracy per (len_a, len_b), one panel per result, like the paper's figure."""

from __future__ import annotations

import os

import numpy as np

from tapetrain.atomic_io import save_figure


def accuracy_grid(report: dict) -> np.ndarray:
    """(eval_max_digits, eval_max_digits) accuracy in percent; row = len_a - 1, column = len_b - 1 (NaN if absent)."""
    size = report["eval_max_digits"]
    grid = np.full((size, size), np.nan)
    for cell in report["cells"]:
        grid[cell["len_a"] - 1, cell["len_b"] - 1] = 100.0 * cell["accuracy"]
    return grid


def panel_title(report: dict, label: str | None = None) -> str:
    name = label or os.path.basename(str(report["model"]).split("@")[0].rstrip("/"))
    return f"{name}: {100 * report['mean_all']:.2f}% average"


def plot_heatmaps(reports: list[dict], out_png: str, labels: list[str] | None = None) -> None:
    """One heatmap per report side by side (`heatmap_figure`), written to out_png."""
    import matplotlib.pyplot as plt

    fig = heatmap_figure(reports, labels)
    save_figure(fig, out_png)
    plt.close(fig)


def heatmap_figure(reports: list[dict], labels: list[str] | None = None):
    """The figure of `plot_heatmaps`: per report its heatmap, titled with the whole grid's average (the paper's
    number); the dashed square marks where the training lengths end."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.patches import Rectangle

    n = len(reports)
    fig, axes = plt.subplots(1, n, figsize=(4.2 * n + 0.8, 4.2), squeeze=False)
    image = None
    for i, (ax, report) in enumerate(zip(axes[0], reports, strict=True)):
        grid = accuracy_grid(report)
        size = grid.shape[0]
        extent = (0.5, size + 0.5, 0.5, size + 0.5)
        image = ax.imshow(grid, origin="lower", cmap="viridis", vmin=0, vmax=100, extent=extent, aspect="equal")
        train = report["train_max_digits"]
        ax.add_patch(Rectangle((0.5, 0.5), train, train, fill=False, edgecolor="white", linestyle="--", linewidth=1.2))
        if size <= 12:  # small grids: print the numbers
            for la in range(size):
                for lb in range(size):
                    if not np.isnan(grid[la, lb]):
                        ax.text(lb + 1, la + 1, f"{grid[la, lb]:.0f}", ha="center", va="center", fontsize=6,
                                color="white" if grid[la, lb] < 60 else "black")
        ticks = [t for t in range(1, size + 1) if size <= 12 or t % 5 == 0 or t == 1]
        ax.set_xticks(ticks)
        ax.set_yticks(ticks)
        ax.set_xlabel("length of the second operand")
        if i == 0:
            ax.set_ylabel("length of the first operand")
        ax.set_title(panel_title(report, labels[i] if labels else None), fontsize=9)
    fig.colorbar(image, ax=axes[0].tolist(), label="exact match (%)", shrink=0.85)
    return fig
