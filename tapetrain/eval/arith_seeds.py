"""Addition results over seeds: per-PE mean ± sd and min–max, which differences the seeds resolve, and the figure.

Input: for every PE, the `tapetrain eval arith` reports of its runs, one per (data seed, model seed) pair, in the same
pair order for every PE. A difference between two PEs counts as resolved only when their per-seed ranges (min–max)
do not overlap: every seed of one is above every seed of the other. With N seeds and no true difference
(exchangeable seeds) that happens by chance with probability 2 / C(2N, N): 0.33 for 2 seeds, 0.10 for 3, 0.008 for
5. It ignores the pairing (both PEs saw the same data seeds), so it is conservative; the paired count
("better on k of N seeds") is reported beside it, not used for the verdict.
"""

from __future__ import annotations

import math
import statistics
from dataclasses import dataclass
from itertools import combinations

import numpy as np

from tapetrain.atomic_io import save_figure
from tapetrain.eval.arith_plots import accuracy_grid

METRICS = {
    "mean_in_distribution": "in distribution",
    "mean_out_of_distribution": "out of distribution",
    "mean_all": "whole grid",
}
RULE = (
    "a difference is resolved when the two PEs' per-seed ranges (min–max) do not overlap; by chance alone "
    "(no true difference) that happens with probability 2/C(2N,N) for N seeds"
)


@dataclass(frozen=True)
class Spread:
    """One metric of one PE over seeds (fractions in [0, 1]); sd is the sample sd (None with one seed)."""

    values: tuple[float, ...]

    @property
    def mean(self) -> float:
        return statistics.fmean(self.values)

    @property
    def sd(self) -> float | None:
        return statistics.stdev(self.values) if len(self.values) > 1 else None

    @property
    def low(self) -> float:
        return min(self.values)

    @property
    def high(self) -> float:
        return max(self.values)

    def as_dict(self) -> dict:
        return {"mean": self.mean, "sd": self.sd, "min": self.low, "max": self.high, "per_seed": list(self.values)}


def spreads(reports: dict[str, list[dict]]) -> dict[str, dict[str, Spread]]:
    """{pe: {metric: Spread}} from {pe: per-seed reports}; a metric that a report lacks (None) is an error."""
    out: dict[str, dict[str, Spread]] = {}
    for pe, runs in reports.items():
        if not runs:
            raise ValueError(f"{pe}: no per-seed results")
        values = {m: tuple(r[m] for r in runs) for m in METRICS}
        missing = [m for m, v in values.items() if any(x is None for x in v)]
        if missing:
            raise ValueError(f"{pe}: a result has no {missing[0]} (is the grid larger than the training lengths?)")
        out[pe] = {m: Spread(v) for m, v in values.items()}
    return out


def chance_of_separation(n: int) -> float:
    """P(two sets of n exchangeable values have disjoint ranges) = 2 / C(2n, n)."""
    return 2 / math.comb(2 * n, n)


def compare_pair(a: Spread, b: Spread) -> dict:
    """Verdict for two PEs on one metric: resolved iff their ranges are disjoint (and both have >= 2 seeds)."""
    n = min(len(a.values), len(b.values))
    better = sum(x > y for x, y in zip(a.values, b.values, strict=True))
    worse = sum(x < y for x, y in zip(a.values, b.values, strict=True))
    separated = a.low > b.high or b.low > a.high
    resolved = separated and n >= 2
    leader = None if not resolved else ("a" if a.low > b.high else "b")
    return {
        "resolved": resolved,
        "leader": leader,
        "a_better_seeds": better,
        "b_better_seeds": worse,
        "seeds": n,
        "mean_difference": a.mean - b.mean,
    }


def pairwise(table: dict[str, dict[str, Spread]]) -> list[dict]:
    """Every pair of PEs on every metric: {a, b, metric, resolved, leader (a PE or None), ...}."""
    rows = []
    for a, b in combinations(table, 2):
        for metric in METRICS:
            verdict = compare_pair(table[a][metric], table[b][metric])
            leader = {"a": a, "b": b}.get(verdict.pop("leader") or "")
            rows.append({"a": a, "b": b, "metric": metric, "leader": leader, **verdict})
    return rows


def pct(value: float | None) -> str:
    return "n/a" if value is None else f"{100 * value:.1f}"


def cell_text(s: Spread) -> str:
    """`88.9 ± 22.0 (53.9–97.8)` in percent; one seed: just the value."""
    if len(s.values) == 1:
        return pct(s.mean)
    return f"{pct(s.mean)} ± {pct(s.sd)} ({pct(s.low)}–{pct(s.high)})"


