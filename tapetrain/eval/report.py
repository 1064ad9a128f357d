"""Result files, tables and plots of the eval tools."""

from __future__ import annotations

import json
import os

from tapetrain.atomic_io import save_figure
from tapetrain.errors import InputError, MissingInputError


def read_json(path: str) -> dict:
    if not os.path.isfile(path):
        raise MissingInputError(f"result file {path} does not exist; pass JSON files written with --out")
    with open(path) as f:
        report = json.load(f)
    if not isinstance(report, dict) or not isinstance(report.get("results"), list):
        raise InputError(f"{path} is not an eval result (no 'results' list); pass JSON files written with --out")
    return report


def format_ppl_table(report: dict) -> str:
    lines = [f"perplexity of {report['model']} on {report['data']} ({report['protocol']}"
             + (f", stride {report['stride']}" if report.get("stride") else "") + ")",
             f"{'length':>8} {'ppl':>12} {'nll':>9} {'tokens':>12} {'windows':>8}"]
    for r in report["results"]:
        lines.append(f"{r['length']:>8} {r['ppl']:>12.4f} {r['nll']:>9.4f} {r['tokens']:>12} {r['windows']:>8}")
    return "\n".join(lines)


def format_passkey_table(report: dict) -> str:
    protocol = f"{report['protocol']} protocol, " if report.get("protocol") else ""
    depths = report.get("depths")
    per = f"per (length, depth), depths {','.join(f'{d:g}' for d in depths)}" if depths else "per length"
    lines = [f"passkey retrieval of {report['model']} ({protocol}{report['trials']} trials {per})",
             f"{'length':>8} {'accuracy':>9} {'correct':>8}" + "".join(f" {f'@{d:g}':>6}" for d in depths or [])]
    cells = {(c["length"], c["depth"]): c["accuracy"] for c in report.get("cells") or []}
    for r in report["results"]:
        lines.append(f"{r['length']:>8} {r['accuracy']:>9.3f} {r['correct']:>8}"
                     + "".join(f" {cells[(r['length'], d)]:>6.2f}" for d in depths or []))
    return "\n".join(lines)


def _label(report: dict) -> str:
    name = os.path.basename(str(report.get("model", "?")).rstrip("/")) or str(report.get("model"))
    return f"{name} ({report['protocol']})" if "protocol" in report else name


def _line_figure(reports: list[dict], key: str, ylabel: str, title: str, log_y: bool, ylim=None):
    """One line per report of `key` vs context length; `ylim` fixes the y-axis (an accuracy is 0..1 whatever the
    values, or an all-zero result would get an axis of -0.04..0.04)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.5, 4.2))
    trained, lengths, values = set(), set(), []
    for report in reports:
        rows = sorted(report["results"], key=lambda r: r["length"])
        ax.plot([r["length"] for r in rows], [r[key] for r in rows], marker="o", label=_label(report),
                clip_on=ylim is None)  # markers on a fixed axis's edge (accuracy 0 or 1) stay whole
        lengths.update(r["length"] for r in rows)
        values.extend(r[key] for r in rows)
        if report.get("trained_context"):
            trained.add(report["trained_context"])
    for ctx in sorted(trained):
        ax.axvline(ctx, color="grey", linestyle=":", linewidth=1)
    ax.set_xscale("log", base=2)
    ax.set_xticks(sorted(lengths), [str(n) for n in sorted(lengths)])  # plain token counts, not 2^k
    ax.minorticks_off()
    if log_y and values and min(values) > 0 and max(values) / min(values) > 10:  # log only for wide ranges
        ax.set_yscale("log")
    if ylim is not None:
        ax.set_ylim(*ylim)
    ax.set_xlabel("context length (tokens)")
    ax.set_ylabel(ylabel)
    ax.set_title(title)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8)
    return fig


def _save_and_close(fig, out_png: str) -> None:
    import matplotlib.pyplot as plt

    save_figure(fig, out_png)
    plt.close(fig)


def plot_ppl(results: list[dict], out_png: str) -> None:
    """PPL vs context length, one line per `eval ppl` result dict (dotted lines mark the training contexts)."""
    _save_and_close(_line_figure(results, "ppl", "perplexity", "Perplexity vs context length", log_y=True), out_png)


def passkey_figure(results: list[dict]):
    """Passkey accuracy (y from 0 to 1) vs context length, one line per `eval passkey` result dict."""
    return _line_figure(results, "accuracy", "passkey accuracy", "Passkey retrieval", log_y=False, ylim=(0.0, 1.0))


def plot_passkey(results: list[dict], out_png: str) -> None:
    _save_and_close(passkey_figure(results), out_png)


def plot_ruler(results: list[dict], out_png: str) -> None:
    """RULER score (mean over tasks, 0..1) vs context length, one line per `eval ruler` result dict."""
    _save_and_close(_line_figure(results, "score", "RULER score (mean over tasks)", "RULER via lm-eval", log_y=False,
                                 ylim=(0.0, 1.0)), out_png)