def markdown_table(
    table: dict[str, dict[str, Spread]], names: dict[str, str], paper: dict[str, float] | None = None
) -> str:
    """One row per PE; `paper`: a last column with the paper's whole-grid averages (%)."""
    head = [*METRICS.values(), *(["paper (whole 2x grid)"] if paper else [])]
    lines = ["| PE | " + " | ".join(head) + " |", "|---|" + "---|" * len(head)]
    for pe, row in table.items():
        cells = [cell_text(row[m]) for m in METRICS] + ([f"{paper[pe]:.2f}"] if paper else [])
        lines.append(f"| {names.get(pe, pe)} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def markdown_verdicts(rows: list[dict], names: dict[str, str], seeds: int) -> str:
    """One line per metric: the resolved differences, then how many pairs stay unresolved."""
    lines = [
        f"Exact match in percent: mean ± sample sd over {seeds} seed pair(s) (min–max). Verdicts: {RULE} "
        f"({chance_of_separation(seeds):.3f} for N = {seeds})."
        if seeds > 1
        else "One seed pair: no difference can be told from seed noise (run with --seeds 3 or more)."
    ]
    for metric, title in METRICS.items():
        mine = [r for r in rows if r["metric"] == metric]
        done = [
            f"{names.get(r['leader'], r['leader'])} > {names.get(other(r), other(r))}" for r in mine if r["resolved"]
        ]
        lines.append(
            f"- {title}: resolved {', '.join(done) if done else 'none'}; "
            f"{len(mine) - len(done)} of {len(mine)} pairs unresolved (ranges overlap)"
        )
    return "\n".join(lines)


def other(row: dict) -> str:
    return row["b"] if row["leader"] == row["a"] else row["a"]


def summary_dict(table: dict[str, dict[str, Spread]], rows: list[dict], pairs: list[dict]) -> dict:
    return {
        "seed_pairs": pairs,
        "rule": RULE,
        "chance_of_separation": chance_of_separation(len(pairs)),
        "results": {pe: {m: s.as_dict() for m, s in row.items()} for pe, row in table.items()},
        "pairwise": rows,
    }


def cell_stats(runs: list[dict]) -> tuple[np.ndarray, np.ndarray]:
    """(mean, sd) per grid cell over seeds, in percent (sd is 0 with one seed)."""
    grids = np.stack([accuracy_grid(r) for r in runs])
    sd = grids.std(axis=0, ddof=1) if len(runs) > 1 else np.zeros(grids.shape[1:])
    return grids.mean(axis=0), sd


def plot_seed_summary(reports: dict[str, list[dict]], out_png: str, names: dict[str, str]) -> None:
    """Top row: each PE's mean heatmap over seeds; bottom row: per-cell sd over seeds; right: per-seed in
    distribution (top) and whole-grid (bottom) accuracy, one dot per seed."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    pes = list(reports)
    n = len(pes)
    fig, axes = plt.subplots(2, n + 1, figsize=(3.6 * (n + 1), 7.2), squeeze=False)
    images = {}  # row -> an image of that row, for its colour bar
    for i, pe in enumerate(pes):
        mean, sd = cell_stats(reports[pe])
        train = reports[pe][0]["train_max_digits"]
        for row, grid, vmax, title in ((0, mean, 100, "mean"), (1, sd, 50, "sd over seeds")):
            ax = axes[row][i]
            images[row] = draw_grid(ax, grid, vmax, train)
            ax.set_title(f"{names.get(pe, pe)}: {title} ({len(reports[pe])} seeds)", fontsize=9)
    for row, label in ((0, "exact match, mean over seeds (%)"), (1, "sd over seeds (points)")):
        fig.colorbar(images[row], ax=axes[row][:n].tolist(), label=label, shrink=0.85)
    for ax, metric in ((axes[0][n], "mean_in_distribution"), (axes[1][n], "mean_all")):
        for i, pe in enumerate(pes):
            values = [100 * r[metric] for r in reports[pe]]
            ax.scatter([i] * len(values), values, s=18)
            ax.hlines(np.mean(values), i - 0.25, i + 0.25, color="black")
        ax.set_xticks(range(n), [names.get(p, p) for p in pes], fontsize=8)
        ax.set_ylim(-2, 102)
        ax.set_title(f"{METRICS[metric]}: one dot per seed", fontsize=9)
    save_figure(fig, out_png)
    plt.close(fig)


def plot_loss_curves(curves: dict[str, dict[str, list[list[float]]]], out_png: str, names: dict[str, str]) -> None:
    """One panel per PE, one training-loss line per seed (log scale): the plateau before carrying is learned and
    when each seed leaves it."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    pes = [pe for pe in curves if curves[pe]]
    fig, axes = plt.subplots(1, len(pes), figsize=(3.6 * len(pes), 3.2), squeeze=False, sharey=True)
    for ax, pe in zip(axes[0], pes, strict=True):
        for seed, points in curves[pe].items():
            steps, losses = zip(*points, strict=True) if points else ((), ())
            ax.plot(steps, [max(loss, 1e-4) for loss in losses], label=seed, linewidth=1)
        ax.set_yscale("log")
        ax.set_title(f"{names.get(pe, pe)}: training loss", fontsize=9)
        ax.set_xlabel("step", fontsize=8)
    axes[0][0].set_ylabel("loss (answer tokens)", fontsize=8)
    axes[0][-1].legend(fontsize=7)
    save_figure(fig, out_png)
    plt.close(fig)


def draw_grid(ax, grid: np.ndarray, vmax: float, train: int):
    """A (len_a, len_b) heatmap with its values printed and the training square dashed."""
    from matplotlib.patches import Rectangle

    size = grid.shape[0]
    image = ax.imshow(
        grid, origin="lower", cmap="viridis", vmin=0, vmax=vmax, extent=(0.5, size + 0.5, 0.5, size + 0.5)
    )
    ax.add_patch(Rectangle((0.5, 0.5), train, train, fill=False, edgecolor="white", linestyle="--", linewidth=1.2))
    if size <= 12:
        for la in range(size):
            for lb in range(size):
                if not np.isnan(grid[la, lb]):
                    ax.text(
                        lb + 1,
                        la + 1,
                        f"{grid[la, lb]:.0f}",
                        ha="center",
                        va="center",
                        fontsize=6,
                        color="white" if grid[la, lb] < 0.6 * vmax else "black",
                    )
    ticks = [t for t in range(1, size + 1) if size <= 12 or t % 5 == 0 or t == 1]
    ax.set_xticks(ticks)
    ax.set_yticks(ticks)
    ax.set_xlabel("length of b", fontsize=8)
    ax.set_ylabel("length of a", fontsize=8)
    return image
